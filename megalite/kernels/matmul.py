"""bf16 / fp16 matrix products on CPUs that have no bf16 / fp16 matrix instructions.

A CPU without AVX-512-BF16 or AMX (this project's 2-core AMD machine, most desktops)
runs PyTorch's bf16 GEMM through a scalar fallback at about 1 GFLOP/s, over 100x slower
than its fp32 GEMM, and the bf16 flash-attention backward likewise. On such a CPU the
model's products take their bf16 operands up to fp32, multiply with the fp32 GEMM and
round the result back to bf16. That is the arithmetic of a bf16 GEMM with fp32
accumulation (a product of two bf16 numbers is exact in fp32), so results match a GPU's
bf16 GEMM up to summation order. Everywhere else (GPUs, CPUs with bf16 units, fp32)
these functions are the plain PyTorch ops.

`linear` saves its bf16 inputs, not their fp32 copies, so activation memory is that of
a bf16 model; the copies are made again in the backward (cheap next to the GEMMs).
`set_fp32_products(True/False)` forces the choice (tests); None restores detection.
"""

import torch
import torch.nn.functional as F

_forced: bool | None = None


def set_fp32_products(value: bool | None) -> None:
    """Force (True/False) or re-detect (None) fp32 products for reduced-precision CPU tensors."""
    global _forced
    _forced = value


def _cpu_has_gemm_for(dtype: torch.dtype) -> bool:
    """Whether oneDNN has fast `dtype` GEMM kernels on this CPU (AVX-512-BF16 / AMX / AVX-512-FP16)."""
    try:
        if dtype == torch.bfloat16:
            return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    except (AttributeError, RuntimeError):  # a torch built without oneDNN: its fallback is the slow one
        return False


# Asked once, at import: a constant is free to read inside torch.compile'd code.
_CPU_HAS_GEMM = {dtype: _cpu_has_gemm_for(dtype) for dtype in (torch.bfloat16, torch.float16)}


def cpu_has_gemm_units(dtype: torch.dtype) -> bool:
    """Whether this CPU multiplies `dtype` matrices natively (always for fp32; detection, not forcing)."""
    return _CPU_HAS_GEMM.get(dtype, True)


def fp32_products(x: torch.Tensor) -> bool:
    """Whether products of `x` (and tensors like it) are computed in fp32 here."""
    if x.dtype not in (torch.bfloat16, torch.float16) or x.device.type != "cpu":
        return False
    if _forced is not None:
        return _forced
    return not cpu_has_gemm_units(x.dtype)


class _Linear(torch.autograd.Function):
    """y = x W^T + b for x `[*, in]`, W `[out, in]`, b `[out]`, with `matmul`'s fp32 products.

    Writes y `[*, out]` (x's dtype) into `out` when given (a tensor nothing else holds,
    e.g. from a RecycledBuffer, its rows maybe padded), else into new memory; every grad
    comes back in its input's dtype.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, out):
        ctx.save_for_backward(x, weight)
        ctx.bias_dtype = None if bias is None else bias.dtype
        flat_x = x.reshape(-1, x.shape[-1])  # [tokens, in]
        flat_out = None if out is None else out.view(-1, weight.shape[0])  # [tokens, out]
        if fp32_products(x):  # the bias joins in fp32, then one rounding, as a GPU GEMM's epilogue does
            product = F.linear(flat_x.float(), weight.float(), None if bias is None else bias.float())
            output = _rounded(product, x.dtype, flat_out)
        elif bias is None:
            output = torch.mm(flat_x, weight.t(), out=flat_out)
        else:
            output = torch.addmm(bias, flat_x, weight.t(), out=flat_out)
        return output.view(*x.shape[:-1], weight.shape[0]) if out is None else out

    @staticmethod
    def backward(ctx, grad_output):
        x, weight = ctx.saved_tensors
        grad = grad_output.reshape(-1, grad_output.shape[-1])  # [tokens, out]
        in_fp32 = fp32_products(grad)
        if in_fp32:
            grad = grad.float()  # once, for both products
        grad_x = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_x = (grad @ (weight.float() if in_fp32 else weight)).to(x.dtype).view(*x.shape)
        if ctx.needs_input_grad[1]:
            flat_x = x.reshape(-1, x.shape[-1])
            grad_weight = (grad.t() @ (flat_x.float() if in_fp32 else flat_x)).to(weight.dtype)
        if ctx.bias_dtype is not None and ctx.needs_input_grad[2]:
            grad_bias = grad.sum(dim=0, dtype=torch.float32).to(ctx.bias_dtype)
        return grad_x, grad_weight, grad_bias, None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias), with fp32 products where `fp32_products(x)` says so.

    out: a `[*, out_features]` tensor of x's dtype, contiguous but for padding after each
    row, to write the result into and return (autograd-tracked like F.linear's result);
    only for memory nothing else reads.
    """
    if fp32_products(x) or out is not None:
        return _Linear.apply(x, weight, bias, out)
    return F.linear(x, weight, bias)


def matmul(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """a @ b for 2-D a, b (no autograd needed) in a's dtype, into `out` when given, with fp32
    products where `fp32_products(a)` says so."""
    if not fp32_products(a):
        return torch.mm(a, b, out=out)
    return _rounded(a.float() @ b.float(), a.dtype, out)


def _rounded(product: torch.Tensor, dtype: torch.dtype, out: torch.Tensor | None) -> torch.Tensor:
    """An fp32 `product` rounded once to `dtype`, written into `out` when given."""
    return product.to(dtype) if out is None else out.copy_(product)
