"""The Triton RMSNorm and LayerNorm against a float64 reference, on `device` (tests/kernels/conftest.py:
the GPU when there is one, else the CPU through Triton's interpreter).

Output, input grad, weight grad (and bias grad), in fp32 and with bf16 inputs, at odd sizes: the
kernel's error must stay within twice the PyTorch reference's own error in the same
dtype (relative L2 error, with a floor at the dtype's rounding for exact cases).
"""

import pytest
import torch

from megalite import kernels
from megalite.kernels.layernorm import TritonNorm, layer_norm_reference
from megalite.kernels.rmsnorm import rms_norm, rms_norm_reference
from tests.helpers.kernel_device import FP32_FLOOR

pytestmark = pytest.mark.skipif(not kernels.triton_available(), reason="triton is not installed")

FLOOR = {torch.float32: FP32_FLOOR, torch.bfloat16: 4e-3}  # FP32_FLOOR: tests/helpers/kernel_device.py


NORMS = {  # name -> (PyTorch reference, Triton Function, has bias)
    "rmsnorm": (rms_norm_reference, lambda x, weight, eps: TritonNorm.apply(x, weight, None, eps), False),
    "layernorm": (layer_norm_reference, TritonNorm.apply, True),
}


def run(function, with_bias, x, weight, bias, grad, dtype):
    """(y, dx, dweight[, dbias]) in float64 of `function` on copies of the inputs cast to `dtype`."""
    leaves = [t.detach().clone().to(dtype).requires_grad_() for t in ((x, weight, bias) if with_bias else (x, weight))]
    y = function(*leaves, 1e-5)
    y.backward(grad.to(y.dtype))
    return (y.detach().double(), *(leaf.grad.double() for leaf in leaves))


def relative_error(actual, expected):
    return float((actual - expected).norm() / expected.norm())


@pytest.mark.parametrize("norm", list(NORMS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(3, 5, 37), (7, 64), (2, 1, 130)])
def test_triton_norm_matches_float64_within_twice_torch_error(norm, shape, dtype, one_thread, device):
    reference_function, triton_function, with_bias = NORMS[norm]
    generator = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(shape, generator=generator, dtype=torch.float64) * 3 + 1
    weight = torch.randn(shape[-1], generator=generator, dtype=torch.float64)
    bias = torch.randn(shape[-1], generator=generator, dtype=torch.float64)
    grad = torch.randn(shape, generator=generator, dtype=torch.float64)
    inputs = tuple(t.to(device) for t in (x, weight, bias, grad))
    reference = run(reference_function, with_bias, *inputs, torch.float64)
    torch_path = run(reference_function, with_bias, *inputs, dtype)
    triton_path = run(triton_function, with_bias, *inputs, dtype)
    for name, expected, ours, theirs in zip(("y", "dx", "dweight", "dbias"), reference, triton_path, torch_path):
        bound = 2 * max(relative_error(theirs, expected), FLOOR[dtype])
        assert relative_error(ours, expected) <= bound, name


def test_non_contiguous_input_and_dispatch(one_thread, device):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(6, 4, 24, generator=generator).to(device).transpose(0, 1)  # not contiguous
    weight = torch.randn(24, generator=generator).to(device)
    fused = rms_norm(x, weight, 1e-6, kernels="triton")
    assert kernels.use_triton(x.cpu(), "auto") is False  # auto on a CPU tensor: PyTorch, on any machine
    assert kernels.use_triton(x, "auto") is (x.is_cuda and kernels.triton_available())  # and Triton on a GPU
    torch.testing.assert_close(fused, rms_norm_reference(x, weight, 1e-6), rtol=1e-6, atol=1e-6)
