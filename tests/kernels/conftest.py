"""The `device` every kernel test builds its tensors on: the GPU when there is one, else the CPU
with Triton's interpreter (tests/helpers/kernel_device.py says how and why)."""

import pytest
import torch

from megalite import kernels
from tests.helpers import triton_interpreter
from tests.helpers.kernel_device import DEVICE


@pytest.fixture(autouse=True)
def cpu_unless_marked_gpu():
    """Kernel tests keep the GPU where there is one (this replaces tests/conftest.py's fixture)."""
    yield


@pytest.fixture
def device() -> torch.device:
    """The GPU when there is one, else the CPU with Triton's interpreter."""
    if DEVICE.type == "cpu" and kernels.triton_available() and not kernels.interpreting():
        pytest.fail("no GPU and TRITON_INTERPRET is not 1: tests/conftest.py sets it before megalite is imported")
    if DEVICE.type == "cpu" and kernels.triton_available() and triton_interpreter.problem():
        pytest.skip(triton_interpreter.problem())
    return DEVICE
