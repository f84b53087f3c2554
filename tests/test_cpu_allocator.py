"""megalite/cpu_allocator.py: the recycled buffer hands out memory only once nothing else holds it;
freed memory kept in the process is reused without page faults."""

import copy
import os
import subprocess
import sys

import pytest
import torch

from megalite.cpu_allocator import RecycledBuffer

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_a_free_block_is_handed_out_again():
    buffer = RecycledBuffer()
    first = buffer.take((4, 6), torch.float32, "cpu")
    pointer = first.data_ptr()
    del first
    again = buffer.take((4, 6), torch.float32, "cpu")
    assert again.data_ptr() == pointer and again.shape == (4, 6) and again.is_contiguous()
    del again
    smaller = buffer.take((3, 2), torch.bfloat16, "cpu")  # fits in the kept block
    assert smaller.data_ptr() == pointer and smaller.dtype == torch.bfloat16


def test_a_block_still_held_by_a_view_is_not_handed_out():
    buffer = RecycledBuffer()
    first = buffer.take((4, 6), torch.float32, "cpu").fill_(1.0)
    row = first[2]
    del first
    second = buffer.take((4, 6), torch.float32, "cpu").fill_(2.0)
    assert second.data_ptr() != row.data_ptr()
    assert torch.equal(row, torch.ones(6))  # the view's memory was not handed out
    del row, second
    assert buffer.take((4, 6), torch.float32, "cpu") is not None


def test_a_block_saved_for_a_backward_is_not_handed_out():
    buffer = RecycledBuffer()
    weight = torch.randn(4, 6, requires_grad=True)
    logits = buffer.take((4, 6), torch.float32, "cpu").copy_(torch.randn(4, 6))
    loss = (logits.detach() * weight).sum()  # mul saves the logits for weight's grad
    saved = logits.detach().clone()
    del logits
    buffer.take((4, 6), torch.float32, "cpu").fill_(7.0)
    loss.backward()
    assert torch.equal(weight.grad, saved)


def test_a_larger_request_gets_a_new_block_which_is_kept():
    buffer = RecycledBuffer()
    small = buffer.take((2, 3), torch.float32, "cpu")
    del small
    larger = buffer.take((5, 3), torch.float32, "cpu")
    assert larger.numel() == 15 and buffer._storage.nbytes() == 15 * 4
    pointer = larger.data_ptr()
    del larger
    assert buffer.take((5, 3), torch.float32, "cpu").data_ptr() == pointer


def test_other_devices_and_copies_get_plain_memory():
    buffer = RecycledBuffer()
    meta = buffer.take((2, 3), torch.float32, "meta")
    assert meta.is_meta and buffer._storage is None
    buffer.take((2, 3), torch.float32, "cpu")
    assert copy.deepcopy(buffer)._storage is None


FAULTS_SCRIPT = """
import resource, sys
from megalite.cpu_allocator import keep_freed_memory
took = keep_freed_memory()
import torch
for _ in range(8):  # 64 MB touched, then freed; the heap settles within a few rounds (alignment slack)
    torch.empty(16 << 20).fill_(1.0)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(4):
    torch.empty(16 << 20).fill_(1.0)  # pages kept, or faulted in afresh
print(int(took), resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults_of_reallocating(keep: str):
    """(whether keep_freed_memory took, page faults of 4 late 64 MB allocations) in a fresh process."""
    env = dict(os.environ, MEGALITE_KEEP_FREED_MEMORY=keep, THP_MEM_ALLOC_ENABLE="0")
    out = subprocess.run([sys.executable, "-c", FAULTS_SCRIPT], env=env, cwd=REPO_ROOT, check=True,
                         capture_output=True, text=True).stdout.split()
    return bool(int(out[0])), int(out[1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt: Linux")
def test_kept_memory_is_reused_without_page_faults():
    took, kept_faults = _faults_of_reallocating("1")
    opted_out, fresh_faults = _faults_of_reallocating("0")
    assert took and not opted_out
    assert fresh_faults > 1000  # 4 x 16k pages of 4 KiB when the block goes back to the kernel each time
    assert kept_faults < fresh_faults / 10
