"""tools/bench/moe_dispatch.py: the closed form of each dispatcher's bytes, and the bench itself on a world of
two gloo ranks at the smallest sizes (its measured bytes equal the closed form on every rank)."""

import pytest

from megalite.errors import UserError
from tools.bench.moe_dispatch import closed_form_bytes, main as bench_main, parse_args

HIDDEN, EXPERTS, TOKENS = 32, 8, 16 * 2  # the bench's --hidden, --experts, --seq-length x --micro-batch-size


def test_the_closed_forms_count_the_rows_that_cross_ranks():
    # EP 2 over 4 experts (2 each): rank 0 routes 2 rows to rank 1's experts, rank 1 routes 1 row to rank 0's.
    counts = [[3, 1, 2, 0], [0, 1, 4, 2]]
    row = 2 * 8 * 4 + 4  # a row of hidden 8 in fp32, there and back, and its fp32 prob
    for rank in (0, 1):
        assert closed_form_bytes("alltoall", counts, rank, 6, 8, 4) == (2 + 1) * row + 8 * 4
    # allgather: 6 rows, hidden 8, fp32, 4 experts: rows x4 (gather, scatter, and their grads), probs x2, map x1
    assert closed_form_bytes("allgather", counts, 0, 6, 8, 4) == 6 * (4 * 8 * 4 + 2 * 4 * 4 + 4)
    assert closed_form_bytes("allgather", [[0] * 4] * 4, 3, 6, 8, 4) == 3 * 6 * (4 * 8 * 4 + 9 * 4)


def test_the_bench_counts_each_dispatchers_bytes_at_their_closed_form(capsys):
    assert bench_main(["--ep", "1", "2", "--hidden", str(HIDDEN), "--layers", "1", "--seq-length", "16",
                       "--micro-batch-size", "2", "--vocab-size", "64", "--iters", "1", "--warmup-iters", "0"]) == 0
    out = capsys.readouterr().out
    # EP, dispatcher, rank, all-gather, reduce-scatter, all-to-all, total, closed form (KB), ratio
    rows = [line.split() for line in out.splitlines() if line.split()[:2] in (["2", "allgather"], ["2", "alltoall"])]
    assert sorted((row[1], row[2]) for row in rows) == [(d, r) for d in ("allgather", "alltoall") for r in "01"]
    allgather_kb = TOKENS * (4 * HIDDEN * 4 + 9 * EXPERTS) / 1024
    for row in rows:
        total, expected, ratio = float(row[6]), float(row[7]), row[8]
        assert ratio == "1.000" and total == expected
        if row[1] == "allgather":
            assert total == pytest.approx(allgather_kb, abs=0.01) and float(row[5]) == 0
        else:  # the counts' all-gather (8 experts, int64) and the rows' all-to-all
            assert float(row[3]) == pytest.approx(8 * EXPERTS / 1024, abs=0.01) and float(row[5]) > 0
    assert "PASS: every rank's bytes equal the closed form" in out
    layouts = out.split("vs one process")[1].splitlines()[1:5]
    assert [line.split()[0] for line in layouts] == ["one", "EP", "EP", "EP"]
    assert all(float(line.split()[-2]) > 0 for line in layouts)  # tokens/s


def test_an_ep_size_that_does_not_divide_the_world_is_refused():
    with pytest.raises(UserError, match="--ep 2 must divide --experts 8 and the world of 3 ranks"):
        parse_args(["--ep", "2", "3"])
