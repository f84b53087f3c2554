"""The output layer's GEMMs with the logits' rows contiguous or padded, as megalite lays them out on a CPU.

    python tools/bench/logits_layout.py [--config A|B] [--rounds 12] [--threads 2] [--steps N]

A `[tokens, vocab]` logits matrix whose rows are a whole number of 4 KiB apart (config A:
8,192 fp32 columns, 32 KiB rows) maps the start of every row to the same cache sets, and
the GEMMs that write or read it lose time to their own evictions. megalite's output layer
writes the logits with one cache line of padding after each such row
(`megalite/cpu_allocator.py`, `padded_row_length`). This bench times the layer's three
GEMMs, forward `x W^T`, input grad `G W` and weight grad `G^T x` (tokens = micro-batch x
seq of the config), on both layouts in alternating rounds, and prints each GEMM's median
time and the median of the same-round ratios contiguous / padded (above 1: padding is
faster) with a 90% bootstrap interval. A config whose rows are not a multiple of 4 KiB
(B: 32,000 columns) is not padded, and the bench says so.

It then times the fused output layer + cross-entropy (`--fused-output-cross-entropy`,
forward and backward at the same shapes, PyTorch path), whose chunks of logits follow
the same rule, both ways.

`--steps N` also trains config A's (or B's) model: two compiled copies, N iterations each,
alternating, and prints the same-iteration ratio: what the layout is worth in a whole
training step. The contiguous runs (here and for the fused path) call
`megalite.cpu_allocator.set_row_padding(False)`.
"""

import argparse
import copy
import statistics
import time

import torch

from megalite.cpu_allocator import empty_padded_rows, padded_row_length, set_row_padding
from megalite.errors import run_main
from megalite.kernels import kernels_mode, linear_cross_entropy as fused_module, set_kernels
from tools.bench import train_throughput


def get_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", choices=("A", "B"), default="A", help="issue 10's config (shapes)")
    parser.add_argument("--rounds", type=int, default=12, help="alternating timed rounds of each layout")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=0,
                        help="also time N training iterations of two compiled models, padded against contiguous")
    return parser.parse_args(argv)


def gemms(x: torch.Tensor, weight: torch.Tensor, logits: torch.Tensor) -> dict:
    """name -> a closure running that GEMM of the output layer with `logits` `[tokens, vocab]` as its
    output (forward) or its grad operand (input and weight grads)."""
    grad_x = torch.empty_like(x)
    grad_weight = torch.empty_like(weight)
    return {"forward x W^T": lambda: torch.mm(x, weight.t(), out=logits),
            "input grad G W": lambda: torch.mm(logits, weight, out=grad_x),
            "weight grad G^T x": lambda: torch.mm(logits.t(), x, out=grad_weight)}


def time_gemms(tokens: int, hidden: int, vocab: int, rounds: int) -> dict:
    """(gemm, layout) -> seconds per round, layouts "contiguous" and "padded" alternating (each GEMM's
    buffers are laid out here, so the row-padding switch `alternate` turns does not touch them)."""
    generator = torch.Generator().manual_seed(0)
    x, weight = torch.randn(tokens, hidden, generator=generator), torch.randn(vocab, hidden, generator=generator)
    layouts = {}
    for layout in ("contiguous", "padded"):
        logits = empty_padded_rows(tokens, vocab, torch.float32, "cpu") if layout == "padded" else \
            torch.empty(tokens, vocab)
        layouts[layout] = gemms(x, weight, logits.normal_(generator=generator))
    times = {}
    for name in layouts["contiguous"]:
        pair = alternate({layout: closures[name] for layout, closures in layouts.items()}, rounds, warmup=1)
        times.update({(name, layout): seconds for layout, seconds in pair.items()})
    return times


def time_fused(tokens: int, hidden: int, vocab: int, rounds: int) -> dict:
    """layout -> seconds of the fused output layer + cross-entropy's forward and backward, alternating."""
    generator = torch.Generator().manual_seed(0)
    leaves = [(torch.randn(shape, generator=generator) * 0.02).requires_grad_() for shape in ((tokens, hidden),
                                                                                           (vocab, hidden))]
    labels = torch.randint(0, vocab, (tokens,), generator=generator)

    def forward_backward():
        for leaf in leaves:
            leaf.grad = None
        fused_module.linear_cross_entropy(*leaves, labels).mean().backward()

    mode = kernels_mode()
    set_kernels("torch")  # the chunks' math in PyTorch: what a CPU runs
    try:
        return alternate({"contiguous": forward_backward, "padded": forward_backward}, rounds, warmup=1)
    finally:
        set_kernels(mode)


def alternate(runs: dict, rounds: int, warmup: int) -> dict:
    """layout -> seconds of each call of `runs[layout]` ("contiguous" with row padding off), the
    layouts alternating round by round after `warmup` untimed calls each."""
    times = {layout: [] for layout in runs}
    try:
        for round_index in range(-warmup, rounds):
            for layout in (list(runs) if round_index % 2 == 0 else list(reversed(runs))):
                set_row_padding(layout != "contiguous")
                start = time.perf_counter()
                runs[layout]()
                if round_index >= 0:
                    times[layout].append(time.perf_counter() - start)
    finally:
        set_row_padding(True)
    return times


def ratio_text(slow: list[float], fast: list[float]) -> str:
    """The median of the same-round ratios slow / fast, with its 90% bootstrap interval."""
    ratios = [a / b for a, b in zip(slow, fast)]
    text = f"{statistics.median(ratios):.3f}"
    interval = train_throughput.median_interval(ratios)
    return text + (f" ({interval[0]:.3f}-{interval[1]:.3f})" if interval else "")


def time_steps(config_name: str, steps: int) -> dict:
    """layout -> seconds of each training iteration of the config's model, compiled, the two alternating."""
    args = train_throughput.get_args(["--config", config_name, "--dtype", "fp32"])
    config = train_throughput.build_config(args)
    model = train_throughput.build_model(config, args.seed, dtype=torch.float32).train()
    generator = torch.Generator().manual_seed(args.seed)
    shape = (args.micro_batch_size, config.seq_length)
    tokens = torch.randint(0, config.vocab_size, shape, generator=generator)
    batch = (tokens, tokens.roll(-1, dims=1), torch.arange(config.seq_length).expand(shape))
    # Two copies, so that each keeps its own recycled logits block and compiled graphs.
    runs = {layout: train_throughput.megalite_variant(copy.deepcopy(model), "compile", batch)
            for layout in ("contiguous", "padded")}
    return alternate(runs, steps, warmup=2)  # warm-up: compile, then one warm iteration


def report(name: str, times: dict, note: str = "") -> float:
    """Print one row (medians of both layouts, the same-round ratio); return that ratio's median."""
    contiguous, padded = times["contiguous"], times["padded"]
    print(f"{name:<20}{statistics.median(contiguous) * 1e3:>15.1f}{statistics.median(padded) * 1e3:>12.1f}"
          f"  {ratio_text(contiguous, padded)}{note}")
    return statistics.median(a / b for a, b in zip(contiguous, padded))


def main(argv=None) -> dict:
    train_throughput.set_up_allocator()  # before any tensor, as the throughput bench
    args = get_args(argv)
    torch.set_num_threads(args.threads)
    bench_args = train_throughput.get_args(["--config", args.config])
    config = train_throughput.build_config(bench_args)
    tokens, hidden, vocab = bench_args.micro_batch_size * config.seq_length, config.hidden_size, config.vocab_size
    row = padded_row_length(vocab, 4)
    print(f"torch {torch.__version__}, {args.threads} threads; config {args.config}: logits [{tokens}, {vocab}] "
          f"fp32, hidden {hidden}; rows {vocab * 4} bytes apart, "
          + (f"padded to {row * 4}" if row != vocab else "not a multiple of 4 KiB: megalite does not pad them"))
    times = time_gemms(tokens, hidden, vocab, args.rounds)
    print(f"{'GEMM':<20}{'contiguous ms':>15}{'padded ms':>12}  contiguous / padded, same-round median (90%)")
    summary = {name: report(name, {layout: times[(name, layout)] for layout in ("contiguous", "padded")})
               for name in dict.fromkeys(name for name, _ in times)}
    total = {layout: [sum(parts) for parts in zip(*(times[key] for key in times if key[1] == layout))]
             for layout in ("contiguous", "padded")}
    summary["all three"] = report("all three", total)
    summary["fused"] = report("fused output + CE", time_fused(tokens, hidden, vocab, args.rounds),
                              "  (forward + backward, chunks padded as the logits)")
    if args.steps:
        summary["step"] = report(f"training step x{args.steps}", time_steps(args.config, args.steps),
                                 "  (whole compiled iterations)")
    return summary


if __name__ == "__main__":
    run_main(main)
