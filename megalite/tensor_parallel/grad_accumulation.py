"""Megatron's gradient-accumulation fusion: a linear layer's weight grad goes straight into the fp32 `main_grad`.

Without it, autograd writes each backward's weight grad `[out, in]` into a new tensor in the model's dtype, and
the grad buffer's hook adds it into `main_grad` and frees it: one extra weight-sized tensor and one extra pass
over it per weight and micro-batch, and under bf16 the grad is rounded to 8 bits before it is summed. With it,
the backward's weight-grad GEMM accumulates into `main_grad` itself: `main_grad += grad_outputᵀ · input`, with
fp32 output where the device's GEMM has it (`add_product`: CUDA's `addmm(..., out_dtype=float32)`; any device in
fp32).

A parameter takes part when the grad buffer has given it `add_to_main_grad` (data_parallel/grad_buffer.py),
which prepares its bucket, runs the addition and reports the grad as ready, as the buffer's hook does for an
autograd grad. The weight must be used once per backward (a linear's own weight; the tied output layer's
embedding weight is not), since its grad is reported ready as soon as it is added.
"""

import torch
import torch.nn.functional as F

# device type -> how a 16-bit GEMM is formed in fp32 there (`mixed_gemm`).
_MIXED_GEMM: dict[str, str | None] = {}


def linear(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear (`[*, in]` x `[out, in]` -> `[*, out]`), its weight grad added into `weight.main_grad` by the
    backward when the grad buffer lets it (`weight.add_to_main_grad`)."""
    if getattr(weight, "add_to_main_grad", None) is None or not torch.is_grad_enabled():
        return F.linear(input, weight, bias)
    return _LinearIntoMainGrad.apply(input, weight, bias)


class _LinearIntoMainGrad(torch.autograd.Function):
    """y = x Wᵀ + b whose backward adds dW into W.main_grad and returns no grad for W."""

    @staticmethod
    def forward(ctx, input, weight, bias):
        ctx.save_for_backward(input, weight)
        # Held here, not read off the saved weight: under recomputation that is a recomputed alias, not the Parameter.
        ctx.add_to_main_grad, ctx.has_bias = weight.add_to_main_grad, bias is not None
        return F.linear(input, weight, bias)

    @staticmethod
    def backward(ctx, grad_output):
        input, weight = ctx.saved_tensors
        grad_input = grad_output.matmul(weight) if ctx.needs_input_grad[0] else None
        grad_2d = grad_output.reshape(-1, grad_output.shape[-1])  # [N, out]
        input_2d = input.reshape(-1, input.shape[-1])  # [N, in]
        ctx.add_to_main_grad(lambda main_grad: add_product(main_grad, grad_2d.t(), input_2d))
        grad_bias = grad_2d.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_input, None, grad_bias


def add_product(accumulator: torch.Tensor, a: torch.Tensor, b: torch.Tensor, exact: bool = False) -> None:
    """accumulator `[m, n]` (fp32) += a `[m, k]` @ b `[k, n]`: one GEMM into the accumulator where the device has
    one for a's dtype (fp32 anywhere; 16-bit inputs on CUDA, `mixed_gemm`). Elsewhere the product is rounded to
    the inputs' dtype and added, as autograd's grad would be; or with `exact` it is formed in fp32 (CUDA's
    `mm(out_dtype=float32)` then the add; else the inputs cast to fp32), for sums over many products."""
    if a.dtype == accumulator.dtype:
        accumulator.addmm_(a, b)
        return
    way = mixed_gemm(accumulator.device)
    if way == "addmm":
        torch.addmm(accumulator, a, b, out_dtype=accumulator.dtype, out=accumulator)
    elif not exact:
        accumulator.add_(a @ b)
    elif way == "mm":
        accumulator.add_(torch.mm(a, b, out_dtype=accumulator.dtype))
    else:
        accumulator.addmm_(a.to(accumulator.dtype), b.to(accumulator.dtype))


def mixed_gemm(device: torch.device) -> str | None:
    """How this torch forms a 16-bit GEMM in fp32 on `device`: "addmm" (added into an fp32 tensor in place), "mm"
    (an fp32 result only), or None (not at all: CPUs). Tried once per device type on a small product, against
    fp64."""
    if device.type not in _MIXED_GEMM:
        _MIXED_GEMM[device.type] = _mixed_gemm_way(device) if device.type == "cuda" else None
    return _MIXED_GEMM[device.type]


def _mixed_gemm_way(device: torch.device) -> str | None:
    generator = torch.Generator().manual_seed(0)
    a, b, c = (torch.randn(shape, generator=generator) for shape in ((32, 16), (16, 48), (32, 48)))
    a16, b16 = a.bfloat16().to(device), b.bfloat16().to(device)
    product = a.bfloat16().double() @ b.bfloat16().double()
    tries = {"addmm": (lambda out: torch.addmm(out, a16, b16, out_dtype=torch.float32, out=out), c + product),
             "mm": (lambda out: out.copy_(torch.mm(a16, b16, out_dtype=torch.float32)), product)}
    for way, (run, expected) in tries.items():
        out = c.to(device)
        try:
            run(out)
        except (RuntimeError, TypeError, NotImplementedError):
            continue
        if torch.allclose(out.double().cpu(), expected.double(), rtol=1e-5, atol=1e-5):
            return way
    return None
