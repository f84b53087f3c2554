"""--kernels: the one dispatch point and its errors."""

import pytest
import torch

from megalite import kernels
from megalite.config import TrainConfig
from megalite.errors import UserError


def test_triton_on_a_cpu_without_the_interpreter_is_refused_with_the_fix(monkeypatch):
    if torch.cuda.is_available() or not kernels.triton_available():
        pytest.skip("needs a CPU-only machine with triton installed")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(UserError, match="TRITON_INTERPRET=1"):
        kernels.check_kernels("triton")
    kernels.check_kernels("torch")
    kernels.check_kernels("auto")


def test_modes_pick_the_path():
    x = torch.zeros(2)
    try:
        kernels.set_kernels("torch")
        assert not kernels.use_triton(x)
        kernels.set_kernels("auto")
        assert kernels.use_triton(x) == (x.is_cuda and kernels.triton_available())
    finally:
        kernels.set_kernels("auto")


def test_an_unknown_mode_is_the_configs_to_refuse():
    with pytest.raises(UserError, match="--kernels fast is not one of auto, triton, torch"):
        TrainConfig(kernels="fast").validate()
