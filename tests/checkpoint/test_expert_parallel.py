"""Experts are stored by global index: a small module's expert-marked params and their optimizer state, saved at
one EP layout through save_checkpoint, load bitwise at any other (one process, EP 4 under TP, EP 2 under
ETP = TP) through load_checkpoint, whole (MixedPrecisionOptimizer's form) or as flat ranges sharded over
expert-DP (DistributedOptimizer's form)."""

import zlib

import torch

from megalite.checkpoint import load_checkpoint, save_checkpoint
from megalite.parallel_state import ONE_PROCESS, build_parallel_state
from megalite.tensor_parallel.layers import mark_parameter, shard_full_tensor
from tests.helpers.checkpoint import small_config
from tests.helpers.distributed import run_world

NUM_EXPERTS = 4
# name: (global shape, TP split dim, [gate; up] blocks, expert_parallel)
PARAMS = {"dense.weight": ((4, 3), 0, 1, False), "experts.weight": ((NUM_EXPERTS, 8, 3), 1, 2, True),
          "experts.bias": ((NUM_EXPERTS, 8), 1, 2, True)}


def truth(name: str, shape) -> torch.Tensor:
    """The global tensor every layout's slices come from."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(zlib.crc32(name.encode())))


def local_slice(full: torch.Tensor, name: str, parallel) -> torch.Tensor:
    """This rank's part of the global `full` of `name`: an expert param's experts, then its expert-TP shard."""
    _, dim, chunks, expert = PARAMS[name]
    if not expert:
        return shard_full_tensor(full, dim, parallel.tp_rank, parallel.tp_size, chunks)
    experts = full.chunk(parallel.ep_size)[parallel.ep_rank]
    return shard_full_tensor(experts, dim, parallel.expert_tp_rank, parallel.expert_tp_size, chunks)


class ExpertToy(torch.nn.Module):
    """A dense TP-split weight, an expert weight and bias (`expert_parallel`, split over expert-TP as
    model/moe.py's), and a buffer every rank holds whole; zeros, or this rank's slices of `truth`."""

    def __init__(self, parallel, filled: bool = False):
        super().__init__()
        for name, (shape, dim, chunks, expert) in PARAMS.items():
            value = local_slice(truth(name, shape) if filled else torch.zeros(shape), name, parallel)
            split = parallel.expert_tp_size > 1 if expert else parallel.tp_size > 1
            param = mark_parameter(torch.nn.Parameter(value), split, dim, partition_chunks=chunks)
            param.expert_parallel = expert
            self.register_parameter(name.replace(".", "_"), param)
        self.register_buffer("expert_bias", truth("expert_bias", NUM_EXPERTS) if filled else torch.zeros(NUM_EXPERTS))

    def expected(self, parallel) -> dict[str, torch.Tensor]:
        """What this rank holds of `truth`, by state_dict name."""
        return {**{name.replace(".", "_"): local_slice(truth(name, shape), name, parallel)
                   for name, (shape, *_) in PARAMS.items()}, "expert_bias": truth("expert_bias", NUM_EXPERTS)}


def _moment(name: str, parallel) -> torch.Tensor:
    """This rank's part of the global exp_avg of `name`."""
    return local_slice(truth(name + ".exp_avg", PARAMS[name][0]), name, parallel)


class WholeState:
    """MixedPrecisionOptimizer's form: each param's exp_avg as the param's local tensor."""

    distributed = False

    def __init__(self, parallel, filled: bool = False):
        self.tensors = {f"{name.replace('.', '_')}.exp_avg": _moment(name, parallel) if filled else
                        torch.zeros_like(_moment(name, parallel)) for name in PARAMS}

    def state_dict(self):
        return {"tensors": self.tensors, "meta": {"step": 1}}

    def load_state_dict(self, state):
        for name, value in self.tensors.items():
            value.copy_(state["tensors"][name])

    def expected(self, parallel):
        return WholeState(parallel, True).tensors


class FlatState(WholeState):
    """DistributedOptimizer's form: each param's local exp_avg flattened and cut into contiguous ranges over
    expert-DP (expert params) or DP (dense ones); this rank holds its range."""

    distributed = True

    def __init__(self, parallel, filled: bool = False):
        super().__init__(parallel, filled)
        self.starts = {}
        for name, (*_, expert) in PARAMS.items():
            size, rank = (parallel.expert_dp_size, parallel.expert_dp_rank) if expert else \
                (parallel.dp_size, parallel.dp_rank)
            param_name = name.replace(".", "_")
            flat = self.tensors[f"{param_name}.exp_avg"].view(-1)
            start, end = len(flat) * rank // size, len(flat) * (rank + 1) // size
            self.tensors[f"{param_name}.exp_avg"], self.starts[param_name] = flat[start:end].clone(), start

    def state_dict(self):
        return {**super().state_dict(), "flat_ranges": self.starts}

    def expected(self, parallel):
        return FlatState(parallel, True).tensors


def assert_bitwise(got: dict, expected: dict, where: str) -> None:
    assert got.keys() == expected.keys(), where
    for name in got:
        assert torch.equal(got[name], expected[name]), f"{where}: {name}"


def load_and_check(folder, parallel, rank: int = 0) -> None:
    """Load both checkpoints of `folder` (the whole-state one into a flat state and back) and compare with
    `truth`."""
    for saved, kind in (("whole", FlatState), ("flat", WholeState)):
        model, state = ExpertToy(parallel), kind(parallel)
        load_checkpoint(f"{folder}/{saved}", model, state, model_config=small_config(), load_rng=False,
                        rank=rank, parallel=parallel)
        where = f"{saved} checkpoint at rank {rank} of {parallel}"
        assert_bitwise(model.state_dict(), model.expected(parallel), where)
        assert_bitwise(state.state_dict()["tensors"], state.expected(parallel), where)


def save_layout(rank, world_size, folder, tp, ep, etp, source=None):
    """At TP `tp`, EP `ep`, expert-TP `etp`: load `source` (else start from `truth`) and save both forms."""
    parallel = build_parallel_state(tp, ep=ep, etp=etp)
    if source is not None:
        load_and_check(source, parallel, rank)
    for name, kind in (("whole", WholeState), ("flat", FlatState)):
        save_checkpoint(f"{folder}/{name}", 1, ExpertToy(parallel, True), kind(parallel, True), consumed_samples=0,
                        model_config=small_config(), rank=rank, parallel=parallel)


def test_experts_saved_at_one_ep_layout_load_bitwise_at_every_other_and_back(tmp_path):
    """Worlds of 4: EP 2 folded over DP 4 (expert-DP 2: DP rank 1 holds experts nobody else writes) -> one
    process, and EP 4 x TP 2 with whole experts (ETP 1) -> EP 2 x ETP 2 -> one process."""
    run_world(4, save_layout, str(tmp_path / "ep2"), 1, 2, None)
    load_and_check(tmp_path / "ep2", ONE_PROCESS)
    run_world(4, save_layout, str(tmp_path / "ep4"), 2, 4, 1, str(tmp_path / "ep2"))
    run_world(4, save_layout, str(tmp_path / "etp2"), 2, 2, 2, str(tmp_path / "ep4"))
    load_and_check(tmp_path / "etp2", ONE_PROCESS)
