"""tools/bench/kernels.py at a tiny shape: every row runs, and its memory figures are real."""

import pytest
import torch

from tools.bench import kernels as bench

TINY = bench.ModelShape("tiny", hidden=64, ffn=96, heads=4, groups=2, vocab=3000, tokens=128)


@pytest.mark.parametrize("kernel", sorted(bench.IMPLEMENTATIONS))
def test_every_kernel_row_runs_and_reports_its_traffic(kernel, one_thread):
    reference = bench.IMPLEMENTATIONS[kernel][1]
    lines = bench.bench_kernel(kernel, TINY, torch.float32, torch.device("cpu"), [("eager", reference)],
                               repeats=1, bandwidth=10.0)
    fields = lines[0].split()
    assert fields[:3] == [kernel, "tiny", "eager"] and float(fields[3]) > 0 and float(fields[4]) > 0


def test_peak_memory_sees_a_known_allocation():
    with bench.PeakMemory(torch.device("cpu")) as memory:
        block = torch.ones(1024, 1024)  # 4 MiB, alive until the end of the block
        block.mul_(2)
    assert 4 * bench.MB <= memory.peak < 5 * bench.MB


def test_fused_output_cross_entropy_needs_less_memory_than_unfused(one_thread):
    results = bench.bench_fused_output(TINY, torch.float32, torch.device("cpu"), repeats=1, chunk_elements=2 ** 14)
    fused, unfused = results["fused"][1], results["unfused"][1]
    logits_mb = TINY.tokens * TINY.vocab * 4 / bench.MB
    weight_grad_mb = TINY.vocab * TINY.hidden * 4 / bench.MB
    assert unfused >= 2 * logits_mb  # logits and their grad (or the saved softmax)
    assert weight_grad_mb <= fused < weight_grad_mb + logits_mb / 2
