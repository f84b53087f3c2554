"""megalite/cpu_allocator.py: the recycled buffer hands out memory only once nothing else holds it;
freed memory kept in the process is reused without page faults."""

import copy
import os
import subprocess
import sys

import pytest
import torch

from megalite.cpu_allocator import RecycledBuffer, empty_padded_rows, padded_row_length

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


def test_rows_a_whole_number_of_4_kib_apart_get_one_cache_line_more():
    assert padded_row_length(8192, 4) == 8208  # config A's fp32 logits: 32 KiB rows
    assert padded_row_length(1024, 4) == 1040 and padded_row_length(2048, 2) == 2080  # 4 KiB, in bf16 too
    assert padded_row_length(32000, 4) == 32000  # 125 KiB: rows fall on different cache sets already
    assert padded_row_length(1000, 4) == 1000 and padded_row_length(512, 4) == 512


def test_a_padded_block_is_laid_out_in_padded_rows_and_handed_out_again():
    buffer = RecycledBuffer()
    first = buffer.take((3, 2, 1024), torch.float32, "cpu", pad_rows=True)
    assert first.shape == (3, 2, 1024) and first.stride() == (2 * 1040, 1040, 1)
    assert buffer._storage.nbytes() == 3 * 2 * 1040 * 4
    assert first.view(-1, 1024).stride() == (1040, 1)  # token rows flatten into one GEMM output
    pointer = first.data_ptr()
    del first
    again = buffer.take((3, 2, 1024), torch.float32, "cpu", pad_rows=True)
    assert again.data_ptr() == pointer and again.stride() == (2 * 1040, 1040, 1)
    del again
    plain = buffer.take((3, 2, 1024), torch.float32, "cpu")  # fits in the padded block, contiguous
    assert plain.data_ptr() == pointer and plain.is_contiguous()


def test_a_gemm_output_has_padded_rows_on_a_cpu_only():
    chunk = empty_padded_rows(3, 1024, torch.float32, "cpu")
    assert chunk.shape == (3, 1024) and chunk.stride() == (1040, 1)
    assert empty_padded_rows(3, 1000, torch.float32, "cpu").is_contiguous()
    assert empty_padded_rows(3, 1024, torch.float32, "meta").is_contiguous()


def test_other_devices_and_copies_get_plain_memory():
    buffer = RecycledBuffer()
    meta = buffer.take((2, 3), torch.float32, "meta")
    assert meta.is_meta and buffer._storage is None
    buffer.take((2, 3), torch.float32, "cpu")
    assert copy.deepcopy(buffer)._storage is None


KEPT_SCRIPT = """
import os
from megalite.cpu_allocator import keep_freed_memory
took = keep_freed_memory()
import torch
def resident_mb():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2 ** 20
block = torch.empty(16 << 20).fill_(1.0)  # 64 MB, every page touched
before = resident_mb()
del block
print(int(took), before - resident_mb())
"""


def _memory_returned_on_free(keep: str):
    """(whether keep_freed_memory took, MB the process gave back when a touched 64 MB block was freed)."""
    env = dict(os.environ, MEGALITE_KEEP_FREED_MEMORY=keep, THP_MEM_ALLOC_ENABLE="0")
    out = subprocess.run([sys.executable, "-c", KEPT_SCRIPT], env=env, cwd=REPO_ROOT, check=True,
                         capture_output=True, text=True).stdout.split()
    return bool(int(out[0])), float(out[1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt: Linux")
def test_freed_memory_stays_in_the_process_for_reuse():
    """Kept: a freed block stays resident (the next allocation reuses its pages, no faults).
    Opted out: glibc unmaps a block that large on free, and the next one is faulted in afresh."""
    took, kept_returned = _memory_returned_on_free("1")
    opted_out, default_returned = _memory_returned_on_free("0")
    assert took and not opted_out
    assert default_returned > 56
    assert kept_returned < 8
