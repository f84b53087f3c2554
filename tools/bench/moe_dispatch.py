"""Expert-parallel dispatch: bytes each rank sends per MoE layer under each dispatcher, against their closed
form, and tokens/s of a small MoE model at each EP size beside one process.

    python tools/bench/moe_dispatch.py                  # a world of 4 gloo ranks; EP 1, 2 and 4
    python tools/bench/moe_dispatch.py --ep 1 2 --hidden 128 --layers 4

The script launches itself (tools/bench/memory.py's run_ranks) on max(--ep) gloo CPU ranks (one thread each); EP folds over DP
(Megatron's MoE parallel folding): every rank is a data-parallel replica with its own micro-batch, and at each
EP size the ranks of an EP group hold E/EP experts each. Rank 0's figures are printed.

Bytes: one MoE layer (fp32, seed fixed) runs a forward and a backward on each rank's `[s, b, h]` micro-batch
(n = s·b rows, E experts, top-k routing) while the collectives over the EP group are counted by what each
rank sends: an all-gather or reduce-scatter of a whole tensor of S bytes by a ring, S (EP-1)/EP; an all-to-all,
the rows it sends to the other ranks (not to itself). With e bytes per element and P = EP, per rank and layer:

- allgather: the rows, the fp32 probs and the bool routing map `[n, E]` are all-gathered over EP and the expert
  outputs reduce-scattered back; backward reduce-scatters the rows' and probs' grads and all-gathers the
  output grad: (P-1) n (4 h e + 9 E). It does not depend on the routing.
- alltoall: `out` rows (token, expert) this rank routes to experts on other ranks, and `in` rows other ranks
  route to its experts. Forward sends `out` rows and their probs (dispatch) and `in` expert outputs (combine);
  backward sends the grads the reverse way (`in` rows and probs, `out` outputs); plus the all-gather of the
  per-expert counts (int64): (out + in) (2 h e + 4) + (P-1) 8 E. With the layer's own routing counts this is
  exact, not an estimate.

tokens/s: a small MoE GPT (every layer MoE) runs forward + backward of its loss on each rank's micro-batch
(no grad reduction, no optimizer step) at each EP size and dispatcher; the one-process row runs the same
global batch (one micro-batch per rank of the world, one after the other) in one process on one thread. On
gloo CPU ranks on one machine these figures measure software overhead (the dispatch's copies and the
collectives' cost in shared memory), not a network or a GPU.
"""

import argparse
import sys
import time

import torch

from megalite.errors import UserError, run_main
from tools.bench.memory import flags_of, gather_to_file, run_ranks

DISPATCHERS = ("allgather", "alltoall")
KB = 2 ** 10
SEED = 1234


def closed_form_bytes(dispatcher: str, counts: list[list[int]], ep_rank: int, rows: int, hidden: int,
                      element_bytes: int) -> int:
    """Bytes rank `ep_rank` of an EP group sends in one MoE layer's forward + backward (module docstring):
    `counts` `[EP][E]`, the (token, expert) rows each rank of the group routes to each global expert; `rows`
    (n) tokens per rank of `hidden` elements of `element_bytes` each."""
    ep, experts = len(counts), len(counts[0])
    if dispatcher == "allgather":
        return (ep - 1) * rows * (4 * hidden * element_bytes + 9 * experts)
    local = experts // ep

    def routed(source: int, destination: int) -> int:
        return sum(counts[source][destination * local:(destination + 1) * local])

    sent = sum(routed(ep_rank, other) for other in range(ep) if other != ep_rank)
    received = sum(routed(other, ep_rank) for other in range(ep) if other != ep_rank)
    return (sent + received) * (2 * hidden * element_bytes + 4) + (ep - 1) * 8 * experts


class ExpertParallelTraffic:
    """Counts the bytes this rank sends by each collective over `group` while installed (module docstring)."""

    def __init__(self, group):
        import torch.distributed as dist

        from megalite.tensor_parallel import comm

        self.group, self.size, self.rank = group, dist.get_world_size(group), dist.get_rank(group)
        self.bytes = {"all-gather": 0, "reduce-scatter": 0, "all-to-all": 0}
        # comm binds the all-gather and reduce-scatter at import, and calls dist.all_to_all_single.
        self.patched = [(comm, "all_gather_single", self._ring("all-gather", 0)),
                        (comm, "reduce_scatter_single", self._ring("reduce-scatter", 1)),
                        (dist, "all_to_all_single", self._all_to_all)]
        self.originals = [getattr(module, name) for module, name, _ in self.patched]
        for (module, name, counting), original in zip(self.patched, self.originals):
            setattr(module, name, counting(original))

    def _ring(self, kind: str, whole: int):
        """`whole`: the argument holding the whole tensor (the all-gather's output, the reduce-scatter's input)."""
        def counting(original):
            def counted(*args, **kwargs):
                if kwargs.get("group") is self.group:
                    tensor = args[whole]
                    self.bytes[kind] += tensor.numel() * tensor.element_size() * (self.size - 1) // self.size
                return original(*args, **kwargs)
            return counted
        return counting

    def _all_to_all(self, original):
        def counted(output, tensor, output_splits, input_splits, group=None, **kwargs):
            if group is self.group:
                row_bytes = tensor[:1].numel() * tensor.element_size()
                sent = sum(rows for rank, rows in enumerate(input_splits) if rank != self.rank)
                self.bytes["all-to-all"] += sent * row_bytes
            return original(output, tensor, output_splits, input_splits, group=group, **kwargs)
        return counted

    def remove(self) -> None:
        for (module, name, _), original in zip(self.patched, self.originals):
            setattr(module, name, original)


def model_config(args, dispatcher: str):
    """The bench's LLaMA-shaped MoE GPT: every layer's MLP routes to --experts experts of FFN size --hidden."""
    from megalite.config import ModelConfig

    return ModelConfig.of(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=4,
                          ffn_hidden_size=2 * args.hidden, seq_length=args.seq_length, vocab_size=args.vocab_size,
                          swiglu=True, normalization="RMSNorm", position_embedding_type="rope",
                          add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
                          num_experts=args.experts, moe_router_topk=args.topk, moe_ffn_hidden_size=args.hidden,
                          moe_token_dispatcher_type=dispatcher).validate()


def random_tokens(args, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A micro-batch's (inputs, labels) `[b, s]`."""
    tokens = torch.randint(0, args.vocab_size, (args.micro_batch_size, args.seq_length + 1),
                           generator=torch.Generator().manual_seed(seed))
    return tokens[:, :-1], tokens[:, 1:]


def layer_traffic(args, dispatcher: str, parallel) -> dict:
    """One MoE layer's forward + backward on this rank's micro-batch: bytes sent per collective, and the
    layer's routing counts `[E]` (the closed form's input)."""
    from megalite.model.transformer import build_mlp
    from megalite.tensor_parallel.layers import initialize

    layer = build_mlp(model_config(args, dispatcher), 0, parallel)
    initialize(layer, seed=SEED, prefix="mlp")
    generator = torch.Generator().manual_seed(SEED + parallel.rank)
    shape = (args.seq_length, args.micro_batch_size, args.hidden)
    hidden = torch.randn(shape, generator=generator).requires_grad_()
    traffic = ExpertParallelTraffic(parallel.ep_group)
    try:
        layer(hidden).backward(torch.randn(shape, generator=generator))
    finally:
        traffic.remove()
    return {"bytes": traffic.bytes, "counts": layer.router.routed_tokens.tolist()}


def seconds_per_iteration(args, config, parallel, micro_batches: list[int]) -> float:
    """Forward + backward of the model's loss on the micro-batches of these seeds, per iteration, after the
    warm-up ones; in a world (`parallel` not one process) every rank starts and ends the timing together."""
    import torch.distributed as dist

    from megalite.model.gpt import build_model
    from megalite.model.loss import LanguageModelLoss

    together = parallel.world_size > 1
    model = build_model(config, seed=SEED, parallel=parallel)
    loss_fn = LanguageModelLoss.of(model)
    batches = [random_tokens(args, seed) for seed in micro_batches]
    for iteration in range(args.warmup_iters + args.iters):
        if iteration == args.warmup_iters:
            if together:
                dist.barrier()
            start = time.perf_counter()
        for inputs, labels in batches:
            loss_fn(model, model(inputs), labels).mean().backward()
    if together:
        dist.barrier()
    return (time.perf_counter() - start) / args.iters


def figures(args, world) -> dict:
    """On every rank: bytes and routing counts per (EP, dispatcher) for EP > 1, seconds per iteration per
    layout, and on rank 0 the one-process run (the other ranks wait at a barrier)."""
    import torch.distributed as dist

    from megalite.parallel_state import ONE_PROCESS, build_parallel_state

    result = {"traffic": {}, "seconds": {}}
    for ep in args.ep:
        parallel = build_parallel_state(ep=ep)
        for dispatcher in DISPATCHERS if ep > 1 else DISPATCHERS[:1]:  # at EP 1 no dispatcher communicates
            layout = f"{ep} {dispatcher}"
            if ep > 1:
                result["traffic"][layout] = layer_traffic(args, dispatcher, parallel)
            result["seconds"][layout] = seconds_per_iteration(args, model_config(args, dispatcher), parallel,
                                                              [world.rank])
    if world.rank == 0:
        result["seconds"]["one process"] = seconds_per_iteration(
            args, model_config(args, DISPATCHERS[0]), ONE_PROCESS, list(range(world.world_size)))
    dist.barrier()
    return result


def worker(args) -> None:
    gather_to_file(args.output, lambda world: figures(args, world))


def traffic_table(args, ranks: list[dict]) -> bool:
    """Print every rank's bytes per collective beside the closed form; whether they all match."""
    from megalite.parallel_state import group_ranks

    world, rows = len(ranks), args.seq_length * args.micro_batch_size
    print(f"Bytes sent per rank in one MoE layer's forward + backward (KB): hidden {args.hidden}, {args.experts} "
          f"experts, top-{args.topk}, {rows} tokens per rank, fp32, world of {world} gloo ranks")
    print(f"{'EP':>3} {'dispatcher':<10} {'rank':>4} {'all-gather':>10} {'reduce-scatter':>14} {'all-to-all':>10} "
          f"{'total':>9} {'closed form':>11} {'ratio':>6}")
    match = True
    for ep in (ep for ep in args.ep if ep > 1):
        groups = group_ranks(world, 1, 1, ep)["ep"]
        for dispatcher in DISPATCHERS:
            layout = f"{ep} {dispatcher}"
            for rank, figures_of_rank in enumerate(ranks):
                group = next(group for group in groups if rank in group)
                counts = [ranks[member]["traffic"][layout]["counts"] for member in group]
                expected = closed_form_bytes(dispatcher, counts, group.index(rank), rows, args.hidden, 4)
                sent = figures_of_rank["traffic"][layout]["bytes"]
                total = sum(sent.values())
                match &= total == expected
                print(f"{ep:>3} {dispatcher:<10} {rank:>4} {sent['all-gather'] / KB:>10.2f} "
                      f"{sent['reduce-scatter'] / KB:>14.2f} {sent['all-to-all'] / KB:>10.2f} {total / KB:>9.2f} "
                      f"{expected / KB:>11.2f} {total / expected:>6.3f}")
    return match


def throughput_table(args, seconds: dict, world: int) -> None:
    """Print tokens/s per layout (rank 0's `seconds` per iteration) beside the one-process run's."""
    tokens = world * args.micro_batch_size * args.seq_length
    print(f"\ntokens/s of a {args.layers}-layer MoE GPT (hidden {args.hidden}, {args.experts} experts, "
          f"top-{args.topk}), forward + backward of a global batch of {world} x {args.micro_batch_size} x "
          f"{args.seq_length} tokens; gloo CPU ranks, one thread each: software overhead only")
    print(f"{'layout':<22} {'dispatcher':<10} {'ms/iter':>8} {'tokens/s':>9} {'vs one process':>14}")
    alone = tokens / seconds["one process"]
    print(f"{'one process':<22} {'-':<10} {seconds['one process'] * 1000:>8.1f} {alone:>9.0f} {1:>14.3f}")
    for layout, elapsed in seconds.items():
        if layout == "one process":
            continue
        ep, dispatcher = layout.split()
        name = f"EP {ep} x EDP {world // int(ep)} ({world} ranks)"
        shown = dispatcher if int(ep) > 1 else "-"
        print(f"{name:<22} {shown:<10} {elapsed * 1000:>8.1f} {tokens / elapsed:>9.0f} "
              f"{tokens / elapsed / alone:>14.3f}")


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ep", type=int, nargs="+", default=[1, 2, 4],
                        help="expert-parallel sizes; the world is the largest, which the others divide")
    parser.add_argument("--hidden", type=int, default=64, help="hidden size (each expert's FFN size too)")
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--topk", type=int, default=2)
    parser.add_argument("--layers", type=int, default=2, help="layers of the tokens/s model (all MoE)")
    parser.add_argument("--seq-length", type=int, default=64)
    parser.add_argument("--micro-batch-size", type=int, default=2, help="sequences per rank")
    parser.add_argument("--vocab-size", type=int, default=512)
    parser.add_argument("--iters", type=int, default=5, help="timed iterations per layout")
    parser.add_argument("--warmup-iters", type=int, default=1)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--output", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    world = max(args.ep)
    for ep in args.ep:
        if ep < 1 or world % ep or args.experts % ep:
            raise UserError(f"--ep {ep} must divide --experts {args.experts} and the world of {world} ranks (the "
                            f"largest --ep); pick --ep values that divide both")
    if args.iters < 1 or args.warmup_iters < 0:
        raise UserError("--iters must be at least 1 and --warmup-iters at least 0")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    flags = flags_of(args, ("hidden", "experts", "topk", "layers", "seq_length", "micro_batch_size", "vocab_size",
                            "iters", "warmup_iters"))
    world = max(args.ep)
    ranks = run_ranks(__file__, world, ["--ep", *map(str, args.ep), *flags])
    match = traffic_table(args, ranks) if world > 1 else True
    throughput_table(args, ranks[0]["seconds"], world)
    if world > 1:
        print(f"{'PASS' if match else 'FAIL'}: every rank's bytes {'equal' if match else 'differ from'} the closed "
              f"form")
    return 0 if match else 1


if __name__ == "__main__":
    sys.exit(run_main(main))
