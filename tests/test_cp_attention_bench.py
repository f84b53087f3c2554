"""tools/bench/cp_attention.py: the closed form of each CP comm type's bytes, and the bench itself at CP 2 and 4
(a2a+p2p: pairs and a ring of 2) on four gloo ranks at the smallest sizes (its measured bytes equal the closed
form on every rank)."""

import pytest

from megalite.errors import UserError
from megalite.model.context_parallel import bytes_sent
from tools.bench.cp_attention import main as bench_main, parse_args

# The bench's --seq-length, --heads, --groups, --head-dim below; fp32.
SEQ, HEADS, GROUPS, HEAD_DIM = 8, 4, 1, 4


def test_the_closed_forms_count_each_comm_types_messages():
    key_values = 2 * 2 * 3 * 2 * 4 * 4  # K and V: 2 tokens per rank, batch 3, 2 kv heads of 4, fp32
    assert bytes_sent("p2p", 4, 2, 3, 4, 2, 4, 4) == (3 + 3 + 4) * key_values  # fwd, bwd K/V, dK/dV
    # bf16: K/V at 2 bytes an element, the dK/dV accumulator at fp32's 4
    assert bytes_sent("p2p", 4, 2, 3, 4, 2, 4, 2) == (3 + 3) * key_values // 2 + 4 * key_values
    assert bytes_sent("all_gather", 4, 2, 3, 4, 2, 4, 4) == 2 * 3 * key_values
    head = 2 * 3 * 4 * 4  # one head of 2 tokens, batch 3, fp32
    # a2a at CP 4 with 2 kv heads: they repeat to 4; q, k, v and the output, each way, 3/4 of each
    assert bytes_sent("a2a", 4, 2, 3, 4, 2, 4, 4) == 2 * 3 * (4 + 4 + 4 + 4) * head // 4
    # a2a+p2p at CP 4 = a2a over 2 x p2p over 2: the a2a's 1/2 of q, k, v (2 kv heads split as they are) and the
    # output each way, then a ring of 2 over 4 tokens, 2 heads and 1 kv head per rank
    a2a, ring_kv = 2 * 1 * (4 + 2) * head // 2 * 2, 2 * 1 * 4 * 3 * 4 * 4
    assert bytes_sent("a2a+p2p", 4, 2, 3, 4, 2, 4, 4, a2a_size=2) == a2a + (3 * 2 - 2) * ring_kv
    assert bytes_sent("a2a+p2p", 4, 2, 3, 4, 2, 4, 4, a2a_size=1) == bytes_sent("p2p", 4, 2, 3, 4, 2, 4, 4)
    assert bytes_sent("a2a+p2p", 4, 2, 3, 4, 2, 4, 4, a2a_size=4) == bytes_sent("a2a", 4, 2, 3, 4, 2, 4, 4)


def test_the_bench_counts_each_comm_types_bytes_at_their_closed_form(capsys):
    assert bench_main(["--cp", "2", "4", "--seq-length", str(SEQ), "--heads", str(HEADS), "--groups", str(GROUPS),
                       "--head-dim", str(HEAD_DIM), "--iters", "1", "--warmup-iters", "0"]) == 0
    out = capsys.readouterr().out
    # CP, comm type, rank, p2p, all-gather, reduce-scatter, all-to-all, total, closed form (KB), ratio
    rows = [line.split() for line in out.splitlines() if line.split()[:1] in (["2"], ["4"])]
    comm_types = {"2": ("a2a", "all_gather", "p2p"), "4": ("a2a", "a2a+p2p", "all_gather", "p2p")}
    assert sorted(tuple(row[:3]) for row in rows) == [(cp, c, r) for cp in "24" for c in comm_types[cp]
                                                      for r in "0123"]
    # Each comm type's own collectives, and only those: a2a+p2p sends by all-to-all and the ring.
    used = {"p2p": {"p2p"}, "all_gather": {"all-gather", "reduce-scatter"}, "a2a": {"all-to-all"},
            "a2a+p2p": {"all-to-all", "p2p"}}
    for row in rows:
        cp, sent = int(row[0]), dict(zip(("p2p", "all-gather", "reduce-scatter", "all-to-all"), map(float, row[3:7])))
        assert row[9] == "1.000" and float(row[7]) == float(row[8])
        assert {name for name, kb in sent.items() if kb > 0} == used[row[1]], row
        key_values_kb = 2 * (SEQ // cp) * GROUPS * HEAD_DIM * 4 / 1024
        if row[1] == "p2p":
            assert sent["p2p"] == pytest.approx((3 * cp - 2) * key_values_kb, abs=0.01)
        if row[1] == "all_gather":
            assert sent["all-gather"] == sent["reduce-scatter"] == pytest.approx((cp - 1) * key_values_kb, abs=0.01)
    assert "PASS: every rank's bytes equal the closed form" in out


def test_a_cp_size_that_does_not_divide_the_world_is_refused():
    with pytest.raises(UserError, match="--cp 2 must be at least 2 and divide the world of 3 ranks"):
        parse_args(["--cp", "2", "3"])


def test_one_ranks_ring_blocks_are_timed_as_the_ring_runs_them():
    """The ring's arithmetic alone (CUDA in the bench): on a CPU the matmul blocks time, and the flash row says
    why it cannot run."""
    from tools.bench.cp_attention import ring_block_seconds

    args = parse_args(["--cp", "2", "--seq-length", "16", "--heads", "2", "--groups", "1", "--head-dim", "8",
                       "--dtype", "fp32", "--iters", "1", "--warmup-iters", "1"])
    for cp in (2, 4):
        assert ring_block_seconds(args, cp, "matmul", device="cpu") > 0
    assert ring_block_seconds(args, 2, "flash", device="cpu") == (
        "the ring's blocks here: matmul (not a CUDA device)")
