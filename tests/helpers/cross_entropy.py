"""Cross-entropy's float64 reference, and one path's losses and logit grad: shared by the kernel
tests at tiny shapes and the GPU tests at model shapes."""

import torch
import torch.nn.functional as F

from megalite.kernels.cross_entropy import IGNORE_INDEX
from megalite.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy


def reference_losses(logits, labels, real_vocab, z_loss_weight):
    """float64 F.cross_entropy (+ z-loss), padding columns dropped, ignored labels 0."""
    logits = logits[..., :real_vocab].double()
    losses = F.cross_entropy(logits.flatten(0, -2), labels.flatten(), reduction="none", ignore_index=IGNORE_INDEX)
    lse = logits.logsumexp(-1).flatten()
    losses = losses + z_loss_weight * lse.square() * (labels.flatten() != IGNORE_INDEX)
    return losses.view(labels.shape)


def losses_and_grad(logits, labels, grad, dtype, real_vocab, z_loss_weight, use_reference=False, kernels="auto"):
    """(losses, logit grad) in float64; padding columns of the grad included; `kernels`: the --kernels mode."""
    leaf = logits.detach().clone().to(dtype).requires_grad_()
    if use_reference:
        losses = reference_losses(leaf, labels, real_vocab, z_loss_weight)
    else:
        losses = vocab_parallel_cross_entropy(leaf, labels, None, 0, real_vocab, z_loss_weight, kernels=kernels)
        assert losses.dtype == torch.float32
    losses.backward(grad.to(losses.dtype))
    assert leaf.grad.dtype == dtype
    return losses.detach().double(), leaf.grad.double()
