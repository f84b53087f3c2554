"""Triton fused kernels, each beside its PyTorch reference, behind one dispatch point: each op takes the
`--kernels` mode, auto (Triton on CUDA tensors), triton (also on a CPU, through Triton's slow interpreter,
TRITON_INTERPRET=1) or torch, which the model holds from when it is built, and asks `use_triton(x, kernels)`.
No mode is kept here: two models in one process may use different ones."""

import os

import torch

from megalite.errors import UserError

try:
    import triton
    import triton.language as tl
except ImportError:  # the PyTorch paths need no Triton
    triton = tl = None


def triton_available() -> bool:
    return triton is not None


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def check_kernels(mode: str) -> None:
    """UserError when `--kernels mode` (one of TrainConfig's KERNEL_MODES) cannot run on this machine."""
    if mode == "triton" and not triton_available():
        raise UserError("--kernels triton needs the triton package; pip install -r requirements.txt, "
                        "or use --kernels torch")
    if mode == "triton" and not torch.cuda.is_available() and not interpreting():
        raise UserError("--kernels triton needs a CUDA GPU, or TRITON_INTERPRET=1 to run the kernels in "
                        "Triton's (slow) CPU interpreter; use --kernels auto or torch on this machine")


def use_triton(x: torch.Tensor, kernels: str) -> bool:
    """Whether the op on `x` runs the Triton kernel under `--kernels kernels` (auto, triton or torch)."""
    return kernels == "triton" or (kernels == "auto" and x.is_cuda and triton_available())
