"""Megatron's gradient-accumulation fusion: a linear layer's weight grad goes straight into the fp32 `main_grad`.

Without it, autograd writes each backward's weight grad `[out, in]` into a new tensor in the model's dtype, and
the grad buffer's hook adds it into `main_grad` and frees it: one extra weight-sized tensor and one extra pass
over it per weight and micro-batch, and under bf16 the grad is rounded to 8 bits before it is summed. With it,
the backward's weight-grad GEMM accumulates into `main_grad` itself: `main_grad += grad_outputᵀ · input`, with
fp32 output where the device's GEMM has it (kernels/gemm.py: CUDA's `addmm(..., out_dtype=float32)`; any device
in fp32).

A parameter takes part when the grad buffer has given it `add_to_main_grad` (data_parallel/grad_buffer.py),
which prepares its bucket, runs the addition and reports the grad as ready, as the buffer's hook does for an
autograd grad. The weight must be used once per backward (a linear's own weight; the tied output layer's
embedding weight is not), since its grad is reported ready as soon as it is added.
"""

import torch
import torch.nn.functional as F

from megalite.kernels.gemm import add_product


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
