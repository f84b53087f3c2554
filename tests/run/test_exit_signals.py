"""Signals at exact moments of a 2-rank CPU run.

A SIGTERM is never lost: sent to one rank at any boundary between an iteration's log line and the
next iteration (the evaluation's start, each evaluation batch, its end, the save's start, middle and
end), during the end-of-run evaluation, the last save or the teardown, every rank saves (or has
saved) and exits 0, and the same command again finishes the run with the uninterrupted run's
losses, bitwise. A SIGKILL of either rank, during a step or in the middle of a save, leaves a
survivor that exits non-zero with one sentence naming the dead rank, and a complete checkpoint.

One launcher process imports torch once and runs every case in turn: each launch is a process
forked from it, which wraps one function of the training code so that the chosen rank sends itself
the signal at that exact moment (deterministic, where a timed signal would hit a window of a few
milliseconds only now and then), then forks the ranks as tools/fork_ranks.py does.
"""

import dataclasses
import json
import os
import signal
import subprocess
import sys

import pytest

from megalite.checkpoint import choose_checkpoint, read_latest_iteration
from tools import fault_campaign as campaign
from tools.fork_ranks import REPO_ROOT
from tools.loss_compare import read_losses

pytestmark = pytest.mark.slow

FLAGS = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "255", "--num-layers", "2",
         "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16", "--micro-batch-size", "2",
         "--global-batch-size", "4", "--train-iters", "8", "--lr", "3e-3", "--lr-warmup-iters", "2",
         "--log-interval", "1", "--eval-interval", "4", "--eval-iters", "2", "--save-interval", "2",
         "--use-distributed-optimizer"]
CASE_TIMEOUT_S = 120  # one launch; a hung one is killed and fails its test

# Runs every launch of a plan: argv = [plan.json]; each launch's stdout, stderr and exit code go to
# <folder>/<phase>.out, .err, .code, and a copy of the --save folder as the interruption left it to
# <folder>/interrupted.
LAUNCHER = r"""
import json, os, shutil, signal, sys, time
from tools import fork_ranks
os.environ.update(fork_ranks.cpu_world_environment())  # before torch: a CPU world on any machine
from megalite import parallel_state
from megalite.checkpoint import checkpointer, saving
from megalite.run import training
from megalite.run.logger import TrainingLogger

target = None  # (moment, iteration, rank, signal) of this launch
current = {"split": None, "batches": 0, "saving": None}


def arrive(moment, iteration):
    if target is not None and target[:2] == (moment, iteration) and int(os.environ["RANK"]) == target[2]:
        os.kill(os.getpid(), target[3])


def wrap(owner, name, before=None, after=None):
    original = getattr(owner, name)

    def wrapped(*args, **kwargs):
        if before:
            before(*args, **kwargs)
        result = original(*args, **kwargs)
        if after:
            after(*args, **kwargs)
        return result
    setattr(owner, name, wrapped)


def start_split(trainer, split, iterator):
    current.update(split=(split, trainer.state.iteration), batches=0)
    arrive(f"{split}-start", trainer.state.iteration)


def end_split(trainer, split, iterator):
    current["split"] = None
    arrive(f"{split}-end", trainer.state.iteration)


def next_batch(*args, **kwargs):
    if current["split"]:
        current["batches"] += 1  # the signal comes while batch k runs, after its check
        split, iteration = current["split"]
        arrive(f"{split}-batch{current['batches']}", iteration)


def start_save(save, iteration, *args, **kwargs):
    current["saving"] = iteration
    arrive("save", iteration)


wrap(TrainingLogger, "log_iteration", after=lambda logger, iteration, *a, **k: arrive("logged", iteration))
wrap(training.Trainer, "train_step", before=lambda trainer: arrive("step", trainer.state.iteration + 1))
wrap(training.Trainer, "evaluate_split", before=start_split, after=end_split)
wrap(training, "next_global_batch", before=next_batch)
wrap(checkpointer, "save_checkpoint", before=start_save, after=lambda save, at, *a, **k: arrive("save-end", at))
wrap(saving, "write_rank_files", after=lambda *a, **k: arrive("save-write", current["saving"]))
wrap(parallel_state, "destroy", before=lambda *a, **k: arrive("teardown", 0))
fork_ranks._script()  # imported once, here


def launch(flags, folder, phase, signal_at, timeout):
    global target
    pid = os.fork()
    if pid == 0:
        os.setpgid(0, 0)  # its ranks with it: a hung launch is killed as a group
        if signal_at:
            moment, iteration, rank, name = signal_at.split(":")
            target = (moment, int(iteration), int(rank), getattr(signal, name))
        for fd, suffix in ((1, "out"), (2, "err")):
            os.dup2(os.open(os.path.join(folder, f"{phase}.{suffix}"), os.O_WRONLY | os.O_CREAT, 0o644), fd)
        os._exit(fork_ranks.launch(2, flags))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.02)
    os.killpg(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return "hung"


plan = json.load(open(sys.argv[1]))
for case in plan["cases"]:
    flags = [*plan["flags"], "--save", os.path.join(case["folder"], "run")]
    phases = [("interrupted", case["signal_at"])] + ([("resumed", None)] if case["resume"] else [])
    for phase, signal_at in phases:
        code = launch(flags, case["folder"], phase, signal_at, plan["timeout"])
        open(os.path.join(case["folder"], f"{phase}.code"), "w").write(str(code))
        if phase == "interrupted" and os.path.isdir(flags[-1]):  # as it was left, for the test to read
            shutil.copytree(flags[-1], os.path.join(case["folder"], "interrupted"))
"""


@dataclasses.dataclass
class Launch:
    code: int | str  # "hung": killed after CASE_TIMEOUT_S
    stdout: str
    stderr: str


@dataclasses.dataclass
class Outcome:
    run: str  # the run's --save folder (the resumed launch goes on in it)
    save: str  # a copy of it as the interrupted launch left it
    interrupted: Launch
    resumed: Launch | None  # the same command again, for cases that resume


def read_launch(folder, phase) -> Launch | None:
    if not os.path.exists(os.path.join(folder, f"{phase}.code")):
        return None
    text = {suffix: open(os.path.join(folder, f"{phase}.{suffix}")).read() for suffix in ("code", "out", "err")}
    return Launch(int(text["code"]) if text["code"].lstrip("-").isdigit() else text["code"], text["out"], text["err"])


# SIGTERM: (moment, iteration, rank signalled, the iteration the run stops at and saves, whether the test
# resumes it). Every boundary after iteration 4's log line (an evaluation and a save follow it) up to
# iteration 5's step; the resumed cases cover each kind of checkpoint left (evaluation pending or done,
# mid-run or final).
SIGTERMS = [
    ("logged", 3, 0, 3, False),  # an iteration without evaluation or save: it saves there
    ("logged", 4, 1, 4, False),
    ("valid-start", 4, 0, 4, False),
    ("valid-batch1", 4, 0, 4, True),  # it stops before batch 2, logs nothing; the resumed run evaluates first
    ("valid-batch2", 4, 1, 4, False),  # the last batch: the evaluation completes and is logged
    ("valid-end", 4, 0, 4, False),
    ("save", 4, 1, 4, False),
    ("save-write", 4, 0, 4, False),
    ("save-end", 4, 1, 4, False),
    ("step", 5, 0, 5, False),
    ("save", 6, 1, 6, True),
    ("test-batch1", 8, 1, 8, True),  # the end-of-run evaluation
    ("save", 8, 0, 8, True),  # the last save
    ("teardown", 0, 1, 8, False),  # everything is saved: nothing to say, exit 0
]
# SIGKILL: (moment, iteration, rank killed, the iteration the survivor names).
SIGKILLS = [("step", 3, 0, 3), ("save-write", 4, 0, 4), ("step", 3, 1, 3), ("save-write", 4, 1, 4)]


def case_id(moment, iteration, rank, name) -> str:
    return f"{name}-{moment}@{iteration}-rank{rank}"


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> dict[str, Outcome]:
    """Every launch of this file, run by one launcher: {case id: Outcome}; "reference" is uninterrupted."""
    root = tmp_path_factory.mktemp("signals")
    cases = [("reference", None, False)]
    cases += [(case_id(m, i, r, "SIGTERM"), f"{m}:{i}:{r}:SIGTERM", resume) for m, i, r, _, resume in SIGTERMS]
    cases += [(case_id(m, i, r, "SIGKILL"), f"{m}:{i}:{r}:SIGKILL", False) for m, i, r, _ in SIGKILLS]
    plan = {"flags": FLAGS, "timeout": CASE_TIMEOUT_S, "cases": []}
    for name, signal_at, resume in cases:
        os.makedirs(root / name)
        plan["cases"].append({"folder": str(root / name), "signal_at": signal_at, "resume": resume})
    (root / "plan.json").write_text(json.dumps(plan))
    subprocess.run([sys.executable, "-c", LAUNCHER, str(root / "plan.json")], env={**os.environ, "OMP_NUM_THREADS": "1"},
                   cwd=REPO_ROOT, timeout=CASE_TIMEOUT_S * 2 * len(cases))
    return {name: Outcome(str(root / name / "run"), str(root / name / "interrupted"),
                          read_launch(root / name, "interrupted"),
                          read_launch(root / name, "resumed")) for name, _, _ in cases}


@pytest.fixture(scope="module")
def reference(outcomes) -> dict:
    launch = outcomes["reference"].interrupted
    assert launch and launch.code == 0, launch
    return read_losses(os.path.join(outcomes["reference"].save, "metrics.jsonl"))


@pytest.mark.parametrize("moment, iteration, rank, stop, resume", SIGTERMS,
                         ids=[case_id(*case[:3], "SIGTERM") for case in SIGTERMS])
def test_a_sigterm_saves_exits_0_and_the_run_resumes_exactly(outcomes, reference, moment, iteration, rank, stop,
                                                             resume):
    outcome = outcomes[case_id(moment, iteration, rank, "SIGTERM")]
    interrupted = outcome.interrupted
    assert interrupted and interrupted.code == 0, interrupted
    if moment != "teardown":
        assert f"exiting at iteration {stop}: SIGTERM" in interrupted.stdout, interrupted.stdout[-3000:]
    assert read_latest_iteration(outcome.save) == stop
    cut_short = read_losses(os.path.join(outcome.save, "metrics.jsonl"))
    assert cut_short == {key: reference[key] for key in cut_short}  # what was logged is the reference's
    split = "test" if moment.startswith("test") else "valid"
    due, evaluated = (split, stop) in reference, (split, stop) in cut_short
    # A signal before the evaluation's last batch cuts it short; one during that batch or later does not.
    assert evaluated == (due and moment not in ("logged", "valid-start", "valid-batch1", "test-batch1"))
    path, _ = choose_checkpoint(outcome.save)
    metadata = json.load(open(os.path.join(path, "metadata.json")))
    assert metadata["extra"]["evaluation_pending"] == (split == "valid" and due and not evaluated)
    if resume:
        assert outcome.resumed and outcome.resumed.code == 0, outcome.resumed
        assert read_losses(os.path.join(outcome.run, "metrics.jsonl")) == reference  # every loss, bitwise


@pytest.mark.parametrize("moment, iteration, rank, named", SIGKILLS,
                         ids=[case_id(*case[:3], "SIGKILL") for case in SIGKILLS])
def test_a_survivor_of_a_sigkill_names_the_dead_rank_in_one_sentence(outcomes, moment, iteration, rank, named):
    """Printed by the lowest living rank: rank 1 when rank 0 died, which used to wait for rank 0 to speak."""
    outcome = outcomes[case_id(moment, iteration, rank, "SIGKILL")]
    interrupted = outcome.interrupted
    assert interrupted and interrupted.code not in (0, "hung"), interrupted
    survivor = 1 - rank
    lines = interrupted.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        f"error: rank {survivor} stopped during iteration {named}: rank {rank} died ("), interrupted.stderr
    assert lines[0].endswith(f"the last complete checkpoint is {outcome.run}/iter_0000002, rerun the same command "
                             f"(or use torchrun --max-restarts) to resume from it")
    path, note = choose_checkpoint(outcome.save)
    assert path == os.path.join(outcome.save, "iter_0000002") and not note


SHUTDOWN = r"""
import os, runpy, signal, sys


class SignalAtShutdown:
    def __del__(self):  # a global of __main__: deleted after the interpreter stopped running Python handlers
        os.kill(os.getpid(), signal.SIGTERM)


sentinel = SignalAtShutdown()
sys.argv = ["pretrain_gpt.py", *sys.argv[1:]]
runpy.run_path("pretrain_gpt.py", run_name="__main__")
"""


def test_a_sigterm_during_the_interpreters_shutdown_exits_0(tmp_path):
    """Python's shutdown puts the default action back before torch is torn down: a SIGTERM there killed a
    run that had saved everything (exit -15) until the signal owner set SIGTERM to SIG_IGN at exit."""
    flags = [*FLAGS, "--save", str(tmp_path), "--train-iters", "1", "--lr-warmup-iters", "0", "--eval-iters", "0",
             "--num-layers", "1"]
    result = subprocess.run([sys.executable, "-c", SHUTDOWN, *flags], capture_output=True, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=REPO_ROOT, timeout=120)
    assert result.returncode == 0, (result.returncode, result.stderr[-3000:])
    assert read_latest_iteration(str(tmp_path)) == 1


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
