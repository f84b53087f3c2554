"""Data-parallel bytes communicated per iteration under each sharding strategy, beside plain DP's.

    python tools/bench/sharding_comm.py                 # DP = 4, fp32 params, every strategy
    python tools/bench/sharding_comm.py --dp 8 --dtype bf16
    python tools/bench/sharding_comm.py --grad-reduce-in-bf16   # grads reduced in bf16: half their bytes

The script launches itself (tools/bench/memory.py's run_ranks; gloo on the CPU, one thread per rank). Every
rank builds a small LLaMA-style model and, for each --data-parallel-sharding-strategy,
takes two training steps on random tokens; the second is counted. Each collective over
the data-parallel group is counted by what a ring algorithm moves per rank: an all-reduce
of S bytes sends 2 S (DP-1)/DP, an all-gather or reduce-scatter of S bytes (the whole
tensor) S (DP-1)/DP. Plain DP all-reduces the fp32 grads; ZeRO-1 and 2 reduce-scatter
them and all-gather the updated params (the same volume for fp32 params); ZeRO-3
all-gathers each unit's params before its forward and again before its backward, and
reduce-scatters its grads: 1.5x plain DP's volume when params and grads have the same
dtype. With bf16 params the gathers move half as many bytes; with --grad-reduce-in-bf16 the
all-reduces and reduce-scatters of the grads do.

The last line checks ZeRO-3's volume against plain DP's (target: 1.4x to 1.6x, fp32).
"""

import argparse
import sys

import torch

from megalite.config.parallel import SHARDING_STRATEGIES, Sharding
from tools.bench.memory import gather_to_file, model_config, random_micro_batch, run_ranks

MB = 2 ** 20
TARGET = (1.4, 1.6)


class DataParallelTraffic:
    """Counts the bytes each collective over `group` moves per rank while installed (module docstring)."""

    def __init__(self, group, size: int):
        import torch.distributed as dist

        from megalite.data_parallel import ddp, param_shards

        self.group, self.size, self.bytes = group, size, {"all-reduce": 0, "all-gather": 0, "reduce-scatter": 0}
        self.patched = [(dist, "all_reduce"), (ddp, "reduce_scatter_single"), (ddp, "all_gather_single"),
                        (param_shards, "all_gather_single")]
        self.originals = [getattr(module, name) for module, name in self.patched]
        counters = {"all_reduce": ("all-reduce", 2, 0), "reduce_scatter_single": ("reduce-scatter", 1, 1),
                    "all_gather_single": ("all-gather", 1, 0)}
        for (module, name), original in zip(self.patched, self.originals):
            setattr(module, name, self._counting(original, *counters[name]))

    def _counting(self, original, kind: str, factor: int, whole: int):
        """`whole`: the argument holding the whole tensor (the all-gather's output, the reduce-scatter's input)."""
        def counted(*args, **kwargs):
            if kwargs.get("group") is self.group:
                tensor = args[whole]
                self.bytes[kind] += factor * tensor.numel() * tensor.element_size() * (self.size - 1) // self.size
            return original(*args, **kwargs)
        return counted

    def remove(self) -> None:
        for (module, name), original in zip(self.patched, self.originals):
            setattr(module, name, original)


def measure(strategy: str, dtype: torch.dtype, parallel, small: bool, grad_reduce_in_bf16: bool = False) -> dict:
    """Bytes per kind of collective in the second of two training steps under `strategy`."""
    from megalite.data_parallel.ddp import ParallelModel
    from megalite.data_parallel.optimizer import DistributedOptimizer, MixedPrecisionOptimizer
    from megalite.pipeline_parallel.stages import build_model_chunks
    from megalite.run.training import forward_backward

    config = model_config(small)
    model = build_model_chunks(config, seed=1234, dtype=dtype, parallel=parallel)
    kind = MixedPrecisionOptimizer if strategy == "no_shard" else DistributedOptimizer
    ddp = ParallelModel(model, parallel, sharding=Sharding(strategy), grad_reduce_in_bf16=grad_reduce_in_bf16)
    optimizer = kind(ddp, lr=1e-3)
    batch = random_micro_batch(config, parallel.dp_rank)
    for step in range(2):
        traffic = DataParallelTraffic(parallel.dp_group, parallel.dp_size) if step == 1 else None
        optimizer.zero_grad()
        ddp.start_iteration(1)
        forward_backward(model, [batch], optimizer, parallel)
        ddp.finish_grad_sync()
        optimizer.step(1e-3)
    traffic.remove()
    return traffic.bytes


def worker(args) -> None:
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    gather_to_file(args.output, lambda parallel: {
        strategy: measure(strategy, dtype, parallel, args.small, args.grad_reduce_in_bf16)
        for strategy in SHARDING_STRATEGIES})


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dp", type=int, default=4, help="data-parallel ranks (at least 2)")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="the model params' dtype")
    parser.add_argument("--small", action="store_true", help="a ~10x smaller model (hidden 64, vocab 4096)")
    parser.add_argument("--grad-reduce-in-bf16", action="store_true", help="reduce the grads in bf16 (as the "
                                                                            "training flag of the same name)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--output", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.dp < 2:
        parser.error(f"--dp must be at least 2 (one rank communicates nothing), got {args.dp}")
    if args.worker:
        worker(args)
        return 0
    flags = ["--dtype", args.dtype, *(["--small"] if args.small else []),
             *(["--grad-reduce-in-bf16"] if args.grad_reduce_in_bf16 else [])]
    rank0 = run_ranks(__file__, args.dp, flags)[0]
    plain = sum(rank0["no_shard"].values())
    reduced = "bf16" if args.grad_reduce_in_bf16 else "fp32"
    print(f"DP={args.dp}, {args.dtype} params, fp32 grads reduced in {reduced}; MB per rank in one iteration "
          f"(ring algorithm volumes)")
    print(f"{'strategy':<19} {'all-reduce':>10} {'all-gather':>10} {'reduce-scatter':>14} {'total':>8} "
          f"{'vs no_shard':>11}")
    for strategy in SHARDING_STRATEGIES:
        volumes = rank0[strategy]
        total = sum(volumes.values())
        print(f"{strategy:<19} {volumes['all-reduce'] / MB:>10.3f} {volumes['all-gather'] / MB:>10.3f} "
              f"{volumes['reduce-scatter'] / MB:>14.3f} {total / MB:>8.3f} {total / plain:>11.3f}")
    ratio = sum(rank0["optim_grads_params"].values()) / plain
    met = TARGET[0] <= ratio <= TARGET[1]
    if args.dtype != "fp32" or args.grad_reduce_in_bf16:
        print(f"ZeRO-3 moves {ratio:.3f}x plain DP's bytes with {args.dtype} params and {reduced} reductions (the "
              f"{TARGET[0]}-{TARGET[1]}x target is for params and reductions of one dtype: run with --dtype fp32 "
              f"and no --grad-reduce-in-bf16)")
        return 0
    print(f"{'PASS' if met else 'FAIL'}: ZeRO-3 moves {ratio:.3f}x plain DP's bytes per iteration "
          f"(target: {TARGET[0]}x to {TARGET[1]}x)")
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
