"""The rank grid (pure arithmetic), the process groups a gloo world builds from it, and a world of one."""

import types

import pytest
import torch
import torch.distributed as dist

from megalite import parallel_state
from megalite.config import ParallelConfig
from megalite.errors import UserError
from megalite.model.context_parallel import comm_levels
from megalite.parallel_state import (GROUP_KINDS, ParallelState, build_parallel_state, coordinates,
                                     expert_coordinates, expert_rank_grid, group_ranks, initialize, rank_grid)
from tests.helpers.distributed import run_world

LAYOUTS = [(8, 2, 1, 2), (8, 4, 1, 1), (8, 1, 1, 8), (4, 1, 1, 1), (1, 1, 1, 1),  # (world, tp, cp, pp)
           (16, 2, 2, 2), (8, 1, 4, 1), (8, 2, 2, 1), (12, 1, 3, 2)]


def test_megatron_layout_for_world_8_tp_2_pp_2():
    groups = group_ranks(8, tp=2, pp=2)
    assert groups["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert groups["dp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert groups["pp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert groups["mp"] == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert groups["embedding"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert rank_grid(8, 2, 2).squeeze(2).tolist() == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]
    # At CP 1 the context-parallel groups are single ranks, and dp_cp, tp_cp are dp, tp.
    assert groups["cp"] == [[r] for r in range(8)]
    assert (groups["dp_cp"], groups["tp_cp"]) == (groups["dp"], groups["tp"])


def test_megatron_layout_with_context_parallelism():
    """Megatron's order tp-cp-dp-pp: 16 ranks = TP 2 x CP 2 x DP 2 x PP 2."""
    groups = group_ranks(16, tp=2, pp=2, cp=2)
    assert groups["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]]
    assert groups["cp"] == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]]
    assert groups["dp"] == [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15]]
    assert groups["dp_cp"] == [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]]
    assert groups["tp_cp"] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    assert groups["pp"] == [[r, r + 8] for r in range(8)] == groups["embedding"]
    assert groups["mp"] == [[0, 1, 8, 9], [2, 3, 10, 11], [4, 5, 12, 13], [6, 7, 14, 15]]
    # At EP 1 the experts' data-parallel ranks are the dense grads' DP x CP ranks (Megatron's folding).
    assert groups["expert_dp"] == groups["dp_cp"] and groups["tp_ep"] == groups["tp"]
    assert coordinates(13, 16, 2, 2, 2) == (1, 1, 0, 1)
    assert ParallelConfig(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, context_parallel_size=2,
                          world_size=16).validate().data_parallel_size == 2


@pytest.mark.parametrize("world, tp, cp, pp", [layout for layout in LAYOUTS if layout[0] > 1])
def test_stage_rank_walks_this_rank_s_pipeline(world, tp, cp, pp):
    grid = rank_grid(world, tp, pp, cp)
    for rank in range(world):
        pp_rank, dp_rank, cp_rank, tp_rank = coordinates(rank, world, tp, pp, cp)
        state = ParallelState(rank=rank, world_size=world, tp_size=tp, tp_rank=tp_rank, pp_size=pp, pp_rank=pp_rank,
                              dp_size=world // (tp * cp * pp), dp_rank=dp_rank, cp_size=cp, cp_rank=cp_rank)
        assert [state.stage_rank(stage) for stage in range(pp)] == grid[:, dp_rank, cp_rank, tp_rank].tolist()
        dp_cp = [ranks for ranks in group_ranks(world, tp, pp, cp=cp)["dp_cp"] if rank in ranks][0]
        assert (state.dp_cp_size, dp_cp[state.dp_cp_rank]) == (len(dp_cp), rank)


def test_expert_groups_fold_over_data_and_tensor_parallel_ranks():
    """Megatron's example: 8 ranks, dense TP 2 x DP 4, experts ETP 1 x EP 4 x EDP 2."""
    groups = group_ranks(8, tp=2, pp=1, ep=4, etp=1)
    assert groups["ep"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert groups["expert_dp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert groups["tp_ep"] == groups["ep"] and groups["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    # Experts split over TP (ETP = TP 2) and PP 2: EP 2 runs across the data-parallel ranks of one TP rank.
    groups = group_ranks(8, tp=2, pp=2, ep=2, etp=2)
    assert groups["ep"] == [[0, 2], [1, 3], [4, 6], [5, 7]] == groups["dp"]
    assert groups["expert_dp"] == [[r] for r in range(8)] and groups["tp_ep"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert groups["expert_mp"] == [list(range(8))]
    # At EP 1 the expert groups are the dense ones.
    dense = group_ranks(8, tp=2, pp=2)
    assert (dense["expert_dp"], dense["tp_ep"], dense["expert_mp"]) == (dense["dp"], dense["tp"], dense["mp"])
    for rank in range(8):
        edp_rank, ep_rank, etp_rank = expert_coordinates(rank, 8, 1, 4, 1)
        assert expert_rank_grid(8, 1, 4, 1)[0, edp_rank, ep_rank, etp_rank] == rank


def test_other_layouts():
    assert group_ranks(8, 4, 1)["tp"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert group_ranks(8, 4, 1)["dp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert group_ranks(8, 4, 1)["embedding"] == [[r] for r in range(8)]
    assert group_ranks(8, 1, 8)["pp"] == [list(range(8))]
    assert group_ranks(8, 1, 8)["embedding"] == [[0, 7]]
    assert group_ranks(4, 1, 1)["dp"] == [[0, 1, 2, 3]]
    assert group_ranks(1, 1, 1) == {kind: [[0]] for kind in GROUP_KINDS}


@pytest.mark.parametrize("world, tp, cp, pp", LAYOUTS)
def test_every_rank_once_per_kind_and_groups_share_the_other_coordinates(world, tp, cp, pp):
    groups = group_ranks(world, tp, pp, cp=cp)
    dp = world // (tp * cp * pp)
    sizes = {"tp": tp, "dp": dp, "pp": pp, "mp": tp * pp, "cp": cp, "dp_cp": dp * cp, "tp_cp": tp * cp}
    for kind, size in sizes.items():
        assert sorted(r for ranks in groups[kind] for r in ranks) == list(range(world)), kind
        assert all(len(ranks) == size for ranks in groups[kind]), kind
    # Which coordinates a group of each kind holds fixed (pp, dp, cp, tp).
    shared = {"tp": (0, 1, 2), "dp": (0, 2, 3), "pp": (1, 2, 3), "mp": (1, 2), "cp": (0, 1, 3), "dp_cp": (0, 3),
              "tp_cp": (0, 1)}
    for kind, fixed in shared.items():
        for ranks in groups[kind]:
            coords = [coordinates(r, world, tp, pp, cp) for r in ranks]
            assert len({tuple(c[i] for i in fixed) for c in coords}) == 1, (kind, ranks)
    embedding = [r for ranks in groups["embedding"] for r in ranks]
    assert len(embedding) == len(set(embedding))
    assert all(coordinates(r, world, tp, pp, cp)[0] in (0, pp - 1) for r in embedding)


@pytest.mark.parametrize("world, tp, cp, pp", LAYOUTS)
def test_coordinates_round_trip(world, tp, cp, pp):
    grid = rank_grid(world, tp, pp, cp)
    for rank in range(world):
        pp_rank, dp_rank, cp_rank, tp_rank = coordinates(rank, world, tp, pp, cp)
        assert grid[pp_rank, dp_rank, cp_rank, tp_rank] == rank
        assert rank == pp_rank * (world // pp) + (dp_rank * cp + cp_rank) * tp + tp_rank


def test_sizes_that_do_not_fit_name_the_flags_and_numbers():
    """The grid trusts sizes ParallelConfig.validate accepted; initialize validates the config it is given."""
    with pytest.raises(UserError, match=r"--tensor-model-parallel-size 2 x --pipeline-model-parallel-size 3 "
                                        r"= 6 does not divide the world size 8"):
        ParallelConfig(tensor_model_parallel_size=2, pipeline_model_parallel_size=3, world_size=8).validate()
    with pytest.raises(UserError, match="--tensor-model-parallel-size must be at least 1, got 0"):
        ParallelConfig(tensor_model_parallel_size=0, world_size=8).validate()
    with pytest.raises(UserError, match="--pipeline-model-parallel-size must be at least 1, got -2"):
        ParallelConfig(pipeline_model_parallel_size=-2, world_size=8).validate()
    with pytest.raises(ValueError, match="rank 8 is outside a world of 8"):
        coordinates(8, 8, 2, 2)
    with pytest.raises(UserError, match=r"--tensor-model-parallel-size 2 x --context-parallel-size 2 x "
                                        r"--pipeline-model-parallel-size 2 = 8 does not divide the world size 12"):
        ParallelConfig(tensor_model_parallel_size=2, context_parallel_size=2, pipeline_model_parallel_size=2,
                       world_size=12).validate()
    with pytest.raises(UserError, match="--context-parallel-size must be at least 1, got 0"):
        ParallelConfig(context_parallel_size=0, world_size=8).validate()
    with pytest.raises(UserError, match="^--expert-model-parallel-size 8 x --expert-tensor-parallel-size 1 = 8 does "
                                        "not divide the 4 data-parallel x context-parallel x tensor-parallel ranks"):
        ParallelConfig(context_parallel_size=2, expert_model_parallel_size=8, world_size=8,
                       pipeline_model_parallel_size=2).validate()
    folded = ParallelConfig(context_parallel_size=2, expert_model_parallel_size=4, world_size=8,
                            pipeline_model_parallel_size=2).validate()  # EP 4 over DP 2 x CP 2
    assert folded.expert_data_parallel_size == 1
    layout = ParallelConfig(tensor_model_parallel_size=2, context_parallel_size=2, world_size=8).validate()
    assert layout.describe() == "8 ranks = TP 2 x CP 2 x PP 1 x DP 2"
    assert layout.expert_data_parallel_size == 4  # DP x CP: the experts' data-parallel ranks fold CP in


def test_world_of_one_without_torch_distributed():
    assert not dist.is_initialized()
    state = build_parallel_state()
    assert (state.rank, state.world_size) == (0, 1)
    assert (state.tp_size, state.pp_size, state.dp_size) == (1, 1, 1)
    assert (state.tp_rank, state.pp_rank, state.dp_rank) == (0, 0, 0)
    assert all(group is None for group in (state.tp_group, state.pp_group, state.dp_group,
                                           state.mp_group, state.embedding_group))
    assert state.embedding_ranks == [0] and state.in_embedding_group
    assert state.is_logging_rank
    if torch.cuda.is_available():  # a world of one takes the GPU when there is one
        assert state.device == torch.device("cuda", torch.cuda.current_device())
    else:
        assert state.device == torch.device("cpu")


def test_initialize_world_of_one(monkeypatch):
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    state = initialize(ParallelConfig(distributed_backend="gloo"))
    assert state.device == torch.device("cpu") and state.world_size == 1 and state.tp_group is None
    assert not dist.is_initialized()
    parallel_state.destroy(state)  # nothing to tear down
    with pytest.raises(UserError, match="--pipeline-model-parallel-size 2 = 2 does not divide the world size 1"):
        initialize(ParallelConfig(pipeline_model_parallel_size=2))
    with pytest.raises(UserError, match="--tensor-model-parallel-size 2 x"):
        initialize(ParallelConfig(tensor_model_parallel_size=2))
    with pytest.raises(ValueError, match="WORLD_SIZE is 1"):
        initialize(ParallelConfig(world_size=4))


def test_nccl_without_cuda_names_the_flag(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(UserError, match="--distributed-backend nccl needs CUDA"):
        parallel_state.choose_backend("nccl")
    assert parallel_state.choose_backend(None) == "gloo"


def test_cpu_ranks_share_the_cores(monkeypatch):
    threads = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(parallel_state.os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    try:
        parallel_state._limit_cpu_threads(4)
        assert torch.get_num_threads() == 2
        parallel_state._limit_cpu_threads(16)
        assert torch.get_num_threads() == 1
        monkeypatch.setenv("OMP_NUM_THREADS", "3")
        torch.set_num_threads(5)
        parallel_state._limit_cpu_threads(4)
        assert torch.get_num_threads() == 5
    finally:
        torch.set_num_threads(threads)


def _groups_seen(state) -> dict:
    """Per kind: (the group's ranks, the ranks an all-reduce of one-hot vectors over it finds)."""
    seen = {}
    for kind in GROUP_KINDS:
        group = getattr(state, f"{kind}_group")
        if group is None:
            seen[kind] = None
            continue
        one_hot = torch.zeros(state.world_size)
        one_hot[state.rank] = 1.0
        dist.all_reduce(one_hot, group=group)
        seen[kind] = (dist.get_process_group_ranks(group), one_hot.nonzero().flatten().tolist())
    return seen


def _state_summary(state) -> dict:
    return dict(experts=(state.ep_size, state.ep_rank, state.expert_tp_size, state.expert_tp_rank,
                         state.expert_dp_size, state.expert_dp_rank),
                coords=(state.pp_rank, state.dp_rank, state.cp_rank, state.tp_rank),
                sizes=(state.pp_size, state.dp_size, state.cp_size, state.tp_size), groups=_groups_seen(state),
                logging=state.is_logging_rank, embedding_ranks=state.embedding_ranks,
                next=state.stage_rank((state.pp_rank + 1) % state.pp_size),
                prev=state.stage_rank((state.pp_rank - 1) % state.pp_size),
                device=str(state.device), backend=dist.get_backend())


def _two_topologies(rank, world_size):
    """Four states in one process: tp 2 x pp 2 built directly, then pp 4 through initialize, then tp 2 with
    experts over ep 4 (etp 1) built directly, then cp 2 x pp 2 through initialize."""
    grid = _state_summary(build_parallel_state(tp=2, pp=2))
    experts = _state_summary(build_parallel_state(tp=2, ep=4, etp=1))
    summaries = []
    for cp, pp in ((1, 4), (2, 2)):
        state = initialize(ParallelConfig(context_parallel_size=cp, pipeline_model_parallel_size=pp,
                                          distributed_backend="gloo", world_size=world_size))
        summaries.append(_state_summary(state))
        parallel_state.destroy(state)  # run_world owns the process group: this must leave it alone
        assert dist.is_initialized()
    return grid, summaries[0], experts, summaries[1]


def test_groups_in_a_gloo_world_of_4():
    results = run_world(4, _two_topologies)
    for layout, (tp, cp, pp, ep, etp) in enumerate([(2, 1, 2, 1, 2), (1, 1, 4, 1, 1), (2, 1, 1, 4, 1),
                                                    (1, 2, 2, 1, 1)]):
        expected = group_ranks(4, tp, pp, ep, etp, cp)
        for rank, summary in enumerate(r[layout] for r in results):
            assert summary["coords"] == coordinates(rank, 4, tp, pp, cp)
            assert summary["sizes"] == (pp, 4 // (tp * cp * pp), cp, tp)
            for kind in GROUP_KINDS:
                mine = [ranks for ranks in expected[kind] if rank in ranks]
                if not mine:  # a middle pipeline stage: no embedding group
                    assert kind == "embedding" and summary["groups"][kind] is None
                    continue
                assert summary["groups"][kind] == (mine[0], mine[0]), (layout, rank, kind)
            assert summary["logging"] == (rank == 3)
            edp_rank, ep_rank, etp_rank = expert_coordinates(rank, 4, pp, ep, etp)
            assert summary["experts"] == (ep, ep_rank, etp, etp_rank, 4 // (pp * ep * etp), edp_rank)
            stride = 4 // pp
            assert summary["next"] == (rank + stride) % 4 and summary["prev"] == (rank - stride) % 4
            assert summary["device"] == "cpu" and summary["backend"] == "gloo"
    assert [r[1]["embedding_ranks"] for r in results] == [[0, 3]] * 4
    assert results[0][2]["groups"]["ep"] == ([0, 1, 2, 3], [0, 1, 2, 3])  # EP 4 folded over TP 2 x DP 2
    assert [r[1]["groups"]["embedding"] is None for r in results] == [False, True, True, False]
    # CP 2 x PP 2: each CP rank is its own pipeline, and its stages hold the same CP rank's chunks.
    assert [r[3]["embedding_ranks"] for r in results] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert [r[3]["groups"]["cp"][0] for r in results] == [[0, 1], [0, 1], [2, 3], [2, 3]]


def test_a2a_p2p_levels_are_adjacent_cp_ranks_and_a_ring_over_them():
    """--cp-comm-type a2a+p2p with --hierarchical-context-parallel-sizes A P: the all-to-all among A adjacent ranks of
    each CP group, the ring over the ranks A apart; degenerate levels are plain a2a or p2p; bad sizes, one sentence."""
    groups = group_ranks(16, 2, 1, cp=4, cp_a2a=2)  # TP 2 x CP 4 x DP 2: CP groups [0, 2, 4, 6], [1, 3, 5, 7], ...
    assert groups["cp"][:2] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert groups["cp_a2a"][:4] == [[0, 2], [4, 6], [1, 3], [5, 7]]
    assert groups["cp_p2p"][:4] == [[0, 4], [2, 6], [1, 5], [3, 7]]
    assert "cp_a2a" not in group_ranks(16, 2, 1, cp=4)

    def layout(*sizes, comm="a2a+p2p"):
        return ParallelConfig(context_parallel_size=4, cp_comm_type=comm, world_size=4,
                              hierarchical_context_parallel_sizes=list(sizes) or None).validate()

    state = types.SimpleNamespace(cp_a2a_group="pairs", cp_p2p_group="ring")
    assert layout(2, 2).cp_a2a_size == 2 and comm_levels(layout(2, 2), state) == ("a2a+p2p", ("pairs", "ring"))
    assert comm_levels(layout(1, 4), state) == ("p2p", None) and comm_levels(layout(4, 1), state) == ("a2a", None)
    assert layout(comm="a2a").cp_a2a_size == 4 and layout(comm="p2p").cp_a2a_size == 1
    for sizes, words in (((), "given: none"), ((2, 3), "given: 2 3"), ((4,), "given: 4")):
        with pytest.raises(UserError, match=r"^--cp-comm-type a2a\+p2p needs --hierarchical-context-parallel-sizes A "
                                            r"P, .* = --context-parallel-size 4 \(" + words):
            layout(*sizes)
    with pytest.raises(UserError, match=r"^--hierarchical-context-parallel-sizes sets --cp-comm-type a2a\+p2p's"):
        layout(2, 2, comm="p2p")
    with pytest.raises(UserError, match=r"A x P = --context-parallel-size 1 \(given: 2 2\)"):
        ParallelConfig(cp_comm_type="a2a+p2p", hierarchical_context_parallel_sizes=[2, 2]).validate()
    assert ParallelConfig(cp_comm_type="a2a+p2p").validate().cp_a2a_size == 1  # CP 1: nothing to split
