"""Fused kernels against PyTorch eager and torch.compile: time, bandwidth, peak memory.

    python tools/bench/kernels.py                 # CUDA: 1B and 8B shapes; CPU: small shapes, PyTorch only
    python tools/bench/kernels.py --sizes 8b --dtype bf16
    python tools/bench/kernels.py --no-compile    # skip torch.compile (it takes a while per shape)

For every kernel (RMSNorm, LayerNorm, rotary q+k, SwiGLU, cross-entropy) and model size,
times forward + backward of each implementation and prints:
- ms: median wall time of forward + backward (CUDA events on a GPU);
- GB/s: the kernel's minimum traffic (each input and output read or written once,
  forward and backward; see `BYTES`) over that time;
- % peak: GB/s over the device's memory bandwidth, measured in the same run as the
  best of several large device-to-device copies (read + write);
- vs eager / vs compile: the eager time (compile time) over this row's time;
- peak MB: the most memory allocated during forward + backward above what was
  allocated before (inputs excluded).

Then the fused output layer + cross-entropy (`--fused-output-cross-entropy`) against
the unfused output layer + cross-entropy: time and peak memory, with the ratio of peaks
(target: at most 1/4 at the large shapes).

Without a CUDA GPU the Triton rows are skipped (Triton on CPU runs only in its
interpreter) and the shapes are scaled down; peak memory on CPU comes from the PyTorch
profiler's memory timeline.
"""

import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO_ROOT not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, REPO_ROOT)

import torch  # noqa: E402

from megalite import kernels  # noqa: E402
from megalite.kernels.layernorm import layer_norm, layer_norm_reference  # noqa: E402
from megalite.kernels.linear_cross_entropy import CHUNK_ELEMENTS, linear_cross_entropy  # noqa: E402
from megalite.kernels.rmsnorm import rms_norm, rms_norm_reference  # noqa: E402
from megalite.kernels.rotary import apply_rotary, apply_rotary_reference  # noqa: E402
from megalite.kernels.swiglu import swiglu, swiglu_reference  # noqa: E402
from megalite.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy  # noqa: E402

MB = 2 ** 20


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


# Llama 3.2 1B and Llama 3 8B at sequence 4096, micro-batch 1; CPU shapes are a scaled-down pair.
GPU_SHAPES = {"1b": ModelShape("1b", 2048, 8192, 32, 8, 128256, 4096),
              "8b": ModelShape("8b", 4096, 14336, 32, 8, 128256, 4096)}
CPU_SHAPES = {"1b": ModelShape("1b/16", 512, 2048, 8, 2, 32000, 1024),
              "8b": ModelShape("8b/16", 1024, 3584, 8, 2, 32000, 1024)}


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


IMPLEMENTATIONS = {  # kernel -> (dispatching function, PyTorch reference)
    "rmsnorm": (lambda x, w: rms_norm(x, w, 1e-5), lambda x, w: rms_norm_reference(x, w, 1e-5)),
    "layernorm": (lambda x, w, b: layer_norm(x, w, b, 1e-5), lambda x, w, b: layer_norm_reference(x, w, b, 1e-5)),
    "rotary": (apply_rotary, apply_rotary_reference),
    "swiglu": (swiglu, swiglu_reference),
    "cross_entropy": (lambda z, y: vocab_parallel_cross_entropy(z, y, None, 0),
                      lambda z, y: torch.nn.functional.cross_entropy(z.float(), y, reduction="none")),
}


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


def _step(function, leaves, others, grads):
    for leaf in leaves:
        leaf.grad = None
    outputs = function(*leaves, *others)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    torch.autograd.backward(outputs, grads)


def time_ms(function, leaves, others, grads, device, repeats: int) -> float:
    """Median ms of forward + backward after two warm-up calls."""
    for _ in range(2):
        _step(function, leaves, others, grads)
    times = []
    for _ in range(repeats):
        _synchronize(device)
        start = time.perf_counter()
        _step(function, leaves, others, grads)
        _synchronize(device)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def peak_mb(function, leaves, others, grads, device) -> float:
    for leaf in leaves:  # the previous call's grads are freed before, not inside, the measurement
        leaf.grad = None
    with PeakMemory(device) as memory:
        _step(function, leaves, others, grads)
    return memory.peak / MB


def copy_bandwidth(device, dtype, nbytes: int) -> float:
    """GB/s of the best of five device-to-device copies (bytes read + written)."""
    source = torch.empty(nbytes // _element_bytes(dtype), dtype=dtype, device=device)
    target = torch.empty_like(source)
    best = float("inf")
    for _ in range(6):
        _synchronize(device)
        start = time.perf_counter()
        target.copy_(source)
        _synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 2 * nbytes / best / 1e9


def bench_kernel(kernel, shape, dtype, device, implementations, repeats, bandwidth):
    leaves, others, grads = _inputs(kernel, shape, dtype, device)
    rows, eager_ms = [], None
    for name, function in implementations:
        ms = time_ms(function, leaves, others, grads, device, repeats)
        eager_ms = ms if name == "eager" else eager_ms
        rows.append((name, ms, peak_mb(function, leaves, others, grads, device)))
    compile_ms = next((ms for name, ms, _ in rows if name == "compile"), None)
    lines = []
    for name, ms, peak in rows:
        gbs = minimum_bytes(kernel, shape, dtype) / (ms / 1e3) / 1e9
        vs_compile = f"{compile_ms / ms:10.2f}" if compile_ms else f"{'-':>10}"
        lines.append(f"{kernel:14} {shape.name:6} {name:8} {ms:9.3f} {gbs:8.1f} {100 * gbs / bandwidth:7.1f}% "
                     f"{eager_ms / ms:8.2f} {vs_compile} {peak:9.1f}")
    return lines


def bench_fused_output(shape, dtype, device, repeats, chunk_elements):
    """{path: (ms, peak MB)} for output layer + loss on `shape`: unfused with megalite's
    cross-entropy (as --kernels dispatches it), unfused with PyTorch's, and fused."""
    hidden = torch.randn(shape.tokens, shape.hidden, dtype=dtype, device=device, requires_grad=True)
    weight = (torch.randn(shape.vocab, shape.hidden, dtype=dtype, device=device) * 0.02).requires_grad_()
    labels = torch.randint(0, shape.vocab, (shape.tokens,), device=device)
    grad = torch.full((shape.tokens,), 1.0 / shape.tokens, device=device)
    paths = {
        "unfused": lambda h, w, y: vocab_parallel_cross_entropy(h @ w.t(), y, None, 0),
        "unfused-torch": lambda h, w, y: torch.nn.functional.cross_entropy((h @ w.t()).float(), y, reduction="none"),
        "fused": lambda h, w, y: linear_cross_entropy(h, w, y, chunk_elements=chunk_elements),
    }
    return {name: (time_ms(function, [hidden, weight], [labels], [grad], device, repeats),
                   peak_mb(function, [hidden, weight], [labels], [grad], device))
            for name, function in paths.items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", choices=sorted(GPU_SHAPES), default=sorted(GPU_SHAPES))
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default=None, help="default: bf16 on GPU, fp32 on CPU")
    parser.add_argument("--kernels", nargs="+", choices=sorted(IMPLEMENTATIONS), default=sorted(IMPLEMENTATIONS))
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile rows")
    parser.add_argument("--repeats", type=int, default=None, help="timed calls per row (default: 20 GPU, 3 CPU)")
    parser.add_argument("--chunk-elements", type=int, default=None,
                        help=f"fused output + loss: logits per chunk (default {CHUNK_ELEMENTS} on GPU, 2^22 on "
                             f"CPU, where the shapes are 16x smaller)")
    args = parser.parse_args(argv)

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype or ("bf16" if cuda else "fp32")]
    repeats = args.repeats or (20 if cuda else 3)
    shapes = GPU_SHAPES if cuda else CPU_SHAPES
    torch.manual_seed(0)

    bandwidth = copy_bandwidth(device, dtype, (1 << 30) if cuda else (256 << 20))
    name = torch.cuda.get_device_name() if cuda else f"CPU, {torch.get_num_threads()} threads"
    print(f"device: {name}; dtype {str(dtype).removeprefix('torch.')}; copy bandwidth {bandwidth:.0f} GB/s "
          f"(the % peak column's 100%)")
    if not cuda:
        print("no CUDA GPU: Triton rows skipped (the interpreter is for tests, not timing); shapes scaled down")
    print(f"{'kernel':14} {'size':6} {'impl':8} {'ms':>9} {'GB/s':>8} {'% peak':>8} {'vs eager':>8} "
          f"{'vs compile':>10} {'peak MB':>9}")
    for size in args.sizes:
        shape = shapes[size]
        for kernel in args.kernels:
            triton_function, reference = IMPLEMENTATIONS[kernel]
            implementations = [("eager", reference)]
            if not args.no_compile:
                implementations.append(("compile", torch.compile(reference, dynamic=False)))
            if cuda and kernels.triton_available():
                kernels.set_kernels("triton")
                implementations.append(("triton", triton_function))
            for line in bench_kernel(kernel, shape, dtype, device, implementations, repeats, bandwidth):
                print(line, flush=True)
            torch._dynamo.reset()

    chunk_elements = args.chunk_elements or (CHUNK_ELEMENTS if cuda else 2 ** 22)
    print(f"\nfused output layer + cross-entropy ({chunk_elements} logits per chunk) vs the output layer then "
          f"megalite's cross-entropy (unfused; kernels: {'triton' if cuda and kernels.triton_available() else 'torch'})"
          f" or PyTorch's F.cross_entropy on fp32 logits (unfused-torch); forward + backward, weight grad included")
    print(f"{'size':6} {'tokens':>6} {'hidden':>6} {'vocab':>7} {'path':14} {'ms':>9} {'peak MB':>9} {'fused/this':>10}")
    worst = 0.0
    for size in args.sizes:
        shape = shapes[size]
        results = bench_fused_output(shape, dtype, device, repeats, chunk_elements)
        fused_peak = results["fused"][1]
        for path, (ms, peak) in results.items():
            ratio = fused_peak / peak if peak > 0 else float("nan")
            worst = max(worst, ratio) if path == "unfused" else worst
            print(f"{shape.name:6} {shape.tokens:6} {shape.hidden:6} {shape.vocab:7} {path:14} {ms:9.2f} {peak:9.1f} "
                  f"{ratio:10.3f}", flush=True)
    print(f"fused peak memory over the unfused path's, worst size: {worst:.3f} (target at the GPU shapes: 0.25 or less)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
