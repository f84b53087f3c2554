"""A SIGTERM is never lost: sent to one rank of a 2-rank CPU run during an evaluation, a save, the end
of the run or its teardown, every rank saves (or has saved) and exits 0, and the same command again
finishes the run with the uninterrupted run's losses, bitwise.

Each run is forked by tools/fork_ranks.py from a launcher that first wraps one function of the
training code so that the chosen rank sends itself SIGTERM at that exact moment: deterministic,
where a timed signal would hit a window of a few milliseconds only now and then.
"""

import os
import signal
import subprocess
import sys

import pytest

from megalite.checkpoint import read_latest_iteration
from tools import fault_campaign as campaign
from tools.fork_ranks import REPO_ROOT
from tools.loss_compare import read_losses

pytestmark = pytest.mark.slow

FLAGS = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "255", "--num-layers", "2",
         "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16", "--micro-batch-size", "2",
         "--global-batch-size", "4", "--train-iters", "8", "--lr", "3e-3", "--lr-warmup-iters", "2",
         "--log-interval", "1", "--eval-interval", "4", "--eval-iters", "2", "--save-interval", "2",
         "--use-distributed-optimizer"]

# Runs in the launcher before the ranks are forked, so every rank inherits the wrapped function;
# MEGALITE_TEST_SIGNAL = "<moment>:<iteration>:<rank>" says where the signal goes.
LAUNCHER = r"""
import os, signal, sys
from tools import fork_ranks
os.environ.update(fork_ranks.cpu_world_environment())  # before torch: a CPU world on any machine
from megalite import parallel_state
from megalite.run import training
from megalite.checkpoint import checkpointer

moment, iteration, target = os.environ.pop("MEGALITE_TEST_SIGNAL").split(":")
iteration, target = int(iteration), int(target)
state = {"split": None, "batches": 0}


def signal_me():
    if int(os.environ["RANK"]) == target:
        os.kill(os.getpid(), signal.SIGTERM)


evaluate_split, next_global_batch = training.Trainer.evaluate_split, training.next_global_batch
save_checkpoint, destroy = checkpointer.save_checkpoint, parallel_state.destroy


def wrapped_evaluate_split(self, split, iterator):
    state["split"] = (split, self.state.iteration)
    try:
        return evaluate_split(self, split, iterator)
    finally:
        state["split"] = None


def wrapped_next_global_batch(*args, **kwargs):
    if state["split"] == (moment, iteration):
        state["batches"] += 1
        if state["batches"] == 1:  # while the evaluation's first batch runs: its second must not
            signal_me()
    return next_global_batch(*args, **kwargs)


def wrapped_save_checkpoint(save, at, *args, **kwargs):
    if moment == "save" and at == iteration:
        signal_me()
    return save_checkpoint(save, at, *args, **kwargs)


def wrapped_destroy(*args, **kwargs):
    if moment == "teardown":
        signal_me()
    return destroy(*args, **kwargs)


training.Trainer.evaluate_split, training.next_global_batch = wrapped_evaluate_split, wrapped_next_global_batch
checkpointer.save_checkpoint, parallel_state.destroy = wrapped_save_checkpoint, wrapped_destroy
sys.exit(fork_ranks.main(["--nproc-per-node", "2", "--", *sys.argv[1:]]))
"""


def launch(folder, signal_at: str | None = None) -> subprocess.CompletedProcess:
    """The 2-rank run saving into `folder` (resuming from it when it holds a checkpoint)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MEGALITE_TEST_SIGNAL": signal_at or "none:0:-1"}
    return subprocess.run([sys.executable, "-c", LAUNCHER, *FLAGS, "--save", str(folder)],
                          capture_output=True, text=True, env=env, cwd=REPO_ROOT, timeout=300)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    folder = tmp_path_factory.mktemp("uninterrupted")
    result = launch(folder)
    assert result.returncode == 0, result.stderr[-3000:]
    return read_losses(str(folder / "metrics.jsonl"))


# (moment, iteration, rank signalled, the iteration the run stops at and saves)
CASES = [
    ("valid", 4, 0, 4),  # during an evaluation: it stops early and the resumed run evaluates first
    ("save", 6, 1, 6),  # during a save: the save completes, then the exit
    ("test", 8, 1, 8),  # during the end-of-run evaluation, after the last iteration
    ("save", 8, 0, 8),  # during the last save
]


@pytest.mark.parametrize("moment, iteration, rank, stop", CASES, ids=[f"{c[0]}@{c[1]}-rank{c[2]}" for c in CASES])
def test_a_sigterm_saves_exits_0_and_the_run_resumes_exactly(reference, tmp_path, moment, iteration, rank, stop):
    interrupted = launch(tmp_path, f"{moment}:{iteration}:{rank}")
    assert interrupted.returncode == 0, interrupted.stderr[-3000:]
    assert f"exiting at iteration {stop}: SIGTERM" in interrupted.stdout, interrupted.stdout[-3000:]
    assert open(tmp_path / "latest_checkpointed_iteration.txt").read().strip() == str(stop)
    cut_short = read_losses(str(tmp_path / "metrics.jsonl"))
    if moment in ("valid", "test"):  # evaluation stopped early: nothing logged for it
        assert (moment, iteration) in reference and (moment, iteration) not in cut_short
    resumed = launch(tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert read_losses(str(tmp_path / "metrics.jsonl")) == reference  # every loss, bitwise


def test_a_sigterm_while_the_finished_run_tears_down_exits_0(reference, tmp_path):
    result = launch(tmp_path, "teardown:0:1")
    assert result.returncode == 0, (result.returncode, result.stderr[-3000:])
    assert read_losses(str(tmp_path / "metrics.jsonl")) == reference


def test_a_sigterm_to_every_process_of_a_run_with_loader_workers_saves_and_exits_0(tmp_path):
    """SLURM's scancel and time limit signal every process of the job step, so the data-loader workers
    (--num-workers 2) get the SIGTERM too, here sent to the run's process group. They leave it to the main
    process, which saves at its next boundary and exits 0."""
    save = tmp_path / "run"
    flags = [*FLAGS, "--num-workers", "2", "--save", str(save)]
    flags[flags.index("--train-iters") + 1] = "1000"  # the signal ends it
    with open(tmp_path / "output.log", "w") as output:
        run = subprocess.Popen([sys.executable, "pretrain_gpt.py", *flags], stdout=output, stderr=subprocess.STDOUT,
                               env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=REPO_ROOT, start_new_session=True)
    try:
        assert campaign.wait_for(lambda: campaign.logged_iterations(str(save)) >= 2, [run], timeout=120)
        assert len(campaign.child_pids(run.pid)) >= 2  # the training and validation loaders' workers
        os.killpg(run.pid, signal.SIGTERM)
        code = run.wait(timeout=120)
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
    log = (tmp_path / "output.log").read_text()
    assert code == 0, log[-3000:]
    assert f"exiting at iteration {read_latest_iteration(str(save))}: SIGTERM" in log, log[-3000:]
