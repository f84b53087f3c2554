"""tools/bench/memory.py and tools/bench/sharding_comm.py on real gloo worlds (forked ranks): model state and bytes
communicated per rank under each sharding strategy."""

import pytest

from tools.bench.memory import main as bench_main


def test_memory_bench_shards_model_state_by_strategy(capsys):
    assert bench_main(["--dp", "1", "2", "--dtype", "bf16", "--small", "--micro-batches", "3"]) == 0
    out = capsys.readouterr().out
    table, accumulation = out.split("peak model state (MB) over 3 micro-batches")
    rows = [line.split() for line in table.splitlines() if line.split()[:1] in (["1"], ["2"])]
    # DP, strategy, rank, params MB, exp, grads MB, exp, optim MB, exp, state/N, formula, ratio, peak MB, vs no_shard
    state = {(int(row[0]), row[1], int(row[2])): (float(row[9]), float(row[13])) for row in rows}
    strategies = ("no_shard", "optim", "optim_grads", "optim_grads_params")
    assert sorted(state) == sorted((dp, strategy, rank) for dp in (1, 2) for strategy in strategies
                                   for rank in range(dp))
    for strategy in strategies:  # one rank: nothing to shard
        assert state[(1, strategy, 0)][0] == pytest.approx(18.0, abs=0.01)
    for rank in (0, 1):  # bytes per parameter at DP 2: 18, 6 + 12/2, 2 + 16/2, 18/2
        for strategy, per_param in zip(strategies, (18.0, 12.0, 10.0, 9.0)):
            assert state[(2, strategy, rank)][0] == pytest.approx(per_param, abs=0.05)
            assert state[(2, strategy, rank)][1] == pytest.approx(per_param / 18.0, abs=0.005)
    assert "every measured figure equals its closed form to the byte" in out
    assert "PASS: every strategy's model state within 10% of its formula" in out
    assert "not checked" in out  # DP=8 was not run
    # Under accumulation ZeRO-2/3 reduce each micro-batch into their shard: no growth, below ZeRO-1.
    peaks = {(row[0], row[1], row[2]): [float(x) for x in row[3:]] for row in map(str.split, accumulation.splitlines())
             if row[:1] == ["2"]}
    for strategy in ("optim_grads", "optim_grads_params"):
        for rank in "01":
            one, many, growth, versus_zero1 = peaks[("2", strategy, rank)]
            assert growth <= 1.1 and versus_zero1 < 1
    assert "PASS: ZeRO-2/3's peak over 3 micro-batches within 1.1x of one micro-batch's and below ZeRO-1's" in out


def test_sharding_comm_bench_counts_zero3_at_one_and_a_half_times_plain_dp(capsys):
    from tools.bench.sharding_comm import main as comm_main

    assert comm_main(["--dp", "2", "--small"]) == 0
    out = capsys.readouterr().out
    ratios = {line.split()[0]: float(line.split()[-1]) for line in out.splitlines()
              if line.split()[:1] and line.split()[0] in ("no_shard", "optim", "optim_grads", "optim_grads_params")}
    assert ratios == {"no_shard": 1.0, "optim": 1.0, "optim_grads": 1.0, "optim_grads_params": 1.5}
    assert "PASS: ZeRO-3 moves 1.500x plain DP's bytes" in out


def columns(out: str) -> dict:
    """strategy -> (all-reduce, all-gather, reduce-scatter) MB of the bench's table."""
    return {row[0]: tuple(float(x) for x in row[1:4]) for row in (line.split() for line in out.splitlines())
            if row[:1] and row[0] in ("no_shard", "optim", "optim_grads", "optim_grads_params")}


def test_sharding_comm_bench_counts_grads_reduced_in_bf16_at_half_the_bytes(capsys):
    """--grad-reduce-in-bf16 halves every grad reduction (all-reduce, reduce-scatter); the fp32 param
    all-gathers stay as they are."""
    from tools.bench.sharding_comm import main as comm_main

    assert comm_main(["--dp", "2", "--small"]) == 0
    fp32 = columns(capsys.readouterr().out)
    assert comm_main(["--dp", "2", "--small", "--grad-reduce-in-bf16"]) == 0
    out = capsys.readouterr().out
    bf16 = columns(out)
    assert "fp32 grads reduced in bf16" in out
    for strategy, (all_reduce, all_gather, reduce_scatter) in fp32.items():
        assert bf16[strategy][0] == pytest.approx(all_reduce / 2, abs=0.002)
        assert bf16[strategy][1] == all_gather
        assert bf16[strategy][2] == pytest.approx(reduce_scatter / 2, abs=0.002)
    assert fp32["no_shard"][0] > 0 and fp32["optim"][2] > 0
