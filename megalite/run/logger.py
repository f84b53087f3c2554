"""TrainingLogger: Megatron's log lines with throughput and MFU (megalite/run/flops.py), the metrics file
(megalite/run/metrics.py) and a progress bar."""

import math
import os
import resource
import sys
from dataclasses import dataclass
from typing import Callable

import torch

from megalite.config import ModelConfig
from megalite.run.flops import DTYPE_NAMES, flops_per_iteration, peak_flops
from megalite.run.metrics import MetricsFile, finite_or_none


def peak_memory_bytes(device) -> int:
    """Peak memory so far: the CUDA caching allocator's max allocated bytes on a GPU (tensors
    only, not the allocator's reserve); on a CPU the process's max resident set size."""
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    max_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(max_rss if sys.platform == "darwin" else max_rss * 1024)  # Linux reports KiB


PEAK_REMEASURES = 2  # log lines at which a CPU's peak is measured again (TrainingLogger._update_peak)
SPLITS = {"valid": "validation", "test": "test"}  # the metrics file's name -> the printed name


@dataclass
class _Interval:
    """What happened since the last training line."""

    iterations: int = 0
    seconds: float = 0.0
    tokens: int = 0
    flops: float = 0.0
    loss_sum: float = 0.0
    losses: int = 0
    skipped: int = 0
    nan: int = 0


class TrainingLogger:
    """Console lines, progress bar and metrics file of one training run: `log_iteration` after each
    iteration, `log_evaluation` after each evaluation, `close` at the end. Only the logging
    rank prints, measures a CPU peak or writes; elsewhere every method returns at once."""

    def __init__(self, config: ModelConfig, global_batch_size: int, seq_length: int, train_iters: int,
                 log_interval: int = 1, metrics_file: str | os.PathLike | None = None, *,
                 device="cpu", dtype: torch.dtype = torch.float32, num_devices: int = 1,
                 is_logging_rank: bool = True, progress_bar: bool | None = None,
                 peak: tuple[float | None, str] | None = None, print_fn: Callable[[str], None] | None = None):
        """num_devices: devices sharing the FLOPs (the world size). progress_bar: None shows one when the lines go
        to a terminal's stdout. peak: (FLOP/s or None, source) instead of `peak_flops(device, dtype)`. print_fn:
        where lines go (None: stdout, above the progress bar). `print` works at once; the rest waits for `start`."""
        self.config, self.global_batch_size = config, global_batch_size
        self.seq_length, self.train_iters = seq_length, train_iters
        self.log_interval = max(1, log_interval)
        self.device, self.dtype = torch.device(device), dtype
        self.num_devices = num_devices
        self.is_logging_rank = is_logging_rank
        self._metrics_file, self._progress_bar, self._peak = metrics_file, progress_bar, peak
        self._print_fn = print_fn
        self._interval = _Interval()
        self._sinks: list[Callable[[dict], None]] = []
        self._metrics = self._bar = None
        self.peak, self.peak_source = None, "not the logging rank"
        self._remeasures = 0  # log lines left at which a measured (CPU) peak is measured again

    def start(self, iteration: int = 0, evaluations=None) -> "TrainingLogger":
        """Open the metrics file, the progress bar and the peak FLOP/s for a run starting after `iteration`
        (a resumed run's, with the `evaluations` its checkpoint had logged at it: the metrics file's lines past
        them are dropped, `MetricsFile`), and print how throughput is computed; returns the logger."""
        if not self.is_logging_rank:
            return self
        peak = self._peak
        self.peak, self.peak_source = peak if peak is not None else peak_flops(self.device, self.dtype)
        if peak is None and self.device.type == "cpu":
            self._remeasures = PEAK_REMEASURES
        if self._metrics_file is not None:
            self._metrics = MetricsFile(self._metrics_file, iteration, evaluations)
            if self._metrics.dropped:
                self.print(f"metrics file {self._metrics.path}: dropped {self._metrics.dropped} line(s) after "
                           f"iteration {iteration}, which this run writes again")
            self._sinks.append(self._metrics.write)
        terminal = self._print_fn is None and sys.stdout.isatty()
        if self._progress_bar or (self._progress_bar is None and terminal):
            from tqdm import tqdm  # only terminals need it
            self._bar = tqdm(total=self.train_iters, initial=iteration, file=sys.stdout,
                             dynamic_ncols=True, unit="it", desc="training")
        self.print(self.startup_line())
        return self

    def add_sink(self, sink: Callable[[dict], None]) -> None:
        """Send every later metrics record (training and evaluation) to `sink(record)` too."""
        self._sinks.append(sink)  # records are made on the logging rank only

    def _emit(self, record: dict) -> None:
        for sink in self._sinks:
            sink(dict(record))  # a sink that edits its record (adds a prefix, say) affects no other

    def print(self, line: str) -> None:
        """Print one line on the logging rank, above the progress bar when there is one."""
        if not self.is_logging_rank:
            return
        if self._print_fn is not None:
            self._print_fn(line)
        elif self._bar is not None:
            self._bar.write(line, file=sys.stdout)  # clears the bar, prints, redraws it below
        else:
            print(line, flush=True)

    def startup_line(self) -> str:
        """One line describing how throughput and MFU are computed in this run."""
        name = (torch.cuda.get_device_name(self.device) if self.device.type == "cuda"
                else f"cpu ({torch.get_num_threads()} threads)")
        peak = "unknown" if self.peak is None else f"{self.peak / 1e12:.3f} TFLOP/s"
        recompute = (f", {self.config.recompute_granularity} recomputation not counted"
                     if self.config.recompute_granularity else "")
        flops = flops_per_iteration(self.config, self.global_batch_size, self.seq_length)
        return (f"throughput: {self.num_devices} x {name}, dtype {DTYPE_NAMES.get(self.dtype, self.dtype)} | "
                f"peak per device: {peak} ({self.peak_source}) | model FLOPs per iteration: {flops:.4E} "
                f"({self.global_batch_size} x {self.seq_length} tokens, 3 x forward{recompute}; docs/flops.md)")

    def log_iteration(self, iteration: int, consumed_samples: int, elapsed_s: float, lr: float,
                      lm_loss: float | None, loss_scale: float | None = 1.0, grad_norm: float | None = None,
                      *, skipped: bool = False, global_batch_size: int | None = None,
                      moe: dict | None = None) -> dict | None:
        """Record one finished iteration (1-based, as Megatron counts); every `log_interval` iterations and at
        `train_iters`, print and write a line of averages since the last one and return its record (else None).
        A `skipped` step's loss (fp16 overflow) stays out of the average; its time and tokens count. moe: an MoE
        model's routing values since the last line (model/moe.py's take_moe_statistics), added to line and record."""
        if not self.is_logging_rank:
            return None
        global_batch_size = global_batch_size or self.global_batch_size
        interval = self._interval
        interval.iterations += 1
        interval.seconds += elapsed_s
        interval.tokens += global_batch_size * self.seq_length
        interval.flops += flops_per_iteration(self.config, global_batch_size, self.seq_length)
        if skipped:
            interval.skipped += 1
        elif lm_loss is not None:
            # A NaN loss joins the average on purpose: the line must show it, not hide it.
            interval.nan += 0 if math.isfinite(lm_loss) else 1
            interval.loss_sum += lm_loss
            interval.losses += 1
        if self._bar is not None:
            self._bar.update(1)
        if not self.logs_at(iteration):
            return None
        mean_loss = interval.loss_sum / interval.losses if interval.losses else None
        seconds = max(interval.seconds, 1e-12)
        flops_per_device = interval.flops / seconds / self.num_devices
        self._update_peak(flops_per_device)
        record = {
            "iteration": iteration,
            "consumed_samples": consumed_samples,
            "lm_loss": finite_or_none(mean_loss),
            "lr": float(lr),
            "grad_norm": finite_or_none(grad_norm),
            "loss_scale": finite_or_none(loss_scale),
            "tokens_per_sec": interval.tokens / seconds,
            "tflops_per_device": flops_per_device / 1e12,
            "mfu": None if self.peak is None else flops_per_device / self.peak,
            "iteration_time_ms": 1000.0 * interval.seconds / interval.iterations,
            "mem_peak_bytes": peak_memory_bytes(self.device),
            **(moe or {}),
        }
        self.print(self._training_line(record, global_batch_size, mean_loss, loss_scale, grad_norm))
        if self._bar is not None and mean_loss is not None:
            self._bar.set_postfix(loss=f"{mean_loss:.4f}", refresh=False)
        self._emit(record)
        self._interval = _Interval()
        return record

    def logs_at(self, iteration: int) -> bool:
        """Whether `log_iteration` writes a line at `iteration` (on the logging rank)."""
        return iteration % self.log_interval == 0 or iteration >= self.train_iters

    def _update_peak(self, flops_per_device: float) -> None:
        """Keep the best peak seen, so that MFU never reads above 100%. A CPU's start-up matmul may share the
        cores with other work and read low (docs/benchmarks.md): the peak is measured again at the first
        PEAK_REMEASURES log lines, and an interval faster than the peak raises it."""
        if self._remeasures:
            self._remeasures -= 1
            measured, _ = peak_flops(self.device, self.dtype)
            if measured is not None and measured > self.peak:
                self.print(f"CPU peak re-measured: {measured / 1e9:.1f} GFLOP/s (was {self.peak / 1e9:.1f}); MFU "
                           f"divides by the best peak seen")
                self.peak = measured
        if self.peak is not None and flops_per_device > self.peak:
            self.print(f"peak raised to this interval's {flops_per_device / 1e9:.1f} GFLOP/s per device (was "
                       f"{self.peak / 1e9:.1f}): the device did more than the peak said, so MFU reads 100%")
            self.peak = flops_per_device

    def _training_line(self, record: dict, global_batch_size: int, mean_loss: float | None,
                       loss_scale: float | None, grad_norm: float | None) -> str:
        """Megatron's iteration line, with tokens/s, TFLOP/s per device and MFU added. The losses and
        norms come apart from the record, which holds None for NaN: the console must show the NaN."""
        mfu = "unknown" if record["mfu"] is None else f"{100 * record['mfu']:.1f}%"
        parts = [
            f" iteration {record['iteration']:8d}/{self.train_iters:8d}",
            f" consumed samples: {record['consumed_samples']:12d}",
            f" elapsed time per iteration (ms): {record['iteration_time_ms']:.1f}",
            f" tokens/s: {record['tokens_per_sec']:.0f}",
            f" TFLOP/s per device: {record['tflops_per_device']:.3f}",
            f" MFU: {mfu}",
            f" learning rate: {record['lr']:.3E}",
            f" global batch size: {global_batch_size:5d}",
            f" lm loss: {'n/a' if mean_loss is None else format(mean_loss, '.6E')}",
        ]
        if loss_scale is not None:
            parts.append(f" loss scale: {loss_scale:.1f}")
        if grad_norm is not None:  # Megatron leaves it out when there is none (skipped step)
            parts.append(f" grad norm: {grad_norm:.3f}")
        if "tokens_per_expert_min" in record:  # an MoE model (Megatron's names for its losses)
            parts.append(f" load_balancing_loss: {record['load_balancing_loss']:.6E}")
            parts.append(f" z_loss: {record['z_loss']:.6E}")
            parts.append(f" tokens per expert (of the mean): min {record['tokens_per_expert_min']:.2f} max "
                         f"{record['tokens_per_expert_max']:.2f}")
        parts.append(f" number of skipped iterations: {self._interval.skipped:3d}")
        parts.append(f" number of nan iterations: {self._interval.nan:3d}")
        return " |".join(parts) + " |"

    def log_evaluation(self, iteration: int, split: str, lm_loss: float) -> dict | None:
        """Print Megatron's evaluation block for `split` ("valid" or "test") and write
        `{"iteration", "split", "lm_loss"}`; returns that record (None off the logging rank)."""
        if split not in SPLITS:
            raise ValueError(f"split must be one of {sorted(SPLITS)}, got {split!r}")
        if not self.is_logging_rank:
            return None
        perplexity = math.exp(lm_loss) if lm_loss < 700 else float("inf")  # exp overflows past ~709
        line = (f" {SPLITS[split]} loss at iteration {iteration} | lm loss value: {lm_loss:.6E} | "
                f"lm loss PPL: {perplexity:.6E} |")
        rule = "-" * len(line)
        self.print("\n".join((rule, line, rule)))
        record = {"iteration": iteration, "split": split, "lm_loss": finite_or_none(lm_loss)}
        self._emit(record)
        return record

    def close(self) -> None:
        """Close the progress bar and the metrics file; safe to call twice."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self._metrics is not None:
            self._sinks.remove(self._metrics.write)
            self._metrics.close()
            self._metrics = None
