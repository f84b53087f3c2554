"""Cross-entropy over vocabulary-sharded logits `[s, b, v/tp]` without gathering them: each rank computes the max logit,
the sum of exponentials and the target logit over its shard (megalite/kernels/cross_entropy.py), three all-reduces of
`[s * b]` combine them, and the backward is local (softmax minus one-hot on this rank's slice)."""

import torch
import torch.distributed as dist

from megalite.kernels import use_triton
from megalite.kernels.cross_entropy import IGNORE_INDEX, logit_grads, losses_from_stats, row_stats
from megalite.tensor_parallel.comm import all_reduce


def combine_stats(m, s, t, group):
    """(lse, target logit) `[rows]` over the whole vocabulary from every TP rank's shard stats."""
    if group is not None and dist.get_world_size(group) > 1:
        global_m = all_reduce(m.clone(), group, dist.ReduceOp.MAX)
        # A rank whose shard is all padding has m = -inf and s = 0: its term is 0.
        s = all_reduce(s * torch.exp(m - global_m).nan_to_num_(0.0), group)
        t = all_reduce(t.clone(), group)
        m = global_m
    return m + s.log(), t


class VocabParallelCrossEntropy(torch.autograd.Function):
    """Saves the logits (the input itself when it has unit column stride) and one fp32 lse per
    row, never the softmax; with `inplace` on the PyTorch path the saved logits hold the shifted
    exponentials and become the grad (one buffer in all)."""

    @staticmethod
    def forward(ctx, logits, labels, group, vocab_start, real_vocab_size, z_loss_weight, ignore_index, inplace,
                kernels):
        shape, local_vocab = labels.shape, logits.shape[-1]
        rows_logits, rows_labels = logits.detach().reshape(-1, local_vocab), labels.reshape(-1)
        if rows_logits.stride(-1) != 1:  # the kernels need unit column stride
            rows_logits = rows_logits.contiguous()
        real_columns = local_vocab if real_vocab_size is None else \
            min(max(real_vocab_size - vocab_start, 0), local_vocab)
        triton = use_triton(rows_logits, kernels)
        keep_exp = inplace and rows_logits.dtype == torch.float32 and not triton
        m, s, t = row_stats(rows_logits, rows_labels, vocab_start, real_columns, ignore_index, keep_exp, kernels)
        lse, target = combine_stats(m, s, t, group)
        # The PyTorch path exponentiates against the row max in both passes (Triton needs only lse).
        ctx.save_for_backward(rows_logits, rows_labels, lse, None if triton else m)
        ctx.args = (logits.shape, z_loss_weight, vocab_start, real_columns, ignore_index, keep_exp, kernels)
        return losses_from_stats(lse, target, rows_labels, z_loss_weight, ignore_index).view(shape)

    @staticmethod
    def backward(ctx, grad_losses):
        rows_logits, rows_labels, lse, row_max = ctx.saved_tensors
        shape, z_loss_weight, vocab_start, real_columns, ignore_index, keep_exp, kernels = ctx.args
        grad_losses = grad_losses.reshape(-1).float().masked_fill(rows_labels == ignore_index, 0.0)
        grad = logit_grads(rows_logits, rows_labels, lse, grad_losses, z_loss_weight, vocab_start, real_columns,
                           ignore_index, shift=row_max, exp_in_logits=keep_exp, kernels=kernels)
        return grad.view(shape), None, None, None, None, None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, group, vocab_start_index: int,
                                 real_vocab_size: int | None = None, z_loss_weight: float = 0.0,
                                 ignore_index: int = IGNORE_INDEX, inplace: bool = False,
                                 kernels: str = "auto") -> torch.Tensor:
    """Per-token fp32 losses `[s, b]` of vocab-sharded `logits` `[s, b, v/tp]` against global ids `labels`.

    logits: this rank's slice from column `vocab_start_index`, any float dtype (computed in fp32).
    real_vocab_size: ids from it on are padding, their logits count as -inf (None: no padding).
    group: the TP group (None: one rank). z_loss_weight: adds w * logsumexp^2 per token; labels
    equal to ignore_index give loss 0 and no grad. With w = 0 this equals F.cross_entropy(
    full_logits[..., :real_vocab_size], labels, reduction="none", ignore_index=ignore_index).
    inplace: `logits` may be overwritten (by the exponentials, then their grad), as Megatron does,
    for logits nothing else reads (else autograd stops with "modified by an inplace operation").
    kernels: the `--kernels` mode (Triton or PyTorch blocks)."""
    return VocabParallelCrossEntropy.apply(logits, labels, group, vocab_start_index, real_vocab_size,
                                           z_loss_weight, ignore_index, inplace, kernels)
