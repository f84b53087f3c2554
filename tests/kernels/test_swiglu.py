"""The Triton SwiGLU against a float64 reference, on `device` (tests/kernels/conftest.py: the GPU when
there is one, else the CPU through Triton's interpreter)."""

import pytest
import torch

from megalite import kernels
from megalite.kernels.swiglu import _SwiGLU, swiglu_reference
from tests.helpers.kernel_device import FP32_FLOOR

pytestmark = pytest.mark.skipif(not kernels.triton_available(), reason="triton is not installed")

FLOOR = {torch.float32: FP32_FLOOR, torch.bfloat16: 4e-3}  # FP32_FLOOR: tests/helpers/kernel_device.py


def run(function, x, grad, dtype):
    leaf = x.detach().clone().to(dtype).requires_grad_()
    y = function(leaf)
    y.backward(grad.to(y.dtype))
    return y.detach().double(), leaf.grad.double()


def relative_error(actual, expected):
    return float((actual - expected).norm() / expected.norm())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(3, 5, 2 * 37), (4, 2 * 1100), (1, 2, 2)])  # odd, several blocks, tiny
def test_triton_swiglu_matches_float64_within_twice_torch_error(shape, dtype, one_thread, device):
    generator = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(shape, generator=generator, dtype=torch.float64).to(device) * 2
    grad = torch.randn(*shape[:-1], shape[-1] // 2, generator=generator, dtype=torch.float64).to(device)
    reference = run(swiglu_reference, x, grad, torch.float64)
    torch_path = run(swiglu_reference, x, grad, dtype)
    triton_path = run(_SwiGLU.apply, x, grad, dtype)
    for name, expected, ours, theirs in zip(("y", "dx"), reference, triton_path, torch_path):
        assert relative_error(ours, expected) <= 2 * max(relative_error(theirs, expected), FLOOR[dtype]), name


def test_swiglu_saves_only_its_input(one_thread, device):
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(0)).to(device).requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        _SwiGLU.apply(x.transpose(0, 1).contiguous().transpose(0, 1))
    assert len(saved) == 1 and saved[0].numel() == x.numel()
