"""The output layer and cross-entropy fused in chunks, so the logits `[N, V]` never exist whole (TP = 1).

Forward, in chunks of tokens: logits_c = hidden_c @ W^T and their row stats, keeping one fp32
lse per token. Backward, in chunks of the vocabulary (columns v0..v1), recomputing the logits
(grads in the forward would need each token's loss weight):
    logits_v = hidden @ W_v^T,  d logits_v = g * (softmax_v (1 + 2 w lse) - onehot_v)
    d W_v = d logits_v^T @ hidden  (one matmul, straight into the grad),  d hidden += d logits_v @ W_v  (fp32)
With gradient-accumulation fusion (tensor_parallel/grad_accumulation.py) d W_v goes into the fp32 main grad's rows
instead, and no `[V, h]` grad exists.
"""

import torch

from megalite.kernels.cross_entropy import IGNORE_INDEX, logit_grads, losses_from_stats, row_stats
from megalite.kernels.gemm import add_product

CHUNK_ELEMENTS = 2 ** 25  # logits per chunk: 64 MiB in bf16


def chunk_size(total: int, other: int, chunk_elements: int = CHUNK_ELEMENTS) -> int:
    """Rows (or columns) per chunk of a `[total, other]` matrix: about `chunk_elements`, 1 to `total`."""
    return max(1, min(total, chunk_elements // max(other, 1)))


class _LinearCrossEntropy(torch.autograd.Function):
    """hidden `[N, h]`, weight `[V_padded, h]` (rows from `vocab` on: padding), labels `[N]` -> losses `[N]` fp32."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, vocab, z_loss_weight, ignore_index, chunk_elements, kernels,
                add_to_main_grad):
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
        ctx.add_to_main_grad = add_to_main_grad
        return losses

    @staticmethod
    def backward(ctx, grad_losses):
        hidden, weight, labels, lse = ctx.saved_tensors
        vocab, z_loss_weight, ignore_index, chunk_elements, kernels = ctx.args
        grad_losses = grad_losses.float().masked_fill(labels == ignore_index, 0.0)
        grad_hidden = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
        columns = chunk_size(vocab, hidden.shape[0], chunk_elements)
        chunk = hidden.new_empty(hidden.shape[0], columns)

        def run_chunks(add_weight_grad):
            """Each vocabulary chunk's grads: dW of rows [start, end) to `add_weight_grad`, dh into grad_hidden."""
            for start in range(0, vocab, columns):
                end = min(start + columns, vocab)
                weight_block = weight[start:end]
                # recomputed [N, Vc], then overwritten by its grad
                logits = torch.mm(hidden, weight_block.t(), out=chunk[:, :end - start])
                grad_logits = logit_grads(logits, labels, lse, grad_losses, z_loss_weight, start, end - start,
                                          ignore_index, out=logits, kernels=kernels)
                add_weight_grad(start, end, grad_logits)
                add_product(grad_hidden, grad_logits, weight_block, exact=True)

        if ctx.add_to_main_grad is not None:  # gradient-accumulation fusion: no [V, h] grad at all
            grad_weight = None
            ctx.add_to_main_grad(lambda main_grad: run_chunks(
                lambda start, end, grad_logits: add_product(main_grad[start:end], grad_logits.t(), hidden)))
        else:
            grad_weight = torch.empty_like(weight)
            grad_weight[vocab:] = 0
            run_chunks(lambda start, end, grad_logits: torch.mm(grad_logits.t(), hidden, out=grad_weight[start:end]))
        return grad_hidden.to(hidden.dtype), grad_weight, None, None, None, None, None, None, None


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                         real_vocab_size: int | None = None, z_loss_weight: float = 0.0,
                         ignore_index: int = IGNORE_INDEX, chunk_elements: int = CHUNK_ELEMENTS,
                         kernels: str = "auto", weight_used_once: bool = False) -> torch.Tensor:
    """Per-token fp32 losses of `hidden @ weight^T` against `labels`, equal to the unfused cross-entropy.

    hidden: `[..., h]`; weight: `[V, h]`, rows from `real_vocab_size` (None: V) on are padding;
    labels: `[...]`, ids or `ignore_index`; returns losses shaped like labels.
    chunk_elements: logits per chunk (forward: whole rows; backward: whole columns). kernels: the `--kernels` mode.
    weight_used_once: nothing else uses the weight (an untied output layer), so where the grad buffer lets it
    (`weight.add_to_main_grad`, gradient-accumulation fusion) its grad goes into the fp32 main grad chunk by chunk."""
    vocab = weight.shape[0] if real_vocab_size is None else real_vocab_size
    add_to_main_grad = getattr(weight, "add_to_main_grad", None) if weight_used_once else None
    losses = _LinearCrossEntropy.apply(hidden.reshape(-1, hidden.shape[-1]), weight, labels.reshape(-1), vocab,
                                       z_loss_weight, ignore_index, chunk_elements, kernels, add_to_main_grad)
    return losses.view(labels.shape)
