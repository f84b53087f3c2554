"""Where the kernel tests run their tensors, and the fp32 floor of their error rule there.

With a CUDA GPU, on the GPU: Triton compiles the kernels (TRITON_INTERPRET is not set there).
Without one, on the CPU, where tests/conftest.py has put Triton in its interpreter. Tests draw
their random values on the CPU from a seeded generator and move them with `.to(DEVICE)`, so
both machines test the same numbers against the same float64 reference.

The rule of every kernel test: the Triton path's relative error against float64 is at most
twice the PyTorch path's own error in the same dtype, or twice a floor where both are at
rounding level. In fp32 that level depends on where Triton runs: its interpreter computes with
numpy's correctly rounded operations, while compiled GPU code takes the hardware's approximate
exp, sqrt and division (a few ulp each; PyTorch's CUDA ops are closer to correctly rounded), so
a correct fp32 kernel there can be a few times PyTorch's error while both are near 1e-7.
"""

import torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
FP32_FLOOR = 1e-7 if DEVICE.type == "cpu" else 1e-6
