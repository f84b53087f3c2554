"""LayerNorm `y = (x - mean) / std * weight + bias` over x `[..., hidden]`, Triton beside PyTorch.

Statistics in fp32; the Triton forward saves x and each row's mean and 1/std, and in the
backward each program walks a block of rows, summing their weight and bias grads in fp32:
    xhat = (x - mean) * rstd,  g = dy * weight,  dx = rstd * (g - mean(g) - xhat * mean(g * xhat))
    dweight = sum over rows of dy * xhat,  dbias = sum over rows of dy
"""

import torch
import torch.nn.functional as F

from megalite.kernels import backward_programs, tl, triton, use_triton


def layer_norm_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    return F.layer_norm(x, x.shape[-1:], weight, bias, eps)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float,
               kernels: str = "auto") -> torch.Tensor:
    """LayerNorm of `x` over its last dimension; Triton or PyTorch per `--kernels kernels`."""
    if use_triton(x, kernels):
        return _LayerNorm.apply(x, weight, bias, eps)
    return layer_norm_reference(x, weight, bias, eps)


if triton is not None:

    @triton.jit
    def _forward_kernel(x_ptr, weight_ptr, bias_ptr, y_ptr, mean_ptr, rstd_ptr, n_cols, eps, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        mean = tl.sum(x, axis=0) / n_cols
        centred = tl.where(mask, x - mean, 0.0)
        rstd = 1.0 / tl.sqrt(tl.sum(centred * centred, axis=0) / n_cols + eps)
        weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        bias = tl.load(bias_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_ptr + row * n_cols + cols, (centred * rstd * weight + bias).to(y_ptr.dtype.element_ty), mask=mask)
        tl.store(mean_ptr + row, mean)
        tl.store(rstd_ptr + row, rstd)

    @triton.jit
    def _backward_kernel(dy_ptr, x_ptr, weight_ptr, mean_ptr, rstd_ptr, dx_ptr, dweight_ptr, dbias_ptr,
                         n_rows, n_cols, rows_per_program, BLOCK: tl.constexpr):
        program = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        dweight = tl.zeros((BLOCK,), dtype=tl.float32)
        dbias = tl.zeros((BLOCK,), dtype=tl.float32)
        first = program.to(tl.int64) * rows_per_program
        for i in range(0, rows_per_program):
            row = first + i
            if row < n_rows:
                x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
                dy = tl.load(dy_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
                mean = tl.load(mean_ptr + row)
                rstd = tl.load(rstd_ptr + row)
                xhat = tl.where(mask, (x - mean) * rstd, 0.0)
                g = dy * weight
                dx = rstd * (g - tl.sum(g, axis=0) / n_cols - xhat * (tl.sum(g * xhat, axis=0) / n_cols))
                tl.store(dx_ptr + row * n_cols + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)
                dweight += dy * xhat
                dbias += dy
        offsets = program.to(tl.int64) * n_cols + cols
        tl.store(dweight_ptr + offsets, dweight, mask=mask)
        tl.store(dbias_ptr + offsets, dbias, mask=mask)


class _LayerNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
        shape, hidden = x.shape, x.shape[-1]
        x2 = x.reshape(-1, hidden).contiguous()  # [rows, hidden]
        rows = x2.shape[0]
        y = torch.empty((rows, hidden), dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
        mean, rstd = (torch.empty(rows, dtype=torch.float32, device=x.device) for _ in range(2))
        _forward_kernel[(rows,)](x2, weight.contiguous(), bias.contiguous(), y, mean, rstd, hidden, eps,
                                 BLOCK=triton.next_power_of_2(hidden))
        ctx.save_for_backward(x2, weight, mean, rstd)
        ctx.shape, ctx.bias_dtype = shape, bias.dtype
        return y.view(shape)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x2, weight, mean, rstd = ctx.saved_tensors
        rows, hidden = x2.shape
        dy2 = dy.reshape(rows, hidden).contiguous()
        dx = torch.empty_like(x2)
        programs = backward_programs(rows, x2.device)
        dweight, dbias = (torch.empty((programs, hidden), dtype=torch.float32, device=x2.device) for _ in range(2))
        _backward_kernel[(programs,)](dy2, x2, weight.contiguous(), mean, rstd, dx, dweight, dbias, rows, hidden,
                                      triton.cdiv(rows, programs), BLOCK=triton.next_power_of_2(hidden))
        return dx.view(ctx.shape), dweight.sum(0).to(weight.dtype), dbias.sum(0).to(ctx.bias_dtype), None
