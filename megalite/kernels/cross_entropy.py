"""Cross-entropy over (possibly vocab-sharded) logits: two Triton kernels and their PyTorch twins.

Each TP rank holds logits `[rows, v/tp]` for a contiguous vocabulary slice starting at
`vocab_start`; columns at or above `real_columns` are vocabulary padding (-inf). Per row
the loss needs three numbers from the whole vocabulary, computed here per shard and then
combined over the TP group:

    stats (one pass over the row):  m = max_v z_v,  s = sum_v exp(z_v - m),  t = z_label
    combine (all-reduce [rows]):   M = max_r m_r,  lse = M + log(sum_r s_r exp(m_r - M)),  t = sum_r t_r
    loss = lse - t + w * lse^2                     (w: --z-loss-weight, PaLM's z-loss)
    grad (one pass, recomputed):   dz_v = g * (softmax_v * (1 + 2 w lse) - [v == label])

Rows whose label is `ignore_index` have loss 0 and zero grad (PyTorch's reduction="none").
Softmax probabilities are never stored: the forward keeps the logits and one fp32 lse per
row; the backward recomputes exp(z - lse) block by block while writing the grad.

`row_stats` and `logit_grads` are the building blocks (Triton or PyTorch per
`--kernels`); `cross_entropy` is the autograd Function over them; the fused output
layer (`megalite/kernels/linear_cross_entropy.py`) reuses the blocks chunk by chunk.
"""

import torch
import torch.distributed as dist

from megalite.kernels import use_triton
from megalite.tensor_parallel.comm import all_reduce

try:
    import triton
    import triton.language as tl
except ImportError:  # the PyTorch path needs no Triton
    triton = None

IGNORE_INDEX = -100
BLOCK = 4096  # vocabulary columns per loop step (a power of two)


def local_targets(labels: torch.Tensor, vocab_start: int, real_columns: int, ignore_index: int):
    """(labels - vocab_start with 0 where not owned, owned mask): which rows' targets live here."""
    local = labels - vocab_start
    owned = (labels != ignore_index) & (local >= 0) & (local < real_columns)
    return local.masked_fill(~owned, 0), owned


def _row_stats_torch(logits, labels, vocab_start, real_columns, ignore_index):
    z = logits[:, :real_columns].float()
    local, owned = local_targets(labels, vocab_start, real_columns, ignore_index)
    if real_columns == 0:
        empty = torch.zeros(logits.shape[0], device=logits.device)
        return torch.full_like(empty, float("-inf")), empty, empty
    m = z.amax(dim=-1)
    s = (z - m.unsqueeze(-1)).exp_().sum(dim=-1)
    t = z.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(~owned, 0.0)
    return m, s, t


def _logit_grads_torch(logits, labels, lse, grad_losses, z_loss_weight, vocab_start, real_columns,
                       ignore_index, out):
    if real_columns == 0:
        return out.zero_()
    scale = grad_losses * (1.0 + 2.0 * z_loss_weight * lse)  # [rows]
    grad = (logits[:, :real_columns].float() - lse.unsqueeze(-1)).exp_().mul_(scale.unsqueeze(-1))
    local, owned = local_targets(labels, vocab_start, real_columns, ignore_index)
    grad.scatter_add_(-1, local.unsqueeze(-1), -(grad_losses * owned).unsqueeze(-1))
    out[:, :real_columns] = grad
    out[:, real_columns:] = 0
    return out


if triton is not None:

    @triton.jit
    def _stats_kernel(logits_ptr, row_stride, labels_ptr, m_ptr, s_ptr, t_ptr, real_columns, vocab_start,
                      ignore_index, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        base = logits_ptr + row * row_stride
        label = tl.load(labels_ptr + row)
        local = label - vocab_start
        owned = (label != ignore_index) & (local >= 0) & (local < real_columns)
        m = -float("inf")
        s = 0.0
        for start in range(0, real_columns, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            z = tl.load(base + cols, mask=cols < real_columns, other=-float("inf")).to(tl.float32)
            new_m = tl.maximum(m, tl.max(z, axis=0))
            # exp(-inf - -inf) is NaN: a row that has seen only -inf so far keeps s = 0.
            s = tl.where(new_m == -float("inf"), 0.0, s * tl.exp(m - new_m) +
                         tl.sum(tl.exp(z - new_m), axis=0))
            m = new_m
        t = 0.0
        if owned:
            t = tl.load(base + local).to(tl.float32)
        tl.store(m_ptr + row, m)
        tl.store(s_ptr + row, s)
        tl.store(t_ptr + row, t)

    @triton.jit
    def _grad_kernel(logits_ptr, row_stride, labels_ptr, lse_ptr, grad_losses_ptr, grad_ptr, grad_stride,
                     n_columns, real_columns, vocab_start, ignore_index, z_loss_weight, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        label = tl.load(labels_ptr + row)
        local = label - vocab_start
        g = tl.load(grad_losses_ptr + row)
        lse = tl.load(lse_ptr + row)
        scale = g * (1.0 + 2.0 * z_loss_weight * lse)
        owned = (label != ignore_index) & (local >= 0) & (local < real_columns)
        for start in range(0, n_columns, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            real = cols < real_columns
            z = tl.load(logits_ptr + row * row_stride + cols, mask=real, other=0.0).to(tl.float32)
            grad = tl.where(real, tl.exp(z - lse) * scale, 0.0)
            grad = tl.where(owned & (cols == local), grad - g, grad)
            tl.store(grad_ptr + row * grad_stride + cols, grad.to(grad_ptr.dtype.element_ty), mask=cols < n_columns)


def _rows_view(logits: torch.Tensor) -> torch.Tensor:
    """`[..., v]` -> `[rows, v]` with unit column stride (copies only when it must)."""
    rows = logits.reshape(-1, logits.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def row_stats(logits, labels, vocab_start: int, real_columns: int, ignore_index: int = IGNORE_INDEX):
    """Per-row (max, sum of exp(z - max), target logit or 0), each `[rows]` fp32.

    logits: `[rows, v_local]` (unit column stride); labels: `[rows]` global ids.
    """
    if not use_triton(logits):
        return _row_stats_torch(logits, labels, vocab_start, real_columns, ignore_index)
    rows = logits.shape[0]
    m, s, t = (torch.empty(rows, dtype=torch.float32, device=logits.device) for _ in range(3))
    if rows:
        _stats_kernel[(rows,)](logits, logits.stride(0), labels.contiguous(), m, s, t, real_columns, vocab_start,
                               ignore_index, BLOCK=min(BLOCK, triton.next_power_of_2(max(real_columns, 1))))
    return m, s, t


def logit_grads(logits, labels, lse, grad_losses, z_loss_weight: float, vocab_start: int, real_columns: int,
                ignore_index: int = IGNORE_INDEX, out: torch.Tensor | None = None) -> torch.Tensor:
    """d loss / d logits `[rows, v_local]` in the logits' dtype (into `out` if given, which may be `logits`).

    lse, grad_losses: `[rows]` fp32 (grad_losses already zero on ignored rows).
    """
    out = torch.empty_like(logits) if out is None else out
    if not use_triton(logits):
        return _logit_grads_torch(logits, labels, lse, grad_losses, z_loss_weight, vocab_start, real_columns,
                                  ignore_index, out)
    rows, columns = logits.shape
    if rows:
        _grad_kernel[(rows,)](logits, logits.stride(0), labels.contiguous(), lse.contiguous(),
                              grad_losses.contiguous(), out, out.stride(0), columns, real_columns, vocab_start,
                              ignore_index, float(z_loss_weight),
                              BLOCK=min(BLOCK, triton.next_power_of_2(max(columns, 1))))
    return out


def combine_stats(m, s, t, group):
    """(lse, target logit) `[rows]` over the whole vocabulary from every TP rank's shard stats."""
    if group is not None and dist.get_world_size(group) > 1:
        global_m = all_reduce(m.clone(), group, dist.ReduceOp.MAX)
        # A rank whose shard is all padding has m = -inf and s = 0: its term is 0.
        s = all_reduce(s * torch.exp(m - global_m).nan_to_num_(0.0), group)
        t = all_reduce(t.clone(), group)
        m = global_m
    return m + s.log(), t


def losses_from_stats(lse, target, labels, z_loss_weight: float, ignore_index: int):
    """Per-row fp32 losses: lse - target (+ w lse^2), 0 where the label is ignored."""
    losses = lse - target
    if z_loss_weight:
        losses = losses + z_loss_weight * lse.square()
    return losses.masked_fill(labels == ignore_index, 0.0)


class CrossEntropy(torch.autograd.Function):
    """Cross-entropy over vocab-sharded logits from `row_stats` and `logit_grads`.

    Saves the logits (the input, not a copy when it has unit column stride), the labels
    and one fp32 lse per row; see the module docstring.
    """

    @staticmethod
    def forward(ctx, logits, labels, group, vocab_start, real_vocab_size, z_loss_weight, ignore_index):
        shape = labels.shape
        rows_logits, rows_labels = _rows_view(logits), labels.reshape(-1)
        local_vocab = rows_logits.shape[-1]
        real_columns = local_vocab if real_vocab_size is None else \
            min(max(real_vocab_size - vocab_start, 0), local_vocab)
        lse, target = combine_stats(*row_stats(rows_logits, rows_labels, vocab_start, real_columns, ignore_index),
                                    group)
        ctx.save_for_backward(rows_logits, rows_labels, lse)
        ctx.args = (logits.shape, z_loss_weight, vocab_start, real_columns, ignore_index)
        return losses_from_stats(lse, target, rows_labels, z_loss_weight, ignore_index).view(shape)

    @staticmethod
    def backward(ctx, grad_losses):
        rows_logits, rows_labels, lse = ctx.saved_tensors
        shape, z_loss_weight, vocab_start, real_columns, ignore_index = ctx.args
        grad_losses = grad_losses.reshape(-1).float().masked_fill(rows_labels == ignore_index, 0.0)
        grad = logit_grads(rows_logits, rows_labels, lse, grad_losses, z_loss_weight, vocab_start, real_columns,
                           ignore_index)
        return grad.view(shape), None, None, None, None, None, None
