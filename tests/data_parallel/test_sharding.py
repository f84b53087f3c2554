"""ZeRO-1/2/3 (--data-parallel-sharding-strategy) on gloo worlds against one process.

Each world builds its ranks' model chunks from the same seed as one process, runs its DP
share of one global batch through the real schedule, finishes the grad sync and returns the
grads its optimizer owns, placed in global coordinates; the test assembles them and compares
every parameter's grad with the one-process grad. The worlds also report how many ZeRO-3
units were gathered at once and which memory was released after the step.
"""

import dataclasses

import numpy as np
import pytest
import torch

from megalite.arguments import parse_args
from megalite.checkpoint import flat_range_pieces, tensor_parallel_pieces
from megalite.config import Sharding
from megalite.data_parallel.ddp import ParallelModel
from megalite.data_parallel.optimizer import DistributedOptimizer, MixedPrecisionOptimizer
from megalite.data_parallel.param_shards import ParamShards
from megalite.errors import UserError
from megalite.model.options import apply_options
from megalite.parallel_state import build_parallel_state
from megalite.pipeline_parallel.comm import PipelineComm
from megalite.pipeline_parallel.stages import build_model_chunks
from megalite.plan.dry_run import plan
from megalite.run.training import forward_backward
from tests.helpers.distributed import run_world
from tests.helpers.pipeline import MICRO, SEQ, config, micro_batches as global_batch
from tools.bench.memory import PeakSampler, random_micro_batch
from tools.check_layouts import COMMON, MODELS


def sharded_world(rank, world_size, tp, pp, vp, strategy, tied, recompute, grad_reduce_in_bf16=False):
    """(loss, owned grads as [(name, offsets, array)], (peak gathered units, peak buckets of full grads),
    bytes left unreleased).
    With grad_reduce_in_bf16 every strategy overlaps its reductions with the backward (async works).

    Arrays rather than tensors: many small tensors sent back through the result queue would
    each need a shared-memory handle that outlives the rank's process."""
    parallel = build_parallel_state(tp, pp, sequence_parallel=tp > 1)
    model = build_model_chunks(config(tied), seed=11, parallel=parallel, vp=vp)
    for chunk in model:
        apply_options(chunk, **recompute)
    ddp = ParallelModel(model, parallel, sharding=Sharding(strategy), bucket_size=2000, overlap_grad_reduce=grad_reduce_in_bf16,
                            grad_reduce_in_bf16=grad_reduce_in_bf16)
    kind = MixedPrecisionOptimizer if strategy == "no_shard" else DistributedOptimizer
    optimizer = kind(ddp, lr=1e-3)
    peak = [0, 0]

    def count_units():  # units with memory: gathered, or being gathered
        if ddp.param_shards is not None:
            peak[0] = max(peak[0], sum(u.bucket.param.untyped_storage().nbytes() > 0 for u in ddp.param_shards.units))

    if ddp.sharded_grads:
        ready = ddp.buffer.on_grad_ready

        def counting_ready(param):  # at each grad's arrival, before its bucket may be reduced and freed
            peak[1] = max(peak[1], sum(bucket.grad.untyped_storage().nbytes() > 0 for bucket in ddp.buffer.buckets))
            count_units()
            ready(param)
        ddp.buffer.on_grad_ready = counting_ready
    if ddp.param_shards is not None:
        shards = ddp.param_shards
        gather = shards.gather

        def counting_gather(unit):
            gather(unit)
            count_units()
        shards.gather = counting_gather
        assert all(unit.bucket.param.untyped_storage().nbytes() == 0 for unit in shards.units)  # sharded at once
    mine = global_batch()[parallel.dp_rank::parallel.dp_size]
    comm = PipelineComm(parallel, (SEQ // tp, MICRO, 32), torch.float32)
    optimizer.zero_grad()
    ddp.start_iteration(len(mine))
    loss = float(forward_backward(model, mine, optimizer, parallel, comm))
    ddp.finish_grad_sync()
    if ddp.param_shards is not None:  # a prefetch that no forward waited for is freed too
        ddp.param_shards.prefetch(ddp.param_shards.units[0])
        ddp.param_shards.release_all()
    return loss, owned_grads(optimizer, strategy, parallel.tp_rank, tp), tuple(peak), unreleased_bytes(ddp)


def owned_grads(optimizer, strategy, tp_rank=0, tp=1) -> list[tuple[str, list[int], np.ndarray]]:
    """The grads `optimizer` owns, as (name, offsets in the global tensor, array)."""
    pieces = []
    if strategy == "no_shard":
        for name, grad, param in zip(optimizer.names, optimizer.main_grads, optimizer.model_params):
            pieces += [(name, p.offsets, p.tensor.numpy().copy())
                       for p in tensor_parallel_pieces(grad, param, tp_rank, tp)]
    else:
        for name, grad, param, (start, _) in zip(optimizer.names, optimizer.main_grads, optimizer.model_params,
                                                 optimizer.ranges):
            pieces += [(name, p.offsets, p.tensor.numpy().copy())
                       for p in flat_range_pieces(grad, param, start, tp_rank, tp)]
    return pieces


def unreleased_bytes(ddp) -> int:
    """ZeRO-2/3's full grads and gathered parameters still allocated."""
    left = 0
    if ddp.sharded_grads:
        left += sum(bucket.grad.untyped_storage().nbytes() for bucket in ddp.buffer.buckets)
    if ddp.param_shards is not None:
        left += sum(unit.bucket.param.untyped_storage().nbytes() for unit in ddp.param_shards.units)
    return left


@pytest.fixture(scope="module")
def single():
    """The one-process loss and grads, tied and untied."""
    references = {}
    for tied in (False, True):
        model = build_model_chunks(config(tied), seed=11)
        ddp = ParallelModel(model)
        ddp.zero_grad()
        loss = float(forward_backward(model, global_batch(), MixedPrecisionOptimizer(ddp, lr=1e-3)))
        references[tied] = (loss, {name: param.main_grad.clone() for name, param in model.named_parameters()})
    return references


LAYOUTS = {  # name -> (processes, tp, pp, vp, tied)
    "dp2": (2, 1, 1, 1, False),
    "dp4-tied": (4, 1, 1, 1, True),
    "tp2-dp2-sp": (4, 2, 1, 1, False),
    "pp2-dp2-tied": (4, 1, 2, 1, True),
    "tp2-pp2-vp2-dp2-sp": (8, 2, 2, 2, False),
}


def check_world(results, reference, strategy):
    loss, grads = reference
    assembled = {name: torch.full_like(grad, float("nan")) for name, grad in grads.items()}
    for rank_loss, pieces, _, left in results:
        assert rank_loss == pytest.approx(loss, rel=1e-6)
        assert left == 0  # ZeRO-2/3: no full grads or gathered parameters outlive the step
        for name, offsets, tensor in pieces:
            region = tuple(slice(o, o + n) for o, n in zip(offsets, tensor.shape))
            assembled[name][region] = torch.from_numpy(tensor)
    for name, grad in grads.items():
        assert not assembled[name].isnan().any(), f"{strategy}: no rank owns all of {name}'s grad"
        torch.testing.assert_close(assembled[name], grad, rtol=1e-5, atol=1e-7, msg=f"{strategy}: {name}")


@pytest.mark.parametrize("strategy", ["optim", "optim_grads", "optim_grads_params"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_each_strategy_gives_the_one_process_grads(layout, strategy, single, one_thread):
    processes, tp, pp, vp, tied = LAYOUTS[layout]
    results = run_world(processes, sharded_world, tp, pp, vp, strategy, tied, {})
    check_world(results, single[tied], strategy)
    if strategy == "optim_grads_params":
        # The running unit and the prefetched one, plus a tied embedding held for the head.
        assert max(peak[0] for _, _, peak, _ in results) <= 2 + tied
    if strategy != "optim":
        # Each micro-batch's buckets are reduced as they fill: the one accumulating and the one in flight, plus
        # a tied embedding's, whose grad comes last in the backward (or, over the pipeline, after the stages' sum).
        assert max(peak[1] for _, _, peak, _ in results) <= 2 + tied


@pytest.mark.parametrize("strategy", ["no_shard", "optim", "optim_grads", "optim_grads_params"])
def test_grads_reduced_in_bf16_match_the_fp32_sum_within_bf16_rounding(strategy, single, one_thread):
    """--grad-reduce-in-bf16 at DP 2: every grad is a bf16 value (the sum really ran in bf16), within bf16's
    rounding of the one-process fp32 grad, and not equal to it (the fp32 reduction matches to 1e-5)."""
    loss, grads = single[False]
    results = run_world(2, sharded_world, 1, 1, 1, strategy, False, {}, True)
    assembled = {name: torch.full_like(grad, float("nan")) for name, grad in grads.items()}
    for rank_loss, pieces, _, left in results:
        assert rank_loss == pytest.approx(loss, rel=1e-6) and left == 0
        for name, offsets, tensor in pieces:
            assembled[name][tuple(slice(o, o + n) for o, n in zip(offsets, tensor.shape))] = torch.from_numpy(tensor)
    differs = False
    for name, grad in grads.items():
        ours = assembled[name]
        if strategy in ("no_shard", "optim"):  # one bf16 sum; ZeRO-2/3 add one per micro-batch to an fp32 shard
            assert torch.equal(ours, ours.bfloat16().float()), f"{strategy}: {name} was not reduced in bf16"
        # Each rank's part rounded to bf16 (2^-9 relative), then their sum: within 2^-7 of the largest grad.
        torch.testing.assert_close(ours, grad, rtol=2 ** -7, atol=2 ** -7 * float(grad.abs().max()),
                                   msg=f"{strategy}: {name}")
        differs |= not torch.allclose(ours, grad, rtol=1e-5, atol=1e-7)
    assert differs


def test_zero3_with_full_recomputation_gives_the_one_process_grads(single, one_thread):
    """Layers 0-2 recomputed as one unit, then layer 3 alone: ZeRO-3 gathers the three together for the
    recomputation (and the tied embedding for the head), and releases everything by the end of the step."""
    recompute = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=3)
    results = run_world(4, sharded_world, 2, 1, 1, "optim_grads_params", True, recompute)
    check_world(results, single[True], "optim_grads_params")
    assert max(peak[0] for _, _, peak, _ in results) == 3 + 1


@pytest.mark.parametrize("early_stop", [True, False])
def test_zero3_keeps_a_recomputed_group_gathered_through_its_backward(single, early_stop):
    """One process (DP 1): the layers of a recomputed unit run their forward hooks again inside the backward,
    which must not release their parameters (torch stops a recomputation early by default, before the
    unit's last forward hook; without that, the hook would release the weights the backward is about to use)."""
    model = build_model_chunks(config(False), seed=11)
    apply_options(model[0], recompute_granularity="full", recompute_method="uniform", recompute_num_layers=2)
    ddp = ParallelModel(model, sharding=Sharding.OPTIM_GRADS_PARAMS)
    optimizer = DistributedOptimizer(ddp, lr=1e-3)
    optimizer.zero_grad()
    ddp.start_iteration(len(global_batch()))
    with torch.utils.checkpoint.set_checkpoint_early_stop(early_stop):
        loss = forward_backward(model, global_batch(), optimizer)
    ddp.finish_grad_sync()
    result = (loss, owned_grads(optimizer, "optim_grads_params"), None, unreleased_bytes(ddp))
    check_world([result], single[False], "optim_grads_params")


def test_zero3_moves_every_parameter_into_its_units_shards():
    """Built on one process (DP 1), ZeRO-3 keeps each parameter's values, laid out by unit, in the DDP's
    ParamShards, which checkpoints take from it explicitly: nothing is written onto the model."""
    model = build_model_chunks(config(False), seed=11)
    before = {name: param.detach().clone() for name, param in model.named_parameters()}
    ddp = ParallelModel(model, sharding=Sharding.OPTIM_GRADS_PARAMS)
    shards: ParamShards = ddp.param_shards
    assert not hasattr(model, "param_shards") and not any(hasattr(chunk, "param_shards") for chunk in model)
    assert len(shards.units) == 4 + 2  # each layer, the embedding, the head
    assert ddp.buffer.param_shards.numel() == sum(param.numel() for param in before.values())
    for unit in shards.units:
        shards.gather(unit)
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.detach(), before[name], rtol=0, atol=0)
    shards.release_all()
    assert all(unit.bucket.param.untyped_storage().nbytes() == 0 for unit in shards.units)


BUDGET_FLAGS = [*COMMON, *MODELS["llama"], "--bf16", "--data-parallel-sharding-strategy"]


def model_state_of_plan(strategy: str) -> int:
    """The dry run's per-rank model state (params, grads, optimizer state and ZeRO's working bytes)."""
    report = plan(parse_args([*BUDGET_FLAGS, strategy, "--dry-run", "--world-size", "4"], 4))
    return max(cls.param_bytes + cls.grad_bytes + cls.optimizer_bytes + cls.working_bytes for cls in report.classes)


def budget_world(rank, world_size, strategy, budget, iterations):
    """Train `iterations` steps under `strategy`; (losses, the most model-state bytes live at once)."""
    run = parse_args([*BUDGET_FLAGS, strategy], world_size)
    parallel = build_parallel_state()
    model = build_model_chunks(run.model, seed=5, dtype=torch.bfloat16, parallel=parallel)
    ddp = ParallelModel(model, parallel, sharding=Sharding(strategy))
    optimizer = (MixedPrecisionOptimizer if strategy == "no_shard" else DistributedOptimizer)(ddp, lr=3e-3)
    sampler = PeakSampler(model, ddp, optimizer)
    batch = random_micro_batch(run.model, parallel.dp_rank)
    losses = []
    for _ in range(iterations):
        optimizer.zero_grad()
        ddp.start_iteration(1)
        losses.append(float(forward_backward(model, [batch], optimizer, parallel)))
        ddp.finish_grad_sync()
        optimizer.step(3e-3)
        sampler.sample()
        if sampler.peak > budget:
            break  # over the budget: a GPU of this size would have run out of memory here
    return losses, sampler.peak


def test_zero3_trains_a_model_whose_unsharded_state_exceeds_the_budget(one_thread):
    """A per-rank budget between the dry run's ZeRO-3 and no_shard figures: ZeRO-3 trains within it
    (live model state sampled throughout), no_shard does not fit it."""
    zero3, unsharded = model_state_of_plan("optim_grads_params"), model_state_of_plan("no_shard")
    budget = zero3  # what the dry run says ZeRO-3 needs at most, working bytes included
    assert unsharded > 2 * budget
    losses, peak = run_world(4, budget_world, "optim_grads_params", budget, 8)[0]
    assert peak <= budget and len(losses) == 8 and losses[-1] < losses[0] - 0.5
    _, unsharded_peak = run_world(4, budget_world, "no_shard", budget, 1)[0]
    assert unsharded_peak > budget


def param_gather_world(rank, world_size, overlap, pp=1, tied=False, fused=False):
    """Three steps of the distributed optimizer (ZeRO-1) at DP 2 x `pp`, `fused`: the fused output layer and
    loss; (pp rank, losses, bucket gathers still in flight right after the first step, the final weights as
    arrays by name)."""
    parallel = build_parallel_state(1, pp)
    model = build_model_chunks(dataclasses.replace(config(tied), fused_output_cross_entropy=fused), seed=11,
                               parallel=parallel)
    # Small buckets: a weight read outside its module's forward sits alone in one.
    ddp = ParallelModel(model, parallel, sharding=Sharding.OPTIM, bucket_size=16, overlap_param_gather=overlap)
    optimizer = DistributedOptimizer(ddp, lr=1e-2)
    comm = PipelineComm(parallel, (SEQ, MICRO, 32), torch.float32) if pp > 1 else None
    mine = global_batch()[parallel.dp_rank::parallel.dp_size]
    losses, pending = [], 0
    for step in range(3):
        optimizer.zero_grad()
        ddp.start_iteration(len(mine))
        losses.append(float(forward_backward(model, mine, optimizer, parallel, comm)))
        ddp.finish_grad_sync()
        optimizer.step(1e-2)
        if step == 0:
            pending = len(ddp._gathers or {})
    ddp.finish_param_sync()
    return parallel.pp_rank, losses, pending, {name: param.detach().numpy().copy()
                                               for name, param in model.named_parameters()}


@pytest.mark.parametrize("pp, tied, fused", [(1, False, False), (1, False, True), (2, True, False)],
                         ids=["dp2", "dp2-fused-output", "pp2-dp2-tied"])
def test_overlapped_param_gather_changes_nothing(pp, tied, fused, one_thread):
    """--overlap-param-gather: the step only starts the all-gathers, each forward waits for the weights it
    reads (also those read outside their module: the fused output layer's, a tied last stage's embedding
    copy), and training is bitwise the same; a tied embedding's two pipeline copies stay equal."""
    plain = run_world(2 * pp, param_gather_world, False, pp, tied, fused)
    overlapped = run_world(2 * pp, param_gather_world, True, pp, tied, fused)
    for (_, losses, _, weights), (_, losses_overlapped, pending, weights_overlapped) in zip(plain, overlapped):
        assert pending > 1 and losses_overlapped == losses and len(set(losses)) == 3
        for name, values in weights.items():
            assert np.array_equal(weights_overlapped[name], values), name
    if tied:
        name = "embedding.word_embeddings.weight"
        first, last = (next(w for stage, _, _, w in overlapped if stage == s)[name] for s in (0, pp - 1))
        assert np.array_equal(first, last)


def in_place_world(rank, world_size, strategy):
    """Two steps of ZeRO-1/2 at DP 2 with overlapped grad reductions and param gathers; for each collective,
    (its name, whether its output lies in its input's storage, whether that storage is the grad buffer's or
    the parameters' own)."""
    import megalite.data_parallel.ddp as ddp_module

    parallel = build_parallel_state()
    model = build_model_chunks(config(False), seed=11, parallel=parallel)
    ddp = ParallelModel(model, parallel, sharding=Sharding(strategy), bucket_size=2000, overlap_grad_reduce=True,
                       overlap_param_gather=True)
    optimizer = DistributedOptimizer(ddp, lr=1e-2)
    records = []

    def storage(tensor):
        return tensor.untyped_storage().data_ptr()

    def recorded(name, collective, owners):
        def call(output, source, **kwargs):
            records.append((name, storage(output) == storage(source), storage(source) in owners()))
            return collective(output, source, **kwargs)
        return call

    buffer = ddp.buffer
    grads = (lambda: {storage(bucket.grad) for bucket in buffer.buckets}) if buffer.sharded else \
        (lambda: {storage(buffer.data)})
    ddp_module.reduce_scatter_single = recorded("reduce-scatter", ddp_module.reduce_scatter_single, grads)
    ddp_module.all_gather_single = recorded("all-gather", ddp_module.all_gather_single,
                                            lambda: {storage(buffer.param_data)})
    mine = global_batch()[parallel.dp_rank::parallel.dp_size]
    for _ in range(2):
        optimizer.zero_grad()
        ddp.start_iteration(len(mine))
        forward_backward(model, mine, optimizer, parallel)
        ddp.finish_grad_sync()
        optimizer.step(1e-2)
    ddp.finish_param_sync()
    return records


@pytest.mark.parametrize("strategy", ["optim", "optim_grads"])
def test_zero1_and_zero2_reduce_and_gather_in_place(strategy, one_thread):
    """No copy of the grads before a reduce-scatter, no separate tensor to gather the parameters into: each
    collective's output is its rank's slice of its input, the grad buffer's or the parameters' own storage."""
    for records in run_world(2, in_place_world, strategy):
        assert {name for name, _, _ in records} == {"reduce-scatter", "all-gather"}
        assert all(in_place and owned for _, in_place, owned in records), records


def test_overlap_param_gather_needs_a_sharded_optimizer():
    with pytest.raises(UserError, match="--overlap-param-gather overlaps the distributed optimizer's"):
        parse_args(["--overlap-param-gather"])
    assert parse_args(["--overlap-param-gather", "--use-distributed-optimizer"]).parallel.overlap_param_gather
