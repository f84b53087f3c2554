"""End to end on CPU ranks: context parallelism (each comm type, with DP and the distributed optimizer, with TP
and SP) matches one process in its losses and grad norms, and its checkpoints move to one process and to CP 4.
tools/check_layouts.py runs every CP layout of issue 42 for 10 iterations (its CP_LAYOUTS)."""

import os
import shutil

import pytest

from tests.helpers.runs import FLAGS, assert_matches, train_logged
from tools.check_layouts import LAYOUTS
from tools.loss_compare import compare, read_grad_norms, read_losses


def records(folder) -> tuple[dict, dict]:
    """A run's losses and grad norms (its metrics file travels with its checkpoint: a resumed run's holds every
    stage's records)."""
    metrics = os.path.join(folder, "metrics.jsonl")
    return read_losses(metrics), read_grad_norms(metrics)


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """The one-process run of the layout tests' llama model: its losses and grad norms."""
    folder = tmp_path_factory.mktemp("cp-single")
    train_logged(folder, 1)
    return records(folder)


def continue_at(source, target, processes: int, *flags: str) -> str:
    """Copy a stopped run's folder and go on from its checkpoint with another layout; its output."""
    shutil.copytree(source, target)
    return train_logged(target, processes, *flags, load=True)[1]


def assert_same_run(single: tuple[dict, dict], folder) -> None:
    losses, norms = records(folder)
    assert_matches(single[0], losses, 7)
    assert sorted(norms) == sorted(single[1]) and compare(single[1], norms)[1] <= 1e-5


def test_context_parallel_runs_match_one_process_and_reshard_cp2_dp2_to_one_process_to_cp4(single, tmp_path):
    """CP 2 x DP 2 (ring attention, the distributed optimizer with overlapped reduction) stops after iteration 1;
    one process goes on to 2, CP 4 (Ulysses all-to-all) to 3, and CP 4 as a2a+p2p (all-to-all among pairs, the
    ring over the pairs) to the end."""
    _, out = train_logged(tmp_path / "cp2-dp2", 4, *LAYOUTS["cp2-dp2-distopt-p2p"][1], "--exit-interval", "1")
    assert "4 ranks = TP 1 x CP 2 x PP 1 x DP 2" in out, out
    continue_at(tmp_path / "cp2-dp2", tmp_path / "one", 1, "--exit-interval", "2")
    continue_at(tmp_path / "one", tmp_path / "cp4", 4, *LAYOUTS["cp4-a2a"][1], "--exit-interval", "3")
    continue_at(tmp_path / "cp4", tmp_path / "cp4-hierarchical", 4, *LAYOUTS["cp4-a2a+p2p"][1])
    assert_same_run(single, tmp_path / "cp4-hierarchical")


def test_context_parallel_with_tensor_and_sequence_parallelism_matches_one_process(single, tmp_path):
    train_logged(tmp_path / "cp2-tp2", 4, *LAYOUTS["cp2-tp2-sp-all_gather"][1])
    assert_same_run(single, tmp_path / "cp2-tp2")
