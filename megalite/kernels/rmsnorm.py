"""RMSNorm `y = weight * (x / rms(x))` over x `[..., hidden]`: Triton (layernorm.py's kernels, without
centring or bias) beside PyTorch."""

import torch

from megalite.kernels import use_triton
from megalite.kernels.layernorm import TritonNorm


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """PyTorch RMSNorm as LLaMA computes it: normalised in fp32, cast to x's dtype, times weight."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, kernels: str = "auto") -> torch.Tensor:
    """RMSNorm of `x` over its last dimension; Triton or PyTorch per `--kernels kernels`."""
    return TritonNorm.apply(x, weight, None, eps) if use_triton(x, kernels) else rms_norm_reference(x, weight, eps)
