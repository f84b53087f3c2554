"""Experiment tracking: a run's config and metrics records, sent to wandb (with --wandb-project, Megatron's
rule) and TensorBoard (--tensorboard-dir) by the logging rank, under the same names (`scalars_of`). The
network never blocks or stops a run (README.md, "Experiment tracking", says how)."""

import contextlib
import math
import os
import socket
import time
from typing import Callable
from urllib.parse import urlparse

from megalite.config.run import DEFAULT_WANDB_HOST, LoggingConfig, wandb_api_key_configured
from megalite.run.resilience import deferred_signals

INIT_TIMEOUT_S = 20  # wandb's own default (90 s) is long for a job waiting on its GPUs
PROBE_TIMEOUT_S = 3
PROXY_VARIABLES = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")


def default_run_name(run) -> str:
    """A readable wandb run name: model, layout and start time, e.g. `tiny-tp2-pp2-dp1-20250101-120000`."""
    parallel = run.parallel
    return (f"{run.model_name}-tp{parallel.tensor_model_parallel_size}-pp{parallel.pipeline_model_parallel_size}"
            f"-dp{parallel.data_parallel_size}-{time.strftime('%Y%m%d-%H%M%S')}")


def scalars_of(record: dict) -> dict[str, float]:
    """The named scalars of one metrics record: `train/<key>` for every key of a training record but the
    iteration, `<split>/lm_loss` and `<split>/ppl` for an evaluation; None values (MFU unknown) left out."""
    split = record.get("split", "train")
    scalars = {f"{split}/{key}": value for key, value in record.items()
               if key not in ("iteration", "split") and value is not None}
    loss = record.get("lm_loss")
    if split != "train" and loss is not None and loss < 700:  # exp overflows past ~709
        scalars[f"{split}/ppl"] = math.exp(loss)
    return scalars


def exit_code_of(error: BaseException) -> int:
    """The process exit code an exception leads to: SystemExit's own, 130 for Ctrl-C, else 1."""
    if isinstance(error, SystemExit):
        return error.code if isinstance(error.code, int) else (0 if error.code is None else 1)
    return 130 if isinstance(error, KeyboardInterrupt) else 1


class Tracker:
    """Where metrics go besides the console and the metrics file: a wandb run and a TensorBoard writer,
    either None. A failure of either is reported once and turns it off: tracking never stops training."""

    def __init__(self, wandb_run=None, tensorboard=None, warn: Callable[[str], None] = print):
        self._wandb, self._tensorboard, self._warn = wandb_run, tensorboard, warn

    @property
    def active(self) -> bool:
        return self._wandb is not None or self._tensorboard is not None

    def log_record(self, record: dict) -> None:
        """A TrainingLogger sink: one metrics record, at step = its iteration."""
        self._write(scalars_of(record), record["iteration"])

    def log_checkpoint(self, iteration: int) -> None:
        self._write({"checkpoint/iteration": iteration}, iteration)

    def _write(self, scalars: dict, step: int) -> None:
        with deferred_signals():  # a SIGTERM that ends the run at once waits for wandb's call to return
            if self._wandb is not None:
                try:
                    self._wandb.log(scalars, step=step)
                except Exception as error:  # noqa: BLE001 - any wandb failure must not stop training
                    self._warn(f"wandb: logging failed ({_first_line(error)}); training goes on without wandb")
                    self._finish_wandb(1)
            if self._tensorboard is not None:
                try:
                    for key, value in scalars.items():
                        self._tensorboard.add_scalar(key, value, step)
                except Exception as error:  # noqa: BLE001 - a full disk, say; training goes on
                    self._warn(f"tensorboard: writing failed ({_first_line(error)}); training goes on without it")
                    self._tensorboard = None

    def finish(self, exit_code: int = 0, summary: dict | None = None) -> None:
        """Close the wandb run (marked failed for a non-zero exit code) and the writer; safe twice."""
        if self._wandb is not None and summary:
            with contextlib.suppress(Exception):  # the summary is a nicety; finishing is what matters
                self._wandb.summary.update(summary)
        self._finish_wandb(exit_code)
        if self._tensorboard is not None:
            try:
                self._tensorboard.close()
            except Exception as error:  # noqa: BLE001
                self._warn(f"tensorboard: closing failed ({_first_line(error)})")
            self._tensorboard = None

    def _finish_wandb(self, exit_code: int) -> None:
        wandb_run, self._wandb = self._wandb, None
        if wandb_run is None:
            return
        import wandb

        try:
            with deferred_signals():  # finishing, once begun, is not cut short by the exit it is part of
                wandb_run.finish(exit_code=exit_code)
            # finish() may return before wandb's service wrote the run file; teardown waits, so an offline run is whole.
            wandb.teardown()
        except Exception as error:  # noqa: BLE001 - e.g. its service process was killed with ours
            self._warn(f"wandb: finishing the run failed ({_first_line(error)}); its local files may lack the end")


def start_tracking(run, config: dict, logger, is_logging_rank: bool,
                   warn: Callable[[str], None] = print) -> Tracker:
    """Start what `run.logging` asks for on the logging rank and add it to `logger`'s sinks; `config` is
    the full RunConfig as plain JSON values (wandb's run config)."""
    logging = run.logging
    if not is_logging_rank:
        return Tracker(warn=warn)
    wandb_run = tensorboard = None
    if logging.wandb_project and logging.wandb_mode != "disabled":
        wandb_run = _start_wandb(logging, logging.wandb_exp_name or default_run_name(run), config, warn)
    if logging.tensorboard_dir:
        try:
            from torch.utils.tensorboard import SummaryWriter
            tensorboard = SummaryWriter(log_dir=logging.tensorboard_dir, flush_secs=30)
        except Exception as error:  # noqa: BLE001 - missing package or unwritable folder: training goes on
            warn(f"tensorboard: cannot write to {logging.tensorboard_dir} ({_first_line(error)}); "
                 f"training goes on without it")
    tracker = Tracker(wandb_run, tensorboard, warn)
    if tracker.active:
        logger.add_sink(tracker.log_record)
    return tracker


def _start_wandb(logging, name: str, config: dict, warn):
    """A wandb run in the requested mode, else offline, else None; at most one warning line."""
    import wandb

    save_dir = logging.wandb_save_dir
    if save_dir:
        os.makedirs(save_dir, exist_ok=True)
    offline = (f"logging offline into {save_dir or os.environ.get('WANDB_DIR') or 'the current folder'} "
               f"(upload later with `wandb sync`)")
    modes = ("online", "offline") if logging.wandb_mode == "online" else (logging.wandb_mode,)
    if logging.wandb_mode == "online":  # on a terminal wandb would ask for a missing key, and wait
        problem = ("no API key is configured (set WANDB_API_KEY or run `wandb login`)"
                   if not wandb_api_key_configured() else
                   _unreachable(os.environ.get("WANDB_BASE_URL") or DEFAULT_WANDB_HOST))
        if problem:
            warn(f"wandb: {problem}; {offline}")
            modes = ("offline",)
    settings = {} if os.environ.get("WANDB_INIT_TIMEOUT") else {"init_timeout": INIT_TIMEOUT_S}
    failures = []
    for mode in modes:
        try:
            wandb_run = wandb.init(project=logging.wandb_project, entity=logging.wandb_entity, name=name,
                                   dir=save_dir, config=config, mode=mode, settings=wandb.Settings(**settings))
        except Exception as error:  # noqa: BLE001 - a bad key, a dead server, a bad entity: never fatal
            failures.append(f"{mode} start failed: {_first_line(error)}")
            continue
        if failures:
            warn(f"wandb: {failures[0]}; {offline}")
        return wandb_run
    warn(f"wandb: {'; '.join(failures)}; training goes on without wandb")
    return None


def _unreachable(base_url: str) -> str | None:
    """Why the wandb host cannot be reached in PROBE_TIMEOUT_S seconds, or None when it answers.
    Behind a proxy only wandb itself can tell, so there is no probe then."""
    if any(os.environ.get(variable) for variable in PROXY_VARIABLES):
        return None
    parsed = urlparse(base_url)
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    try:
        socket.create_connection((parsed.hostname, port), timeout=PROBE_TIMEOUT_S).close()
    except OSError as error:
        return f"{parsed.hostname}:{port} cannot be reached ({error.strerror or error})"
    return None


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
