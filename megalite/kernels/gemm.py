"""A 16-bit GEMM added into an fp32 tensor: the weight grads of gradient-accumulation fusion
(tensor_parallel/grad_accumulation.py) and the fused output loss's fp32 sums (linear_cross_entropy.py)."""

import torch

# device type -> how a 16-bit GEMM is formed in fp32 there (`mixed_gemm`).
_MIXED_GEMM: dict[str, str | None] = {}


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
