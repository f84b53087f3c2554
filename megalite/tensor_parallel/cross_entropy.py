"""Cross-entropy over vocabulary-sharded logits, without gathering the full logits.

Each TP rank holds the logits of its contiguous vocabulary slice `[s, b, v/tp]`. The
loss needs only three numbers per token from the whole vocabulary: the max logit (for
stability), the sum of exponentials, and the target's logit, owned by one rank; each
is one all-reduce of an `[s, b]` tensor. The backward is local: softmax minus one-hot
on this rank's slice.

This file is the PyTorch path (`--kernels torch`, and `auto` on a CPU); the Triton path
(`megalite/kernels/cross_entropy.py`) computes the same function without storing the
softmax. Both take PaLM's z-loss (`--z-loss-weight` w adds w * lse^2 per token) and an
ignore index (those tokens get loss 0 and zero grad, as PyTorch's reduction="none").
"""

import functools

import torch
import torch.distributed as dist

from megalite.kernels import use_triton
from megalite.kernels.cross_entropy import IGNORE_INDEX, CrossEntropy, local_targets
from megalite.tensor_parallel.comm import all_reduce


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Forward: per-token loss log(sum_v exp(z_v)) - z_label over every rank's slice.

    With z-loss weight w the loss adds w * lse^2, lse = log(sum_v exp(z_v)).

    Backward: (softmax * (1 + 2 w lse) - one_hot(label)) * grad on this rank's slice,
    which is zero on the padding columns and on ignored tokens. The exponentials saved by
    forward are turned into the grad in place (no second `[s, b, v/tp]` fp32 tensor), so
    the graph can be backpropagated once.
    """

    @staticmethod
    def forward(ctx, logits, labels, group, vocab_start_index, real_vocab_size, z_loss_weight, ignore_index,
                inplace, compiled):
        ctx.input_dtype = logits.dtype
        local_vocab = logits.shape[-1]
        # Columns at or above `real_columns` are vocabulary padding: treated as -inf.
        real_columns = local_vocab if real_vocab_size is None else \
            min(max(real_vocab_size - vocab_start_index, 0), local_vocab)
        logits = logits.detach()  # with `inplace`, its storage becomes the softmax, then the grad

        if real_columns > 0:
            max_logits = logits[..., :real_columns].amax(dim=-1).float()
        else:
            max_logits = logits.new_full(logits.shape[:-1], float("-inf"), dtype=torch.float32)
        all_reduce(max_logits, group, dist.ReduceOp.MAX)

        ignored = labels == ignore_index
        local_labels, owned = local_targets(labels, vocab_start_index, real_columns, ignore_index)
        target_logits = logits.gather(-1, local_labels.unsqueeze(-1)).squeeze(-1).float()
        target_logits = target_logits.sub_(max_logits).masked_fill_(~owned, 0.0)
        all_reduce(target_logits, group)

        reuse_logits = inplace and logits.dtype == torch.float32  # no second [s, b, v/tp] tensor
        if reuse_logits and compiled:  # shift, exp and row sums in one compiled pass
            exp_logits, sum_exp = logits, _compiled_exp_rows()(logits, max_logits, real_columns)
        else:  # eager; not in place, the shift makes a new fp32 tensor (bf16 logits: promoted)
            shift = max_logits.unsqueeze(-1)
            exp_logits = (logits.sub_(shift) if reuse_logits else logits - shift).exp_()
            sum_exp = exp_logits[..., :real_columns].sum(dim=-1)
        exp_logits[..., real_columns:] = 0.0  # padding: no probability (not in the compiled pass, see _exp_rows)
        all_reduce(sum_exp, group)
        log_sum_exp = sum_exp.log()  # of the shifted logits: lse - max
        losses = log_sum_exp - target_logits
        # softmax = exp_logits / sum_exp; the division waits for the backward, where it joins
        # the per-row grad scale (one pass over [s, b, v/tp] instead of two).
        row_scale = sum_exp.reciprocal()
        if z_loss_weight:
            lse = log_sum_exp + max_logits
            losses = losses + z_loss_weight * lse.square()
            row_scale.mul_(1.0 + 2.0 * z_loss_weight * lse)
        ctx.save_for_backward(exp_logits, row_scale, local_labels, owned, ignored)
        return losses.masked_fill(ignored, 0.0)

    @staticmethod
    def backward(ctx, grad_losses):
        exp_logits, row_scale, local_labels, owned, ignored = ctx.saved_tensors
        grad_losses = grad_losses.masked_fill(ignored, 0.0)
        grad = exp_logits.mul_((grad_losses * row_scale).unsqueeze(-1))  # the grad, in place
        grad.scatter_add_(-1, local_labels.unsqueeze(-1), -(grad_losses * owned).unsqueeze(-1))
        return grad.to(ctx.input_dtype), None, None, None, None, None, None, None, None


def _exp_rows(logits: torch.Tensor, max_logits: torch.Tensor, real_columns: int) -> torch.Tensor:
    """In place: logits `[..., v]` fp32 <- exp(logits - max_logits[..., None]) on the first
    `real_columns` columns (the rest untouched). Returns the row sums `[...]`.

    The padding columns' zeros are left to the caller: written in the same compiled pass,
    they put a per-vector column mask into its inner loop, and the pass over config A's
    logits took 21 ms instead of 14 (no padding: the mask is still made) and 28 instead of
    11 (92 padding columns)."""
    exp = (logits[..., :real_columns] - max_logits.unsqueeze(-1)).exp()
    logits[..., :real_columns] = exp
    return exp.sum(dim=-1)


@functools.cache
def _compiled_exp_rows():
    """`_exp_rows` under torch.compile: one fused pass instead of three (sub, exp, sum) over
    the logits. One graph per logits shape, so only for `compiled` runs (a few seconds to compile)."""
    return torch.compile(_exp_rows, dynamic=False)


def vocab_parallel_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, group, vocab_start_index: int,
                                 real_vocab_size: int | None = None, z_loss_weight: float = 0.0,
                                 ignore_index: int = IGNORE_INDEX, inplace: bool = False,
                                 compiled: bool = False) -> torch.Tensor:
    """Per-token fp32 losses `[s, b]` of vocab-sharded `logits` `[s, b, v/tp]` against `labels`.

    logits: this rank's vocabulary slice, columns `vocab_start_index ...` (any float dtype;
    computed in fp32; its grad comes back in the same dtype). labels `[s, b]`: global
    token ids below `real_vocab_size`. real_vocab_size: ids at or above it are padding,
    their logits count as -inf (no probability, zero grad); None: no padding.
    group: the TP group (None for one rank: plain cross-entropy). z_loss_weight: adds
    w * logsumexp^2 per token. Labels equal to ignore_index give loss 0 and no grad. With
    w = 0 this equals F.cross_entropy(full_logits[..., :real_vocab_size], labels,
    reduction="none", ignore_index=ignore_index). Runs the Triton kernels per `--kernels`.
    inplace: fp32 `logits` may be overwritten (by the softmax, then their grad), as
    Megatron does: one `[s, b, v/tp]` buffer instead of two. Only for logits nothing else
    reads; the model's own logits are such. Were they saved for some other backward,
    autograd would stop with its "modified by an inplace operation" error.
    compiled: with `inplace` fp32 logits, the shift, exp and row sums run as one
    torch.compile'd pass (`--compile` runs; the same values).
    """
    if use_triton(logits):
        return CrossEntropy.apply(logits, labels, group, vocab_start_index, real_vocab_size, z_loss_weight,
                                  ignore_index)
    return _VocabParallelCrossEntropy.apply(logits, labels, group, vocab_start_index, real_vocab_size,
                                            z_loss_weight, ignore_index, inplace, compiled)
