"""Rotary embedding of q `[s, b, heads, d]` and k `[s, b, groups, d]` together, Triton beside PyTorch.
cos/sin: `[s, b or 1, 1, r]` fp32 tables (model/rotary.py); channel i pairs with i + r/2:
    y1 = x1 cos - x2 sin,   y2 = x2 cos + x1 sin
r < d (--rotary-percent) rotates the first r channels of each head and passes the rest through, as Megatron's partial
rotary embedding does. The backward is the same kernel with the opposite sign."""

import torch

from megalite.kernels import tl, triton, use_triton

TOKENS_PER_PROGRAM = 4


def apply_rotary_pos_emb(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first r channels of x `[s, b, heads, d]` by the angles of cos/sin `[s, b or 1, 1, r]`
    and pass the other d - r through; keeps x's dtype."""
    r = cos.shape[-1]
    if r < x.shape[-1]:
        return torch.cat([apply_rotary_pos_emb(x[..., :r], cos, sin), x[..., r:]], dim=-1)
    x1, x2 = x.chunk(2, dim=-1)
    return (x * cos.to(x.dtype)) + (torch.cat([-x2, x1], dim=-1) * sin.to(x.dtype))


def apply_rotary_reference(q, k, cos, sin):
    return apply_rotary_pos_emb(q, cos, sin), apply_rotary_pos_emb(k, cos, sin)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kernels: str = "auto"):
    """(rotated q, rotated k); Triton or PyTorch per `--kernels kernels`."""
    return _Rotary.apply(q, k, cos, sin) if use_triton(q, kernels) else apply_rotary_reference(q, k, cos, sin)


if triton is not None:

    @triton.jit
    def _rotate_heads(x_ptr, y_ptr, position, sample, token, cos, sin, x_stride_s, x_stride_b, x_stride_h, heads,
                      half, width, BLOCK_HEADS: tl.constexpr, BLOCK: tl.constexpr):
        """The first 2 half channels of one token's `heads` head vectors of x rotated into y (contiguous
        `[tokens, heads, width]`; channels past 2 half are the caller's)."""
        rows = tl.arange(0, BLOCK_HEADS)[:, None]
        cols = tl.arange(0, BLOCK)[None, :]
        mask = (rows < heads) & (cols < half)
        source = x_ptr + position * x_stride_s + sample * x_stride_b + rows * x_stride_h + cols
        x1 = tl.load(source, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(source + half, mask=mask, other=0.0).to(tl.float32)
        target = y_ptr + token * heads * width + rows * width + cols
        out = y_ptr.dtype.element_ty
        tl.store(target, (x1 * cos - x2 * sin).to(out), mask=mask)
        tl.store(target + half, (x2 * cos + x1 * sin).to(out), mask=mask)

    @triton.jit
    def _rotate_kernel(q_ptr, k_ptr, q_out_ptr, k_out_ptr, cos_ptr, sin_ptr, tokens, batch, q_heads, k_heads,
                       half, width, q_stride_s, q_stride_b, q_stride_h, k_stride_s, k_stride_b, k_stride_h,
                       cos_stride_s, cos_stride_b, sign, TOKENS: tl.constexpr, BLOCK_Q: tl.constexpr,
                       BLOCK_K: tl.constexpr, BLOCK: tl.constexpr):
        first = tl.program_id(0).to(tl.int64) * TOKENS
        cols = tl.arange(0, BLOCK)[None, :]
        for i in range(TOKENS):
            token = first + i  # tokens are (position, sample) pairs in [s, b] order
            if token < tokens:
                position, sample = token // batch, token % batch
                table = position * cos_stride_s + sample * cos_stride_b + cols
                cos = tl.load(cos_ptr + table, mask=cols < half, other=0.0)
                sin = tl.load(sin_ptr + table, mask=cols < half, other=0.0) * sign
                _rotate_heads(q_ptr, q_out_ptr, position, sample, token, cos, sin, q_stride_s, q_stride_b,
                              q_stride_h, q_heads, half, width, BLOCK_Q, BLOCK)
                _rotate_heads(k_ptr, k_out_ptr, position, sample, token, cos, sin, k_stride_s, k_stride_b,
                              k_stride_h, k_heads, half, width, BLOCK_K, BLOCK)


def _rotate(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sign: float):
    """q and k rotated by `sign` times the angles of cos/sin; contiguous outputs in the inputs' dtypes."""
    q, k = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k))
    s, b, q_heads, d = q.shape
    k_heads, r = k.shape[2], cos.shape[-1]
    q_out, k_out = (torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in (q, k))
    if r < d:  # partial rotary: the kernel writes the first r channels, the rest pass through
        for x, out in ((q, q_out), (k, k_out)):
            out[..., r:] = x[..., r:]
    cos, sin = cos.float().contiguous(), sin.float().contiguous()
    stride_b = cos.stride(1) if cos.shape[1] > 1 else 0
    tokens = s * b
    _rotate_kernel[(triton.cdiv(tokens, TOKENS_PER_PROGRAM),)](
        q, k, q_out, k_out, cos, sin, tokens, b, q_heads, k_heads, r // 2, d, q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2), cos.stride(0), stride_b, sign, TOKENS=TOKENS_PER_PROGRAM,
        BLOCK_Q=triton.next_power_of_2(q_heads), BLOCK_K=triton.next_power_of_2(k_heads),
        BLOCK=triton.next_power_of_2(r // 2))
    return q_out, k_out


class _Rotary(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, cos, sin):
        ctx.save_for_backward(cos, sin)
        return _rotate(q, k, cos, sin, 1.0)

    @staticmethod
    def backward(ctx, dq, dk):
        cos, sin = ctx.saved_tensors
        # An unused output's grad arrives as zeros (materialize_grads is on), never None.
        return *_rotate(dq, dk, cos, sin, -1.0), None, None
