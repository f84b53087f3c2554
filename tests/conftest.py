"""Fixtures shared by every test folder."""

import os

import pytest
import torch

# Triton kernels run in Triton's CPU interpreter on a machine without a GPU. The variable
# is read when a kernel is defined, so it is set here, before any test imports megalite.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def one_thread():
    """Run the test with one torch thread (fast and deterministic on a shared 2-core machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
