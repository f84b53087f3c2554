"""LayerNorm `y = (x - mean) / std * weight + bias` over x `[..., hidden]`, Triton beside PyTorch. The kernels also
serve RMSNorm (rmsnorm.py), which is LayerNorm without centring (mean = 0) and without bias.

Statistics in fp32; the Triton forward saves x and each row's 1/std (and mean), and in the backward each program walks a
block of rows, summing their weight and bias grads in fp32:
    xhat = (x - mean) * rstd,  g = dy * weight,  dx = rstd * (g - mean(g) - xhat * mean(g * xhat))
    dweight = sum over rows of dy * xhat,  dbias = sum over rows of dy
(RMSNorm: dx = rstd * (g - xhat * mean(g * xhat)), no mean(g) term.)"""

import torch
import torch.nn.functional as F

from megalite.kernels import tl, triton, use_triton


def layer_norm_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    return F.layer_norm(x, x.shape[-1:], weight, bias, eps)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float,
               kernels: str = "auto") -> torch.Tensor:
    """LayerNorm of `x` over its last dimension; Triton or PyTorch per `--kernels kernels`."""
    norm = TritonNorm.apply if use_triton(x, kernels) else layer_norm_reference
    return norm(x, weight, bias, eps)


if triton is not None:

    @triton.jit
    def _forward_kernel(x_ptr, weight_ptr, bias_ptr, y_ptr, mean_ptr, rstd_ptr, n_cols, eps,
                        CENTRED: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        if CENTRED:
            mean = tl.sum(x, axis=0) / n_cols
            x = tl.where(mask, x - mean, 0.0)
            tl.store(mean_ptr + row, mean)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n_cols + eps)
        weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        y = x * rstd * weight
        if CENTRED:
            y = y + tl.load(bias_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_ptr + row * n_cols + cols, y.to(y_ptr.dtype.element_ty), mask=mask)
        tl.store(rstd_ptr + row, rstd)

    @triton.jit
    def _backward_kernel(dy_ptr, x_ptr, weight_ptr, mean_ptr, rstd_ptr, dx_ptr, dweight_ptr, dbias_ptr,
                         n_rows, n_cols, rows_per_program, CENTRED: tl.constexpr, BLOCK: tl.constexpr):
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
                rstd = tl.load(rstd_ptr + row)
                g = dy * weight
                if CENTRED:
                    xhat = tl.where(mask, (x - tl.load(mean_ptr + row)) * rstd, 0.0)
                    dx = rstd * (g - tl.sum(g, axis=0) / n_cols - xhat * (tl.sum(g * xhat, axis=0) / n_cols))
                    dbias += dy
                else:
                    xhat = x * rstd
                    dx = rstd * (g - xhat * (tl.sum(g * xhat, axis=0) / n_cols))
                tl.store(dx_ptr + row * n_cols + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)
                dweight += dy * xhat
        offsets = program.to(tl.int64) * n_cols + cols
        tl.store(dweight_ptr + offsets, dweight, mask=mask)
        if CENTRED:
            tl.store(dbias_ptr + offsets, dbias, mask=mask)


class TritonNorm(torch.autograd.Function):
    """The Triton LayerNorm of (x, weight, bias, eps); RMSNorm when `bias` is None."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
        shape, hidden, centred = x.shape, x.shape[-1], bias is not None
        x2 = x.reshape(-1, hidden).contiguous()  # [rows, hidden]
        rows = x2.shape[0]
        y = torch.empty((rows, hidden), dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
        rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
        mean = torch.empty(rows if centred else 0, dtype=torch.float32, device=x.device)  # RMSNorm keeps none
        bias = bias.contiguous() if centred else rstd  # RMSNorm: a pointer the kernel never reads
        _forward_kernel[(rows,)](x2, weight.contiguous(), bias, y, mean, rstd, hidden, eps, CENTRED=centred,
                                 BLOCK=triton.next_power_of_2(hidden))
        ctx.save_for_backward(x2, weight, mean, rstd)
        ctx.shape, ctx.bias_dtype = shape, bias.dtype if centred else None
        return y.view(shape)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x2, weight, mean, rstd = ctx.saved_tensors
        rows, hidden = x2.shape
        centred = ctx.bias_dtype is not None
        dy2 = dy.reshape(rows, hidden).contiguous()
        dx = torch.empty_like(x2)
        # Enough programs to fill a GPU, few in the interpreter.
        processors = torch.cuda.get_device_properties(x2.device).multi_processor_count if x2.is_cuda else 1
        programs = min(rows, 4 * processors)
        dweight = torch.empty((programs, hidden), dtype=torch.float32, device=x2.device)
        dbias = torch.empty((programs if centred else 0, hidden), dtype=torch.float32, device=x2.device)
        _backward_kernel[(programs,)](dy2, x2, weight.contiguous(), mean, rstd, dx, dweight, dbias, rows, hidden,
                                      triton.cdiv(rows, programs), CENTRED=centred,
                                      BLOCK=triton.next_power_of_2(hidden))
        grad_bias = dbias.sum(0).to(ctx.bias_dtype) if centred else None
        return dx.view(ctx.shape), dweight.sum(0).to(weight.dtype), grad_bias, None
