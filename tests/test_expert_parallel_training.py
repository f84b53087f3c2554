"""End to end on CPU ranks: an MoE model trained with expert parallelism (both dispatchers, folded over DP and
TP, with PP, virtual stages and the distributed optimizer) matches one process in its losses and its grad norms,
and its checkpoints move between EP layouts and one process. tools/check_layouts.py runs every EP layout of the
issue for 10 iterations (its EXPERT_LAYOUTS); the composition matrix pairs EP with every other feature."""

import os
import shutil

import pytest

from tests.helpers.runs import assert_matches, train_logged
from tools.check_layouts import COMMON, LAYOUTS, MODELS
from tools.loss_compare import compare, read_grad_norms, read_losses

MOE_FLAGS = [*COMMON, *MODELS["moe"], "--train-iters", "4", "--eval-interval", "2"]


def continue_at(source, target, processes: int, flags: list[str], *extra: str) -> str:
    """Copy a stopped run's folder and go on from its checkpoint with another layout; its output."""
    shutil.copytree(source, target)
    return train_logged(target, processes, *flags, *extra, load=True, base=MOE_FLAGS)[1]


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """The one-process MoE run: its losses and grad norms (an expert grad scaled by EP or TP, or counted twice in
    the norm, shows in the grad norms even where Adam's scale invariance hides it from the losses)."""
    folder = tmp_path_factory.mktemp("moe-single")
    train_logged(folder, 1, base=MOE_FLAGS)
    return train_records(folder)


def test_expert_parallel_runs_match_one_process_and_reshard_ep4_to_ep2_to_one_process_to_ep4(single, tmp_path):
    """EP 4 (alltoall) stops after iteration 1; EP 2 x TP 2-SP with whole experts (allgather) goes on to 2, one
    process to 3, and EP 4 x TP 2 x PP 2 x VP 2 (ETP 1, distributed optimizer, alltoall) to the end. Every
    iteration's loss and grad norm match the uninterrupted one-process run's."""
    losses, norms = single
    ep4 = LAYOUTS["ep4-alltoall"][1]
    _, out = train_logged(tmp_path / "ep4", 4, *ep4, "--exit-interval", "1", base=MOE_FLAGS)
    assert "experts ETP 1 x EP 4 x EDP 1" in out
    ep2 = LAYOUTS["ep2-tp2-sp-etp1-allgather"][1]
    continue_at(tmp_path / "ep4", tmp_path / "ep2", 2, ep2, "--exit-interval", "2")
    continue_at(tmp_path / "ep2", tmp_path / "one", 1, [], "--exit-interval", "3")
    everything = LAYOUTS["ep4-tp2-pp2-vp2-etp1-distopt-alltoall"][1]
    out = continue_at(tmp_path / "one", tmp_path / "all", 8, everything)
    assert "experts ETP 1 x EP 4 x EDP 1" in out
    # The metrics file travels with the checkpoint: the last stage's holds every stage's records.
    resumed = train_records(tmp_path / "all")
    assert_matches(losses, resumed[0], 7)
    assert sorted(resumed[1]) == sorted(norms) and compare(norms, resumed[1])[1] <= 1e-5


def train_records(folder) -> tuple[dict, dict]:
    """A run's losses and grad norms."""
    metrics = os.path.join(folder, "metrics.jsonl")
    return read_losses(metrics), read_grad_norms(metrics)
