"""Kill a 2-process training run at random moments, resume it, and check that nothing was lost.

    python tools/fault_campaign.py                   # 20 trials, seed 0
    python tools/fault_campaign.py --trials 5 --seed 3 --keep runs/campaign

One uninterrupted run gives the reference losses. Each trial starts the same run (2
ranks on CPU, gloo, data parallel with the distributed optimizer, a checkpoint every 2
iterations), then, by trial kind:

    sigkill-train   SIGKILL one rank or both at a random moment of training
    sigkill-save    SIGKILL one rank or both while a checkpoint is being written
    sigterm         SIGTERM one rank (a preemption): both must save and exit 0, and say
                    `exiting at iteration N` (or, for a signal after the last save, that it
                    came too late to stop anything)

A rank that outlives a killed peer must stop within --distributed-timeout-minutes and
print one `error:` line naming the dead rank, whichever rank died. Then the folder's latest checkpoint must be complete, and the same
command again (no --load: it defaults to --save) must finish the run with every logged
loss bitwise equal to the reference. One line per trial; exits 1 when any trial fails.
The ranks are started directly (RANK, WORLD_SIZE, MASTER_ADDR/PORT, as torchrun would),
so that the campaign knows each rank's process, with no GPU visible (CPU and gloo on any
machine).
"""

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

from megalite.checkpoint import LATEST_FILE, STAGING_SUFFIX, choose_checkpoint
from megalite.run.resilience import LATE_SIGNAL_LINE
from tools.fork_ranks import cpu_world_environment, free_port, rank_environment

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TRAIN_ITERS = 12
FLAGS = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "255", "--num-layers", "2",
         "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32", "--micro-batch-size", "2",
         "--global-batch-size", "8", "--train-iters", str(TRAIN_ITERS), "--lr", "3e-3", "--lr-warmup-iters", "2",
         "--log-interval", "1", "--eval-interval", "4", "--eval-iters", "1", "--save-interval", "2",
         "--use-distributed-optimizer", "--distributed-timeout-minutes", "1"]
KINDS = ("sigkill-train", "sigkill-save", "sigterm")
LATE_LINE = LATE_SIGNAL_LINE.format(name="SIGTERM")  # what a rank says of a signal it had nothing left to stop for
EXIT_TIMEOUT_S = 90  # a survivor must stop well within this (it is not --distributed-timeout-minutes: it
# sees a closed connection at once); a hang fails the trial


def start_world(save: str, world_size: int = 2, flags=FLAGS, logs: str | None = None) -> list[subprocess.Popen]:
    """Start `pretrain_gpt.py flags --save save` as `world_size` ranks; output goes to <logs>/rank<r>.log."""
    logs = logs or save + "-logs"
    os.makedirs(logs, exist_ok=True)
    port = free_port()
    processes = []
    for rank in range(world_size):
        env = cpu_world_environment(**rank_environment(rank, world_size, port), OMP_NUM_THREADS="1")
        output = open(os.path.join(logs, f"rank{rank}.log"), "a")
        processes.append(subprocess.Popen([sys.executable, os.path.join(REPO_ROOT, "pretrain_gpt.py"), *flags,
                                           "--save", save], stdout=output, stderr=subprocess.STDOUT, env=env,
                                          cwd=REPO_ROOT))
        output.close()
    return processes


def wait_all(processes, timeout: float) -> list[int | None]:
    """Exit codes (negative: killed by that signal); None for a process still running after `timeout` s
    (it is killed then)."""
    deadline = time.monotonic() + timeout
    codes = []
    for process in processes:
        try:
            codes.append(process.wait(timeout=max(0.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            codes.append(None)
    return codes


def child_pids(parent_pid: int) -> list[int]:
    """The pids of `parent_pid`'s child processes (Linux /proc)."""
    return [int(pid) for task in os.listdir(f"/proc/{parent_pid}/task")
            for pid in open(f"/proc/{parent_pid}/task/{task}/children").read().split()]


def worker_pids(launcher_pid: int) -> dict[int, int]:
    """{rank: pid} of the worker processes a torchrun launcher started (Linux /proc)."""
    workers = {}
    for pid in child_pids(launcher_pid):
        try:
            environ = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
        except FileNotFoundError:
            continue
        ranks = [item[len(b"RANK="):] for item in environ if item.startswith(b"RANK=")]
        if ranks:
            workers[int(ranks[0])] = pid
    return workers


def read_losses(save: str) -> dict:
    """{(split, iteration): lm_loss} of <save>/metrics.jsonl (a torn last line is skipped)."""
    losses = {}
    path = os.path.join(save, "metrics.jsonl")
    if not os.path.exists(path):
        return losses
    for line in open(path):
        try:
            record = json.loads(line)
        except ValueError:
            continue
        losses[(record.get("split", "train"), record["iteration"])] = record["lm_loss"]
    return losses


def logged_iterations(save: str) -> int:
    return sum(1 for key in read_losses(save) if key[0] == "train")


def rank_log(save: str, rank: int) -> str:
    path = os.path.join(save + "-logs", f"rank{rank}.log")
    return open(path).read() if os.path.exists(path) else ""


def reference_run(folder: str) -> dict:
    save = os.path.join(folder, "reference")
    codes = wait_all(start_world(save), 600)
    if codes != [0, 0]:
        raise SystemExit(f"the reference run failed with exit codes {codes}:\n{rank_log(save, 0)[-3000:]}")
    return read_losses(save)


@dataclass
class TrialResult:
    number: int
    kind: str
    target: str  # which ranks got the signal
    moment: str  # when it came
    resumed_from: int  # the iteration the resumed run started at (0: from scratch)
    ok: bool
    detail: str = ""

    def line(self) -> str:
        status = "ok  " if self.ok else "FAIL"
        return (f"trial {self.number:2d} {status} {self.kind:<13} {self.target:<11} {self.moment:<34} "
                f"resumed from iteration {self.resumed_from:2d}" + (f"  {self.detail}" if self.detail else ""))


def wait_for(condition, processes, timeout: float = 300, poll: float = 0.002) -> bool:
    """Poll until `condition()`; False when a process ended first or time ran out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        if any(process.poll() is not None for process in processes):
            return False
        time.sleep(poll)
    return False


def staging_folder(save: str, after: int) -> str | None:
    """A save in progress (an `iter_*.tmp-new` folder) of an iteration >= `after`, if any."""
    try:
        names = os.listdir(save)
    except FileNotFoundError:
        return None
    for name in names:
        if name.endswith(STAGING_SUFFIX) and int(name[len("iter_"):-len(STAGING_SUFFIX)]) >= after:
            return name
    return None


def interrupt(save: str, processes, kind: str, rng: random.Random,
              ranks: list[int] | None = None) -> tuple[str, list[int], str]:
    """Interrupt a run the `kind` way (`ranks`: which; default random); returns (target description,
    ranks signalled, moment)."""
    if ranks is None:
        ranks = rng.choice([[0], [1], [0, 1]]) if kind != "sigterm" else [rng.choice([0, 1])]
    target = "both ranks" if len(ranks) == 2 else f"rank {ranks[0]}"
    if kind == "sigkill-save":
        after = rng.choice(range(2, TRAIN_ITERS, 2))
        found = []
        wait_for(lambda: found.append(staging_folder(save, after)) or found[-1], processes)
        moment = f"while writing {found[-1]}" if found and found[-1] else "after the run ended (missed)"
    else:
        after = rng.randint(1, TRAIN_ITERS - 3)  # late enough to have checkpoints, early enough to hit the run
        reached = wait_for(lambda: logged_iterations(save) >= after, processes, poll=0.01)
        delay = rng.uniform(0, 0.15)  # anywhere inside the next iteration or save
        time.sleep(delay)
        moment = f"{delay * 1000:3.0f} ms after iteration {after} logged" if reached else \
            "after the run ended (missed)"
    signum = signal.SIGTERM if kind == "sigterm" else signal.SIGKILL
    if any(processes[rank].poll() is not None for rank in ranks):
        moment = "after the run ended (missed)"
    elif kind == "sigterm" and ("test", TRAIN_ITERS) in read_losses(save):
        moment += " (late)"  # its last evaluation is logged: the signal may come after the last agreement
    for rank in ranks:
        if processes[rank].poll() is None:
            processes[rank].send_signal(signum)
    return target, ranks, moment


def check_interrupted(save: str, kind: str, ranks: list[int], codes: list, moment: str) -> list[str]:
    """Problems with how the ranks stopped."""
    problems = []
    if None in codes:
        problems.append(f"rank {codes.index(None)} hung (killed after {EXIT_TIMEOUT_S} s)")
    if kind == "sigterm":
        heard = "exiting at iteration" in rank_log(save, 1) or LATE_LINE in rank_log(save, ranks[0])
        if codes != [0, 0]:
            problems.append(f"exit codes {codes} after SIGTERM, not [0, 0]")
        elif not heard and "(missed)" not in moment and "(late)" not in moment:
            problems.append(f"neither 'exiting at iteration' nor '{LATE_LINE}' after SIGTERM")
        return problems
    for rank in sorted(set(range(len(codes))) - set(ranks)):  # the survivor of a one-rank kill
        errors = [line for line in rank_log(save, rank).splitlines() if line.startswith("error:")]
        if codes[rank] == 1 and not (errors and f"rank {ranks[0]} died" in errors[-1]):
            problems.append(f"surviving rank {rank}'s error does not name rank {ranks[0]}: {errors[-1:]}")
        elif codes[rank] not in (0, 1, None):
            problems.append(f"surviving rank {rank} exited with {codes[rank]}")
    return problems


def run_trial(number: int, kind: str, folder: str, reference: dict, rng: random.Random,
              ranks: list[int] | None = None) -> TrialResult:
    """Start the run, interrupt it (`kind`, `ranks`), check how it stopped, resume it, compare the losses."""
    save = os.path.join(folder, f"trial{number:02d}")
    processes = start_world(save)
    target, ranks, moment = interrupt(save, processes, kind, rng, ranks)
    codes = wait_all(processes, EXIT_TIMEOUT_S)
    problems = check_interrupted(save, kind, ranks, codes, moment)
    try:  # what the resumed run will load must be the latest file's own, complete checkpoint
        path, note = choose_checkpoint(save)
    except Exception as error:  # noqa: BLE001 - reported as the trial's failure
        path, note = None, f"no loadable checkpoint: {error}"
    if note:
        problems.append(note)
    resumed_from = int(os.path.basename(path)[len("iter_"):len("iter_") + 7]) if path else 0
    codes = wait_all(start_world(save), 600)  # the same command again
    if codes != [0, 0]:
        problems.append(f"the resumed run exited with {codes}: {rank_log(save, 1)[-500:]!r}")
    losses = read_losses(save)
    if losses != reference:
        differing = sorted(key for key in set(losses) | set(reference) if losses.get(key) != reference.get(key))
        problems.append(f"losses differ from the uninterrupted run at {differing[:4]}")
    leftovers = [name for name in os.listdir(save) if ".tmp" in name]
    if leftovers:
        problems.append(f"leftovers after the resumed run: {leftovers}")
    if not problems and os.path.exists(os.path.join(save, LATEST_FILE)):
        shutil.rmtree(save, ignore_errors=True)
        shutil.rmtree(save + "-logs", ignore_errors=True)
    return TrialResult(number, kind, target, moment, resumed_from, not problems, "; ".join(problems))


def campaign(trials: int, seed: int, folder: str, kinds=KINDS, print_fn=print) -> list[TrialResult]:
    """Run `trials` trials (kinds in turn) in `folder`; returns their results."""
    rng = random.Random(seed)
    start = time.monotonic()
    reference = reference_run(folder)
    print_fn(f"reference: {len(reference)} logged losses in {time.monotonic() - start:.0f} s")
    results = []
    for number in range(1, trials + 1):
        result = run_trial(number, kinds[(number - 1) % len(kinds)], folder, reference, rng)
        print_fn(result.line())
        results.append(result)
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--keep", help="run in this folder and keep it (default: a temporary folder, removed)")
    args = parser.parse_args(argv)
    start = time.monotonic()
    if args.keep:
        os.makedirs(args.keep, exist_ok=True)
        results = campaign(args.trials, args.seed, args.keep)
    else:
        with tempfile.TemporaryDirectory(prefix="megalite-faults-") as folder:
            results = campaign(args.trials, args.seed, folder)
    passed = sum(result.ok for result in results)
    in_saves = sum(result.kind == "sigkill-save" and "while writing" in result.moment for result in results)
    missed = sum("(missed)" in result.moment for result in results)
    late = sum("(late)" in result.moment for result in results)
    print(f"{passed}/{len(results)} trials resumed from a complete checkpoint and reproduced the uninterrupted "
          f"losses bitwise ({in_saves} killed during a save, {late} signalled after the last evaluation, {missed} "
          f"after the run ended) "
          f"in {time.monotonic() - start:.0f} s")
    return 0 if passed == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
