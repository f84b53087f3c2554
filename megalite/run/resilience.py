"""What keeps a long run alive and honest: exit signals, dead ranks, NaNs, loss spikes, skipped steps and
token ids outside the vocabulary. docs/reliability.md says what happens in each case, and why."""

import atexit
import contextlib
import math
import os
import re
import signal
import socket
import statistics
import threading
import time
from collections import deque

import numpy as np
import torch

from megalite.errors import PeerLostError, UserError


class RunSignals:
    """The one owner of SIGTERM and SIGINT for a run (or, under `hold_signals_until_exit`, the process). The
    handler records the first signal. With `save_and_exit` (--exit-signal-handler) the loop agrees on it
    across ranks at its next boundary and saves; a second SIGINT raises KeyboardInterrupt. Without, the signal
    ends the run at once as SystemExit(128 + signum) (KeyboardInterrupt for SIGINT), so the loop's `finally`
    finishes the tracking, or when a `deferred()` block ends. Only the main thread owns signals."""

    def __init__(self, save_and_exit: bool):
        self._previous: dict = {}
        self._deferring, self._pending = 0, None
        self.new_run(save_and_exit)

    def new_run(self, save_and_exit: bool) -> None:
        """Forget the signals of a run before (a process that trains twice)."""
        self.save_and_exit = save_and_exit
        self.received: int | None = None  # the first signal's number
        self.late: int | None = None  # the first one after `close()`, when it had nothing left to stop
        self._closed = False
        self._interrupts = 0  # SIGINTs seen: the second one raises

    def close(self) -> None:
        """The loop's last agreement is behind it: a signal from now on is recorded as `late` (said at exit)."""
        self._closed = True

    def install(self) -> "RunSignals":
        if threading.current_thread() is threading.main_thread() and not self._previous:
            for signum in (signal.SIGTERM, signal.SIGINT):
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def restore(self) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous = {}

    def _handle(self, signum, frame):
        if self.received is None:
            self.received = signum
        if self._closed and self.late is None:
            self.late = signum
        if self.save_and_exit:
            if signum == signal.SIGINT:
                self._interrupts += 1
                if self._interrupts > 1:
                    raise KeyboardInterrupt
            return
        stop = KeyboardInterrupt() if signum == signal.SIGINT else SystemExit(128 + signum)
        if self._deferring:
            self._pending = stop
            return
        raise stop

    @contextlib.contextmanager
    def deferred(self):
        """A block a signal must not interrupt (a call into wandb): an exit it asks for comes after."""
        self._deferring += 1
        try:
            yield
        finally:
            self._deferring -= 1
        if not self._deferring and self._pending is not None:
            stop, self._pending = self._pending, None
            raise stop


_owner: RunSignals | None = None  # the owner installed in this process, if any


def hold_signals_until_exit(save_and_exit: bool) -> RunSignals:
    """The process's signal owner, installed now and never given back, so that a signal down to the
    interpreter's exit is handled as `RunSignals` says (pretrain_gpt.py)."""
    global _owner
    if _owner is None:
        _owner = RunSignals(save_and_exit).install()
        atexit.register(_at_exit)
    _owner.new_run(save_and_exit)
    return _owner


LATE_SIGNAL_LINE = "{name} came after the run's last save: nothing was left to stop"  # said at exit


def _at_exit() -> None:
    """Say that a signal came too late to stop anything, and ignore SIGTERM from now on: SIG_IGN is the one
    setting the interpreter's shutdown keeps, so a saved run is not ended as killed (docs/reliability.md)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if _owner is not None and _owner.late is not None and _owner.save_and_exit:
        print(LATE_SIGNAL_LINE.format(name=signal.Signals(_owner.late).name), flush=True)


@contextlib.contextmanager
def owned_signals(save_and_exit: bool):
    """The signal owner of one run: the process's (its mode set to this run's), else a new one
    installed for the block and restored after it (runs started from Python, tests)."""
    global _owner
    if _owner is not None:
        _owner.save_and_exit = save_and_exit
        yield _owner
        return
    _owner = RunSignals(save_and_exit).install()
    try:
        yield _owner
    finally:
        _owner.restore()
        _owner = None


def deferred_signals():
    """`RunSignals.deferred` of the active owner; nothing to defer without one."""
    return _owner.deferred() if _owner is not None else contextlib.nullcontext()


def exit_reason(train, iteration: int, stop_signal: int, overtime: bool) -> str | None:
    """Why the loop should stop after `iteration` (iterations completed), or None to go on.
    train: the TrainConfig; stop_signal, overtime: `Trainer.agreed_stop`'s answer, the same on every rank."""
    if iteration >= train.train_iters:
        return "finished"
    if stop_signal:
        return signal.Signals(stop_signal).name
    if train.exit_interval and iteration % train.exit_interval == 0:
        return f"--exit-interval {train.exit_interval}"
    if overtime:
        return f"--exit-duration-in-mins {train.exit_duration_in_mins:g}"
    return None


def is_collective_failure(error: BaseException) -> bool:
    """Whether `error` came out of a collective whose peer is gone or hung: NCCL raises DistError
    subclasses, gloo a RuntimeError naming its transport (`.../gloo/transport/tcp/pair.cc: ...`)."""
    return isinstance(error, torch.distributed.DistError) or (isinstance(error, RuntimeError) and "gloo" in str(error))


class PeerWatch:
    """Every rank's host and process id, gathered once, to tell which rank died when a collective fails.
    Ranks on this host are checked through /proc; ranks on other hosts cannot be checked from here."""

    def __init__(self, parallel):
        self.rank = parallel.rank
        self.host = socket.gethostname()
        self.peers = [(self.host, os.getpid())]
        if parallel.world_size > 1:
            self.peers = [None] * parallel.world_size
            torch.distributed.all_gather_object(self.peers, (self.host, os.getpid()))

    def peer_states(self, wait: float) -> dict[int, str]:
        """{rank: "died" | "is suspended"} for the ranks on this host whose process cannot answer,
        checked for up to `wait` seconds: a killed process closes its sockets before it is gone."""
        deadline = time.monotonic() + wait
        while True:
            states = {rank: _process_state(pid) for rank, (host, pid) in enumerate(self.peers)
                      if rank != self.rank and host == self.host}
            states = {rank: state for rank, state in states.items() if state != "running"}
            if states or time.monotonic() >= deadline:
                return states
            time.sleep(0.05)

    def failure(self, error: BaseException, iteration: int, last_checkpoint: str | None) -> PeerLostError:
        """The error to raise for a collective that failed with `error` during `iteration`, naming the ranks found
        dead or suspended (the lowest rank still running prints it, `megalite.errors.run_main`)."""
        states = self.peer_states(wait=3.0)
        if states:
            who = " and ".join(f"rank {rank} {state}" for rank, state in sorted(states.items()))
        else:
            remote = sorted({host for host, _ in self.peers} - {self.host})
            where = f" (ranks on {', '.join(remote)} cannot be checked from here)" if remote else ""
            who = f"another rank died or stopped answering{where}; the launcher's failure summary names it"
        saved, then = ((f"the last complete checkpoint is {last_checkpoint}", "resume from it") if last_checkpoint
                       else ("no checkpoint was saved yet", "start again"))
        return PeerLostError(f"rank {self.rank} stopped during iteration {iteration}: {who} ({_short_error(error)}); "
                             f"{saved}, rerun the same command (or use torchrun --max-restarts) to {then}",
                             lost_ranks=states)


def _short_error(error: BaseException) -> str:
    """The gist of a collective's error: no source location, no advice boilerplate, one line."""
    text = re.sub(r"\[[^\]]*\.(?:cc|cpp|h):\d+\] ", "", " ".join(str(error).split()))
    text = text.split(" This is typically caused")[0]
    return text[:160] + ("..." if len(text) > 160 else "")


def _process_state(pid: int) -> str:
    """"died" (gone, or a zombie its launcher has not reaped), "is suspended" (SIGSTOP), else "running"."""
    try:
        with open(f"/proc/{pid}/stat") as file:
            # The state follows the command name, which is in parentheses and may hold spaces.
            state = file.read().rsplit(")", 1)[1].split()[0]
        return {"Z": "died", "X": "died", "T": "is suspended"}.get(state, "running")
    except FileNotFoundError:
        return "died"
    except (OSError, IndexError):  # no /proc (not Linux): ask the kernel instead
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return "died"
        except PermissionError:
            pass
        return "running"


# fp16 skips steps whose gradients overflow and lowers the loss scale; at --min-loss-scale it cannot go
# lower, so this many overflows in a row there stop the run (as do skipped steps without a scaler).
MAX_SKIPPED_AT_MIN_SCALE = 10

LIKELY_CAUSES = ("likely causes: a learning rate too high for this model (--lr, --lr-warmup-iters), "
                 "gradient clipping off (--clip-grad), a corrupt batch of data, or overflow in half precision")


def _last_good(last_checkpoint: str | None) -> str:
    return f"the last good checkpoint is {last_checkpoint}" if last_checkpoint else "no checkpoint was saved before it"


def _restart(last_checkpoint: str | None) -> str:
    """How a stopped run goes on once its cause is fixed: from its last good checkpoint, or from the start."""
    return "resume from that checkpoint with --load" if last_checkpoint else "start the run again"


def divergence_message(what: str, iteration: int, last_checkpoint: str | None) -> str:
    """The sentence a NaN/Inf loss or grad norm stops the run with."""
    return (f"{what} at iteration {iteration}, so the run diverged and stopped without saving; "
            f"{_last_good(last_checkpoint)}; {LIKELY_CAUSES}; fix the cause and {_restart(last_checkpoint)} "
            f"(--no-check-for-nan-in-loss-and-grad skips such steps instead)")


class SkippedSteps:
    """Counts the optimizer steps skipped in a row that cannot recover: fp16 overflows with the
    loss scale at its minimum, or any skipped step without a scaler."""

    def __init__(self):
        self.in_a_row = 0

    def check(self, updated: bool, scaler, scale: float, iteration: int, last_checkpoint: str | None) -> None:
        """Count `iteration`'s step (`updated`: applied; `scale`: the DynamicLossScaler `scaler`'s scale after it,
        scaler None without fp16); UserError at MAX_SKIPPED_AT_MIN_SCALE stuck steps in a row."""
        stuck = not updated and (scaler is None or scale <= scaler.min_scale)
        self.in_a_row = self.in_a_row + 1 if stuck else 0
        if self.in_a_row < MAX_SKIPPED_AT_MIN_SCALE:
            return
        where = (f"at the minimum loss scale (--min-loss-scale {scaler.min_scale:g}), which cannot go lower"
                 if scaler is not None else "(--no-check-for-nan-in-loss-and-grad)")
        raise UserError(f"{self.in_a_row} iterations in a row up to iteration {iteration} had inf/nan gradients "
                        f"and were skipped {where}, so the run is not recovering; {_last_good(last_checkpoint)}; "
                        f"{LIKELY_CAUSES}; lower --lr or use --bf16, then {_restart(last_checkpoint)}")


class LossSpikeDetector:
    """Flags a loss above `threshold` x the median of the previous `window` finite losses (the median, so
    one spike does not raise the bar for the next), from `window // 2` losses on; threshold 0 is off."""

    def __init__(self, threshold: float, window: int = 20):
        self.threshold, self.window = threshold, window
        self.recent = deque(maxlen=window)

    def check(self, iteration: int, loss: float) -> str | None:
        """A warning line when `loss` is a spike, else None; the loss joins the window either way."""
        warning = None
        if self.threshold > 0 and len(self.recent) >= self.window // 2 and math.isfinite(loss):
            typical = statistics.median(self.recent)
            if typical > 0 and loss > self.threshold * typical:
                warning = (f"warning: loss spike at iteration {iteration}: lm loss {loss:.4f} is "
                           f"{loss / typical:.2f}x the median of the previous {len(self.recent)} iterations "
                           f"({typical:.4f}; --loss-spike-threshold {self.threshold:g})")
        if math.isfinite(loss):
            self.recent.append(loss)
        return warning


def checked_token_ids(micro_batches, vocab_size: int, source: str):
    """`micro_batches` unchanged, after checking every token id is in [0, vocab_size): an id outside means
    another tokenizer made the data, and the embedding lookup would fail (on a GPU, a device-side assert)."""
    for batch in micro_batches:
        tokens, labels = batch["tokens"], batch["labels"]
        low, high = int(tokens.min()), max(int(tokens.max()), int(labels.max()))
        if low < 0 or high >= vocab_size:
            bad = low if low < 0 else high
            raise UserError(f"{source} holds token id {bad}, outside the tokenizer's {vocab_size} ids: the data "
                            f"was tokenized with another tokenizer; pass the --tokenizer-type and --tokenizer-model "
                            f"(or --vocab-size) that tools/preprocess_data.py used for it")
        yield batch


def check_token_dtypes(datasets, vocab_size: int) -> None:
    """UserError when a token file's dtype cannot hold the tokenizer's ids (it was made by another tokenizer)."""
    for indexed in _token_files(datasets):
        dtype = getattr(indexed, "dtype", None)  # mock data has none
        if dtype is None or np.dtype(dtype).kind not in "iu":
            continue
        largest = int(np.iinfo(dtype).max)
        if vocab_size - 1 > largest:
            raise UserError(f"{indexed.path_prefix} stores token ids as {np.dtype(dtype)} (at most {largest}), but "
                            f"the tokenizer has {vocab_size} ids: the files were made with another tokenizer; pass "
                            f"the tokenizer flags they were made with, or preprocess the text again")


def _token_files(datasets):
    """The token files (IndexedDatasets) under datasets: GPTDatasets, BlendedDatasets or None."""
    for dataset in datasets:
        if hasattr(dataset, "datasets"):
            yield from _token_files(dataset.datasets)
        elif hasattr(dataset, "indexed"):
            yield dataset.indexed
