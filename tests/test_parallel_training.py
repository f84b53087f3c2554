"""End to end on CPU ranks (tools/fork_ranks.py): tensor, sequence and pipeline parallel runs match one
process, and checkpoints move between layouts. tools/check_layouts.py runs the full layout
matrix."""

import shutil

import pytest

from tests.helpers.runs import assert_matches, train, train_logged
from tools.check_layouts import COMMON, LAYOUTS, MODELS

TP2 = ["--tensor-model-parallel-size", "2"]
PP2_VP2 = LAYOUTS["pp2-vp2"][1]


def startup_line(out: str) -> str:
    """The run's start-up line (the model, its parameters, the layout), checked to be printed once."""
    lines = [line for line in out.splitlines() if line.startswith(("model ", "custom model "))]
    assert len(lines) == 1, out
    return lines[0]


def parameters(line: str) -> int:
    """The whole model's parameter count a start-up line gives."""
    return int(line.split(": ", 1)[1].split(" parameters")[0].replace(",", ""))


def resume_elsewhere(source, target, processes: int, *flags: str) -> dict:
    """Copy a stopped run's folder and finish it with another layout; the combined losses."""
    shutil.copytree(source, target)
    return train(target, processes, *flags, load=True)


@pytest.fixture(scope="module")
def single_logged(tmp_path_factory):
    """The uninterrupted one-process run every layout is compared with: its losses and output."""
    return train_logged(tmp_path_factory.mktemp("single"), 1)


@pytest.fixture(scope="module")
def single(single_logged):
    return single_logged[0]


def test_tp2_with_sp_matches_one_process_and_its_checkpoint_resumes_at_tp1(single, tmp_path):
    # TP=2 with SP stops half way (iteration 2) and saves a checkpoint...
    first_half = train(tmp_path / "tp2", 2, *TP2, "--sequence-parallel", "--exit-interval", "2")
    assert sorted(first_half) == [("train", 1), ("train", 2), ("valid", 2)]
    assert_matches(single, first_half, 3)
    # ...which one process loads and finishes.
    assert_matches(single, resume_elsewhere(tmp_path / "tp2", tmp_path / "tp1", 1), 7)


def test_one_process_checkpoint_resumes_at_tp2(single, tmp_path):
    train(tmp_path / "tp1", 1, "--exit-interval", "2")
    assert_matches(single, resume_elsewhere(tmp_path / "tp1", tmp_path / "tp2", 2, *TP2), 7)


def test_dropout_under_tp_and_cp_resumes_bitwise_under_recomputation(tmp_path):
    """Per-rank dropout RNG (tracker states, a stream per TP and CP rank) is saved and restored, and full
    recomputation redraws the masks its forward drew (the ring's attention dropout included): a TP 2-SP x CP 2
    run with dropout, stopped and resumed with full recomputation, logs exactly the uninterrupted run's losses."""
    dropout = [*TP2, "--sequence-parallel", "--context-parallel-size", "2", "--hidden-dropout", "0.1",
               "--attention-dropout", "0.1"]
    uninterrupted = train(tmp_path / "whole", 4, *dropout)
    train(tmp_path / "stopped", 4, *dropout, "--exit-interval", "2")
    resumed = train(tmp_path / "stopped", 4, *dropout, "--recompute-granularity", "full", "--recompute-method",
                    "uniform", "--recompute-num-layers", "1", load=True)
    assert resumed == uninterrupted
    assert len(resumed) == 7


def test_interleaved_pipeline_matches_one_process_and_resumes_at_pp1_and_pp4(single, tmp_path):
    first_half = train(tmp_path / "pp2-vp2", 2, *PP2_VP2, "--exit-interval", "2")
    assert_matches(single, first_half, 3, tolerance=1e-6)  # pipelining alone changes no arithmetic
    assert_matches(single, resume_elsewhere(tmp_path / "pp2-vp2", tmp_path / "pp1", 1), 7)
    assert_matches(single, resume_elsewhere(tmp_path / "pp2-vp2", tmp_path / "pp4", 4,
                                            "--pipeline-model-parallel-size", "4"), 7)


def test_tied_gpt_over_pipeline_tensor_and_sequence_parallelism_matches_one_process(tmp_path):
    gpt = [*COMMON, *MODELS["gpt"], "--train-iters", "4"]
    reference, reference_out = train_logged(tmp_path / "single", 1, base=gpt)
    layout, layout_out = train_logged(tmp_path / "pp2-tp2-sp", 4, *LAYOUTS["pp2-tp2-sp"][1], base=gpt)
    assert_matches(reference, layout, 6)  # 4 iterations, validation and test
    # Said once for the world: the whole model (the tied output weight and the TP-replicated norms and
    # biases counted once), the largest rank's part of it, and the layout.
    line, one_process = startup_line(layout_out), startup_line(reference_out)
    assert line.startswith("custom model (--model gpt2-124m with num_layers 4, hidden_size 64, ")
    assert parameters(line) == parameters(one_process) > 0
    largest = int(line.split("(up to ")[1].split(" per rank)")[0].replace(",", ""))
    assert parameters(line) // 4 < largest < parameters(line) // 2
    assert line.endswith("with 1 thread per rank; 4 ranks = TP 2 x PP 2 x DP 1, sequence parallel")


# -- data parallelism and the distributed optimizer ---------------------------------------------

DISTOPT = ["--use-distributed-optimizer"]
OVERLAP = LAYOUTS["dp2-overlap"][1]


def test_data_parallel_with_overlap_and_distributed_optimizer_match_one_process_and_resume_bitwise(single, tmp_path):
    assert_matches(single, train(tmp_path / "dp2", 2, *OVERLAP), 7)
    whole = train(tmp_path / "dp4", 4, *DISTOPT)
    assert_matches(single, whole, 7)
    # Same layout, stopped and resumed: bitwise the uninterrupted losses.
    train(tmp_path / "dp4-stopped", 4, *DISTOPT, "--exit-interval", "2")
    assert train(tmp_path / "dp4-stopped", 4, *DISTOPT, load=True) == whole


def test_gradient_accumulation_over_data_parallel_ranks_is_exact(single, tmp_path):
    # Global batch 8 = 2 DP ranks x 4 micro-batches of 1, or x 1 micro-batch of 4.
    many = train(tmp_path / "4x1", 2, "--micro-batch-size", "1")
    one = train(tmp_path / "1x4", 2, "--micro-batch-size", "4")
    assert_matches(single, many, 7)
    assert_matches(one, many, 7)


def test_eight_ranks_with_every_parallelism_match_and_reshard_to_one_process_and_pp4_dp2(single_logged, tmp_path):
    """TP=2 x PP=2 (V=2) x DP=2 with SP, the distributed optimizer and overlapped reduction
    saves at iteration 2; one process and PP=4 x DP=2 without the distributed optimizer finish."""
    single, single_out = single_logged
    first_half, out = train_logged(tmp_path / "all", 8, *LAYOUTS["tp2-pp2-dp2-sp-vp2-distopt-overlap"][1],
                                   "--exit-interval", "2")
    assert_matches(single, first_half, 3)
    line = startup_line(out)
    assert parameters(line) == parameters(startup_line(single_out))
    assert line.endswith("; 8 ranks = TP 2 x PP 2 x DP 2, 2 virtual stages per pipeline rank, sequence parallel, "
                         "distributed optimizer")
    assert_matches(single, resume_elsewhere(tmp_path / "all", tmp_path / "one", 1), 7)
    assert_matches(single, resume_elsewhere(tmp_path / "all", tmp_path / "pp4-dp2", 8,
                                            "--pipeline-model-parallel-size", "4"), 7)


def test_bf16_on_eight_ranks_stays_within_a_percent_of_one_process(tmp_path):
    bf16 = ["--bf16", "--train-iters", "4"]
    reference = train(tmp_path / "single", 1, *bf16)
    layout = train(tmp_path / "all", 8, *bf16, *LAYOUTS["tp2-pp2-dp2-sp-vp2-distopt-overlap"][1])
    assert_matches(reference, layout, 7, tolerance=1e-2)  # 4 iterations, 2 validations, test
