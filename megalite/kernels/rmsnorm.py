"""RMSNorm `y = weight * (x / rms(x))` over x `[..., hidden]`, Triton beside PyTorch.

Statistics in fp32; the Triton forward saves x and each row's 1/rms, and in the backward each
program walks a block of rows (int64 offsets), summing their weight grads in fp32:
    xhat = x * rstd,  g = dy * weight,  dx = rstd * (g - xhat * mean(g * xhat)),  dweight = sum of dy * xhat
"""

import torch

from megalite.kernels import backward_programs, tl, triton, use_triton


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """PyTorch RMSNorm as LLaMA computes it: normalised in fp32, cast to x's dtype, times weight."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, kernels: str = "auto") -> torch.Tensor:
    """RMSNorm of `x` over its last dimension; Triton or PyTorch per `--kernels kernels`."""
    return _RMSNorm.apply(x, weight, eps) if use_triton(x, kernels) else rms_norm_reference(x, weight, eps)


if triton is not None:

    @triton.jit
    def _forward_kernel(x_ptr, weight_ptr, y_ptr, rstd_ptr, n_cols, eps, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n_cols + eps)
        weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_ptr + row * n_cols + cols, (x * rstd * weight).to(y_ptr.dtype.element_ty), mask=mask)
        tl.store(rstd_ptr + row, rstd)

    @triton.jit
    def _backward_kernel(dy_ptr, x_ptr, weight_ptr, rstd_ptr, dx_ptr, dweight_ptr, n_rows, n_cols,
                         rows_per_program, BLOCK: tl.constexpr):
        program = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        dweight = tl.zeros((BLOCK,), dtype=tl.float32)
        first = program.to(tl.int64) * rows_per_program
        for i in range(0, rows_per_program):
            row = first + i
            if row < n_rows:
                x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
                dy = tl.load(dy_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
                rstd = tl.load(rstd_ptr + row)
                xhat = x * rstd
                g = dy * weight
                dx = rstd * (g - xhat * (tl.sum(g * xhat, axis=0) / n_cols))
                tl.store(dx_ptr + row * n_cols + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)
                dweight += dy * xhat
        tl.store(dweight_ptr + program.to(tl.int64) * n_cols + cols, dweight, mask=mask)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        shape, hidden = x.shape, x.shape[-1]
        x2 = x.reshape(-1, hidden).contiguous()  # [rows, hidden]
        rows = x2.shape[0]
        y = torch.empty((rows, hidden), dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
        rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
        _forward_kernel[(rows,)](x2, weight.contiguous(), y, rstd, hidden, eps, BLOCK=triton.next_power_of_2(hidden))
        ctx.save_for_backward(x2, weight, rstd)
        ctx.shape = shape
        return y.view(shape)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x2, weight, rstd = ctx.saved_tensors
        rows, hidden = x2.shape
        dy2 = dy.reshape(rows, hidden).contiguous()
        dx = torch.empty_like(x2)
        programs = backward_programs(rows, x2.device)
        partial = torch.empty((programs, hidden), dtype=torch.float32, device=x2.device)
        _backward_kernel[(programs,)](dy2, x2, weight.contiguous(), rstd, dx, partial, rows, hidden,
                                      triton.cdiv(rows, programs), BLOCK=triton.next_power_of_2(hidden))
        return dx.view(ctx.shape), partial.sum(0).to(weight.dtype), None
