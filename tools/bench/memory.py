"""Per-rank bytes of params, grads and optimizer state under each data-parallel sharding strategy.

    python tools/bench/memory.py                      # DP = 1, 2, 4, 8; bf16 params
    python tools/bench/memory.py --dtype fp32
    python tools/bench/memory.py --dp 1 2 --strategies no_shard optim_grads_params --small
    python tools/bench/memory.py --micro-batches 4     # each strategy's peak under accumulation

For each data-parallel size the script launches its ranks (`run_ranks`: forked from one
interpreter on a CPU, torchrun where CUDA is; gloo, one thread per rank). Every rank builds a small LLaMA-style model, and for each
strategy in turn (--data-parallel-sharding-strategy: no_shard, optim = ZeRO-1, optim_grads
= ZeRO-2, optim_grads_params = ZeRO-3, built as pretrain_gpt.py builds them) takes one real
training step on random tokens (--micro-batches of them, gradients reduced as they are ready,
--overlap-grad-reduce, the grad buffer in about 16 buckets): forward_backward, the DDP's finish_grad_sync, step. It then
sums the bytes of the live tensors; rank 0 gathers every rank's figures and the launcher
prints one table.

Columns (MB = 2**20 bytes; each measured figure is followed by its closed form, `exp`,
from megalite/plan/memory.py, which `pretrain_gpt.py --dry-run` uses too):

- params: the storage of the model's parameters (under ZeRO-3 the stored shards, and any
  unit still gathered); closed form N x bytes(dtype), or the rank's shard of every unit;
- grads: the fp32 grad buffer, or under ZeRO-2/3 its shards plus any bucket's full grads
  still allocated; closed form 4 bytes per buffer element (each bucket rounded up to a
  multiple of DP when sharded), or the shard of it;
- optim: fp32 main params that do not share storage with the model's values (an fp32
  model's main params are its params, or views of them: 0 bytes), Adam's exp_avg and
  exp_avg_sq and its step counters;
- state/N: the sum per parameter, beside the issue's formula for bf16 with fp32 main
  params (no_shard 18, ZeRO-1 6 + 12/DP, ZeRO-2 2 + 16/DP, ZeRO-3 18/DP bytes; for fp32
  16, 8 + 8/DP, 4 + 12/DP, 16/DP) and their ratio;
- peak MB: the most model-state bytes live at once during the step (sampled before and
  after every module's forward and at every gradient accumulation): under ZeRO-2/3 it adds
  the gathered units and the full grads of buckets not yet reduced, and for every strategy the
  tensors that reductions in flight hold outside the grad buffer;
- vs no_shard: state over the same DP size's no_shard figure.

With --micro-batches N > 1 a second table puts each strategy's peak over N micro-batches beside
its peak over one and ZeRO-1's over N: ZeRO-2/3 reduce each micro-batch's grads into their shard,
so their peak must stay within 1.1x of the one-micro-batch peak and below ZeRO-1's.

The last lines check the targets: every strategy's state within 10% of its formula, ZeRO-3 at
DP=8 at most 0.15 of no_shard, and with --micro-batches the accumulation targets; the script
exits 1 if any fails.
"""

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile

import torch

from megalite.config import ModelConfig, num_parameters
from megalite.config.parallel import SHARDING_STRATEGIES, Sharding
from megalite.plan.memory import element_bytes, state_bytes

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MB = 2 ** 20
MICRO_BATCH_SIZE = 2
TARGET_DP, TARGET_RATIO, FORMULA_TOLERANCE = 8, 0.15, 0.10
BUCKETS = 16  # grad-buffer buckets per model, as --ddp-bucket-size's 40M elements cut a model of ~600M parameters
ACCUMULATION_GROWTH = 1.1  # ZeRO-2/3's peak over several micro-batches, at most this times their peak over one


def formula_bytes_per_param(strategy: str, dp: int, bf16: bool) -> float:
    """The issue's model state per parameter: (param, fp32 grad, fp32 optimizer) bytes, each divided
    by DP where the strategy shards it."""
    param, grad, optim = (2, 4, 12) if bf16 else (4, 4, 8)
    sharded = {"no_shard": (), "optim": ("optim",), "optim_grads": ("optim", "grad"),
               "optim_grads_params": ("optim", "grad", "param")}[strategy]
    return sum(value / dp if name in sharded else value
               for name, value in (("param", param), ("grad", grad), ("optim", optim)))


def model_config(small: bool) -> ModelConfig:
    """The CPU preset's LLaMA shape at sequence 64 (about 7.1M params); `small` shrinks it ~10x."""
    hidden, ffn, vocab = (64, 176, 4096) if small else (256, 688, 8192)
    return ModelConfig.of(num_layers=4, hidden_size=hidden, num_attention_heads=4, num_query_groups=2,
                          ffn_hidden_size=ffn, seq_length=64, vocab_size=vocab, tokenizer_vocab_size=vocab,
                          swiglu=True, normalization="RMSNorm", position_embedding_type="rope",
                          add_bias_linear=False, untie_embeddings_and_output_weights=True, hidden_dropout=0.0,
                          attention_dropout=0.0).validate()


def tensor_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (views count once; freed storages count 0)."""
    storages = {tensor.untyped_storage().data_ptr(): tensor.untyped_storage().nbytes() for tensor in tensors}
    return sum(nbytes for pointer, nbytes in storages.items() if pointer)


def optimizer_state_bytes(optimizer) -> int:
    """Main params with storage of their own, plus every tensor in Adam's state, each counted once."""
    model_storages = {param.untyped_storage().data_ptr() for param in optimizer.model_params}
    for buffer in optimizer.grad_buffers:  # ZeRO-3's stored parameters, the dense and the experts' shards
        if buffer.param_shards is not None:
            model_storages.add(buffer.param_shards.untyped_storage().data_ptr())
    tensors = [main for main in optimizer.main_params if main.untyped_storage().data_ptr() not in model_storages]
    tensors += [value for state in optimizer.adam.state.values() for value in state.values() if torch.is_tensor(value)]
    unique = {(tensor.data_ptr(), tensor.numel()): tensor for tensor in tensors}
    return sum(tensor_bytes(tensor) for tensor in unique.values())


def model_state_bytes(model, parallel_model, optimizer) -> dict[str, int]:
    """{"params", "grads", "optimizer"}: the bytes allocated right now for each. model: what gives the parameters
    (the chunks); parallel_model: their ParallelModel (its dense grad buffer and, with experts, theirs)."""
    params = storage_bytes(model.parameters())
    held = []
    for buffer in parallel_model.buffers:
        if buffer.param_shards is not None:
            params += tensor_bytes(buffer.param_shards)
        held += [buffer.shards, *(bucket.grad for bucket in buffer.buckets)] if buffer.sharded else [buffer.data]
    grads = storage_bytes([*held, *parallel_model.reduction_tensors()])
    return {"params": params, "grads": grads, "optimizer": optimizer_state_bytes(optimizer)}


class PeakSampler:
    """The most model-state bytes seen at once: sampled around every module's forward and at every
    gradient accumulation, while installed."""

    def __init__(self, model, parallel_model, optimizer):
        self.peak, self.model, self.parallel_model, self.optimizer = 0, model, parallel_model, optimizer
        self.handles = [module.register_forward_pre_hook(lambda *_: self.sample()) for module in model.modules()]
        self.handles += [module.register_forward_hook(lambda *_: self.sample()) for module in model.modules()]
        self.handles += [param.register_post_accumulate_grad_hook(lambda _: self.sample())
                         for param in model.parameters() if param.requires_grad]

    def sample(self) -> None:
        self.peak = max(self.peak, sum(model_state_bytes(self.model, self.parallel_model, self.optimizer).values()))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def random_micro_batch(config: ModelConfig, seed: int) -> dict:
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, config.real_vocab_size, (MICRO_BATCH_SIZE, config.seq_length + 1), generator=generator)
    return {"tokens": tokens[:, :-1], "labels": tokens[:, 1:],
            "loss_mask": torch.ones(MICRO_BATCH_SIZE, config.seq_length),
            "position_ids": torch.arange(config.seq_length).expand(MICRO_BATCH_SIZE, -1)}


def measure(strategy: str, config: ModelConfig, dtype: torch.dtype, parallel, micro_batches: int = 1) -> dict:
    """One training step of `micro_batches` micro-batches under `strategy`; this rank's measured bytes, peak
    and their closed forms."""
    from megalite.data_parallel.ddp import ParallelModel
    from megalite.data_parallel.optimizer import DistributedOptimizer, MixedPrecisionOptimizer
    from megalite.pipeline_parallel.stages import build_model_chunks
    from megalite.run.training import forward_backward

    model = build_model_chunks(config, seed=1234, dtype=dtype, parallel=parallel)
    kind = MixedPrecisionOptimizer if strategy == "no_shard" else DistributedOptimizer
    bucket_size = -(-num_parameters(config) // BUCKETS)
    ddp = ParallelModel(model, parallel, bucket_size=bucket_size, sharding=Sharding(strategy),
                        overlap_grad_reduce=True)
    optimizer = kind(ddp, lr=1e-3)
    sampler = PeakSampler(model, ddp, optimizer)
    optimizer.zero_grad()
    ddp.start_iteration(micro_batches)
    batch = [random_micro_batch(config, parallel.dp_rank * micro_batches + i) for i in range(micro_batches)]
    forward_backward(model, batch, optimizer, parallel)
    ddp.finish_grad_sync()
    optimizer.step(1e-3)
    sampler.sample()
    sampler.remove()
    measured = model_state_bytes(model, ddp, optimizer)
    shard = parallel.dp_rank if strategy != "no_shard" else 0  # without sharding every rank updates all of it
    expected = state_bytes(optimizer.grad_buffer, dtype, shard, Sharding(strategy))
    if strategy != "optim_grads_params":
        expected["params"] = num_parameters(config) * element_bytes(dtype)
    return {"measured": measured, "expected": {key: expected[key] for key in measured}, "peak": sampler.peak,
            "working": expected["working"]}


def worker(args) -> None:
    """On every rank: each strategy; rank 0 writes every rank's figures to args.output."""
    config, dtype = model_config(args.small), torch.bfloat16 if args.dtype == "bf16" else torch.float32
    counts = sorted({1, args.micro_batches})
    gather_to_file(args.output, lambda parallel: {
        f"{strategy}@{count}": measure(strategy, config, dtype, parallel, count)
        for strategy in args.strategies for count in counts})


def gather_to_file(output: str, figures_of) -> None:
    """On every rank: `figures_of(parallel)` in a gloo world; rank 0 writes every rank's result,
    in rank order, to `output` as JSON."""
    import torch.distributed as dist

    from megalite.config import ParallelConfig
    from megalite.parallel_state import destroy, initialize, world_size_from_env

    # gloo: the ranks are CPU processes on any machine (a one-GPU machine could not hold DP ranks apart).
    parallel = initialize(ParallelConfig(world_size=world_size_from_env(), distributed_backend="gloo"))
    gathered = [None] * parallel.world_size
    dist.all_gather_object(gathered, figures_of(parallel))
    gc.collect()  # the measured models' hook cycles hold the groups: free them before the groups go
    if parallel.rank == 0:
        with open(output, "w", encoding="utf-8") as file:
            json.dump(gathered, file)
    destroy(parallel)


def launch(dp: int, args) -> list[dict]:
    """Run `worker` on `dp` gloo ranks; every rank's figures, in rank order."""
    figures = run_ranks(__file__, dp, ["--dtype", args.dtype, "--strategies", *args.strategies,
                                                "--micro-batches", str(args.micro_batches),
                                                *(["--small"] if args.small else [])])
    # The main table: each strategy at --micro-batches; the accumulation table adds its peak at one.
    return [{strategy: rank[f"{strategy}@{args.micro_batches}"] | {"peak_one": rank[f"{strategy}@1"]["peak"]}
             for strategy in args.strategies} for rank in figures]


def flags_of(args, names: tuple[str, ...]) -> list[str]:
    """The parsed `args` named `names` as command-line flags again (`--seq-length 8`), for the ranks' relaunch."""
    return [str(value) for name in names for value in (f"--{name.replace('_', '-')}", getattr(args, name))]


def run_ranks(script: str, ranks: int, flags: list[str]) -> list:
    """Run `script --worker --output FILE *flags` on `ranks` gloo ranks (one thread each); what its rank 0 wrote
    to FILE as JSON. Where CUDA is there, under torchrun (each rank may use the GPU); on a CPU, forked from one
    interpreter by tools/fork_ranks.py (torch imported once, not once per rank: seconds per rank)."""
    with tempfile.TemporaryDirectory() as folder:
        output = os.path.join(folder, "figures.json")
        worker = ["--worker", "--output", output, *flags]
        if torch.cuda.is_available():  # --standalone: a free rendezvous port, so other torchrun jobs do not collide
            command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks),
                       os.path.abspath(script), *worker]
        else:
            command = [sys.executable, os.path.join(REPO_ROOT, "tools", "fork_ranks.py"), "--nproc-per-node",
                       str(ranks), "--script", os.path.abspath(script), "--", *worker]
        result = subprocess.run(command, capture_output=True, text=True, cwd=REPO_ROOT,
                                env={**os.environ, "OMP_NUM_THREADS": "1"})
        if result.returncode != 0:
            raise RuntimeError(f"{ranks} ranks failed (exit code {result.returncode}):\n{result.stdout[-2000:]}\n"
                               f"{result.stderr[-4000:]}")
        with open(output, encoding="utf-8") as file:
            return json.load(file)


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dp", type=int, nargs="+", default=[1, 2, 4, 8],
                        help="data-parallel sizes, one world each (DP=1 is always run)")
    parser.add_argument("--strategies", nargs="+", choices=SHARDING_STRATEGIES, default=list(SHARDING_STRATEGIES),
                        help="--data-parallel-sharding-strategy values to measure (no_shard is always measured)")
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16", help="the model params' dtype")
    parser.add_argument("--small", action="store_true", help="a ~10x smaller model (hidden 64, vocab 4096)")
    parser.add_argument("--micro-batches", type=int, default=1,
                        help="micro-batches per step; above 1, each strategy's peak is also shown beside its peak "
                             "over one micro-batch and ZeRO-1's")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--output", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if any(dp < 1 for dp in args.dp):
        parser.error(f"--dp sizes must be at least 1, got {args.dp}")
    if args.micro_batches < 1:
        parser.error(f"--micro-batches must be at least 1, got {args.micro_batches}")
    args.dp = sorted({1, *args.dp})
    args.strategies = [strategy for strategy in SHARDING_STRATEGIES if strategy in {"no_shard", *args.strategies}]
    return args


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.worker:
        worker(args)
        return 0
    config = model_config(args.small)
    n, bf16 = num_parameters(config), args.dtype == "bf16"
    print(f"{args.dtype} params, N = {n:,}; one training step on {args.micro_batches} micro-batch(es) of "
          f"{MICRO_BATCH_SIZE} x {config.seq_length} random tokens per rank, gloo on CPU")
    print(f"{'DP':>3} {'strategy':<18} {'rank':>4} {'params MB':>9} {'exp':>6} {'grads MB':>8} {'exp':>6} "
          f"{'optim MB':>8} {'exp':>6} {'state/N':>7} {'formula':>7} {'ratio':>5} {'peak MB':>7} "
          f"{'vs no_shard':>11}")
    worst, mismatches, off_formula, peaks = {}, [], [], {}
    for dp in args.dp:
        ranks = peaks[dp] = launch(dp, args)
        for strategy in args.strategies:
            for rank, figures in enumerate(ranks):
                measured, expected = figures[strategy]["measured"], figures[strategy]["expected"]
                state = sum(measured.values())
                ratio = state / sum(figures["no_shard"]["measured"].values())
                worst[(dp, strategy)] = max(worst.get((dp, strategy), 0.0), ratio)
                formula = formula_bytes_per_param(strategy, dp, bf16)
                if abs(state / n / formula - 1) > FORMULA_TOLERANCE:
                    off_formula.append(f"DP={dp} {strategy} rank {rank}: {state / n:.2f} B/param against "
                                       f"{formula:.2f}")
                mismatches += [f"DP={dp} {strategy} rank {rank} {what}: {measured[what]} B, expected "
                               f"{expected[what]} B" for what in measured if measured[what] != expected[what]]
                cells = " ".join(f"{measured[what] / MB:>{width}.2f} {expected[what] / MB:>6.2f}"
                                 for what, width in (("params", 9), ("grads", 8), ("optimizer", 8)))
                print(f"{dp:>3} {strategy:<18} {rank:>4} {cells} {state / n:>7.2f} {formula:>7.2f} "
                      f"{state / n / formula:>5.2f} {figures[strategy]['peak'] / MB:>7.2f} {ratio:>11.3f}")
    if mismatches:
        print("measured figures that differ from their closed form:\n  " + "\n  ".join(mismatches))
    else:
        print("every measured figure equals its closed form to the byte")
    print(f"{'FAIL' if off_formula else 'PASS'}: every strategy's model state within "
          f"{FORMULA_TOLERANCE:.0%} of its formula" + "".join(f"\n  {line}" for line in off_formula))
    failed = bool(off_formula)
    if args.micro_batches > 1:
        failed |= not accumulation_table(peaks, args)
    if TARGET_DP not in args.dp or "optim_grads_params" not in args.strategies:
        print(f"ZeRO-3 at DP={TARGET_DP} not measured: its target (model state per rank at most {TARGET_RATIO} "
              f"of no_shard) is not checked")
        return 1 if failed else 0
    ratio = worst[(TARGET_DP, "optim_grads_params")]
    met = ratio <= TARGET_RATIO
    print(f"{'PASS' if met else 'FAIL'}: ZeRO-3 at DP={TARGET_DP}, model state per rank is {ratio:.3f} of "
          f"no_shard (target: at most {TARGET_RATIO})")
    return 0 if met and not failed else 1


def accumulation_table(peaks: dict, args) -> bool:
    """Print each strategy's peak over --micro-batches beside its peak over one and ZeRO-1's; whether ZeRO-2/3
    met their accumulation targets (within ACCUMULATION_GROWTH of one micro-batch, below ZeRO-1)."""
    count = args.micro_batches
    print(f"peak model state (MB) over {count} micro-batches, beside one micro-batch and ZeRO-1 (optim):")
    print(f"{'DP':>3} {'strategy':<18} {'rank':>4} {'peak@1':>7} {f'peak@{count}':>7} {'growth':>6} {'vs ZeRO-1':>9}")
    misses = []
    for dp, ranks in peaks.items():
        for strategy in args.strategies:
            for rank, figures in enumerate(ranks):
                one, many = figures[strategy]["peak_one"], figures[strategy]["peak"]
                zero1 = figures["optim"]["peak"] if "optim" in figures else None
                versus = f"{many / zero1:>9.3f}" if zero1 else f"{'-':>9}"
                print(f"{dp:>3} {strategy:<18} {rank:>4} {one / MB:>7.2f} {many / MB:>7.2f} {many / one:>6.3f} {versus}")
                if strategy in ("optim_grads", "optim_grads_params") and dp > 1:
                    if many > ACCUMULATION_GROWTH * one or (zero1 and many >= zero1):
                        misses.append(f"DP={dp} {strategy} rank {rank}: {many / MB:.2f} MB over {count} micro-batches, "
                                      f"{one / MB:.2f} over one, ZeRO-1 {zero1 / MB if zero1 else float('nan'):.2f}")
    print(f"{'FAIL' if misses else 'PASS'}: ZeRO-2/3's peak over {count} micro-batches within {ACCUMULATION_GROWTH}x "
          f"of one micro-batch's and below ZeRO-1's" + "".join(f"\n  {line}" for line in misses))
    return not misses


if __name__ == "__main__":
    sys.exit(main())
