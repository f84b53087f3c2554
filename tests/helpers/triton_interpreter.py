"""Whether Triton's CPU interpreter can run megalite's kernels in this environment.

Triton 3.6's interpreter converts a loop bound passed as a kernel argument with `int()` of a
one-element array, which NumPy 2.4 and later refuse ("only 0-dimensional arrays can be
converted to Python scalars"); Triton 3.7 fixed it. A GPU image with torch 2.11 (which pins
Triton 3.6) and a new NumPy has that pair: the compiled kernels run on its GPU, but the CPU
worlds that run them in the interpreter cannot. Tests marked `interpreter` are skipped there
with the reason (tests/conftest.py); `pip install -r requirements.txt` gives a working pair.
"""

import functools
import os
import subprocess
import sys

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # tests that need Triton skip on their own
    triton = None

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

if triton is not None:

    @triton.jit
    def _sum_kernel(x_ptr, n, BLOCK: tl.constexpr):
        total = 0.0
        for start in range(0, n, BLOCK):  # a loop bound from an argument, as the kernels' loops over columns
            cols = start + tl.arange(0, BLOCK)
            total += tl.sum(tl.load(x_ptr + cols, mask=cols < n, other=0.0), axis=0)
        tl.store(x_ptr, total)


def _probe_here() -> str | None:
    """Run the probe kernel in this process (TRITON_INTERPRET=1 must have been set before the import)."""
    x = torch.ones(5)
    try:
        _sum_kernel[(1,)](x, 5, BLOCK=4)
    except Exception as error:  # noqa: BLE001 - any failure is the answer
        return f"{type(error).__name__}: {error}"
    return None if x[0].item() == 5.0 else f"the probe kernel summed 5 ones to {x[0].item()}"


@functools.cache
def problem() -> str | None:
    """None where the interpreter runs the probe kernel; else one sentence saying why not."""
    if triton is None:
        return None
    if os.environ.get("TRITON_INTERPRET") == "1":
        error = _probe_here()
    else:  # a GPU machine: the interpreter is only switched on in the CPU worlds' processes
        from tools.fork_ranks import cpu_world_environment
        result = subprocess.run([sys.executable, "-c", "from tests.triton_interpreter import _probe_here as p; "
                                 "print(p() or '')"], capture_output=True, text=True, cwd=REPO_ROOT,
                                env=cpu_world_environment())
        error = result.stdout.strip() or (f"the probe process failed: {result.stderr[-300:]}"
                                          if result.returncode else None)
    if error is None:
        return None
    import numpy
    return (f"Triton {triton.__version__}'s CPU interpreter cannot run the kernels with NumPy {numpy.__version__} "
            f"({error}); Triton 3.7 or later can (pip install -r requirements.txt)")
