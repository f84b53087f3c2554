"""Time share of tensor-parallel communication in a training iteration (forward + backward) on CPU.

    python tools/bench/comm.py                       # launches itself on 2 gloo ranks (TP=2)
    python tools/bench/comm.py --tp 2 --sequence-parallel --iters 10

Every torch.distributed collective the TP layers call (all-reduce, all-gather,
reduce-scatter) is wrapped in a wall-clock timer; the script prints, on rank 0, the
milliseconds per iteration spent inside them next to the whole iteration, and their
share. On one CPU machine gloo moves data through shared memory, so this measures the
collectives' software overhead and copies, not a network.
"""

import argparse
import os
import subprocess
import sys
import time

import torch
import torch.distributed as dist

from megalite.config import ParallelConfig, model_config_from_preset
from megalite.model.gpt import build_model
from megalite.model.loss import LanguageModelLoss
from megalite.parallel_state import initialize
from megalite.tensor_parallel import comm

COLLECTIVES = ("all_reduce", "all_gather_into_tensor", "all_gather_single", "reduce_scatter_tensor",
               "reduce_scatter_single")


def time_collectives() -> dict:
    """Wrap the collectives the TP code calls in timers; returns the running totals (seconds)."""
    totals = {"seconds": 0.0, "calls": 0}

    def timer(original):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                totals["seconds"] += time.perf_counter() - start
                totals["calls"] += 1
        return timed

    for name in COLLECTIVES:
        if hasattr(dist, name):
            setattr(dist, name, timer(getattr(dist, name)))
    # comm.py binds its all-gather / reduce-scatter at import: wrap those names too.
    for name in ("all_gather_single", "reduce_scatter_single"):
        setattr(comm, name, timer(getattr(comm, name)))
    return totals


def main(args) -> None:
    parallel = initialize(ParallelConfig(tensor_model_parallel_size=args.tp, sequence_parallel=args.sequence_parallel,
                                         world_size=int(os.environ["WORLD_SIZE"])))
    config = model_config_from_preset(args.model, args.tp, seq_length=args.seq_length)
    model = build_model(config, seed=1234, parallel=parallel)
    loss_fn = LanguageModelLoss.of(model)
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, config.real_vocab_size, (args.micro_batch_size, config.seq_length + 1),
                           generator=generator)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    totals = time_collectives()
    for iteration in range(args.warmup_iters + args.iters):
        if iteration == args.warmup_iters:
            totals.update(seconds=0.0, calls=0)
            start = time.perf_counter()
        loss_fn(model, model(inputs), labels).mean().backward()
    elapsed = (time.perf_counter() - start) / args.iters
    comm = totals["seconds"] / args.iters
    if parallel.rank == 0:
        print(f"{args.model} seq {config.seq_length} x batch {args.micro_batch_size}, TP={args.tp}"
              f"{' + SP' if args.sequence_parallel else ''}, {torch.get_num_threads()} thread(s) per rank, gloo on CPU")
        print(f"iteration (forward + backward): {elapsed * 1000:.1f} ms | in TP collectives: {comm * 1000:.1f} ms "
              f"({totals['calls'] // args.iters} calls) | share: {comm / elapsed:.1%}")
    dist.destroy_process_group()


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--sequence-parallel", action="store_true")
    parser.add_argument("--seq-length", type=int, default=256)
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--warmup-iters", type=int, default=2)
    return parser.parse_args(argv)


if __name__ == "__main__":
    arguments = parse_args(sys.argv[1:])
    if "WORLD_SIZE" not in os.environ:  # launch ourselves on --tp ranks
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        sys.exit(subprocess.call([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node",
                                  str(arguments.tp), __file__, *sys.argv[1:]], env=env))
    main(arguments)
