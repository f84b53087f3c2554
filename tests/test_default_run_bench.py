"""tools/bench/default_run.py: two checkouts' default runs, alternating, and their same-round ratio."""

import pytest

from tools.bench import default_run

TINY = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "255", "--num-layers", "1",
        "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "16", "--micro-batch-size", "2",
        "--global-batch-size", "2"]


@pytest.mark.slow
def test_a_checkout_against_itself(capsys):
    assert default_run.main(["--baseline", default_run.HERE, "--iters", "4", "--skip", "1", "--rounds", "1",
                             "--", *TINY]) == 0
    out = capsys.readouterr().out
    assert "round 1 baseline:" in out and "round 1 this:" in out
    ratio = float(out.split("same-round: median ")[1].split()[0])
    assert ratio > 0


def test_a_folder_without_megalite_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        default_run.main(["--baseline", str(tmp_path)])
    assert "holds no pretrain_gpt.py" in capsys.readouterr().err
