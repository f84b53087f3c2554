"""Rotary embedding applied to q and k together, Triton beside PyTorch (rotate-half convention).

`apply_rotary(q, k, cos, sin)` is what attention calls; `megalite.kernels.use_triton`
picks the path. q: `[s, b, heads, d]`, k: `[s, b, groups, d]` (grouped-query attention:
any head counts), cos/sin: `[s, b or 1, 1, d]` fp32 tables (model/rotary.py), for any
positions (offsets, --reset-position-ids). Channel i pairs with channel i + d/2:
    y1 = x1 cos - x2 sin,   y2 = x2 cos + x1 sin
The backward is the rotation by the opposite angle, so the kernel serves both with a
sign; nothing but cos and sin is saved. Arithmetic is fp32; offsets are int64.
"""

import torch

from megalite.kernels import use_triton
from megalite.model.rotary import apply_rotary_pos_emb

try:
    import triton
    import triton.language as tl
except ImportError:  # the PyTorch path needs no Triton
    triton = None


def apply_rotary_reference(q, k, cos, sin):
    return apply_rotary_pos_emb(q, cos, sin), apply_rotary_pos_emb(k, cos, sin)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """(rotated q, rotated k); Triton or PyTorch per `--kernels`."""
    if use_triton(q):
        return _Rotary.apply(q, k, cos, sin)
    return apply_rotary_reference(q, k, cos, sin)


if triton is not None:

    @triton.jit
    def _rotate_kernel(x_ptr, y_ptr, cos_ptr, sin_ptr, batch, heads, half, cos_stride_s, cos_stride_b, sign,
                       BLOCK: tl.constexpr):
        program = tl.program_id(0).to(tl.int64)  # one head vector: (position, batch, head)
        token = program // heads
        position, sample = token // batch, token % batch
        cols = tl.arange(0, BLOCK)
        mask = cols < half
        table = position * cos_stride_s + sample * cos_stride_b + cols
        cos = tl.load(cos_ptr + table, mask=mask, other=0.0).to(tl.float32)
        sin = tl.load(sin_ptr + table, mask=mask, other=0.0).to(tl.float32) * sign
        base = program * 2 * half
        x1 = tl.load(x_ptr + base + cols, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(x_ptr + base + half + cols, mask=mask, other=0.0).to(tl.float32)
        out = y_ptr.dtype.element_ty
        tl.store(y_ptr + base + cols, (x1 * cos - x2 * sin).to(out), mask=mask)
        tl.store(y_ptr + base + half + cols, (x2 * cos + x1 * sin).to(out), mask=mask)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sign: float) -> torch.Tensor:
    """x `[s, b, heads, d]` rotated by `sign` times the angles of cos/sin `[s, b or 1, 1, d]`."""
    x = x.contiguous()
    s, b, heads, d = x.shape
    y = torch.empty_like(x)
    cos, sin = cos.float().contiguous(), sin.float().contiguous()
    stride_b = cos.stride(1) if cos.shape[1] > 1 else 0
    _rotate_kernel[(s * b * heads,)](x, y, cos, sin, b, heads, d // 2, cos.stride(0), stride_b, sign,
                                     BLOCK=triton.next_power_of_2(d // 2))
    return y


class _Rotary(torch.autograd.Function):
    """The Triton rotary embedding for q and k; see the module docstring."""

    @staticmethod
    def forward(ctx, q, k, cos, sin):
        ctx.save_for_backward(cos, sin)
        return _rotate(q, cos, sin, 1.0), _rotate(k, cos, sin, 1.0)

    @staticmethod
    def backward(ctx, dq, dk):
        cos, sin = ctx.saved_tensors
        grads = [None if grad is None else _rotate(grad, cos, sin, -1.0) for grad in (dq, dk)]
        return *grads, None, None
