"""Training logs: Megatron's iteration line, the metrics JSONL, a progress bar, throughput and MFU.

Three parts, usable apart:

- `flops_per_iteration`: the model FLOPs of one training iteration, from an explicit
  formula (docs/flops.md works it through for llama2-7b).
- `peak_flops`: the dense peak FLOP/s of one device in the run's dtype, from an
  explicit table of GPU datasheet values, or measured by a matmul on a CPU. An unknown
  GPU gets None, and MFU is then printed as "unknown": never guessed.
- `TrainingLogger`: what the training loop calls once per iteration and after each
  evaluation. It prints Megatron-shaped lines, writes the metrics file of
  ARCHITECTURE.md ("Metrics file"), and shows a tqdm bar with an ETA on a terminal.

This module is `megalite.logging`; it never imports the standard `logging` module, and
with absolute imports `import logging` elsewhere still finds the standard one.
"""

import json
import math
import os
import re
import resource
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from megalite.config import ModelConfig

# ----------------------------------------------------------------------------- FLOPs


def forward_flops_per_token(config: ModelConfig, seq_length: int) -> tuple[float, float, float]:
    """Forward FLOPs per token: (layer matmuls, causal attention, output layer), summed over layers.

    One multiply-add is 2 FLOPs. Per layer, with h = hidden, a = heads, g = query groups,
    d = head dim, f = ffn hidden, s = seq_length:
      QKV projections 2·h·(a + 2g)·d, attention output 2·a·d·h,
      MLP fc1 2·h·f·(2 if SwiGLU else 1), fc2 2·f·h,
      attention scores and values 2·2·s·a·d halved for the causal mask = 2·s·a·d.
    Output layer: 2·h·V with V the padded vocabulary (the model computes those logits).
    Norms, activations, softmax, rotary and the embedding lookup are not matmuls and are
    left out, as in Megatron's and PaLM's counts.
    """
    hidden, heads, groups, head_dim = (config.hidden_size, config.num_attention_heads,
                                       config.query_groups, config.head_dim)
    ffn = config.ffn_hidden_size
    qkv = 2 * hidden * (heads + 2 * groups) * head_dim
    attention_output = 2 * heads * head_dim * hidden
    mlp = 2 * hidden * ffn * (2 if config.swiglu else 1) + 2 * ffn * hidden
    # Each query meets s keys for QK^T and s values for AV; causality halves that on average.
    attention = 2 * 2 * seq_length * heads * head_dim / 2
    logits = 2 * hidden * config.vocab_size
    return (config.num_layers * float(qkv + attention_output + mlp),
            config.num_layers * float(attention), float(logits))


def flops_per_iteration(config: ModelConfig, global_batch_size: int, seq_length: int,
                        include_recompute: bool = False) -> float:
    """Model FLOPs of one training iteration over `global_batch_size` x `seq_length` tokens.

    Training = forward + backward = 3 x forward (the backward computes gradients for
    both the inputs and the weights of every matmul, 2 x forward). This is the count
    MFU uses: recomputation is work the hardware does, not work the model needs, so it
    is left out by default. `include_recompute=True` gives hardware FLOPs instead: full
    recomputation adds one more forward of the transformer layers, selective
    recomputation one more forward of the attention scores and values.
    """
    layer_matmuls, attention, logits = forward_flops_per_token(config, seq_length)
    per_token = 3 * (layer_matmuls + attention + logits)
    if include_recompute and config.recompute_granularity == "full":
        per_token += layer_matmuls + attention
    elif include_recompute and config.recompute_granularity == "selective":
        per_token += attention
    return float(global_batch_size * seq_length) * per_token


# ----------------------------------------------------------------------------- peak FLOP/s


@dataclass(frozen=True)
class GpuPeak:
    """Dense (no sparsity) peak TFLOP/s of one GPU model; None where it has no such unit.

    words: whole words that must all appear in `torch.cuda.get_device_name()`
    (case-insensitive, split on spaces and hyphens); unless: words that must not.
    fp32 is the plain (non-tensor-core) rate; tf32 applies to fp32 matmuls when TF32 is on.
    """

    words: tuple[str, ...]
    bf16: float | None
    fp16: float | None
    tf32: float | None
    fp32: float
    source: str
    unless: tuple[str, ...] = ()


# First match wins, so a variant comes before the family word it contains. Datasheets
# quote tensor-core rates "with sparsity"; the dense rates here are half of those.
GPU_PEAKS: tuple[GpuPeak, ...] = (
    # NVIDIA H100 datasheet: PCIe 1,513 BF16/FP16 and 756 TF32 (sparse), 51 FP32.
    GpuPeak(("H100", "PCIe"), 756.0, 756.0, 378.0, 51.0, "NVIDIA H100 PCIe datasheet"),
    # NVIDIA H100 datasheet: NVL 1,671 BF16/FP16 and 835 TF32 (sparse), 60 FP32.
    GpuPeak(("H100", "NVL"), 835.5, 835.5, 417.5, 60.0, "NVIDIA H100 NVL datasheet"),
    # NVIDIA H100 datasheet: SXM 1,979 BF16/FP16 and 989 TF32 (sparse), 67 FP32.
    # The SXM part reports itself as "NVIDIA H100 80GB HBM3".
    GpuPeak(("H100", "HBM3"), 989.5, 989.5, 494.5, 67.0, "NVIDIA H100 SXM datasheet"),
    GpuPeak(("H100", "SXM"), 989.5, 989.5, 494.5, 67.0, "NVIDIA H100 SXM datasheet"),
    # NVIDIA GH200 datasheet: the same Hopper GPU as H100 SXM.
    GpuPeak(("GH200",), 989.5, 989.5, 494.5, 67.0, "NVIDIA GH200 datasheet"),
    # NVIDIA H200 datasheet: NVL 1,671 BF16/FP16 and 835 TF32 (sparse), 60 FP32.
    GpuPeak(("H200", "NVL"), 835.5, 835.5, 417.5, 60.0, "NVIDIA H200 NVL datasheet"),
    # NVIDIA H200 datasheet: SXM 1,979 BF16/FP16 and 989 TF32 (sparse), 67 FP32.
    GpuPeak(("H200",), 989.5, 989.5, 494.5, 67.0, "NVIDIA H200 SXM datasheet"),
    # NVIDIA A100 datasheet: 312 BF16/FP16, 156 TF32 (dense), 19.5 FP32; SXM and PCIe alike.
    GpuPeak(("A100",), 312.0, 312.0, 156.0, 19.5, "NVIDIA A100 datasheet"),
    # AWS A10G (g5 instances): 70 BF16/FP16 and 35 TF32 tensor, 35 FP32 (80 SMs, half-rate
    # FP32-accumulate tensor cores, unlike the A10).
    GpuPeak(("A10G",), 70.0, 70.0, 35.0, 35.0, "AWS A10G specification"),
    # NVIDIA A10 datasheet: 250 BF16/FP16 and 125 TF32 (sparse), 31.2 FP32.
    GpuPeak(("A10",), 125.0, 125.0, 62.5, 31.2, "NVIDIA A10 datasheet"),
    # NVIDIA L40S datasheet: 733 BF16/FP16 and 366 TF32 (sparse), 91.6 FP32.
    GpuPeak(("L40S",), 362.05, 362.05, 183.0, 91.6, "NVIDIA L40S datasheet"),
    # NVIDIA L40 datasheet: 362.1 BF16/FP16 and 181 TF32 (sparse), 90.5 FP32.
    GpuPeak(("L40",), 181.05, 181.05, 90.5, 90.5, "NVIDIA L40 datasheet"),
    # NVIDIA L4 datasheet: 242 BF16/FP16 and 120 TF32 (sparse), 30.3 FP32.
    GpuPeak(("L4",), 121.0, 121.0, 60.0, 30.3, "NVIDIA L4 datasheet"),
    # NVIDIA Ada Lovelace whitepaper, RTX 4090: 165.2 BF16/FP16 with FP32 accumulate
    # (what PyTorch uses), 82.6 TF32 (dense), 82.6 FP32. The 4090 D is a smaller chip.
    GpuPeak(("RTX", "4090"), 165.2, 165.2, 82.6, 82.6, "NVIDIA Ada Lovelace whitepaper",
            unless=("D",)),
    # NVIDIA V100 datasheet: 125 (SXM2) / 112 (PCIe) / 130 (V100S) FP16 tensor, no BF16 or
    # TF32 units; 15.7 / 14 / 16.4 FP32.
    GpuPeak(("V100", "SXM2"), None, 125.0, None, 15.7, "NVIDIA V100 datasheet"),
    GpuPeak(("V100", "PCIE"), None, 112.0, None, 14.0, "NVIDIA V100 datasheet"),
    GpuPeak(("V100S",), None, 130.0, None, 16.4, "NVIDIA V100S datasheet"),
    # NVIDIA T4 datasheet: 65 FP16 tensor, 8.1 FP32.
    GpuPeak(("T4",), None, 65.0, None, 8.1, "NVIDIA T4 datasheet"),
    # AMD Instinct MI300X datasheet: 1,307.4 BF16/FP16 and 653.7 TF32 (dense), 163.4 FP32 matrix.
    GpuPeak(("MI300X",), 1307.4, 1307.4, 653.7, 163.4, "AMD Instinct MI300X datasheet"),
)

DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def find_gpu_peak(device_name: str) -> GpuPeak | None:
    """The first GPU_PEAKS entry whose words all appear in `device_name` (and none of its `unless`)."""
    words = {word.upper() for word in re.split(r"[\s\-_]+", device_name) if word}
    for entry in GPU_PEAKS:
        if ({w.upper() for w in entry.words} <= words
                and not {w.upper() for w in entry.unless} & words):
            return entry
    return None


def gpu_peak_flops(device_name: str, dtype: torch.dtype, tf32: bool = False) -> tuple[float | None, str]:
    """(dense peak FLOP/s or None, where it comes from) for a GPU named `device_name`.

    tf32: whether fp32 matmuls run on TF32 tensor cores; they then use the TF32 peak.
    """
    entry = find_gpu_peak(device_name)
    if entry is None:
        return None, f"{device_name!r} is not in megalite.logging.GPU_PEAKS: MFU unknown"
    kind = DTYPE_NAMES.get(dtype, str(dtype))
    if dtype == torch.float32 and tf32 and entry.tf32 is not None:
        tflops, kind = entry.tf32, "tf32"
    else:
        tflops = {"bf16": entry.bf16, "fp16": entry.fp16, "fp32": entry.fp32}.get(kind)
    if tflops is None:
        return None, f"{device_name}: no dense {kind} peak in GPU_PEAKS ({entry.source}): MFU unknown"
    return tflops * 1e12, f"{device_name}: {tflops:g} TFLOP/s dense {kind} ({entry.source})"


def cuda_tf32_enabled() -> bool:
    """Whether fp32 CUDA matmuls may use TF32 (PyTorch's new flag, else the legacy one)."""
    precision = getattr(torch.backends.cuda.matmul, "fp32_precision", "none")
    if precision != "none":
        return precision == "tf32"
    try:
        return bool(torch.backends.cuda.matmul.allow_tf32)
    except RuntimeError:  # torch refuses to answer when the legacy and new flags were mixed
        return False


def measure_cpu_flops(dtype: torch.dtype = torch.float32, size: int = 1024, seconds: float = 0.5) -> float:
    """FLOP/s of `size`^3 matmuls in `dtype` on this process's threads, timed for about `seconds`."""
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(size, size, generator=generator).to(dtype)
    b = torch.randn(size, size, generator=generator).to(dtype)
    torch.mm(a, b)  # first call allocates and picks the kernel; keep it out of the timing
    count, start = 0, time.perf_counter()
    while True:
        torch.mm(a, b)
        count += 1
        elapsed = time.perf_counter() - start
        if elapsed >= seconds and count >= 2:
            return 2.0 * size ** 3 * count / elapsed


def peak_flops(device, dtype: torch.dtype, cpu_matmul_size: int = 1024,
               cpu_seconds: float = 0.5) -> tuple[float | None, str]:
    """(peak FLOP/s of one device in `dtype`, or None, and a sentence saying where it comes from).

    CUDA: the GPU_PEAKS entry of `torch.cuda.get_device_name(device)`; an unlisted GPU
    gives None. CPU: no datasheet applies to "this many cores of this machine", so a
    short matmul benchmark on the current thread count stands in for the peak; it is
    measured here, once per call (about `cpu_seconds`), in `dtype`, and for bf16/fp16 also
    in fp32, keeping the faster; only in fp32 on a CPU without units for `dtype`.
    """
    device = torch.device(device)
    if device.type == "cuda":
        return gpu_peak_flops(torch.cuda.get_device_name(device), dtype, tf32=cuda_tf32_enabled())
    if device.type == "cpu":
        name = DTYPE_NAMES.get(dtype, dtype)
        if not _cpu_has_matrix_units(dtype):
            # No bf16/fp16 units: such matmuls crawl (~1 GFLOP/s, seconds per 1024^3 product), so the
            # fp32 rate stands in for this CPU's best.
            value = measure_cpu_flops(torch.float32, cpu_matmul_size, cpu_seconds)
            source = f"a {cpu_matmul_size}^3 fp32 matmul (this CPU has no {name} matrix units)"
        else:
            value = measure_cpu_flops(dtype, cpu_matmul_size, cpu_seconds)
            source = f"a {cpu_matmul_size}^3 {name} matmul"
            if dtype != torch.float32:
                # The faster of the two keeps MFU below 100% where bf16 units are slow ones.
                fp32 = measure_cpu_flops(torch.float32, cpu_matmul_size, cpu_seconds)
                if fp32 > value:
                    value, source = fp32, f"a {cpu_matmul_size}^3 fp32 matmul (faster here than {source})"
        return value, (f"CPU peak measured by {source} at startup on {torch.get_num_threads()} threads: "
                       f"{value / 1e9:.1f} GFLOP/s")
    return None, f"no peak known for device type {device.type!r}: MFU unknown"


def _cpu_has_matrix_units(dtype: torch.dtype) -> bool:
    """Whether oneDNN has fast `dtype` matmul kernels on this CPU (fp32 always; bf16 / fp16 with
    AVX-512-BF16 / AMX / AVX-512-FP16)."""
    try:
        if dtype == torch.bfloat16:
            return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
        if dtype == torch.float16:
            return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    except (AttributeError, RuntimeError):  # a torch built without oneDNN: its fallback is the slow one
        return False
    return True


def peak_memory_bytes(device) -> int:
    """Peak memory so far: the CUDA caching allocator's max allocated bytes on a GPU (tensors
    only, not the allocator's reserve); on a CPU the process's max resident set size."""
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    max_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(max_rss if sys.platform == "darwin" else max_rss * 1024)  # Linux reports KiB


# ----------------------------------------------------------------------------- the logger

TRAINING_KEYS = ("iteration", "consumed_samples", "lm_loss", "lr", "grad_norm", "loss_scale",
                 "tokens_per_sec", "tflops_per_device", "mfu", "iteration_time_ms", "mem_peak_bytes")
EVALUATION_KEYS = ("iteration", "split", "lm_loss")
SPLITS = {"validation": "valid", "valid": "valid", "test": "test"}  # printed name / metrics name


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


def _finite_or_none(value):
    """NaN and inf become None, so every metrics line is strict JSON (jq, pandas)."""
    if value is None:
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def read_metrics_records(path: str) -> list[dict]:
    """The records of a metrics JSONL file (one per log line or evaluation), in file order.

    Each has an integer "iteration"; evaluations also have "split" ("valid" or "test").
    A missing file or a line that is not such a record is a UserError naming it.
    """
    from megalite.errors import UserError

    records = []
    try:
        with open(path, encoding="utf-8") as file:
            for number, line in enumerate(file, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                    record["iteration"] = int(record["iteration"])
                except (ValueError, KeyError, TypeError) as error:
                    raise UserError(f"{path} line {number} is not a metrics record ({error}); pass the "
                                    f"metrics.jsonl a megalite run wrote") from None
                records.append(record)
    except FileNotFoundError:
        raise UserError(f"{path} does not exist; pass the metrics file of a run (<save>/metrics.jsonl "
                        f"or --metrics-file)") from None
    return records


def _trim_metrics_file(path: Path, start_iteration: int) -> int:
    """Drop lines after `start_iteration` (and a torn last line); return how many were dropped.

    A run resumed from the checkpoint of iteration K writes iterations K+1... again, so
    the lines an earlier attempt wrote past K would otherwise appear twice. The file is
    rewritten atomically, and only when something has to go.
    """
    if not path.exists():
        return 0
    kept, dropped = [], 0
    for line in path.read_text().splitlines():
        try:
            keep = json.loads(line)["iteration"] <= start_iteration
        except (ValueError, KeyError, TypeError):
            keep = False  # a line cut short by a crash
        if keep:
            kept.append(line + "\n")
        else:
            dropped += 1
    if dropped:
        temporary = path.with_name(path.name + ".tmp")
        temporary.write_text("".join(kept))
        os.replace(temporary, path)
    return dropped


class TrainingLogger:
    """Console lines, progress bar and metrics file of one training run, with throughput and MFU.

    The training loop builds one on every rank and calls:

        logger = TrainingLogger(config, global_batch_size, seq_length, train_iters, log_interval,
                                metrics_file, device=device, dtype=params_dtype,
                                start_iteration=iteration)   # 0, or the iteration resumed from
        # after each iteration (iteration = iterations completed, from 1):
        logger.log_iteration(iteration, consumed_samples, elapsed_s, lr, lm_loss, loss_scale,
                             grad_norm, skipped=not updated)
        # after each evaluation:
        logger.log_evaluation(iteration, "valid", valid_loss)   # or "test"
        logger.close()   # at the end, also on errors (or use `with`)

    Only the logging rank, by default the last rank (the loss lives on the last pipeline
    stage), prints, measures a CPU peak or touches the metrics file; on the others every
    method returns at once. A wandb sink will be one `add_sink(fn)` call: each metrics
    record (the dict written as a JSON line) goes to every sink.
    """

    def __init__(self, config: ModelConfig, global_batch_size: int, seq_length: int, train_iters: int,
                 log_interval: int = 1, metrics_file: str | os.PathLike | None = None, *,
                 device="cpu", dtype: torch.dtype = torch.float32, num_devices: int | None = None,
                 is_logging_rank: bool | None = None, start_iteration: int = 0,
                 progress_bar: bool | None = None, peak: tuple[float | None, str] | None = None,
                 print_fn: Callable[[str], None] | None = None):
        """config: the model. global_batch_size, seq_length, train_iters: the run's (the batch
        size is `log_iteration`'s default: the final one under batch-size ramp-up).
        log_interval: a training line every this many iterations (and at train_iters).
        metrics_file: the JSONL path, or None for none.
        device, dtype: one device and the run's compute dtype, for the peak and memory.
        num_devices: devices sharing the job's FLOPs, for TFLOP/s per device; None: the
        torch.distributed world size (1 without it).
        is_logging_rank: None: the last rank of torch.distributed (True without it).
        start_iteration: 0, or the iteration a resumed run starts from; metrics lines past
        it are dropped (`_trim_metrics_file`).
        progress_bar: None shows a tqdm bar only when stdout is a terminal and lines go to it.
        peak: (FLOP/s or None, source) to use instead of `peak_flops(device, dtype)`.
        print_fn: where lines go (None or `print`: stdout).
        """
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        world_size = torch.distributed.get_world_size() if distributed else 1
        if is_logging_rank is None:
            is_logging_rank = not distributed or torch.distributed.get_rank() == world_size - 1
        self.config, self.global_batch_size = config, global_batch_size
        self.seq_length, self.train_iters = seq_length, train_iters
        self.log_interval = max(1, log_interval)
        self.device, self.dtype = torch.device(device), dtype
        self.num_devices = num_devices or world_size
        self.is_logging_rank = is_logging_rank
        self._print_fn = None if print_fn is print else print_fn
        self._interval = _Interval()
        self._sinks: list[Callable[[dict], None]] = []
        self._metrics = self._bar = None
        self.peak, self.peak_source = None, "not the logging rank"
        if not is_logging_rank:
            return
        self.peak, self.peak_source = peak if peak is not None else peak_flops(self.device, dtype)
        if metrics_file is not None:
            self._open_metrics_file(Path(metrics_file), start_iteration)
        if progress_bar is None:
            progress_bar = self._print_fn is None and sys.stdout.isatty()
        if progress_bar:
            from tqdm import tqdm  # only terminals need it
            self._bar = tqdm(total=train_iters, initial=start_iteration, file=sys.stdout,
                             dynamic_ncols=True, unit="it", desc="training")
        self.print(self.startup_line())

    # -- sinks

    def add_sink(self, sink: Callable[[dict], None]) -> None:
        """Send every later metrics record (training and evaluation) to `sink(record)` too."""
        if self.is_logging_rank:
            self._sinks.append(sink)

    def _open_metrics_file(self, path: Path, start_iteration: int) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        dropped = _trim_metrics_file(path, start_iteration)
        if dropped:
            self.print(f"metrics file {path}: dropped {dropped} line(s) after iteration {start_iteration}, "
                       f"which this run writes again")
        self._metrics = open(path, "a", encoding="utf-8")
        self._sinks.append(self._write_metrics_line)

    def _write_metrics_line(self, record: dict) -> None:
        self._metrics.write(json.dumps(record) + "\n")
        self._metrics.flush()  # a crash loses at most the line being written

    def _emit(self, record: dict) -> None:
        for sink in self._sinks:
            sink(dict(record))  # a sink that edits its record (adds a prefix, say) affects no other

    # -- console

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

    # -- training and evaluation

    def log_iteration(self, iteration: int, consumed_samples: int, elapsed_s: float, lr: float,
                      lm_loss: float | None, loss_scale: float | None = 1.0, grad_norm: float | None = None,
                      *, skipped: bool = False, global_batch_size: int | None = None,
                      force: bool = False) -> dict | None:
        """Record one finished iteration; every `log_interval` iterations print and write a line.

        iteration: iterations completed so far (1-based, as Megatron's). consumed_samples:
        samples consumed so far. elapsed_s: wall time of this iteration (synchronise the
        GPU before taking it). lm_loss: this iteration's mean loss over the global batch's
        tokens, a float. skipped: the optimizer skipped the step (fp16 overflow); its
        loss stays out of the average, its time and tokens count. global_batch_size: this
        iteration's, when batch-size ramp-up makes it differ from the constructor's.
        A line is due when `iteration % log_interval == 0`, at `train_iters`, or when
        `force`; it reports averages over the iterations since the last line and the
        current lr, loss scale and grad norm. Returns the metrics record (keys:
        TRAINING_KEYS) when a line was written, else None.
        """
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
        if not (force or iteration % self.log_interval == 0 or iteration >= self.train_iters):
            return None
        mean_loss = interval.loss_sum / interval.losses if interval.losses else None
        record = self._training_record(iteration, consumed_samples, lr, mean_loss, loss_scale, grad_norm)
        self.print(self._training_line(record, global_batch_size, mean_loss, loss_scale, grad_norm))
        if self._bar is not None and mean_loss is not None:
            self._bar.set_postfix(loss=f"{mean_loss:.4f}", refresh=False)
        self._emit(record)
        self._interval = _Interval()
        return record

    def _training_record(self, iteration, consumed_samples, lr, mean_loss, loss_scale, grad_norm) -> dict:
        """The metrics record of the interval that ends at `iteration` (keys: TRAINING_KEYS)."""
        interval = self._interval
        seconds = max(interval.seconds, 1e-12)
        flops_per_device = interval.flops / seconds / self.num_devices
        return {
            "iteration": iteration,
            "consumed_samples": consumed_samples,
            "lm_loss": _finite_or_none(mean_loss),
            "lr": float(lr),
            "grad_norm": _finite_or_none(grad_norm),
            "loss_scale": _finite_or_none(loss_scale),
            "tokens_per_sec": interval.tokens / seconds,
            "tflops_per_device": flops_per_device / 1e12,
            "mfu": None if self.peak is None else flops_per_device / self.peak,
            "iteration_time_ms": 1000.0 * interval.seconds / interval.iterations,
            "mem_peak_bytes": peak_memory_bytes(self.device),
        }

    def _training_line(self, record: dict, global_batch_size: int, mean_loss: float | None,
                       loss_scale: float | None, grad_norm: float | None) -> str:
        """Megatron's iteration line, with tokens/s, TFLOP/s per device and MFU added.

        The losses and norms come apart from the record: the record holds None for NaN
        (strict JSON), and the console must show the NaN.
        """
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
        parts.append(f" number of skipped iterations: {self._interval.skipped:3d}")
        parts.append(f" number of nan iterations: {self._interval.nan:3d}")
        return " |".join(parts) + " |"

    def log_evaluation(self, iteration: int, split: str, lm_loss: float) -> dict | None:
        """Print Megatron's evaluation block and write `{"iteration", "split", "lm_loss"}`.

        split: "validation" (or "valid") or "test"; the metrics file says "valid" / "test".
        lm_loss: the mean loss over the evaluated tokens. Returns the record (None off the
        logging rank).
        """
        if split not in SPLITS:
            raise ValueError(f"split must be one of {sorted(SPLITS)}, got {split!r}")
        if not self.is_logging_rank:
            return None
        printed = "validation" if SPLITS[split] == "valid" else "test"
        perplexity = math.exp(lm_loss) if lm_loss < 700 else float("inf")  # exp overflows past ~709
        line = (f" {printed} loss at iteration {iteration} | lm loss value: {lm_loss:.6E} | "
                f"lm loss PPL: {perplexity:.6E} |")
        rule = "-" * len(line)
        self.print("\n".join((rule, line, rule)))
        record = {"iteration": iteration, "split": SPLITS[split], "lm_loss": _finite_or_none(lm_loss)}
        self._emit(record)
        return record

    # -- lifetime

    def close(self) -> None:
        """Close the progress bar and the metrics file; safe to call twice."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self._metrics is not None:
            self._sinks.remove(self._write_metrics_line)
            self._metrics.close()
            self._metrics = None

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()
