"""End to end under torchrun on CPU: tensor/sequence parallel runs match one process, and
checkpoints move between layouts. tools/check_layouts.py runs the full layout matrix."""

import os
import shutil

from tools.check_layouts import COMMON, MODELS, run
from tools.loss_compare import compare, read_losses

FLAGS = [*COMMON, *MODELS["llama"], "--train-iters", "6", "--eval-interval", "3"]


def test_tp2_with_sp_matches_one_process_and_its_checkpoint_resumes_at_tp1(tmp_path):
    single, parallel, resumed = (str(tmp_path / name) for name in ("single", "tp2", "resumed"))
    run(1, [*FLAGS, "--save", single], os.path.join(single, "metrics.jsonl"))
    # TP=2 with SP stops half way (iteration 3) and saves a checkpoint...
    run(2, [*FLAGS, "--tensor-model-parallel-size", "2", "--sequence-parallel", "--save", parallel,
            "--exit-interval", "3"], os.path.join(parallel, "metrics.jsonl"))
    # ...which one process loads and finishes.
    shutil.copytree(parallel, resumed)
    run(1, [*FLAGS, "--load", resumed, "--save", resumed], os.path.join(resumed, "metrics.jsonl"))

    reference = read_losses(os.path.join(single, "metrics.jsonl"))
    first_half = read_losses(os.path.join(parallel, "metrics.jsonl"))
    assert sorted(first_half) == [("train", 1), ("train", 2), ("train", 3), ("valid", 3)]
    _, worst_tp2 = compare({key: reference[key] for key in first_half}, first_half)
    assert worst_tp2 < 1e-5
    rows, worst_resumed = compare(reference, read_losses(os.path.join(resumed, "metrics.jsonl")))
    assert len(rows) == 9 and worst_resumed < 1e-5
    assert len({row[2] for row in rows}) == 9  # the losses move: a real comparison
