"""Context-parallel attention: bytes each rank sends in one attention forward + backward under each
`--cp-comm-type`, against their closed form, and (where CUDA is present) its time against one-device SDPA.

    python tools/bench/cp_attention.py                  # a world of 4 gloo ranks; CP 2 and 4
    python tools/bench/cp_attention.py --cp 2 --seq-length 64 --heads 4 --groups 2

The script launches itself (tools/bench/memory.py's run_ranks) on max(--cp) gloo ranks (one thread each); at a smaller CP the world
is DP x CP and each CP group runs on its own. Rank 0 prints every rank's figures.

Bytes: `megalite.model.context_parallel.context_parallel_attention` runs a forward and a backward (fp32, seed
fixed) on each rank's zig-zag share while the collectives over the CP group are counted by what each rank sends:
the send ops of `batch_isend_irecv` by their tensors' bytes; an all-gather or reduce-scatter of a whole tensor
of W bytes by a ring, W (CP-1)/CP; an all-to-all, the rows it sends to the other ranks. With P = CP, s = S/P
tokens per rank, batch b, n query heads, g key/value heads of d elements of e bytes, KV = 2 s b g d e (this
rank's K and V), per rank:

- p2p: forward sends the K/V block P-1 hops round the ring; backward sends it P-1 hops again, and the dK/dV
  accumulator (in the LSE's dtype: fp32 or wider, the same bytes at fp32) P hops, the last bringing each rank
  its own: (3P - 2) KV at fp32.
- all_gather: K and V all-gathered, dK and dV reduce-scattered: 2 (P-1) KV.
- a2a: q, k, v all-to-all'd from sequence to heads and the output back, each grad the reverse way; each sends
  (P-1)/P of its tensor, k and v with their heads repeated to lcm(g, P) so they split over P:
  4 (P-1)/P s b d e (n + lcm(g, P)).
- a2a+p2p (from CP 4: the all-to-all among pairs of adjacent CP ranks, the ring over the CP/2 pairs): a2a's
  bytes over 2 ranks, then p2p's over CP/2 ranks of 2s tokens, n/2 heads and lcm(g, 2)/2 key/value heads.
The closed form is `megalite.model.context_parallel.bytes_sent`, which the dry run prints too.

Time (CUDA only; skipped on a CPU, saying so): the CP ranks share the one GPU, their tensors on it and their
collectives over gloo, and time forward + backward of their share at the same total length S as one-device
causal SDPA on the whole sequence. With the ranks on one GPU this measures the CP path's overhead (the
collectives through the host, the per-block kernels), not the speed-up of CP devices. The p2p ring is not
timed there: gloo's send/receive take CPU tensors only (timing it needs NCCL, one GPU per rank). Its arithmetic
is: one rank's ring blocks, without communication, by CUDA's flash kernel (the ring's bf16 path) and by plain
matmuls, each beside 1/CP of the one-device SDPA time (1.0: no overhead over a perfect split).
"""

import argparse
import sys
import time

import torch

from megalite.errors import UserError, run_main
from megalite.model.context_parallel import bytes_sent
from tools.bench.memory import flags_of, gather_to_file, run_ranks

COMM_TYPES = ("p2p", "all_gather", "a2a")
A2A_SIZE = 2  # a2a+p2p here: the all-to-all among pairs of adjacent CP ranks, the ring over the pairs (CP 4 and up)
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
KB = 2 ** 10
SEED = 1234


class ContextParallelTraffic:
    """Counts the bytes this rank sends by each collective over `group` while installed (module docstring)."""

    def __init__(self, group):
        import torch.distributed as dist

        from tools.bench.moe_dispatch import ExpertParallelTraffic

        # The all-gather, reduce-scatter and all-to-all are counted as the MoE bench counts them.
        self.collectives = ExpertParallelTraffic(group)
        self.bytes = self.collectives.bytes | {"p2p": 0}
        self.collectives.bytes = self.bytes
        self.group, self.original = group, dist.batch_isend_irecv
        dist.batch_isend_irecv = self._batch_isend_irecv

    def _batch_isend_irecv(self, operations):
        import torch.distributed as dist

        for operation in operations:
            if operation.op is dist.isend and operation.group is self.group:
                self.bytes["p2p"] += operation.tensor.numel() * operation.tensor.element_size()
        return self.original(operations)

    def remove(self) -> None:
        import torch.distributed as dist

        dist.batch_isend_irecv = self.original
        self.collectives.remove()


def random_qkv(args, cp: int, rank: int, device, dtype) -> list[torch.Tensor]:
    """This rank's q `[S/CP, b, heads, d]`, k and v `[S/CP, b, groups, d]`, leaves that want grads."""
    generator = torch.Generator().manual_seed(SEED + rank)
    tokens = args.seq_length // cp
    shapes = [(tokens, args.batch, heads, args.head_dim) for heads in (args.heads, args.groups, args.groups)]
    return [torch.randn(shape, generator=generator).to(device, dtype).requires_grad_() for shape in shapes]


def comm_types(cp: int) -> tuple[str, ...]:
    """The comm types measured at `cp`: a2a+p2p where its two levels are both above one rank."""
    return COMM_TYPES + (("a2a+p2p",) if cp > A2A_SIZE else ())


def levels_of(comm_type: str, parallel) -> tuple | None:
    """a2a+p2p's (all-to-all, ring) groups of `parallel` (built with cp_a2a=A2A_SIZE); None for the others."""
    return (parallel.cp_a2a_group, parallel.cp_p2p_group) if comm_type == "a2a+p2p" else None


def attention_traffic(args, comm_type: str, parallel) -> dict:
    """Bytes sent per collective in one CP attention forward + backward of this rank's share (fp32, CPU); a2a+p2p's
    over both of its groups."""
    from megalite.model.context_parallel import context_parallel_attention

    q, k, v = random_qkv(args, parallel.cp_size, parallel.cp_rank, "cpu", torch.float32)
    levels = levels_of(comm_type, parallel)
    counters = [ContextParallelTraffic(group) for group in (levels or (parallel.cp_group,))]
    try:
        out = context_parallel_attention(q, k, v, parallel.cp_group, comm_type, levels=levels)
        out.backward(torch.randn_like(out))
    finally:
        for counter in reversed(counters):  # each wraps the functions the one before it wrapped
            counter.remove()
    return {kind: sum(counter.bytes[kind] for counter in counters) for kind in counters[0].bytes}


def seconds_per_iteration(args, step, together: bool = False, device: str = "cuda") -> float:
    """Seconds of `step()` (one iteration) per iteration, after the warm-up ones, the device drained at both ends;
    with `together` every rank starts and ends the timing together."""
    import torch.distributed as dist

    synchronize = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    for iteration in range(args.warmup_iters + args.iters):
        if iteration == args.warmup_iters:
            synchronize()
            if together:
                dist.barrier()
            start = time.perf_counter()
        step()
    synchronize()
    if together:
        dist.barrier()
    return (time.perf_counter() - start) / args.iters


def forward_backward(attend, qkv):
    """The step of one forward + backward of `attend(q, k, v)`, the output's grad all ones."""
    def step():
        out = attend(*qkv)
        out.backward(torch.ones_like(out))
    return step


def attention_seconds(args, comm_type: str, parallel) -> float | str:
    """This rank's CP attention forward + backward time on the GPU, or why it could not run."""
    from megalite.model.context_parallel import context_parallel_attention

    if "p2p" in comm_type:  # a CUDA tensor sent by gloo fails ("Bad address") and can abort the whole world
        return "gloo's send/receive take CPU tensors only"
    qkv = random_qkv(args, parallel.cp_size, parallel.cp_rank, "cuda", DTYPES[args.dtype])
    try:
        return seconds_per_iteration(
            args, forward_backward(lambda q, k, v: context_parallel_attention(q, k, v, parallel.cp_group, comm_type),
                                   qkv), together=True)
    except RuntimeError as error:  # a gloo collective that does not take CUDA tensors, say
        return str(error).splitlines()[0]


def one_device_seconds(args) -> float:
    """Causal SDPA of the whole sequence on one GPU, forward + backward, per iteration."""
    from megalite.model.context_parallel import context_parallel_attention

    qkv = random_qkv(args, 1, 0, "cuda", DTYPES[args.dtype])
    attend = lambda q, k, v: context_parallel_attention(q, k, v, None, "p2p")  # noqa: E731 - one process: SDPA
    return seconds_per_iteration(args, forward_backward(attend, qkv))


def ring_block_seconds(args, cp: int, kind: str, device: str = "cuda") -> float | str:
    """One CP rank's share of the ring's arithmetic on the GPU, without communication, per iteration: the causal
    diagonal block of its S/CP tokens, then CP-1 half blocks merged in by LSE, and every block's backward from
    the merged output and LSE; `kind` "flash" (the fused kernel, as the ring runs bf16 on CUDA) or "matmul". A
    string says why it was not timed."""
    from megalite.model import context_parallel as ring

    dtype, where = DTYPES[args.dtype], torch.device(device)
    if kind == "flash":
        ops = ring._block_ops(where, dtype=dtype, head_dim=args.head_dim)
        if ops[0] is not ring._block_forward_flash:
            return f"the ring's blocks here: {ring.ring_blocks(where)}"
    else:
        ops = (ring._block_forward_matmul, ring._block_backward_matmul)
    forward, backward = ops
    tokens, half, scale = args.seq_length // cp, args.seq_length // cp // 2, args.head_dim ** -0.5
    generator = torch.Generator().manual_seed(SEED)
    q, k, v, grad = (torch.randn(args.batch, args.heads, tokens, args.head_dim, generator=generator).to(where, dtype)
                     for _ in range(4))
    blocks = [(slice(None), slice(None), True)] + [(slice(None), slice(None, half), False) if step % 2 else
                                                   (slice(half, None), slice(None), False) for step in range(1, cp)]

    def iteration():
        out, lse = forward(q, k, v, True, scale)
        out = out.float()
        for rows, keys, causal in blocks[1:]:
            block_out, block_lse = forward(q[:, :, rows], k[:, :, keys], v[:, :, keys], causal, scale)
            out, lse = ring._merge(out, lse, rows, block_out, block_lse)
        out = out.to(dtype)
        for rows, keys, causal in blocks:
            backward(grad[:, :, rows].contiguous(), q[:, :, rows].contiguous(), k[:, :, keys], v[:, :, keys],
                     out[:, :, rows].contiguous(), lse[:, :, rows].contiguous(), causal, scale)

    return seconds_per_iteration(args, iteration, device=device)


def figures(args, world) -> dict:
    """On every rank: bytes per (CP, comm type); with CUDA, seconds per (CP, comm type) and on rank 0 the
    one-device SDPA (the other ranks wait at a barrier)."""
    import torch.distributed as dist

    from megalite.parallel_state import build_parallel_state

    timed = torch.cuda.is_available()
    result = {"traffic": {}, "seconds": {}}
    for cp in args.cp:
        parallel = build_parallel_state(cp=cp, cp_a2a=A2A_SIZE)
        for comm_type in comm_types(cp):
            result["traffic"][f"{cp} {comm_type}"] = attention_traffic(args, comm_type, parallel)
    for cp in args.cp if timed else ():
        for comm_type in comm_types(cp):  # fresh groups each: a collective refused mid-way leaves its group unusable
            result["seconds"][f"{cp} {comm_type}"] = attention_seconds(args, comm_type, build_parallel_state(cp=cp))
    if timed and world.rank == 0:
        result["seconds"]["one device"] = one_device_seconds(args)
        result["ring"] = {f"{cp} {kind}": ring_block_seconds(args, cp, kind) for cp in args.cp
                          for kind in ("flash", "matmul")}
    dist.barrier()
    return result


def worker(args) -> None:
    gather_to_file(args.output, lambda world: figures(args, world))


def traffic_table(args, ranks: list[dict]) -> bool:
    """Print every rank's bytes per collective beside the closed form; whether they all match."""
    print(f"Bytes sent per rank in one CP attention forward + backward (KB): sequence {args.seq_length}, batch "
          f"{args.batch}, {args.heads} heads, {args.groups} key/value heads of {args.head_dim}, fp32, world of "
          f"{len(ranks)} gloo ranks")
    print(f"{'CP':>3} {'comm type':<10} {'rank':>4} {'p2p':>8} {'all-gather':>10} {'reduce-scatter':>14} "
          f"{'all-to-all':>10} {'total':>9} {'closed form':>11} {'ratio':>6}")
    match = True
    for cp in args.cp:
        for comm_type in comm_types(cp):
            expected = bytes_sent(comm_type, cp, args.seq_length // cp, args.batch, args.heads, args.groups,
                                  args.head_dim, 4, A2A_SIZE)
            for rank, figures_of_rank in enumerate(ranks):
                sent = figures_of_rank["traffic"][f"{cp} {comm_type}"]
                total = sum(sent.values())
                match &= total == expected
                print(f"{cp:>3} {comm_type:<10} {rank:>4} {sent['p2p'] / KB:>8.2f} {sent['all-gather'] / KB:>10.2f} "
                      f"{sent['reduce-scatter'] / KB:>14.2f} {sent['all-to-all'] / KB:>10.2f} {total / KB:>9.2f} "
                      f"{expected / KB:>11.2f} {total / expected:>6.3f}")
    return match


def time_table(args, seconds: dict, ring: dict) -> None:
    """Print rank 0's ms per forward + backward per layout beside one-device SDPA's, then one rank's ring blocks
    (`ring_block_seconds`) beside 1/CP of it."""
    if not seconds:
        print("\nTime: skipped, CUDA is not available here (the CP attention is timed against one-device SDPA on a "
              "GPU only)")
        return
    print(f"\nForward + backward of causal attention over {args.seq_length} tokens (batch {args.batch}, "
          f"{args.heads} heads, {args.groups} key/value heads of {args.head_dim}, {args.dtype}); the CP ranks share "
          f"one GPU, collectives over gloo: the CP path's overhead, not a multi-GPU speed-up")
    print(f"{'layout':<20} {'ms/iter':>9} {'vs one device':>13}")
    alone = seconds.pop("one device")
    print(f"{'one-device SDPA':<20} {alone * 1000:>9.3f} {1:>13.3f}")
    for layout, elapsed in seconds.items():
        cp, comm_type = layout.split()
        _time_row(f"CP {cp} {comm_type}", elapsed, alone)
    print("\nOne CP rank's ring blocks on the GPU, no communication (the diagonal, CP-1 half blocks merged by LSE, "
          "each block's backward from the merged output), against 1/CP of one-device SDPA")
    print(f"{'blocks':<20} {'ms/iter':>9} {'vs SDPA/CP':>13}")
    for layout, elapsed in ring.items():
        cp, kind = layout.split()
        _time_row(f"ring CP {cp} {kind}", elapsed, alone / int(cp))


def _time_row(name: str, elapsed: float | str, baseline: float) -> None:
    """A timed row: its ms per iteration and `baseline` / its seconds; or why it was not timed."""
    if isinstance(elapsed, str):
        print(f"{name:<20} not timed: {elapsed}")
    else:
        print(f"{name:<20} {elapsed * 1000:>9.3f} {baseline / elapsed:>13.3f}")


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cp", type=int, nargs="+", default=[2, 4],
                        help="context-parallel sizes; the world is the largest, which the others divide")
    parser.add_argument("--seq-length", type=int, default=1024, help="the whole sequence's tokens (S)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=8, help="query heads")
    parser.add_argument("--groups", type=int, default=2, help="key/value heads (grouped-query attention)")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="bf16", help="the GPU timing's dtype")
    parser.add_argument("--iters", type=int, default=10, help="timed iterations per layout (GPU only)")
    parser.add_argument("--warmup-iters", type=int, default=2)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--output", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    world = max(args.cp)
    for cp in args.cp:
        if cp < 2 or world % cp or args.seq_length % (2 * cp) or args.heads % cp:
            raise UserError(f"--cp {cp} must be at least 2 and divide the world of {world} ranks (the largest --cp), "
                            f"--heads {args.heads} and half of --seq-length {args.seq_length}; pick --cp values that "
                            "do")
    if args.heads % args.groups:
        raise UserError(f"--groups {args.groups} must divide --heads {args.heads}")
    if args.iters < 1 or args.warmup_iters < 0:
        raise UserError("--iters must be at least 1 and --warmup-iters at least 0")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    flags = flags_of(args, ("seq_length", "batch", "heads", "groups", "head_dim", "dtype", "iters", "warmup_iters"))
    ranks = run_ranks(__file__, max(args.cp), ["--cp", *map(str, args.cp), *flags])
    match = traffic_table(args, ranks)
    time_table(args, ranks[0]["seconds"], ranks[0].get("ring", {}))
    print(f"{'PASS' if match else 'FAIL'}: every rank's bytes {'equal' if match else 'differ from'} the closed form")
    return 0 if match else 1


if __name__ == "__main__":
    sys.exit(run_main(main))
