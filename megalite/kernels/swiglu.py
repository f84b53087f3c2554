"""SwiGLU `silu(gate) * up`, Triton beside PyTorch: x `[..., 2 * ffn]`, gate then up (the layout ColumnParallelLinear's
`output_chunks=2` keeps per TP rank) -> `[..., ffn]`. The Triton forward saves only x; the backward recomputes in fp32
d gate = dy * up * s * (1 + gate * (1 - s)), d up = dy * gate * s, s = sigmoid(gate)."""

import torch
import torch.nn.functional as F

from megalite.kernels import tl, triton, use_triton

BLOCK = 1024


def swiglu_reference(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def swiglu(x: torch.Tensor, kernels: str = "auto") -> torch.Tensor:
    """silu(gate) * up of the fused `[..., 2 * ffn]` tensor; Triton or PyTorch per `--kernels kernels`."""
    return _SwiGLU.apply(x) if use_triton(x, kernels) else swiglu_reference(x)


if triton is not None:

    @triton.jit
    def _forward_kernel(x_ptr, y_ptr, n_cols, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < n_cols
        gate = tl.load(x_ptr + row * 2 * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + row * 2 * n_cols + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        y = gate * tl.sigmoid(gate) * up
        tl.store(y_ptr + row * n_cols + cols, y.to(y_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _backward_kernel(dy_ptr, x_ptr, dx_ptr, n_cols, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < n_cols
        gate = tl.load(x_ptr + row * 2 * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + row * 2 * n_cols + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        s = tl.sigmoid(gate)
        dgate = dy * up * s * (1.0 + gate * (1.0 - s))
        dup = dy * gate * s
        out = dx_ptr.dtype.element_ty
        tl.store(dx_ptr + row * 2 * n_cols + cols, dgate.to(out), mask=mask)
        tl.store(dx_ptr + row * 2 * n_cols + n_cols + cols, dup.to(out), mask=mask)


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        shape, width = x.shape, x.shape[-1] // 2
        x2 = x.reshape(-1, 2 * width).contiguous()  # [rows, 2 * ffn]
        y = torch.empty((x2.shape[0], width), dtype=x.dtype, device=x.device)
        block = min(BLOCK, triton.next_power_of_2(width))
        _forward_kernel[(x2.shape[0], triton.cdiv(width, block))](x2, y, width, BLOCK=block)
        ctx.save_for_backward(x2)
        ctx.shape = shape
        return y.view(*shape[:-1], width)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        (x2,) = ctx.saved_tensors
        rows, width = x2.shape[0], x2.shape[1] // 2
        dy2 = dy.reshape(rows, width).contiguous()
        dx = torch.empty_like(x2)
        block = min(BLOCK, triton.next_power_of_2(width))
        _backward_kernel[(rows, triton.cdiv(width, block))](dy2, x2, dx, width, BLOCK=block)
        return dx.view(ctx.shape)
