"""tools/bench/memory.py measures real runs: the distributed optimizer halves optimizer state at DP=2."""

from tools.bench.memory import main


def test_memory_bench_shards_optimizer_state_over_data_parallel_ranks(capsys):
    assert main(["--dp", "1", "2", "--dtype", "fp32"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.split()[:1] in (["1"], ["2"])]
    optim = {(int(row[0]), row[1], int(row[2])): float(row[5]) for row in rows}
    assert optim[(1, "MixedPrecisionOptimizer", 0)] > 0
    for rank in (0, 1):
        assert optim[(2, "MixedPrecisionOptimizer", rank)] == optim[(1, "MixedPrecisionOptimizer", 0)]
        ratio = optim[(2, "DistributedOptimizer", rank)] / optim[(1, "MixedPrecisionOptimizer", 0)]
        assert 0.49 <= ratio <= 0.51
