"""End to end under torchrun on CPU: tensor, sequence and pipeline parallel runs match one
process, and checkpoints move between layouts. tools/check_layouts.py runs the full layout
matrix."""

import os
import shutil

import pytest

from tools.check_layouts import COMMON, LAYOUTS, MODELS, run
from tools.loss_compare import compare, read_losses

FLAGS = [*COMMON, *MODELS["llama"], "--train-iters", "6", "--eval-interval", "3"]
TP2 = ["--tensor-model-parallel-size", "2"]
PP2_VP2 = LAYOUTS["pp2-vp2"][1]


def train(folder, processes: int, *flags: str, load: bool = False, base: list[str] = FLAGS) -> dict:
    """Run pretrain_gpt.py with `base` + `flags` saving into `folder` (resuming from it with `load`);
    its losses."""
    run(processes, [*base, *flags, "--save", str(folder), *(["--load", str(folder)] if load else [])],
        os.path.join(folder, "metrics.jsonl"))
    return read_losses(os.path.join(folder, "metrics.jsonl"))


def resume_elsewhere(source, target, processes: int, *flags: str) -> dict:
    """Copy a stopped run's folder and finish it with another layout; the combined losses."""
    shutil.copytree(source, target)
    return train(target, processes, *flags, load=True)


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """The uninterrupted one-process run every layout is compared with."""
    return train(tmp_path_factory.mktemp("single"), 1)


def assert_matches(reference: dict, losses: dict, records: int, tolerance: float = 1e-5) -> None:
    rows, worst = compare({key: reference[key] for key in losses}, losses)
    assert len(rows) == records and worst <= tolerance
    assert len({row[2] for row in rows}) == records  # the losses move: a real comparison


def test_tp2_with_sp_matches_one_process_and_its_checkpoint_resumes_at_tp1(single, tmp_path):
    # TP=2 with SP stops half way (iteration 3) and saves a checkpoint...
    first_half = train(tmp_path / "tp2", 2, *TP2, "--sequence-parallel", "--exit-interval", "3")
    assert sorted(first_half) == [("train", 1), ("train", 2), ("train", 3), ("valid", 3)]
    assert_matches(single, first_half, 4)
    # ...which one process loads and finishes.
    assert_matches(single, resume_elsewhere(tmp_path / "tp2", tmp_path / "tp1", 1), 9)


def test_one_process_checkpoint_resumes_at_tp2(single, tmp_path):
    train(tmp_path / "tp1", 1, "--exit-interval", "3")
    assert_matches(single, resume_elsewhere(tmp_path / "tp1", tmp_path / "tp2", 2, *TP2), 9)


def test_dropout_under_tp_resumes_bitwise(tmp_path):
    """Per-rank dropout RNG (tracker states) is saved and restored: a stopped and resumed
    TP=2 run with dropout logs exactly the losses of the uninterrupted one."""
    dropout = [*TP2, "--sequence-parallel", "--hidden-dropout", "0.1", "--attention-dropout", "0.1"]
    uninterrupted = train(tmp_path / "whole", 2, *dropout)
    train(tmp_path / "stopped", 2, *dropout, "--exit-interval", "3")
    resumed = train(tmp_path / "stopped", 2, *dropout, load=True)
    assert resumed == uninterrupted
    assert len(resumed) == 9


def test_interleaved_pipeline_matches_one_process_and_resumes_at_pp1_and_pp4(single, tmp_path):
    first_half = train(tmp_path / "pp2-vp2", 2, *PP2_VP2, "--exit-interval", "3")
    assert_matches(single, first_half, 4, tolerance=1e-6)  # pipelining alone changes no arithmetic
    assert_matches(single, resume_elsewhere(tmp_path / "pp2-vp2", tmp_path / "pp1", 1), 9)
    assert_matches(single, resume_elsewhere(tmp_path / "pp2-vp2", tmp_path / "pp4", 4,
                                            "--pipeline-model-parallel-size", "4"), 9)


def test_tied_gpt_over_pipeline_tensor_and_sequence_parallelism_matches_one_process(tmp_path):
    gpt = [*COMMON, *MODELS["gpt"], "--train-iters", "4"]
    reference = train(tmp_path / "single", 1, base=gpt)
    layout = train(tmp_path / "pp2-tp2-sp", 4, *LAYOUTS["pp2-tp2-sp"][1], base=gpt)
    assert_matches(reference, layout, 6)  # 4 iterations, validation and test
