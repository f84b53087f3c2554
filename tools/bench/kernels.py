"""Fused kernels against PyTorch eager and torch.compile: GPU time, bandwidth, peak memory.

    python tools/bench/kernels.py                 # CUDA: the 1B and 8B shapes
    python tools/bench/kernels.py --sizes 8b --kernels rmsnorm cross_entropy
    python tools/bench/kernels.py --no-compile    # skip torch.compile (it takes a while per shape)
    python tools/bench/kernels.py --json out.json # the rows also as JSON, rewritten after each row
    python tools/bench/kernels.py --device cpu --sizes tiny   # the CPU path (PyTorch only; Triton's
                                                  # interpreter too where TRITON_INTERPRET=1)

Shapes: one micro-batch of --tokens tokens (default 4 x 2048) of `1b`, the throughput
bench's 1B model (the llama-1b preset: hidden 2048, FFN 5632, 32 heads / 4 key-value
groups, vocabulary 32,000), and of `8b`, Llama 3 8B (hidden 4096, FFN 14336, 32 / 8,
vocabulary 128,256); `tiny` is a toy shape for tests. Without a GPU, 1b and 8b are a
scaled-down pair (`1b/16`, `8b/16`).

For every kernel (RMSNorm, LayerNorm, rotary q+k, SwiGLU, cross-entropy) and size, forward
+ backward of each implementation: `triton` (megalite's kernel), `eager` (its PyTorch
reference), `compile` (torch.compile of that reference) and, when the liger_kernel package
is importable, `liger` (Liger-Kernel's, on its own copies of the inputs in its own layout).
Columns:
- GPU ms: on CUDA, GPU time. The forward + backward closure, on static inputs and output
  grads, is warmed up on a side stream and captured in a CUDA graph (torch.cuda.graph);
  its replays are timed with CUDA events, the L2 cache flushed before each, and the
  median of up to --repeats replays is shown. Where capture fails (a host sync inside,
  say), the kernels' own time from torch.profiler is used instead (median over 5 sessions
  of the per-call sum of CUDA kernel times). `timer` says which: graph or profiler (or wall
  where the profiler saw no kernels either). On a CPU: the wall time (`timer` wall, or
  interpreter for Triton's interpreter);
- wall ms: the median wall time of one eager call (Python, launches and the GPU drained
  at both ends), beside the GPU time;
- GB/s: the kernel's minimum traffic (each input and output read or written once,
  forward and backward; see `minimum_bytes`) over the GPU time;
- % copy: GB/s over the device-to-device copy bandwidth measured in the same run (a
  1 GiB copy timed like the kernels; read + write);
- vs eager / vs compile: the eager (compile) GPU time over this row's;
- peak MB: the most memory allocated during one forward + backward above what was
  allocated before (inputs excluded; not measured in Triton's interpreter).
A summary then puts each kernel's GPU times side by side, one column per implementation.

Then the fused output layer + cross-entropy (`--fused-output-cross-entropy`) against the
unfused output layer + cross-entropy (megalite's, PyTorch's, and PyTorch's under
torch.compile; Liger's fused linear cross-entropy when installed): GPU time, wall time and
peak memory, with the ratio of peaks (target: at most 1/4 at the large shapes).

Peak memory on a CPU comes from the PyTorch profiler's memory timeline.
"""

import argparse
import contextlib
import json
import math
import statistics
import sys
import time
from dataclasses import dataclass

import torch

from megalite import kernels
from megalite.config import model_config_from_preset
from megalite.kernels.layernorm import layer_norm, layer_norm_reference
from megalite.kernels.linear_cross_entropy import CHUNK_ELEMENTS, linear_cross_entropy
from megalite.kernels.rmsnorm import rms_norm, rms_norm_reference
from megalite.kernels.rotary import apply_rotary, apply_rotary_reference
from megalite.kernels.swiglu import swiglu, swiglu_reference
from megalite.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy

MB = 2 ** 20
DEFAULT_TOKENS = 4 * 2048  # micro-batch 4 x sequence 2048, as the throughput bench's 1B config
FLUSH_BYTES = 256 * MB  # zeroed before each timed replay: larger than any GPU's L2 cache
TIME_BUDGET_MS = 1000.0  # per row: fewer repeats where one call is slow (at least MIN_REPEATS)
MIN_REPEATS = 10


@dataclass(frozen=True)
class ModelShape:
    """The dimensions a kernel sees in one micro-batch of `tokens` tokens."""
    name: str
    hidden: int
    ffn: int
    heads: int
    groups: int
    vocab: int
    tokens: int


def preset_shape(name: str, preset: str, tokens: int) -> ModelShape:
    config = model_config_from_preset(preset)
    return ModelShape(name, config.hidden_size, config.ffn_hidden_size, config.num_attention_heads,
                      config.query_groups, config.real_vocab_size, tokens)


def gpu_shapes(tokens: int = DEFAULT_TOKENS) -> dict:
    """The throughput bench's 1B (llama-1b) and Llama 3 8B, `tokens` tokens each, and the test shape."""
    return {"1b": preset_shape("1b", "llama-1b", tokens), "8b": preset_shape("8b", "llama3-8b", tokens),
            "tiny": TINY}


TINY = ModelShape("tiny", hidden=64, ffn=96, heads=4, groups=2, vocab=3000, tokens=128)
GPU_SHAPES = gpu_shapes()
# Without a GPU: a scaled-down pair (1024 tokens, hidden / 4, vocabulary 32000), and the test shape.
CPU_SHAPES = {"1b": ModelShape("1b/16", 512, 2048, 8, 2, 32000, 1024),
              "8b": ModelShape("8b/16", 1024, 3584, 8, 2, 32000, 1024),
              "tiny": TINY}


def _inputs(kernel: str, shape: ModelShape, dtype, device):
    """(inputs needing grad, other inputs, grad of the output(s)) for one kernel."""
    def randn(*size, grad=True, dtype=dtype):
        return torch.randn(*size, dtype=dtype, device=device).requires_grad_(grad)
    tokens, hidden, head_dim = shape.tokens, shape.hidden, shape.hidden // shape.heads
    if kernel in ("rmsnorm", "layernorm"):
        x, weight = randn(tokens, hidden), randn(hidden)
        leaves = [x, weight] + ([randn(hidden)] if kernel == "layernorm" else [])
        return leaves, [], [randn(tokens, hidden, grad=False)]
    if kernel == "rotary":
        q, k = randn(tokens, 1, shape.heads, head_dim), randn(tokens, 1, shape.groups, head_dim)
        angles = torch.rand(tokens, 1, 1, head_dim // 2, device=device) * 100
        angles = torch.cat([angles, angles], dim=-1)
        return [q, k], [angles.cos(), angles.sin()], [torch.randn_like(q), torch.randn_like(k)]
    if kernel == "swiglu":
        return [randn(tokens, 2 * shape.ffn)], [], [randn(tokens, shape.ffn, grad=False)]
    if kernel == "cross_entropy":
        labels = torch.randint(0, shape.vocab, (tokens,), device=device)
        return [randn(tokens, shape.vocab)], [labels], [torch.rand(tokens, device=device)]
    raise ValueError(kernel)


def _element_bytes(dtype) -> int:
    return torch.finfo(dtype).bits // 8


def minimum_bytes(kernel: str, shape: ModelShape, dtype) -> int:
    """Bytes a perfect fused forward + backward must move (weights and per-row stats neglected)."""
    e, tokens = _element_bytes(dtype), shape.tokens
    if kernel in ("rmsnorm", "layernorm"):
        return 5 * tokens * shape.hidden * e  # fwd: x, y; bwd: dy, x, dx
    if kernel == "rotary":
        qk = tokens * (shape.heads + shape.groups) * (shape.hidden // shape.heads)
        return 4 * qk * e  # fwd: q k in and out; bwd: dq dk in and out
    if kernel == "swiglu":
        return 8 * tokens * shape.ffn * e  # fwd: x (2f), y (f); bwd: dy (f), x (2f), dx (2f)
    if kernel == "cross_entropy":
        return 3 * tokens * shape.vocab * e  # fwd: logits; bwd: logits, dlogits
    raise ValueError(kernel)


IMPLEMENTATIONS = {  # kernel -> (dispatching function, taking `kernels=` the --kernels mode; PyTorch reference)
    "rmsnorm": (lambda x, w, kernels="auto": rms_norm(x, w, 1e-5, kernels),
                lambda x, w: rms_norm_reference(x, w, 1e-5)),
    "layernorm": (lambda x, w, b, kernels="auto": layer_norm(x, w, b, 1e-5, kernels),
                  lambda x, w, b: layer_norm_reference(x, w, b, 1e-5)),
    "rotary": (apply_rotary, apply_rotary_reference),
    "swiglu": (swiglu, swiglu_reference),
    "cross_entropy": (lambda z, y, kernels="auto": vocab_parallel_cross_entropy(z, y, None, 0, kernels=kernels),
                      lambda z, y: torch.nn.functional.cross_entropy(z.float(), y, reduction="none")),
}


@dataclass
class Implementation:
    """One column: `function(*leaves, *others)`; `mode`: the --kernels mode it runs under, passed as
    `kernels=mode` (None: not passed); `adapt(leaves, others, grads) -> (leaves, others, grads)`: its own inputs (another library's layout)."""
    name: str
    function: object
    mode: str | None = None
    adapt: object = None


@dataclass
class Measurement:
    gpu_ms: float  # GPU time on CUDA (graph replay or profiler), wall time on a CPU
    timer: str  # graph, profiler, wall or interpreter
    wall_ms: float
    peak_mb: float
    note: str | None = None  # why the graph capture failed, if it did


# ---------------------------------------------------------------------------------------------- Liger-Kernel


def _fresh(tensors):
    """Copies of `tensors` with the same requires_grad (another library may write into its inputs)."""
    return [t.detach().clone().requires_grad_(t.requires_grad) for t in tensors]


def _liger_rotary_layout(x):
    """`[s, 1, heads, d]` -> Liger/HF's `[1, heads, s, d]`, a view of the same `[1, s, heads, d]` memory."""
    return x.detach().clone().transpose(0, 1).transpose(1, 2).requires_grad_(x.requires_grad)


def _liger_swiglu_inputs(leaves, others, grads):
    (x,) = leaves
    half = x.shape[-1] // 2
    gate, up = (part.detach().clone(memory_format=torch.contiguous_format).requires_grad_()
                for part in (x[..., :half], x[..., half:]))
    return [gate, up], [], _fresh(grads)


def _liger_rotary_inputs(leaves, others, grads):
    cos, sin = others
    tables = [t.reshape(1, t.shape[0], t.shape[-1]).contiguous() for t in (cos, sin)]  # [1, s, d]
    return ([_liger_rotary_layout(t) for t in leaves], tables,
            [_liger_rotary_layout(t).detach() for t in grads])


def _liger_cross_entropy_inputs(leaves, others, grads):
    # Liger's cross-entropy returns the mean loss (its grad is made in the forward): a scalar grad of 1.
    return _fresh(leaves), others, [torch.ones((), dtype=torch.float32, device=leaves[0].device)]


def liger_implementations() -> tuple[dict, str]:
    """(kernel -> Implementation, a note for the header): Liger-Kernel's functions where importable."""
    try:
        from liger_kernel.transformers.functional import (liger_cross_entropy, liger_layer_norm, liger_rms_norm,
                                                          liger_rope, liger_swiglu)
    except Exception as error:  # not installed, or an API this bench does not know
        return {}, f"no liger column: liger_kernel not importable ({type(error).__name__}: {error})"
    fresh = lambda leaves, others, grads: (_fresh(leaves), others, _fresh(grads))  # noqa: E731
    return {
        "rmsnorm": Implementation("liger", lambda x, w: liger_rms_norm(x, w, 1e-5), adapt=fresh),
        "layernorm": Implementation("liger", lambda x, w, b: liger_layer_norm(x, w, b, 1e-5), adapt=fresh),
        "rotary": Implementation("liger", lambda q, k, cos, sin: tuple(liger_rope(q, k, cos, sin))[:2],
                                 adapt=_liger_rotary_inputs),
        "swiglu": Implementation("liger", liger_swiglu, adapt=_liger_swiglu_inputs),
        "cross_entropy": Implementation("liger", lambda z, y: liger_cross_entropy(z, y),
                                        adapt=_liger_cross_entropy_inputs),
    }, "liger column: Liger-Kernel (its inputs copied into its layout; its cross-entropy takes the mean loss)"


def liger_fused_linear_cross_entropy():
    """Liger's fused output layer + loss as a (hidden, weight, labels) -> mean loss function, or None."""
    try:
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy as fused
    except Exception:
        return None
    return lambda h, w, y: fused(h, w, y)


# ---------------------------------------------------------------------------------------------- timing


class PeakMemory:
    """Peak bytes allocated inside the block above the level at its start.

    CUDA: the caching allocator's peak. CPU: the PyTorch profiler's memory timeline (every
    tensor's allocation and free, in order; a private but long-standing torch API),
    replayed without the tensors that existed before the block.
    """

    def __init__(self, device):
        self.device, self.peak = device, 0

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            self.start = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        else:
            self.profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                                   record_shapes=True, profile_memory=True, with_stack=True)
            self.profiler.__enter__()
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated() - self.start
            return
        self.profiler.__exit__(*exc)
        from torch.profiler._memory_profiler import Action, MemoryProfileTimeline
        level = 0  # bytes allocated inside the block and still alive
        for _, action, (key, _), size in MemoryProfileTimeline(self.profiler._memory_profile()).timeline:
            if key.device.type != "cpu" or action in (Action.PREEXISTING, Action.INCREMENT_VERSION):
                continue  # tensors from before the block; a version bump is not an allocation
            level += size if action == Action.CREATE else -size
            self.peak = max(self.peak, level)


def _synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def make_step(function, leaves, others, grads, mode: str | None = None):
    """Forward + backward of `function` on fixed tensors, as one closure returning the input grads
    (torch.autograd.grad: nothing accumulates, so it can be called, captured and replayed at will).
    mode: the --kernels mode, passed as `kernels=mode` (None: not passed)."""
    options = {} if mode is None else {"kernels": mode}

    def step():
        outputs = function(*leaves, *others, **options)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        # (a library's loss may come in the logits' dtype: its scalar grad follows)
        output_grads = [g if g.dtype == o.dtype else g.to(o.dtype) for o, g in zip(outputs, grads)]
        return torch.autograd.grad(outputs, leaves, output_grads, allow_unused=True)
    return step


def _repeats_for(estimate_ms: float, repeats: int) -> int:
    """`repeats`, or fewer (MIN_REPEATS at least) where they would take over TIME_BUDGET_MS."""
    if estimate_ms <= 0:
        return repeats
    return max(min(repeats, MIN_REPEATS), min(repeats, int(TIME_BUDGET_MS / estimate_ms)))


def wall_ms(step, device, repeats: int) -> float:
    """Median wall ms of step() after two warm-up calls, the device drained before and after each."""
    for _ in range(2):
        step()
    times = []
    while len(times) < repeats:
        _synchronize(device)
        start = time.perf_counter()
        step()
        _synchronize(device)
        times.append((time.perf_counter() - start) * 1e3)
        if len(times) == 1:
            repeats = _repeats_for(times[0], repeats)
    return statistics.median(times)


def events_median_ms(function, repeats: int) -> float:
    """Median GPU ms of `function` (which launches work without syncing), by CUDA events around each
    call, with the L2 cache flushed before each (as triton.testing.do_bench does)."""
    flush = torch.empty(FLUSH_BYTES // 4, dtype=torch.int32, device="cuda")
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(3):
        function()
    end.record()
    torch.cuda.synchronize()
    repeats = _repeats_for(start.elapsed_time(end) / 3, repeats)
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
    for first, last in zip(starts, ends):
        flush.zero_()
        first.record()
        function()
        last.record()
    torch.cuda.synchronize()
    return statistics.median(first.elapsed_time(last) for first, last in zip(starts, ends))


def graph_replay_ms(step, repeats: int) -> float:
    """Median GPU ms of a CUDA-graph replay of step(): warm-up on a side stream, then one capture
    (PyTorch's recipe), inputs and output grads static; raises if step() cannot be captured."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):  # Triton / Inductor compilation, autotuning, cuBLAS workspaces: before capture
            step()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    static_grads = None
    try:
        # thread_local: the capture stops on this thread's unsafe calls (a host sync), not on other threads'
        with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
            static_grads = step()
        return events_median_ms(graph.replay, repeats)
    finally:
        del static_grads
        graph.reset()


def profiler_ms(step, repeats: int) -> float:
    """GPU ms of step() as the sum of its CUDA kernels' (and copies') times from torch.profiler: the
    median over 5 profiled sessions of the per-call mean. NaN if the profiler saw no CUDA activity."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    for _ in range(2):
        step()
    torch.cuda.synchronize()
    calls = max(1, repeats // 5)
    per_call = []
    for _ in range(5):
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as profiler:
            for _ in range(calls):
                step()
            torch.cuda.synchronize()
        device_us = sum(event.device_time_total for event in profiler.events() if event.device_type == DeviceType.CUDA)
        per_call.append(device_us / 1e3 / calls)
    ms = statistics.median(per_call)
    return ms if ms > 0 else float("nan")


def _reason(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0][:160] if lines else ''}"


def gpu_ms(step, repeats: int) -> tuple[float, str, str | None]:
    """(GPU ms of step(), "graph" or "profiler", why the capture failed or None)."""
    try:
        return graph_replay_ms(step, repeats), "graph", None
    except Exception as error:  # a host sync or other uncapturable call inside: time the kernels instead
        reason = _reason(error)
    with contextlib.suppress(Exception):
        torch.cuda.synchronize()  # a failed capture's errors are not sticky; drain what it left
    return profiler_ms(step, repeats), "profiler", reason


def peak_mb(step, device) -> float:
    with PeakMemory(device) as memory:
        step()
    return memory.peak / MB


def measure(function, leaves, others, grads, device, repeats: int, mode: str | None = None) -> Measurement:
    """Time (GPU on CUDA, wall on a CPU), wall time and peak memory of forward + backward of `function`."""
    step = make_step(function, leaves, others, grads, mode)
    wall = wall_ms(step, device, min(repeats, 20))  # also the warm-up: compilation happens here
    interpreter = device.type == "cpu" and mode == "triton"
    if device.type == "cuda":
        ms, timer, note = gpu_ms(step, repeats)
        if math.isnan(ms):  # neither a graph nor the profiler's kernel times: the wall time stands in
            ms, timer = wall, "wall"
    else:
        ms, timer, note = wall, "interpreter" if interpreter else "wall", None
    # The interpreter's memory is numpy's, not the kernel's (and profiling it takes minutes): no peak.
    peak = float("nan") if interpreter else peak_mb(step, device)
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the graph's pool and the row's blocks: not the next row's
    return Measurement(ms, timer, wall, peak, note)


def copy_bandwidth(device, dtype, nbytes: int) -> float:
    """GB/s of a device-to-device copy (bytes read + written): on CUDA the median of CUDA-event-timed
    copies (L2 flushed before each), elsewhere the best of five wall-timed copies."""
    source = torch.empty(nbytes // _element_bytes(dtype), dtype=dtype, device=device)
    target = torch.empty_like(source)
    if device.type == "cuda":
        return 2 * nbytes / (events_median_ms(lambda: target.copy_(source), 50) / 1e3) / 1e9
    best = float("inf")
    for _ in range(6):
        start = time.perf_counter()
        target.copy_(source)
        best = min(best, time.perf_counter() - start)
    return 2 * nbytes / best / 1e9


# ---------------------------------------------------------------------------------------------- the tables

HEADER = (f"{'kernel':14} {'size':6} {'impl':8} {'GPU ms':>9} {'timer':11} {'wall ms':>9} {'GB/s':>8} "
          f"{'% copy':>7} {'vs eager':>8} {'vs compile':>10} {'peak MB':>9}")


def measure_kernel(kernel, shape, dtype, device, implementations, repeats, notes=None) -> dict:
    """{implementation: Measurement} of one kernel at one shape; `implementations`: Implementation or
    (name, function) pairs. A failing liger row becomes a note (another library's code); any other
    failure raises."""
    leaves, others, grads = _inputs(kernel, shape, dtype, device)
    results = {}
    for implementation in implementations:
        if not isinstance(implementation, Implementation):
            implementation = Implementation(*implementation)
        inputs = (leaves, others, grads)
        try:
            if implementation.adapt is not None:
                inputs = implementation.adapt(*inputs)
            results[implementation.name] = measure(implementation.function, *inputs, device, repeats,
                                                   implementation.mode)
        except Exception as error:
            if implementation.name != "liger":
                raise
            if notes is not None:
                notes.append(f"{implementation.name} {kernel} {shape.name}: failed, no row ({_reason(error)})")
        finally:
            if implementation.name == "compile":
                torch._dynamo.reset()  # its graphs are for this shape only
    return results


def kernel_rows(kernel, shape, dtype, results: dict, bandwidth: float, notes=None) -> list[str]:
    """The table's lines for `measure_kernel`'s results (capture failures go to `notes`)."""
    eager_ms = results["eager"].gpu_ms if "eager" in results else None
    compile_ms = results["compile"].gpu_ms if "compile" in results else None
    lines = []
    for name, m in results.items():
        gbs = minimum_bytes(kernel, shape, dtype) / (m.gpu_ms / 1e3) / 1e9
        vs_eager = f"{eager_ms / m.gpu_ms:8.2f}" if eager_ms else f"{'-':>8}"
        vs_compile = f"{compile_ms / m.gpu_ms:10.2f}" if compile_ms else f"{'-':>10}"
        lines.append(f"{kernel:14} {shape.name:6} {name:8} {m.gpu_ms:9.3f} {m.timer:11} {m.wall_ms:9.3f} {gbs:8.1f} "
                     f"{100 * gbs / bandwidth:6.1f}% {vs_eager} {vs_compile} {_mb(m.peak_mb)}")
        if m.note and notes is not None:
            notes.append(f"{name} {kernel} {shape.name}: CUDA-graph capture failed ({m.note}); "
                         f"timed by torch.profiler's kernel times")
    return lines


def bench_kernel(kernel, shape, dtype, device, implementations, repeats, bandwidth, notes=None) -> list[str]:
    """The table's lines of one kernel at one shape (measure_kernel, then kernel_rows)."""
    results = measure_kernel(kernel, shape, dtype, device, implementations, repeats, notes)
    return kernel_rows(kernel, shape, dtype, results, bandwidth, notes)


def bench_fused_output(shape, dtype, device, repeats, chunk_elements, compile_reference: bool = False,
                       liger: bool = False, notes=None):
    """{path: (GPU ms, peak MB, wall ms, timer)} for output layer + loss on `shape`: unfused with
    megalite's cross-entropy (as --kernels dispatches it), unfused with PyTorch's (eager, and compiled
    with `compile_reference`), fused, fused with its weight grad added into an fp32 main grad (no `[V, h]`
    grad: gradient-accumulation fusion, as training runs it), and Liger's fused linear cross-entropy (with
    `liger`, if importable)."""
    hidden = torch.randn(shape.tokens, shape.hidden, dtype=dtype, device=device, requires_grad=True)
    weight = (torch.randn(shape.vocab, shape.hidden, dtype=dtype, device=device) * 0.02).requires_grad_()
    labels = torch.randint(0, shape.vocab, (shape.tokens,), device=device)
    grad = torch.full((shape.tokens,), 1.0 / shape.tokens, device=device)
    torch_path = lambda h, w, y: torch.nn.functional.cross_entropy((h @ w.t()).float(), y, reduction="none")  # noqa
    paths = {
        "unfused": lambda h, w, y: vocab_parallel_cross_entropy(h @ w.t(), y, None, 0),
        "unfused-torch": torch_path,
        "fused": lambda h, w, y: linear_cross_entropy(h, w, y, chunk_elements=chunk_elements),
    }
    # As training runs it (gradient-accumulation fusion): the weight grad added into a standing fp32 main grad.
    into_main_grad = weight.detach().clone().requires_grad_()
    into_main_grad.main_grad = torch.zeros(weight.shape, dtype=torch.float32, device=device)
    into_main_grad.add_to_main_grad = lambda add: add(into_main_grad.main_grad)
    paths["fused-main-grad"] = lambda h, w, y: linear_cross_entropy(h, w, y, chunk_elements=chunk_elements,
                                                                    weight_used_once=True)
    if compile_reference:
        paths["unfused-compile"] = torch.compile(torch_path, dynamic=False)
    liger_function = liger_fused_linear_cross_entropy() if liger else None
    if liger_function is not None:
        paths["liger-fused"] = liger_function
    results = {}
    for name, function in paths.items():
        inputs = ([hidden, into_main_grad if name == "fused-main-grad" else weight], [labels], [grad])
        if name == "liger-fused":  # the mean loss, on its own copies (Liger writes grads during its forward)
            inputs = (_fresh([hidden, weight]), [labels], [torch.ones((), device=device)])
        try:
            m = measure(function, *inputs, device, repeats)
        except Exception as error:
            if name != "liger-fused":
                raise
            if notes is not None:
                notes.append(f"liger-fused {shape.name}: failed, no row ({_reason(error)})")
            continue
        if name == "unfused-compile":
            torch._dynamo.reset()
        if m.note and notes is not None:
            notes.append(f"{name} {shape.name}: CUDA-graph capture failed ({m.note}); timed by torch.profiler")
        results[name] = (m.gpu_ms, m.peak_mb, m.wall_ms, m.timer)
    return results


def _mb(value: float) -> str:
    return f"{'-':>9}" if math.isnan(value) else f"{value:9.1f}"  # NaN: not measured


def write_json(path: str | None, record: dict) -> None:
    """--json: the rows measured so far, rewritten after each (a run cut short keeps them); NaN (not measured)
    becomes null, as JSON has no NaN."""
    if path is None:
        return
    rows = {part: [{key: None if isinstance(value, float) and math.isnan(value) else value
                    for key, value in row.items()} for row in record[part]] for part in ("kernels", "fused_output")}
    with open(path, "w") as file:
        json.dump({**record, **rows}, file, indent=1)


def print_summary(summary: dict, columns: list) -> None:
    """GPU ms per kernel and size, one column per implementation."""
    print("\nGPU ms of forward + backward (on a CPU: wall ms), by implementation; GB/s in the table above")
    print(f"{'kernel':14} {'size':6} " + " ".join(f"{name:>9}" for name in columns)
          + f" {'triton/eager':>12} {'triton/compile':>14}")
    for (kernel, size), results in summary.items():
        cells = " ".join(f"{results[name].gpu_ms:9.3f}" if name in results else f"{'-':>9}" for name in columns)
        ratios = [f"{results[name].gpu_ms / results['triton'].gpu_ms:.2f}x" if "triton" in results and name in results
                  else "-" for name in ("eager", "compile")]
        print(f"{kernel:14} {size:6} {cells} {ratios[0]:>12} {ratios[1]:>14}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", choices=("1b", "8b", "tiny"), default=["1b", "8b"])
    parser.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: cuda when torch sees one")
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default=None, help="default: bf16 on GPU, fp32 on CPU")
    parser.add_argument("--kernels", nargs="+", choices=sorted(IMPLEMENTATIONS), default=sorted(IMPLEMENTATIONS))
    parser.add_argument("--tokens", type=int, default=DEFAULT_TOKENS,
                        help="tokens per micro-batch at the GPU shapes 1b and 8b (default 4 x 2048)")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile rows")
    parser.add_argument("--no-liger", action="store_true", help="skip the Liger-Kernel rows even if installed")
    parser.add_argument("--no-fused-output", action="store_true", help="skip the fused output + cross-entropy part")
    parser.add_argument("--repeats", type=int, default=None,
                        help="timed calls per row: on GPU the most graph replays (default 100; fewer where they "
                             f"would take over {TIME_BUDGET_MS / 1e3:.0f} s) and up to 20 wall-timed calls; CPU: "
                             "default 3")
    parser.add_argument("--chunk-elements", type=int, default=None,
                        help=f"fused output + loss: logits per chunk (default {CHUNK_ELEMENTS} on GPU, 2^22 on "
                             f"CPU, where the shapes are 16x smaller)")
    parser.add_argument("--json", default=None, metavar="PATH",
                        help="also write every row to PATH as JSON (rewritten after each row)")
    args = parser.parse_args(argv)

    cuda = args.device == "cuda" if args.device else torch.cuda.is_available()
    if cuda and not torch.cuda.is_available():
        print("--device cuda asked for, but torch sees no GPU; use --device cpu", file=sys.stderr)
        return 2
    if args.tokens < 1 or (args.repeats is not None and args.repeats < 1):
        print("--tokens and --repeats must be at least 1", file=sys.stderr)
        return 2
    device = torch.device("cuda" if cuda else "cpu")
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype or ("bf16" if cuda else "fp32")]
    repeats = args.repeats or (100 if cuda else 3)
    shapes = gpu_shapes(args.tokens) if cuda else CPU_SHAPES
    torch.manual_seed(0)
    # Triton: on CUDA tensors as --kernels auto runs it (compiled: not with TRITON_INTERPRET=1); on a CPU only in
    # Triton's interpreter (TRITON_INTERPRET=1: tests; its times say nothing about a GPU).
    triton_mode = "triton" if not cuda and kernels.interpreting() else None
    with_triton = kernels.triton_available() and ((cuda and not kernels.interpreting()) or triton_mode is not None)
    if cuda and kernels.interpreting():
        print("TRITON_INTERPRET=1 on a GPU: Triton rows skipped (unset it to time the compiled kernels)")
    liger, liger_note = liger_implementations() if cuda and not args.no_liger else ({}, None)

    bandwidth = copy_bandwidth(device, dtype, (1 << 30) if cuda else (256 << 20))
    name = torch.cuda.get_device_name() if cuda else f"CPU, {torch.get_num_threads()} threads"
    print(f"device: {name}; torch {torch.__version__}; dtype {str(dtype).removeprefix('torch.')}; device-to-device "
          f"copy {bandwidth:.0f} GB/s (read + write; the % copy column's 100%)")
    if cuda:
        print(f"GPU ms: CUDA-graph replay of forward + backward, median of up to {repeats} replays, L2 flushed "
              f"before each (timer `profiler`: capture failed, CUDA kernel times from torch.profiler); wall ms: "
              f"median of up to 20 eager calls")
    else:
        print("no CUDA GPU: wall times; shapes scaled down; Triton rows "
              + ("in Triton's interpreter (TRITON_INTERPRET=1: correctness, not speed)" if with_triton else
                 "skipped (the interpreter is for tests, not timing; TRITON_INTERPRET=1 runs them)"))
    if liger_note:
        print(liger_note)
    print(HEADER)
    record = {"device": name, "dtype": str(dtype).removeprefix("torch."), "copy_gb_s": bandwidth, "kernels": [],
              "fused_output": []}
    notes, summary = [], {}
    columns = [c for c, on in (("triton", with_triton), ("eager", True), ("compile", not args.no_compile),
                               ("liger", bool(liger))) if on]
    for size in args.sizes:
        shape = shapes[size]
        for kernel in args.kernels:
            triton_function, reference = IMPLEMENTATIONS[kernel]
            implementations = [Implementation("eager", reference)]
            if not args.no_compile:
                implementations.append(Implementation("compile", torch.compile(reference, dynamic=False)))
            if with_triton:
                implementations.append(Implementation("triton", triton_function, mode=triton_mode))
            if kernel in liger:
                implementations.append(liger[kernel])
            results = measure_kernel(kernel, shape, dtype, device, implementations, repeats, notes)
            for line in kernel_rows(kernel, shape, dtype, results, bandwidth, notes):
                print(line, flush=True)
            record["kernels"] += [{"kernel": kernel, "size": shape.name, "impl": impl, "gpu_ms": m.gpu_ms,
                                   "timer": m.timer, "wall_ms": m.wall_ms, "peak_mb": m.peak_mb}
                                  for impl, m in results.items()]
            write_json(args.json, record)
            summary[(kernel, shape.name)] = results
    print_summary(summary, columns)
    for note in notes:
        print(f"note: {note}")
    if args.no_fused_output:
        return 0

    notes = []
    chunk_elements = args.chunk_elements or (CHUNK_ELEMENTS if cuda else 2 ** 22)
    print(f"\nfused output layer + cross-entropy ({chunk_elements} logits per chunk) vs the output layer then "
          f"megalite's cross-entropy (unfused; kernels: {'triton' if cuda and kernels.triton_available() else 'torch'})"
          f" or PyTorch's F.cross_entropy on fp32 logits (unfused-torch"
          + ("; unfused-compile: under torch.compile)" if not args.no_compile else ")")
          + ("; liger-fused: Liger's fused linear cross-entropy (mean loss)" if liger else "")
          + "; fused-main-grad: fused, its weight grad added into an fp32 main grad"
          + "; forward + backward, weight grad included")
    print(f"{'size':6} {'tokens':>6} {'hidden':>6} {'vocab':>7} {'path':15} {'GPU ms':>9} {'timer':11} {'wall ms':>9} "
          f"{'peak MB':>9} {'fused/this':>10}")
    worst, worst_main_grad = 0.0, 0.0
    for size in args.sizes:
        shape = shapes[size]
        results = bench_fused_output(shape, dtype, device, repeats, chunk_elements, not args.no_compile, bool(liger),
                                     notes)
        fused_peak, unfused_peak = results["fused"][1], results["unfused"][1]
        if unfused_peak > 0:
            worst = max(worst, fused_peak / unfused_peak)
            worst_main_grad = max(worst_main_grad, results["fused-main-grad"][1] / unfused_peak)
        for path, (ms, peak, wall, timer) in results.items():
            ratio = fused_peak / peak if peak > 0 else float("nan")
            print(f"{shape.name:6} {shape.tokens:6} {shape.hidden:6} {shape.vocab:7} {path:15} {ms:9.2f} {timer:11} "
                  f"{wall:9.2f} {peak:9.1f} {ratio:10.3f}", flush=True)
            record["fused_output"].append({"size": shape.name, "path": path, "gpu_ms": ms, "timer": timer,
                                           "wall_ms": wall, "peak_mb": peak})
        write_json(args.json, record)
    for note in notes:
        print(f"note: {note}")
    print(f"fused peak memory over the unfused path's, worst size: {worst:.3f}; with the weight grad into the fp32 "
          f"main grad (fused-main-grad): {worst_main_grad:.3f} (target at the GPU shapes: 0.25 or less)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
