"""tools/bench/memory.py on real torchrun worlds: the distributed optimizer halves optimizer state at DP=2."""

from tools.bench.memory import main as bench_main


def test_memory_bench_shards_optimizer_state_over_data_parallel_ranks(capsys):
    assert bench_main(["--dp", "1", "2", "--dtype", "bf16", "--small"]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.split()[:1] in (["1"], ["2"])]
    # DP, optimizer, rank, params MB, exp, grads MB, exp, optim MB, exp, vs DP=1
    optim = {(int(row[0]), row[1], int(row[2])): (float(row[7]), float(row[9])) for row in rows}
    assert sorted(optim) == [(1, "DistributedOptimizer", 0), (1, "MixedPrecisionOptimizer", 0),
                             (2, "DistributedOptimizer", 0), (2, "DistributedOptimizer", 1),
                             (2, "MixedPrecisionOptimizer", 0), (2, "MixedPrecisionOptimizer", 1)]
    baseline, _ = optim[(1, "MixedPrecisionOptimizer", 0)]
    assert baseline > 0
    for rank in (0, 1):
        assert optim[(2, "MixedPrecisionOptimizer", rank)] == (baseline, 1.0)  # replicated: no saving
        sharded, ratio = optim[(2, "DistributedOptimizer", rank)]
        assert 0.49 <= ratio <= 0.51
        assert abs(sharded - baseline / 2) <= 0.01
    assert "every measured figure equals its closed form to the byte" in out
    assert "not checked" in out  # DP=4 was not run
