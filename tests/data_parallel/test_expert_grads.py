"""Expert params (`expert_parallel`) in their own grad buffer, reduced over expert-DP, on gloo worlds.

A toy model stands for an MoE model: each layer holds dense params (a TP-split weight, a TP-replicated bias, an
SP-marked norm) and expert params (weight `[E, 4, 6]`, bias `[E, 6]`: rank ep_rank holds experts
[ep_rank E/EP, (ep_rank + 1) E/EP), under ETP = TP also split over TP). Every param p of a rank takes, per
micro-batch, the loss `sum(x * p) + s/2 sum(p^2)` with `x` and `s` drawn for the rank's contributor: its DP rank
for dense params (TP ranks alike, SP-marked ones also by TP rank), its expert-DP rank for experts (the tokens an
expert saw on the ranks holding its copy). So one process holding all params has the grad x + s W summed over
the contributors: dense over DP, experts over expert-DP only (no EP scale). After one step under each sharding
strategy (overlap on and off) every rank's owned grads, grad norm and updated params must equal that reference
and one AdamW step with the same global norm.
"""

import numpy as np
import pytest
import torch
from torch import nn

from megalite.config import Sharding
from megalite.data_parallel.ddp import ParallelModel
from megalite.data_parallel.grad_buffer import is_expert
from megalite.data_parallel.optimizer import DistributedOptimizer, MixedPrecisionOptimizer
from megalite.parallel_state import build_parallel_state
from tests.helpers.distributed import run_world

EXPERTS, LAYERS_PER_STAGE, MICRO_BATCHES = 4, 2, 2
HYPER = dict(lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8, clip_grad=0.5)
STRATEGIES = [(strategy, overlap) for strategy in ("no_shard", "optim", "optim_grads", "optim_grads_params")
              for overlap in (False, True)]
# name suffix -> (global shape, expert, how it splits: "tp" its dim 0 over TP, "ep" dim 0 over EP and under
# ETP > 1 dim 1 over TP, "sp" TP-replicated and summed over TP, "" replicated)
PARAMS = {
    "dense.weight": ((4, 6), False, "tp"),
    "dense.bias": ((6,), False, ""),
    "dense.norm": ((6,), False, "sp"),
    "experts.weight": ((EXPERTS, 4, 6), True, "ep"),
    "experts.bias": ((EXPERTS, 6), True, "ep"),
}


class Coordinates:
    """A rank's place in both grids, from its ParallelState (or given, for the one-process reference)."""

    def __init__(self, tp, ep, etp, pp_rank, dp_rank, tp_rank, edp_rank, ep_rank):
        self.tp, self.ep, self.etp = tp, ep, etp
        self.pp_rank, self.dp_rank, self.tp_rank, self.edp_rank, self.ep_rank = (pp_rank, dp_rank, tp_rank,
                                                                                edp_rank, ep_rank)

    @classmethod
    def of(cls, parallel):
        return cls(parallel.tp_size, parallel.ep_size, parallel.expert_tp_size, parallel.pp_rank, parallel.dp_rank,
                   parallel.tp_rank, parallel.expert_dp_rank, parallel.ep_rank)

    def box(self, suffix: str) -> tuple[slice, ...]:
        """This rank's part of the global param `suffix`."""
        shape, _, split = PARAMS[suffix]
        if split == "tp":
            rows = shape[0] // self.tp
            return (slice(self.tp_rank * rows, (self.tp_rank + 1) * rows),)
        if split == "ep":
            local = EXPERTS // self.ep
            box = [slice(self.ep_rank * local, (self.ep_rank + 1) * local)]
            if len(shape) == 3 and self.etp > 1:
                rows = shape[1] // self.etp
                box.append(slice(self.tp_rank * rows, (self.tp_rank + 1) * rows))
            return tuple(box)
        return ()

    def contributor(self, suffix: str) -> tuple[int, ...]:
        """Whose micro-batches this rank's grad of `suffix` stands for (see the module docstring)."""
        _, expert, split = PARAMS[suffix]
        summed_over_tp = split == "sp" or (suffix == "experts.bias" and self.etp > 1)
        return (self.edp_rank if expert else self.dp_rank,) + ((self.tp_rank,) if summed_over_tp else ())


def layer_ids(pp_rank: int) -> range:
    return range(pp_rank * LAYERS_PER_STAGE, (pp_rank + 1) * LAYERS_PER_STAGE)


def global_values(name: str) -> torch.Tensor:
    """Param `name`'s initial values, the whole tensor."""
    generator = torch.Generator().manual_seed(hash_of(name))
    return torch.randn(PARAMS[suffix_of(name)][0], generator=generator)


def inputs(name: str, micro: int, contributor: tuple[int, ...]) -> tuple[torch.Tensor, float]:
    """(x, s) of `contributor`'s micro-batch `micro` for param `name`: x global-shaped."""
    generator = torch.Generator().manual_seed(hash_of(f"{name}/{micro}/{contributor}"))
    return torch.randn(PARAMS[suffix_of(name)][0], generator=generator), 0.5 + 0.25 * sum(contributor) + 0.1 * micro


def hash_of(text: str) -> int:
    return sum(ord(c) * 31 ** i for i, c in enumerate(text)) % 2 ** 31


def suffix_of(name: str) -> str:
    return name.split(".", 2)[2]


class ToyPart(nn.Module):
    """The dense or the expert params of a layer, marked as the contract says."""

    def __init__(self, layer: int, kind: str, where: Coordinates):
        super().__init__()
        for suffix in [s for s in PARAMS if s.startswith(kind)]:
            name = f"layers.{layer}.{suffix}"
            _, expert, split = PARAMS[suffix]
            param = nn.Parameter(global_values(name)[where.box(suffix)].clone())
            param.expert_parallel = expert
            param.tensor_model_parallel = split == "tp" or (split == "ep" and param.ndim == 3 and where.etp > 1)
            param.partition_dim = 0 if split == "tp" else 1
            param.sequence_parallel = split == "sp" or (suffix == "experts.bias" and where.etp > 1)
            self.register_parameter(suffix.split(".")[1], param)


class ToyLayer(nn.Module):
    """A layer with dense params and (unless `experts` is False) expert params: the loss of the module docstring."""

    def __init__(self, layer: int, where: Coordinates, experts: bool):
        super().__init__()
        self.layer, self.where = layer, where
        self.dense = ToyPart(layer, "dense", where)
        self.experts = ToyPart(layer, "experts", where) if experts else None

    def forward(self, micro: int) -> torch.Tensor:
        loss = torch.zeros(())
        for part in (self.dense, self.experts):
            for short, param in part.named_parameters() if part is not None else ():
                suffix = f"{'dense' if part is self.dense else 'experts'}.{short}"
                x, s = inputs(f"layers.{self.layer}.{suffix}", micro, self.where.contributor(suffix))
                loss = loss + (x[self.where.box(suffix)] * param).sum() + s / 2 * param.square().sum()
        return loss


class ToyModel(nn.Module):
    """This pipeline stage's layers; ZeRO-3 gathers each layer as one declared unit."""

    def __init__(self, where: Coordinates, experts: bool):
        super().__init__()
        self.layers = nn.ModuleDict({str(i): ToyLayer(i, where, experts) for i in layer_ids(where.pp_rank)})

    def forward(self, micro: int) -> torch.Tensor:
        return sum(layer(micro) for layer in self.layers.values())

    def sharding_units(self) -> list[list[nn.Module]]:
        return [[layer] for layer in self.layers.values()]


def expert_world(rank, world_size, tp, pp, ep, etp, experts_on_last_stage=True):
    """One step under each (strategy, overlap) of STRATEGIES: a list of (owned pieces, grad norm, units mixing
    dense and expert params), each piece (name, box of the local param, flat start, grad before the step,
    values after it) as arrays."""
    parallel = build_parallel_state(tp, pp, ep=ep, etp=etp, sequence_parallel=tp > 1)
    where = Coordinates.of(parallel)
    has_experts = experts_on_last_stage or parallel.pp_rank < pp - 1
    results = []
    for strategy, overlap in STRATEGIES:
        model = ToyModel(where, has_experts)
        ddp = ParallelModel(model, parallel, bucket_size=40, sharding=Sharding(strategy), overlap_grad_reduce=overlap,
                            overlap_param_gather=overlap and strategy in ("optim", "optim_grads"))
        assert len(ddp.domains) == 1 + has_experts
        optimizer = (MixedPrecisionOptimizer if strategy == "no_shard" else DistributedOptimizer)(ddp, **HYPER)
        optimizer.zero_grad()
        ddp.start_iteration(MICRO_BATCHES)
        for micro in range(MICRO_BATCHES):
            optimizer.scale_loss(model(micro)).backward()
        ddp.finish_grad_sync()
        grads = [grad.clone() for grad in optimizer.main_grads]
        _, grad_norm = optimizer.step(HYPER["lr"])
        ddp.finish_param_sync()
        ranges = getattr(optimizer, "ranges", [(0, param.numel()) for param in optimizer.model_params])
        pieces = [(name, where.box(suffix_of(name)), start, grad.numpy().copy(), main.detach().numpy().copy())
                  for name, (start, _), grad, main in zip(optimizer.names, ranges, grads, optimizer.main_params)]
        if strategy in ("optim", "optim_grads"):  # the expert buckets were gathered over expert-DP too
            pieces += [(name, where.box(suffix_of(name)), 0, None, param.detach().numpy().copy())
                       for name, param in model.named_parameters()]
        mixed = sum(len({is_expert(p) for p in unit.bucket.params}) > 1 for unit in ddp.param_shards.units) \
            if ddp.param_shards is not None else 0
        results.append((pieces, float(grad_norm), mixed))
    return results


def reference(pp: int, ep: int, etp: int, tp: int, dp: int, edp: int, experts_on_last_stage=True):
    """One process holding every param: ({name: grad}, grad norm, {name: values after one step})."""
    names = [f"layers.{layer}.{suffix}" for stage in range(pp) for layer in layer_ids(stage) for suffix in PARAMS
             if not PARAMS[suffix][1] or experts_on_last_stage or stage < pp - 1]
    grads = {}
    for name in names:
        suffix = suffix_of(name)
        _, expert, split = PARAMS[suffix]
        summed_over_tp = split == "sp" or (suffix == "experts.bias" and etp > 1)
        ranks = range(edp if expert else dp)
        contributors = [(r, t) for r in ranks for t in range(tp)] if summed_over_tp else [(r,) for r in ranks]
        grads[name] = sum(x + s * global_values(name) for micro in range(MICRO_BATCHES)
                          for x, s in (inputs(name, micro, contributor) for contributor in contributors))
    params = {name: nn.Parameter(global_values(name)) for name in names}
    for name, param in params.items():
        param.grad = grads[name].clone()
    norm = float(torch.nn.utils.clip_grad_norm_(list(params.values()), HYPER["clip_grad"]))
    decay = [p for p in params.values() if p.ndim >= 2]
    no_decay = [p for p in params.values() if p.ndim < 2]
    adam = torch.optim.AdamW([{"params": decay, "weight_decay": HYPER["weight_decay"]},
                              {"params": no_decay, "weight_decay": 0.0}], lr=HYPER["lr"], betas=HYPER["betas"],
                             eps=HYPER["eps"])
    adam.step()
    return grads, norm, {name: param.detach() for name, param in params.items()}


def check(results, grads, norm, updated):
    """Every rank's owned grads and updated values (placed by their boxes) against the one-process ones, every
    element owned by some rank, the grad norm alike everywhere."""
    for index, (strategy, overlap) in enumerate(STRATEGIES):
        label = f"{strategy}, overlap {overlap}"
        seen = {name: torch.zeros_like(grad, dtype=torch.bool) for name, grad in grads.items()}
        for rank_results in results:
            pieces, grad_norm, mixed = rank_results[index]
            assert mixed == 0, f"{label}: a ZeRO-3 unit holds dense and expert params"
            assert grad_norm == pytest.approx(norm, rel=1e-6), label
            for name, box, start, grad, values in pieces:
                local_grad, local_values = grads[name][box], updated[name][box]
                end = start + values.size
                if grad is not None:
                    torch.testing.assert_close(torch.from_numpy(grad).reshape(-1), local_grad.reshape(-1)[start:end],
                                               rtol=1e-5, atol=1e-6, msg=f"{label}: grad of {name}")
                    owned = torch.zeros(local_grad.shape, dtype=torch.bool)
                    owned.view(-1)[start:end] = True
                    seen[name][box] |= owned
                torch.testing.assert_close(torch.from_numpy(values).reshape(-1), local_values.reshape(-1)[start:end],
                                           rtol=1e-5, atol=1e-6, msg=f"{label}: {name} after the step")
        for name, owned in seen.items():
            assert owned.all(), f"{label}: no rank owns all of {name}"


LAYOUTS = {  # name -> (world, tp, pp, ep, etp, dp, edp)
    "dp4-ep2": (4, 1, 1, 2, 1, 4, 2),
    "tp2-dp2-ep2-etp1": (4, 2, 1, 2, 1, 2, 2),
    "tp2-dp2-ep2-etp2": (4, 2, 1, 2, 2, 2, 1),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_expert_grads_sum_over_expert_dp_and_count_once_in_the_norm(layout, one_thread):
    """Dense grads summed over DP, expert grads over expert-DP only; the grad norm counts every distinct shard
    once (a 2x EP scale, or an expert summed over DP, fails); the step equals one AdamW step at that norm."""
    world, tp, pp, ep, etp, dp, edp = LAYOUTS[layout]
    results = run_world(world, expert_world, tp, pp, ep, etp)
    check(results, *reference(pp, ep, etp, tp, dp, edp))


def test_a_pipeline_stage_without_experts_joins_the_expert_norm(one_thread):
    """PP 2 x DP 2 with EP 2: the first stage's layers hold experts, the last stage's none (no expert buffer),
    and the grad norm still sums both stages' dense params and the experts once."""
    results = run_world(4, expert_world, 1, 2, 2, 1, False)
    check(results, *reference(2, 2, 1, 1, 2, 1, experts_on_last_stage=False))
