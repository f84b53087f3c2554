"""tools/bench/kernels.py at a tiny shape: every row runs, its memory figures are real, and the whole
bench runs on a CPU (Triton in its interpreter where TRITON_INTERPRET=1) and, on a GPU, through its
CUDA-graph timer."""

import pytest
import torch

from megalite import kernels
from tools.bench import kernels as bench

TINY = bench.TINY
CPU = torch.device("cpu")


@pytest.mark.parametrize("kernel", sorted(bench.IMPLEMENTATIONS))
def test_every_kernel_row_runs_and_reports_its_traffic(kernel, one_thread):
    reference = bench.IMPLEMENTATIONS[kernel][1]
    lines = bench.bench_kernel(kernel, TINY, torch.float32, CPU, [("eager", reference)], repeats=1, bandwidth=10.0)
    fields = lines[0].split()
    # kernel size impl | GPU ms (on a CPU: wall) timer | wall ms | GB/s | % copy | vs eager | vs compile | peak MB
    assert fields[:3] == [kernel, "tiny", "eager"] and fields[4] == "wall"
    # GB/s has one decimal: a descheduled single repeat on a loaded machine can print 0.0
    assert float(fields[3]) > 0 and float(fields[3]) == float(fields[5]) and float(fields[6]) >= 0
    assert fields[8] == "1.00" and fields[9] == "-"


@pytest.mark.skipif(not (kernels.triton_available() and kernels.interpreting()),
                    reason="Triton on a CPU needs its interpreter (TRITON_INTERPRET=1, set by conftest without a GPU)")
@pytest.mark.interpreter
def test_the_triton_column_runs_in_the_interpreter_on_a_cpu(one_thread):
    triton_function, reference = bench.IMPLEMENTATIONS["rmsnorm"]
    implementations = [bench.Implementation("eager", reference),
                       bench.Implementation("triton", triton_function, mode="triton")]
    results = bench.measure_kernel("rmsnorm", TINY, torch.float32, CPU, implementations, repeats=1)
    assert results["eager"].timer == "wall" and results["triton"].timer == "interpreter"
    lines = bench.kernel_rows("rmsnorm", TINY, torch.float32, results, bandwidth=10.0)
    assert [line.split()[2] for line in lines] == ["eager", "triton"]
    assert lines[1].split()[-1] == "-"  # no peak memory in the interpreter


def test_the_bench_runs_end_to_end_on_a_cpu(capsys, one_thread):
    """main at the tiny shape: the table, the summary with one column per implementation, the fused part."""
    assert bench.main(["--device", "cpu", "--sizes", "tiny", "--kernels", "rmsnorm", "swiglu", "--no-compile",
                       "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    triton = kernels.triton_available() and kernels.interpreting()
    assert "copy" in out and "GB/s" in out and ("Triton rows in Triton's interpreter" in out) == triton
    summary = out.split("by implementation")[1].splitlines()
    assert summary[1].split()[:3] == ["kernel", "size", "triton" if triton else "eager"]
    assert summary[2].split()[:2] == ["rmsnorm", "tiny"] and summary[3].split()[:2] == ["swiglu", "tiny"]
    for path in ("unfused", "unfused-torch", "fused", "fused-main-grad"):
        assert f" {path} " in out
    assert "fused peak memory over the unfused path's" in out


@pytest.mark.slow
def test_the_compile_column_on_a_cpu(one_thread):
    """torch.compile of the reference (one small Inductor compile)."""
    reference = bench.IMPLEMENTATIONS["swiglu"][1]
    implementations = [bench.Implementation("eager", reference),
                       bench.Implementation("compile", torch.compile(reference, dynamic=False))]
    lines = bench.bench_kernel("swiglu", TINY, torch.float32, CPU, implementations, repeats=1, bandwidth=10.0)
    fields = lines[1].split()
    assert fields[2] == "compile" and float(fields[3]) > 0 and float(fields[9]) == 1.0  # vs compile: itself


def test_peak_memory_sees_a_known_allocation():
    with bench.PeakMemory(CPU) as memory:
        block = torch.ones(1024, 1024)  # 4 MiB, alive until the end of the block
        block.mul_(2)
    assert 4 * bench.MB <= memory.peak < 5 * bench.MB


def test_fused_output_cross_entropy_needs_less_memory_than_unfused(one_thread):
    results = bench.bench_fused_output(TINY, torch.float32, CPU, repeats=1, chunk_elements=2 ** 14)
    fused, unfused = results["fused"][1], results["unfused"][1]
    logits_mb = TINY.tokens * TINY.vocab * 4 / bench.MB
    weight_grad_mb = TINY.vocab * TINY.hidden * 4 / bench.MB
    assert unfused >= 2 * logits_mb  # logits and their grad (or the saved softmax)
    assert weight_grad_mb <= fused < weight_grad_mb + logits_mb / 2
    # Gradient-accumulation fusion: no [V, h] grad, the weight grad goes into the standing fp32 main grad.
    assert results["fused-main-grad"][1] < fused - 0.9 * weight_grad_mb
    assert all(ms > 0 and timer == "wall" for ms, _, _, timer in results.values())


def test_the_shapes_are_the_throughput_benchs_1b_and_llama3_8b():
    one, eight = bench.gpu_shapes()["1b"], bench.gpu_shapes()["8b"]
    assert (one.hidden, one.ffn, one.heads, one.groups, one.vocab, one.tokens) == (2048, 5632, 32, 4, 32000, 8192)
    assert (eight.hidden, eight.ffn, eight.heads, eight.groups, eight.vocab) == (4096, 14336, 32, 8, 128256)
    assert bench.gpu_shapes(4096)["8b"].tokens == 4096


def test_repeats_shrink_only_where_a_call_is_slow():
    assert bench._repeats_for(0.01, 100) == 100
    assert bench._repeats_for(50.0, 100) == 20  # one second's worth
    assert bench._repeats_for(5000.0, 100) == bench.MIN_REPEATS
    assert bench._repeats_for(5000.0, 3) == 3


@pytest.mark.gpu
def test_gpu_rows_are_timed_by_cuda_graph_replay():
    """On a GPU: the reference and the Triton kernel (forward + backward) are captured and replayed."""
    cuda = torch.device("cuda")
    triton_function, reference = bench.IMPLEMENTATIONS["rmsnorm"]
    implementations = [bench.Implementation("eager", reference)]
    if kernels.triton_available():
        implementations.append(bench.Implementation("triton", triton_function))
    notes = []
    results = bench.measure_kernel("rmsnorm", TINY, torch.bfloat16, cuda, implementations, repeats=20, notes=notes)
    assert set(results) == {implementation.name for implementation in implementations}
    for measurement in results.values():
        assert measurement.timer == "graph", measurement.note
        assert measurement.gpu_ms > 0 and measurement.wall_ms > 0
    results = bench.bench_fused_output(TINY, torch.bfloat16, cuda, repeats=10, chunk_elements=2 ** 14, notes=notes)
    assert all(ms > 0 for ms, _, _, _ in results.values()), notes
