"""The output layer and cross-entropy fused in chunks, so the logits `[N, V]` never exist whole (TP = 1).

Forward, in chunks of tokens: logits_c = hidden_c @ W^T and their row stats, keeping one fp32
lse per token. Backward, in chunks of the vocabulary (columns v0..v1), recomputing the logits
(grads in the forward would need each token's loss weight):
    logits_v = hidden @ W_v^T,  d logits_v = g * (softmax_v (1 + 2 w lse) - onehot_v)
    d W_v = d logits_v^T @ hidden  (one matmul, straight into the grad),  d hidden += d logits_v @ W_v  (fp32)
"""

import torch

from megalite.kernels.cross_entropy import IGNORE_INDEX, logit_grads, losses_from_stats, row_stats

CHUNK_ELEMENTS = 2 ** 25  # logits per chunk: 64 MiB in bf16


def chunk_size(total: int, other: int, chunk_elements: int = CHUNK_ELEMENTS) -> int:
    """Rows (or columns) per chunk of a `[total, other]` matrix: about `chunk_elements`, 1 to `total`."""
    return max(1, min(total, chunk_elements // max(other, 1)))


def _accumulate_mm(accumulator: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """accumulator (fp32) += a @ b, the products summed in fp32 whatever a's and b's dtype."""
    if a.dtype == torch.float32:
        accumulator.addmm_(a, b)
        return
    if a.is_cuda:
        try:  # bf16/fp16 tensor cores with an fp32 output
            accumulator.add_(torch.mm(a, b, out_dtype=torch.float32))
            return
        except (RuntimeError, TypeError):  # a torch without mm's out_dtype: the fp32 matmul below
            pass
    accumulator.addmm_(a.float(), b.float())


class _LinearCrossEntropy(torch.autograd.Function):
    """hidden `[N, h]`, weight `[V_padded, h]` (rows from `vocab` on: padding), labels `[N]` -> losses `[N]` fp32."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, vocab, z_loss_weight, ignore_index, chunk_elements, kernels):
        lse = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        losses = torch.empty_like(lse)
        rows = chunk_size(hidden.shape[0], vocab, chunk_elements)
        chunk = hidden.new_empty(rows, vocab)  # each chunk's logits in turn
        for start in range(0, hidden.shape[0], rows):
            end = min(start + rows, hidden.shape[0])
            logits = torch.mm(hidden[start:end], weight[:vocab].t(), out=chunk[:end - start])  # [c, V]
            m, s, target = row_stats(logits, labels[start:end], 0, vocab, ignore_index, kernels=kernels)
            lse[start:end] = m + s.log()
            losses[start:end] = losses_from_stats(lse[start:end], target, labels[start:end], z_loss_weight,
                                                  ignore_index)
        ctx.save_for_backward(hidden, weight, labels, lse)
        ctx.args = (vocab, z_loss_weight, ignore_index, chunk_elements, kernels)
        return losses

    @staticmethod
    def backward(ctx, grad_losses):
        hidden, weight, labels, lse = ctx.saved_tensors
        vocab, z_loss_weight, ignore_index, chunk_elements, kernels = ctx.args
        grad_losses = grad_losses.float().masked_fill(labels == ignore_index, 0.0)
        grad_hidden = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
        grad_weight = torch.empty_like(weight)
        grad_weight[vocab:] = 0
        columns = chunk_size(vocab, hidden.shape[0], chunk_elements)
        chunk = hidden.new_empty(hidden.shape[0], columns)
        for start in range(0, vocab, columns):
            end = min(start + columns, vocab)
            weight_block = weight[start:end]
            # recomputed [N, Vc], then overwritten by its grad
            logits = torch.mm(hidden, weight_block.t(), out=chunk[:, :end - start])
            grad_logits = logit_grads(logits, labels, lse, grad_losses, z_loss_weight, start, end - start,
                                      ignore_index, out=logits, kernels=kernels)
            torch.mm(grad_logits.t(), hidden, out=grad_weight[start:end])
            _accumulate_mm(grad_hidden, grad_logits, weight_block)
        return grad_hidden.to(hidden.dtype), grad_weight, None, None, None, None, None, None


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                         real_vocab_size: int | None = None, z_loss_weight: float = 0.0,
                         ignore_index: int = IGNORE_INDEX, chunk_elements: int = CHUNK_ELEMENTS,
                         kernels: str = "auto") -> torch.Tensor:
    """Per-token fp32 losses of `hidden @ weight^T` against `labels`, equal to the unfused cross-entropy.

    hidden: `[..., h]`; weight: `[V, h]`, rows from `real_vocab_size` (None: V) on are padding;
    labels: `[...]`, ids or `ignore_index`; returns losses shaped like labels.
    chunk_elements: logits per chunk (forward: whole rows; backward: whole columns). kernels: the `--kernels` mode."""
    vocab = weight.shape[0] if real_vocab_size is None else real_vocab_size
    losses = _LinearCrossEntropy.apply(hidden.reshape(-1, hidden.shape[-1]), weight, labels.reshape(-1), vocab,
                                       z_loss_weight, ignore_index, chunk_elements, kernels)
    return losses.view(labels.shape)
