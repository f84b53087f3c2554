"""Fixtures shared by every test folder."""

import pytest
import torch


@pytest.fixture
def one_thread():
    """Run the test with one torch thread (fast and deterministic on a shared 2-core machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
