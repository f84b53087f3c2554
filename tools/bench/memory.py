"""Per-rank bytes of params, grads and optimizer state, with and without the distributed optimizer.

    python tools/bench/memory.py                      # DP = 1, 2, 4; bf16 params
    python tools/bench/memory.py --dtype fp32
    python tools/bench/memory.py --dp 1 2 --dtype fp32

For each data-parallel size the script launches itself under torchrun (gloo on the
CPU, one thread per rank). Every rank builds a small LLaMA-style model, and for each
optimizer in turn (MixedPrecisionOptimizer, then DistributedOptimizer as
--use-distributed-optimizer builds it) takes one real training step on random tokens:
forward_backward, the DDP's finish_grad_sync, step. It then sums the bytes of the live tensors;
rank 0 gathers every rank's figures and the launcher prints one table.

Columns (MB = 2**20 bytes; each measured figure is followed by its closed form, `exp`,
from megalite/plan/memory.py, which `pretrain_gpt.py --dry-run` uses too):

- params: the model's parameters; closed form N x bytes(dtype), N from num_parameters;
- grads: the fp32 grad buffer (`optimizer.grad_buffer.data`); closed form 4 bytes per
  buffer element, N plus the padding that rounds each bucket up to a multiple of DP
  (distributed optimizer only);
- optim: fp32 main params that do not share storage with a model param (an fp32
  model's main params are its params, or views of them: 0 bytes), Adam's exp_avg and
  exp_avg_sq and its step counters. Closed form: (4 if bf16 else 0) + 8 bytes per element
  this rank updates (N, or its shard of every bucket under the distributed optimizer,
  about N / DP) plus 4 bytes per step counter (one per parameter, or per piece of one
  in the shard);
- vs DP=1: optim over the DP=1 MixedPrecisionOptimizer figure.

The last line checks the target of the distributed optimizer (ZeRO-1): at DP=4 its
optimizer state per rank is at most 0.3 of the DP=1 figure; the script exits 1 if not.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

import torch

from megalite.config import ModelConfig, num_parameters
from megalite.plan.memory import STEP_COUNTER_BYTES, element_bytes, state_bytes

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MB = 2 ** 20
MICRO_BATCH_SIZE = 2
OPTIMIZERS = ("MixedPrecisionOptimizer", "DistributedOptimizer")
TARGET_DP, TARGET_RATIO = 4, 0.3


def model_config(small: bool) -> ModelConfig:
    """The CPU preset's LLaMA shape at sequence 64 (about 7.1M params); `small` shrinks it ~10x."""
    hidden, ffn, vocab = (64, 176, 4096) if small else (256, 688, 8192)
    return ModelConfig(num_layers=4, hidden_size=hidden, num_attention_heads=4, num_query_groups=2,
                       ffn_hidden_size=ffn, seq_length=64, vocab_size=vocab, tokenizer_vocab_size=vocab,
                       swiglu=True, normalization="RMSNorm", position_embedding_type="rope",
                       add_bias_linear=False, untie_embeddings_and_output_weights=True, hidden_dropout=0.0,
                       attention_dropout=0.0).validate()


def tensor_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def optimizer_state_bytes(optimizer) -> int:
    """Main params with storage of their own, plus every tensor in Adam's state, each counted once."""
    param_storages = {param.untyped_storage().data_ptr() for param in optimizer.model_params}
    tensors = [main for main in optimizer.main_params if main.untyped_storage().data_ptr() not in param_storages]
    tensors += [value for state in optimizer.adam.state.values() for value in state.values() if torch.is_tensor(value)]
    unique = {(tensor.data_ptr(), tensor.numel()): tensor for tensor in tensors}
    return sum(tensor_bytes(tensor) for tensor in unique.values())


def expected_figures(config: ModelConfig, dtype: torch.dtype, buffer, shard: int, shards: int) -> dict:
    """The closed forms (megalite/plan/memory.py): params from N; grads and the optimizer state
    from the bucket sizes and the elements (and parameter pieces) inside shard `shard` of `shards`."""
    return {"params": num_parameters(config) * element_bytes(dtype), **state_bytes(buffer, dtype, shard, shards)}


def measure(kind, config: ModelConfig, dtype: torch.dtype, parallel) -> dict:
    """One training step with optimizer class `kind`; this rank's measured bytes and their closed forms."""
    from megalite.data_parallel.ddp import DataParallelGrads
    from megalite.pipeline_parallel.stages import build_model_chunks
    from megalite.run.training import forward_backward

    model = build_model_chunks(config, seed=1234, dtype=dtype, parallel=parallel)
    optimizer = kind(DataParallelGrads(model, parallel, shard=kind.distributed), lr=1e-3)
    generator = torch.Generator().manual_seed(parallel.dp_rank)  # each DP rank its own data
    tokens = torch.randint(0, config.real_vocab_size, (MICRO_BATCH_SIZE, config.seq_length + 1),
                           generator=generator)
    micro_batch = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:],
                   "loss_mask": torch.ones(MICRO_BATCH_SIZE, config.seq_length),
                   "position_ids": torch.arange(config.seq_length).expand(MICRO_BATCH_SIZE, -1)}
    optimizer.zero_grad()
    optimizer.ddp.start_iteration(1)
    forward_backward(model, [micro_batch], optimizer, parallel)
    optimizer.ddp.finish_grad_sync()
    optimizer.step(1e-3)
    measured = {"params": sum(tensor_bytes(param) for param in model.parameters()),
                "grads": tensor_bytes(optimizer.grad_buffer.data), "optimizer": optimizer_state_bytes(optimizer)}
    # Without sharding every rank updates all of it: shard 0 of 1.
    shard, shards = (parallel.dp_rank, parallel.dp_size) if optimizer.distributed else (0, 1)
    expected = expected_figures(config, dtype, optimizer.grad_buffer, shard, shards)
    return {"measured": measured, "expected": expected}


def worker(args) -> None:
    """On every torchrun rank: both optimizers; rank 0 writes every rank's figures to args.output."""
    import torch.distributed as dist

    from megalite.config import ParallelConfig
    from megalite.data_parallel.optimizer import DistributedOptimizer, MixedPrecisionOptimizer
    from megalite.parallel_state import destroy, initialize, world_size_from_env

    # gloo: the ranks are CPU processes on any machine (a one-GPU machine could not hold DP ranks apart).
    parallel = initialize(ParallelConfig(world_size=world_size_from_env(), distributed_backend="gloo"))
    config, dtype = model_config(args.small), torch.bfloat16 if args.dtype == "bf16" else torch.float32
    figures = {kind.__name__: measure(kind, config, dtype, parallel)
               for kind in (MixedPrecisionOptimizer, DistributedOptimizer)}
    gathered = [None] * parallel.world_size
    dist.all_gather_object(gathered, figures)
    if parallel.rank == 0:
        with open(args.output, "w", encoding="utf-8") as file:
            json.dump(gathered, file)
    destroy(parallel)


def launch(dp: int, args) -> list[dict]:
    """Run `worker` on `dp` gloo ranks; every rank's figures, in rank order."""
    with tempfile.TemporaryDirectory() as folder:
        output = os.path.join(folder, "figures.json")
        # --standalone: a free rendezvous port, so other torchrun jobs on the machine do not collide.
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(dp),
                   os.path.abspath(__file__), "--worker", "--output", output, "--dtype", args.dtype,
                   *(["--small"] if args.small else [])]
        result = subprocess.run(command, capture_output=True, text=True, cwd=REPO_ROOT,
                                env={**os.environ, "OMP_NUM_THREADS": "1"})
        if result.returncode != 0:
            raise RuntimeError(f"DP={dp} failed (exit code {result.returncode}):\n{result.stdout[-2000:]}\n"
                               f"{result.stderr[-4000:]}")
        with open(output, encoding="utf-8") as file:
            return json.load(file)


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dp", type=int, nargs="+", default=[1, 2, 4],
                        help="data-parallel sizes, one torchrun world each (DP=1, the baseline, is always run)")
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16", help="the model params' dtype")
    parser.add_argument("--small", action="store_true", help="a ~10x smaller model (hidden 64, vocab 4096)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--output", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if any(dp < 1 for dp in args.dp):
        parser.error(f"--dp sizes must be at least 1, got {args.dp}")
    args.dp = sorted({1, *args.dp})
    return args


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.worker:
        worker(args)
        return 0
    config = model_config(args.small)
    n = num_parameters(config)
    main_bytes = 4 if args.dtype == "bf16" else 0
    print(f"{args.dtype} params, N = {n:,}; one training step on {MICRO_BATCH_SIZE} x {config.seq_length} "
          f"random tokens per rank, gloo on CPU")
    print(f"optimizer state closed form: ({main_bytes} B main param + 8 B Adam moments) per element updated + "
          f"{STEP_COUNTER_BYTES} B per step counter = about {main_bytes + 8} x N / DP with the distributed "
          f"optimizer")
    print(f"{'DP':>3} {'optimizer':<23} {'rank':>4} {'params MB':>9} {'exp':>6} {'grads MB':>8} {'exp':>6} "
          f"{'optim MB':>8} {'exp':>6} {'vs DP=1':>7}")
    baseline, worst, mismatches = None, {}, []
    for dp in args.dp:
        ranks = launch(dp, args)
        for kind in OPTIMIZERS:
            for rank, figures in enumerate(ranks):
                measured, expected = figures[kind]["measured"], figures[kind]["expected"]
                if baseline is None:
                    baseline = measured["optimizer"]
                ratio = measured["optimizer"] / baseline
                worst[(dp, kind)] = max(worst.get((dp, kind), 0.0), ratio)
                mismatches += [f"DP={dp} {kind} rank {rank} {what}: {measured[what]} B, expected {expected[what]} B"
                               for what in measured if measured[what] != expected[what]]
                cells = " ".join(f"{measured[what] / MB:>{width}.2f} {expected[what] / MB:>6.2f}"
                                 for what, width in (("params", 9), ("grads", 8), ("optimizer", 8)))
                print(f"{dp:>3} {kind:<23} {rank:>4} {cells} {ratio:>7.3f}")
    if mismatches:
        print("measured figures that differ from their closed form:\n  " + "\n  ".join(mismatches))
    else:
        print("every measured figure equals its closed form to the byte")
    if TARGET_DP not in args.dp:
        print(f"DP={TARGET_DP} not measured: the target (distributed optimizer state per rank at most "
              f"{TARGET_RATIO} of DP=1) is not checked")
        return 0
    ratio = worst[(TARGET_DP, "DistributedOptimizer")]
    met = ratio <= TARGET_RATIO
    print(f"{'PASS' if met else 'FAIL'}: distributed optimizer at DP={TARGET_DP}, optimizer state per rank is "
          f"{ratio:.3f} of DP=1 (target: at most {TARGET_RATIO})")
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
