"""`pretrain_gpt.py --dry-run [--world-size N]`: what a configuration needs on every rank, with no process,
GPU or data, from each pipeline rank's model chunks built on the meta device and the real grad buffer laid
out over them (docs/memory.md)."""

import dataclasses
import os
import time
from dataclasses import dataclass

import torch

from megalite.config import RunConfig, num_parameters, recompute_segments
from megalite.data_parallel.ddp import buffer_groups
from megalite.data_parallel.grad_buffer import GradBuffer
from megalite.kernels import check_kernels
from megalite.model.context_parallel import bytes_sent
from megalite.run.flops import DTYPE_NAMES, flops_per_iteration
from megalite.plan.memory import (ActivationModel, chunk_activation_bytes, element_bytes, peak_activation_bytes,
                                  state_bytes)
from megalite.parallel_state import ParallelState, coordinates, expert_coordinates, group_ranks
from megalite.pipeline_parallel.schedules import max_in_flight, operation_order
from megalite.pipeline_parallel.stages import build_model_chunks, chunk_layers

GIB = 2 ** 30


def meta_parallel_state(rank: int, world_size: int, tp: int, pp: int, sequence_parallel: bool = False,
                        ep: int = 1, etp: int | None = None, cp: int = 1) -> ParallelState:
    """Rank `rank`'s ParallelState on the meta device, without torch.distributed; `etp` None: tp."""
    etp = tp if etp is None else etp
    pp_rank, dp_rank, cp_rank, tp_rank = coordinates(rank, world_size, tp, pp, cp)
    edp_rank, ep_rank, _ = expert_coordinates(rank, world_size, pp, ep, etp)
    # Pipelines are listed in (dp, cp, tp) order.
    embedding = group_ranks(world_size, tp, pp, cp=cp)["embedding"][(dp_rank * cp + cp_rank) * tp + tp_rank]
    group = object()  # a process group's stand-in: the layers want one under TP, a dry run never communicates
    return ParallelState(rank=rank, world_size=world_size, tp_size=tp, tp_rank=tp_rank, tp_group=group,
                         pp_size=pp, pp_rank=pp_rank, pp_group=group, dp_size=world_size // (tp * cp * pp),
                         cp_size=cp, cp_rank=cp_rank, cp_group=group, dp_cp_group=group, tp_cp_group=group,
                         dp_rank=dp_rank, dp_group=group, mp_group=group,
                         embedding_group=group if rank in embedding else None, embedding_ranks=embedding,
                         ep_size=ep, ep_rank=ep_rank, ep_group=group, expert_tp_size=etp,
                         expert_dp_size=world_size // (pp * ep * etp), expert_dp_rank=edp_rank,
                         expert_dp_group=group, tp_ep_group=group, expert_mp_group=group,
                         device=torch.device("meta"), sequence_parallel=sequence_parallel)


def grad_buffers(chunks: list[torch.nn.Module], sharding, dense_shards: int, expert_shards: int,
                 bucket_size: int | None) -> list[GradBuffer]:
    """The grad buffers as the data-parallel model lays them out: the dense parameters' (cut into
    `dense_shards`, DP under a sharded optimizer state) and, where the chunks hold routed experts
    (`expert_parallel`), theirs (cut into `expert_shards`, expert-DP)."""
    buffers = []
    for expert, shards in ((False, dense_shards), (True, expert_shards)):
        params = buffer_groups(chunks, sharding, expert)
        if not expert or any(params):
            buffers.append(GradBuffer(params, shard_count=shards, bucket_size=bucket_size))
    return buffers


def dry_run_vocabulary(run: RunConfig) -> tuple[int, str]:
    """(the tokenizer's vocabulary, where it came from), reading no data and nothing large."""
    from megalite.data.tokenizer import build_tokenizer

    data = run.data
    if data.tokenizer_type == "NullTokenizer":
        return build_tokenizer("NullTokenizer", vocab_size=data.vocab_size).vocab_size, \
            f"NullTokenizer --vocab-size {data.vocab_size} (+1 for EOD)"
    if data.tokenizer_type == "GPT2BPETokenizer" and all(path and os.path.exists(path)
                                                         for path in (data.vocab_file, data.merge_file)):
        tokenizer = build_tokenizer(data.tokenizer_type, vocab_file=data.vocab_file, merge_file=data.merge_file)
        return tokenizer.vocab_size, f"--vocab-file {data.vocab_file}"
    if data.tokenizer_model and os.path.exists(data.tokenizer_model):
        tokenizer = build_tokenizer(data.tokenizer_type, data.tokenizer_model)
        return tokenizer.vocab_size, f"--tokenizer-model {data.tokenizer_model}"
    # The preset's, not the built-in corpus's: a plan of --model llama3-8b is of its 128256-token vocabulary.
    why = "no --tokenizer-model" if not data.tokenizer_model else f"--tokenizer-model {data.tokenizer_model} is not " \
                                                                   f"on this machine"
    return run.model.real_vocab_size, f"the {run.model_name} preset ({why})"


@dataclass
class RankClass:
    """The figures shared by `ranks`; bytes are per rank."""

    ranks: list[int]
    pp_rank: int
    layers: list[list[int]]  # global layer ids of each model chunk
    params: int
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    activation_bytes: int  # estimate (megalite/plan/memory.py)
    in_flight: int  # the most micro-batch chunks held at once by the schedule
    working_bytes: int = 0  # ZeRO-2/3: gathered units and full grads that exist only during an iteration
    expert_params: int = 0  # of `params`, the routed experts' (this rank's E/EP experts of each MoE layer)

    @property
    def total_bytes(self) -> int:
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes + self.working_bytes + self.activation_bytes


@dataclass
class DryRunReport:
    """The plan of `run` (its model holding the vocabulary assumed): that vocabulary and its source,
    per-iteration figures, and the rank classes."""

    run: RunConfig
    tokenizer_vocab: int
    vocab_source: str
    model_flops: float  # per iteration, recomputation not counted (what MFU divides)
    hardware_flops: float  # per iteration, recomputation counted
    classes: list[RankClass]
    seconds: float  # how long planning took

    def rank_class(self, rank: int) -> RankClass:
        return next(cls for cls in self.classes if rank in cls.ranks)


def plan(run: RunConfig) -> DryRunReport:
    """Every rank's figures for `run`, grouped into classes of equal figures."""
    start = time.perf_counter()
    vocab, source = dry_run_vocabulary(run)
    run = run.with_tokenizer_vocab(vocab)
    layout, train, model, num_microbatches = run.parallel, run.train, run.model, run.num_microbatches
    tp, pp, dp, world = (layout.tensor_model_parallel_size, layout.pipeline_model_parallel_size,
                         layout.data_parallel_size, layout.world_size)
    ep, etp, edp = layout.expert_model_parallel_size, layout.expert_tensor_size, layout.expert_data_parallel_size
    vp, dtype = layout.virtual_pipeline_model_parallel_size, train.params_dtype
    first, last = layout.decoder_first_pipeline_num_layers, layout.decoder_last_pipeline_num_layers
    cp = layout.context_parallel_size
    activations = ActivationModel(model, train.micro_batch_size, tp, layout.sequence_parallel, element_bytes(dtype),
                                  ep, etp, cp)
    sharding = layout.sharding
    # The bf16 copies of buckets in flight (ddp.py): every bucket's when reductions overlap the backward, else one.
    overlapped = layout.overlap_grad_reduce and not sharding.grads
    bf16_reduce = ("all" if overlapped else "one") if layout.grad_reduce_in_bf16 and dp * cp > 1 else None
    by_figures: dict[tuple, RankClass] = {}
    recomputed_layers = 0  # the layers full recomputation rebuilds in a backward, over every pipeline rank
    for pp_rank in range(pp):
        # Every rank of a stage holds as many parameters (EP ranks: as many experts): one build stands for all.
        state = meta_parallel_state(pp_rank * dp * cp * tp, world, tp, pp, layout.sequence_parallel, ep, etp, cp)
        chunks = build_model_chunks(model, train.seed, "meta", dtype, state, vp, first, last)
        # The grad buffers as MixedPrecisionOptimizer lays them out: building the optimizer itself would import
        # torch's compiler, seconds for nothing (tests/plan/test_dry_run.py checks the two agree).
        buffers = grad_buffers(list(chunks), sharding, dp * cp if sharding.optimizer_state else 1,
                               edp if sharding.optimizer_state else 1,
                               None if sharding.params else layout.ddp_bucket_size)
        params = sum(param.numel() for param in chunks.parameters())
        expert_params = sum(param.numel() for param in chunks.parameters() if getattr(param, "expert_parallel", False))
        layers = chunk_layers(model.num_layers, pp, pp_rank, vp, first, last)
        recomputed_layers += sum(len(positions) for ids in layers for positions, checkpointed
                                 in recompute_segments(len(ids), model.recompute_method, model.recompute_num_layers)
                                 if checkpointed)
        ops = operation_order(pp, vp, num_microbatches, pp_rank)
        chunk_bytes = [chunk_activation_bytes(activations, list(ids), chunk * pp + pp_rank == 0,
                                              chunk * pp + pp_rank == pp * vp - 1)
                       for chunk, ids in enumerate(layers)]
        recomputed_unit = max(activations.largest_recomputed_unit(len(ids)) for ids in layers)
        rebuilt = max(activations.recomputed_unit_bytes(list(ids)) for ids in layers)
        activation = peak_activation_bytes(ops, chunk_bytes, rebuilt)
        for rank in range(pp_rank * dp * cp * tp, (pp_rank + 1) * dp * cp * tp):
            # A rank's optimizer shard: its DP x CP rank's of the dense buffer, its expert-DP rank's of the experts'.
            _, dp_rank, cp_rank, _ = coordinates(rank, world, tp, pp, cp)
            edp_rank, _, _ = expert_coordinates(rank, world, pp, ep, etp)
            shards = (dp_rank * cp + cp_rank, edp_rank) if sharding.optimizer_state else (0, 0)
            figures = [state_bytes(buffer, dtype, shard, sharding, bf16_reduce, recomputed_unit)
                       for buffer, shard in zip(buffers, shards)]
            figures = {key: sum(part[key] for part in figures) for key in figures[0]}
            param_bytes = figures["params"] if sharding.params else params * element_bytes(dtype)
            candidate = RankClass([], pp_rank, layers, params, param_bytes, figures["grads"], figures["optimizer"],
                                  activation, max_in_flight(ops), figures["working"], expert_params)
            # The rest is the pipeline rank's: ranks differ only in their optimizer shards.
            cls = by_figures.setdefault((pp_rank, figures["grads"], figures["optimizer"]), candidate)
            cls.ranks.append(rank)
    classes = sorted(by_figures.values(), key=lambda cls: cls.ranks[0])
    for cls in classes:
        cls.ranks.sort()
    return DryRunReport(run, vocab, source,
                        flops_per_iteration(model, train.global_batch_size, model.seq_length),
                        flops_per_iteration(model, train.global_batch_size, model.seq_length, include_recompute=True,
                                            recomputed_layers=recomputed_layers),
                        classes, time.perf_counter() - start)


def format_ranks(ranks: list[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> "0-2,5,7-8"."""
    runs, start = [], ranks[0]
    for previous, current in zip(ranks, ranks[1:] + [None]):
        if current != previous + 1:
            runs.append(f"{start}" if start == previous else f"{start}-{previous}")
            start = current
    return ",".join(runs)


def _stage(cls: RankClass, pp: int) -> str:
    if pp == 1:
        return "all"
    name = "first" if cls.pp_rank == 0 else "last" if cls.pp_rank == pp - 1 else "middle"
    return f"{cls.pp_rank} ({name})"


def _context_parallel_line(report: DryRunReport) -> str:
    """CP's tokens per rank and the attention's traffic: bytes a rank sends per layer and micro-batch (forward +
    backward, `model.context_parallel.bytes_sent`), and per iteration on the stage with the most layers."""
    run, layout, model = report.run, report.run.parallel, report.run.model
    cp, tp, comm_type = layout.context_parallel_size, layout.tensor_model_parallel_size, layout.cp_comm_type
    tokens = model.seq_length // cp
    per_layer = bytes_sent(comm_type, cp, tokens, run.train.micro_batch_size, model.num_attention_heads // tp,
                           max(model.query_groups // tp, 1), model.head_dim, element_bytes(run.train.params_dtype),
                           layout.cp_a2a_size)
    layers = max(sum(len(ids) for ids in cls.layers) for cls in report.classes)
    if comm_type == "a2a+p2p":
        comm_type += " (a2a over {}, p2p over {})".format(*layout.hierarchical_context_parallel_sizes)
    return (f"context parallel: CP {cp}, {tokens} tokens of each sequence per rank; --cp-comm-type {comm_type} sends "
            f"{per_layer / 2 ** 20:.1f} MiB per rank per layer and micro-batch (forward + backward), "
            f"{per_layer * layers * run.num_microbatches / GIB:.2f} GiB per iteration ({layers} layers x "
            f"{run.num_microbatches} micro-batch{'es' * (run.num_microbatches != 1)}; a recomputed forward's repeat not "
            f"counted)")


def format_report(report: DryRunReport) -> str:
    """The printed plan: the layout, the batch, the FLOPs, one row per rank class, and a warning naming the
    ranks that need more than --dry-run-gpu-memory."""
    run, layout, train, model = report.run, report.run.parallel, report.run.train, report.run.model
    pp, dp = layout.pipeline_model_parallel_size, layout.data_parallel_size
    vp = layout.virtual_pipeline_model_parallel_size
    dtype = DTYPE_NAMES[train.params_dtype]
    schedule = "no pipelining" if pp == 1 else "1F1B" if vp == 1 else f"interleaved 1F1B, {vp} chunks per rank"
    padded_params = num_parameters(model)
    # --recompute-*: "none", "selective", "full", "full, uniform 2", "full, block 1"
    recompute = model.recompute_granularity or "none"
    if model.recompute_method is not None:
        recompute += f", {model.recompute_method} {model.recompute_num_layers}"
    params = num_parameters(dataclasses.replace(model, vocab_size=model.real_vocab_size))
    active = num_parameters(dataclasses.replace(model, vocab_size=model.real_vocab_size), active=True)
    experts = "" if model.num_experts is None else (
        f"; {active:,} active per token (its top {model.moe_router_topk} of {model.num_experts} experts in "
        f"{sum(map(model.is_moe_layer, range(model.num_layers)))} MoE layers)")
    lines = [
        f"dry run: {run.model_name} on {layout.describe()}, {dtype}",
        *([f"precision: {dtype}, a GPU run's default (no --bf16, --fp16 or --fp32 given); --fp32 or --fp16 plans "
           f"those instead"] if train.bf16_default else []),
        f"model: {params:,} parameters ({padded_params:,} with the vocabulary padded to {model.vocab_size}){experts}; "
        f"{model.num_layers} layers, hidden {model.hidden_size}, seq {model.seq_length}; vocabulary "
        f"{report.tokenizer_vocab} from {report.vocab_source}",
        f"batch: global {train.global_batch_size} = micro-batch {train.micro_batch_size} x "
        f"{run.num_microbatches} micro-batches x DP {dp}; schedule: {schedule}; "
        f"recompute: {recompute}",
        *([_context_parallel_line(report)] if layout.context_parallel_size > 1 else []),
        f"FLOPs per iteration: {report.model_flops:.3e} model ({report.model_flops / layout.world_size:.3e} per rank), "
        f"{report.hardware_flops:.3e} with recomputation",
        "per rank (GiB = 2^30 bytes; activations: estimate at the schedule's peak, docs/memory.md):",
    ]
    header = ("ranks", "stage", "layers", "params", "params GiB", "grads GiB", "optim GiB", "working GiB",
              "in flight", "activ GiB", "total GiB")
    # Classes that print alike share a row: DP ranks' optimizer shards differ by a few bytes at most.
    ranks_by_cells: dict[tuple, list[int]] = {}
    for cls in report.classes:
        cells = (_stage(cls, pp), " ".join(format_ranks(ids) for ids in cls.layers), f"{cls.params:,}",
                 *(f"{value / GIB:.2f}" for value in (cls.param_bytes, cls.grad_bytes, cls.optimizer_bytes,
                                                      cls.working_bytes)),
                 str(cls.in_flight), f"{cls.activation_bytes / GIB:.2f}", f"{cls.total_bytes / GIB:.2f}")
        ranks_by_cells.setdefault(cells, []).extend(cls.ranks)
    rows = [header] + [(format_ranks(sorted(ranks)), *cells) for cells, ranks in ranks_by_cells.items()]
    widths = [max(map(len, column)) for column in zip(*rows)]
    for row in rows:
        lines.append("  " + "  ".join(cell.ljust(width) if i < 3 else cell.rjust(width)
                                      for i, (cell, width) in enumerate(zip(row, widths))))
    largest = max(cls.total_bytes for cls in report.classes)
    lines.append(f"largest total per rank: {largest / GIB:.2f} GiB, before the CUDA context, communication buffers "
                 f"and allocator slack; planned in {report.seconds:.2f} s")
    limit = run.dry_run_gpu_memory
    over = sorted(rank for cls in report.classes if cls.total_bytes > limit * GIB for rank in cls.ranks)
    if over:
        many = len(over) > 1
        lines.append(f"warning: rank{'s' * many} {format_ranks(over)} need{'' if many else 's'} more than the "
                     f"{limit:g} GiB of --dry-run-gpu-memory; add tensor or pipeline parallelism, "
                     f"--use-distributed-optimizer or recomputation, or a smaller micro-batch")
    return "\n".join(lines)


def dry_run(run: RunConfig, print_fn=print) -> DryRunReport:
    """Plan `run` and print the report."""
    check_kernels(run.train.kernels)  # as a run's start-up would: --kernels on this machine
    report = plan(run)
    print_fn(format_report(report))
    return report
