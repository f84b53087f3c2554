"""The Triton rotary embedding for q and k together, against float64, on `device` (tests/kernels/conftest.py:
the GPU when there is one, else the CPU through Triton's interpreter)."""

import pytest
import torch

from megalite import kernels
from megalite.kernels.rotary import _Rotary, apply_rotary_reference
from megalite.model.rotary import RotaryEmbedding
from tests.helpers.kernel_device import FP32_FLOOR

pytestmark = pytest.mark.skipif(not kernels.triton_available(), reason="triton is not installed")

FLOOR = {torch.float32: FP32_FLOOR, torch.bfloat16: 4e-3}  # FP32_FLOOR: tests/helpers/kernel_device.py


def run(function, q, k, cos, sin, grads, dtype):
    leaves = [t.detach().clone().to(dtype).requires_grad_() for t in (q, k)]
    # A strided view, as attention hands over q and k split from the fused QKV output.
    views = [torch.cat([leaf, leaf], dim=-1)[..., :leaf.shape[-1]] for leaf in leaves]
    outputs = function(*views, cos, sin)
    torch.autograd.backward(outputs, [g.to(o.dtype) for g, o in zip(grads, outputs)])
    return (*(o.detach().double() for o in outputs), *(leaf.grad.double() for leaf in leaves))


def relative_error(actual, expected):
    return float((actual - expected).norm() / expected.norm())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("positions", ["offset", "per-sample"])
@pytest.mark.parametrize("d, percent", [(10, 1.0), (12, 0.5)], ids=["whole", "half"])
def test_triton_rotary_matches_float64_within_twice_torch_error(d, percent, positions, dtype, one_thread, device):
    """Whole heads (d/2 odd), and --rotary-percent 0.5: 6 of 12 channels rotate (3 pairs), 6 pass through."""
    s, b, heads, groups = 5, 3, 6, 2  # grouped-query: 6 query heads, 2 key heads
    generator = torch.Generator().manual_seed(7)
    q = torch.randn(s, b, heads, d, generator=generator, dtype=torch.float64)
    k = torch.randn(s, b, groups, d, generator=generator, dtype=torch.float64)
    grads = (torch.randn(q.shape, generator=generator, dtype=torch.float64),
             torch.randn(k.shape, generator=generator, dtype=torch.float64))
    rotary = RotaryEmbedding(d, base=500.0, rotary_percent=percent)
    if positions == "offset":
        cos, sin = (table[11:] for table in rotary(11 + s))  # [s, 1, 1, d]: positions 11..15
    else:
        cos, sin = rotary(s, torch.tensor([[0, 1, 2, 0, 1], [3, 4, 5, 6, 7], [9, 8, 7, 6, 5]]))  # [s, b, 1, d]
    q, k, cos, sin = (t.to(device) for t in (q, k, cos, sin))  # tables made on the CPU: the same values
    grads = tuple(g.to(device) for g in grads)
    reference = run(apply_rotary_reference, q, k, cos.double(), sin.double(), grads, torch.float64)
    torch_path = run(apply_rotary_reference, q, k, cos, sin, grads, dtype)
    triton_path = run(_Rotary.apply, q, k, cos, sin, grads, dtype)
    for name, expected, ours, theirs in zip(("q", "k", "dq", "dk"), reference, triton_path, torch_path):
        assert relative_error(ours, expected) <= 2 * max(relative_error(theirs, expected), FLOOR[dtype]), name
    if percent < 1:  # the channels past the rotated ones, and their grads, pass through bit for bit
        for ours, theirs in zip(triton_path, torch_path):
            assert torch.equal(ours[..., 6:], theirs[..., 6:])
