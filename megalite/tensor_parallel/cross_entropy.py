"""Cross-entropy over vocabulary-sharded logits, without gathering the full logits.

Each TP rank holds the logits of its contiguous vocabulary slice `[s, b, v/tp]`. The
loss needs only three numbers per token from the whole vocabulary: the max logit (for
stability), the sum of exponentials, and the target's logit, owned by one rank; each
is one all-reduce of an `[s, b]` tensor. The backward is local: softmax minus one-hot
on this rank's slice.
"""

import torch
import torch.distributed as dist

from megalite.tensor_parallel.comm import all_reduce


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Forward: per-token loss log(sum_v exp(z_v)) - z_label over every rank's slice.

    Backward: (softmax - one_hot(label)) * grad on this rank's slice, which is zero on
    the padding columns. The softmax saved by forward is turned into the grad in
    place (no second `[s, b, v/tp]` fp32 tensor), so the graph can be backpropagated once.
    """

    @staticmethod
    def forward(ctx, logits, labels, group, vocab_start_index, real_vocab_size):
        ctx.input_dtype = logits.dtype
        local_vocab = logits.shape[-1]
        # Columns at or above `real_columns` are vocabulary padding: treated as -inf.
        real_columns = local_vocab if real_vocab_size is None else \
            min(max(real_vocab_size - vocab_start_index, 0), local_vocab)
        logits = logits.float()

        if real_columns > 0:
            max_logits = logits[..., :real_columns].amax(dim=-1)
        else:
            max_logits = logits.new_full(logits.shape[:-1], float("-inf"))
        all_reduce(max_logits, group, dist.ReduceOp.MAX)
        shifted = logits - max_logits.unsqueeze(-1)  # a new fp32 tensor, [s, b, v/tp]

        local_labels = labels - vocab_start_index
        owned = (local_labels >= 0) & (local_labels < real_columns)
        local_labels = local_labels.masked_fill(~owned, 0)
        target_logits = shifted.gather(-1, local_labels.unsqueeze(-1)).squeeze(-1).masked_fill(~owned, 0.0)
        all_reduce(target_logits, group)

        exp_logits = shifted.exp_()
        exp_logits[..., real_columns:] = 0.0
        sum_exp = all_reduce(exp_logits.sum(dim=-1), group)
        losses = sum_exp.log() - target_logits

        softmax = exp_logits.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_labels, owned)
        return losses

    @staticmethod
    def backward(ctx, grad_losses):
        softmax, local_labels, owned = ctx.saved_tensors
        grad = softmax  # becomes the grad in place
        grad.scatter_add_(-1, local_labels.unsqueeze(-1), -owned.to(grad.dtype).unsqueeze(-1))
        grad.mul_(grad_losses.unsqueeze(-1))
        return grad.to(ctx.input_dtype), None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, group, vocab_start_index: int,
                                 real_vocab_size: int | None = None) -> torch.Tensor:
    """Per-token fp32 losses `[s, b]` of vocab-sharded `logits` `[s, b, v/tp]` against `labels`.

    logits: this rank's vocabulary slice, columns `vocab_start_index ...` (any float dtype;
    computed in fp32; its grad comes back in the same dtype). labels `[s, b]`: global
    token ids below `real_vocab_size`. real_vocab_size: ids at or above it are padding,
    their logits count as -inf (no probability, zero grad); None: no padding.
    group: the TP group (None for one rank: plain cross-entropy). Equals
    F.cross_entropy(full_logits[..., :real_vocab_size], labels, reduction="none").
    """
    return _VocabParallelCrossEntropy.apply(logits, labels, group, vocab_start_index, real_vocab_size)
