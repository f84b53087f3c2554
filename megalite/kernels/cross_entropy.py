"""Cross-entropy blocks over vocab-sharded logits `[rows, v/tp]` (columns from `real_columns` on: padding), Triton
beside PyTorch; tensor_parallel/cross_entropy.py combines the shards over TP (docs/kernels.md has the whole
computation):
    stats:  m = max_v z_v,  s = sum_v exp(z_v - m),  t = z_label
    grad:   dz_v = g * (softmax_v (1 + 2 w lse) - [v == label])   (w: --z-loss-weight)
For fp32 logits nothing else reads, the PyTorch path takes Megatron's in-place route (`keep_exp`): exp(z - m) stays in
the logits and becomes the grad."""

import torch

from megalite.kernels import tl, triton, use_triton

IGNORE_INDEX = -100
BLOCK = 4096  # vocabulary columns per loop step (a power of two)


def local_targets(labels: torch.Tensor, vocab_start: int, real_columns: int, ignore_index: int):
    """(labels - vocab_start with 0 where not owned, owned mask): which rows' targets live here."""
    local = labels - vocab_start
    owned = (labels != ignore_index) & (local >= 0) & (local < real_columns)
    return local.masked_fill(~owned, 0), owned


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
            s = tl.where(new_m == -float("inf"), 0.0, s * tl.exp(m - new_m) + tl.sum(tl.exp(z - new_m), axis=0))
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


def row_stats(logits, labels, vocab_start: int, real_columns: int, ignore_index: int = IGNORE_INDEX,
              keep_exp: bool = False, kernels: str = "auto"):
    """Per-row (max, sum of exp(z - max), target logit or 0), each `[rows]` fp32; Triton or PyTorch per
    `kernels`. logits: `[rows, v_local]` (unit column stride); labels: `[rows]` global ids. keep_exp (fp32
    logits nothing else reads, on the PyTorch path): exp(z - max) overwrites the logits' real columns."""
    if use_triton(logits, kernels):
        rows = logits.shape[0]
        m, s, t = (torch.empty(rows, dtype=torch.float32, device=logits.device) for _ in range(3))
        if rows:
            _stats_kernel[(rows,)](logits, logits.stride(0), labels.contiguous(), m, s, t, real_columns, vocab_start,
                                   ignore_index, BLOCK=min(BLOCK, triton.next_power_of_2(max(real_columns, 1))))
        return m, s, t
    local, owned = local_targets(labels, vocab_start, real_columns, ignore_index)
    if real_columns == 0:
        empty = torch.zeros(logits.shape[0], device=logits.device)
        return torch.full_like(empty, float("-inf")), empty, empty
    z = logits[:, :real_columns]
    m = z.amax(dim=-1).float()
    t = z.gather(-1, local.unsqueeze(-1)).squeeze(-1).float().masked_fill(~owned, 0.0)  # before keep_exp writes
    exp = z.sub_(m.unsqueeze(-1)).exp_() if keep_exp else (z.float() - m.unsqueeze(-1)).exp_()
    return m, exp.sum(dim=-1), t


def logit_grads(logits, labels, lse, grad_losses, z_loss_weight: float, vocab_start: int, real_columns: int,
                ignore_index: int = IGNORE_INDEX, out: torch.Tensor | None = None, shift: torch.Tensor | None = None,
                exp_in_logits: bool = False, kernels: str = "auto") -> torch.Tensor:
    """d loss / d logits `[rows, v_local]` in the logits' dtype (into `out` if given, which may be `logits`).
    lse, grad_losses: `[rows]` fp32 (grad_losses zero on ignored rows). shift: the row max the PyTorch path
    exponentiates against (default lse). exp_in_logits: `logits` hold exp(z - shift) from
    `row_stats(keep_exp=True)`, and the grad is written over them. kernels: the `--kernels` mode."""
    out = logits if exp_in_logits else torch.empty_like(logits) if out is None else out
    if use_triton(logits, kernels):
        rows, columns = logits.shape
        if rows:
            _grad_kernel[(rows,)](logits, logits.stride(0), labels.contiguous(), lse.contiguous(),
                                  grad_losses.contiguous(), out, out.stride(0), columns, real_columns, vocab_start,
                                  ignore_index, float(z_loss_weight),
                                  BLOCK=min(BLOCK, triton.next_power_of_2(max(columns, 1))))
        return out
    if real_columns == 0:
        return out.zero_()
    # softmax = exp(z - shift) * exp(shift - lse): the same arithmetic whether the exponentials are computed here
    # or were kept in `logits` by row_stats (then they become the grad in place).
    shift = lse if shift is None else shift
    scale = grad_losses * (1.0 + 2.0 * z_loss_weight * lse) * torch.exp(shift - lse).nan_to_num_(0.0)  # [rows]
    real = logits[:, :real_columns]
    grad = real if exp_in_logits else (real.float() - shift.unsqueeze(-1)).exp_()
    grad.mul_(scale.unsqueeze(-1))
    local, owned = local_targets(labels, vocab_start, real_columns, ignore_index)
    grad.scatter_add_(-1, local.unsqueeze(-1), -(grad_losses * owned).unsqueeze(-1))
    if grad.data_ptr() != out.data_ptr():
        out[:, :real_columns] = grad
    out[:, real_columns:] = 0
    return out


def losses_from_stats(lse, target, labels, z_loss_weight: float, ignore_index: int):
    """Per-row fp32 losses: lse - target (+ w lse^2), 0 where the label is ignored."""
    losses = lse - target
    if z_loss_weight:
        losses = losses + z_loss_weight * lse.square()
    return losses.masked_fill(labels == ignore_index, 0.0)
