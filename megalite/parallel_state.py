"""The rank grid, the process groups cut from it, and the device: one `ParallelState` per run, passed to
builders as an argument (no global singleton). The grid is Megatron's rank order tp-cp-dp-pp, `numpy.arange(world)
.reshape(pp, dp, cp, tp)`, every group the ranks that share the other coordinates (docs/parallelism.md). CP ranks
hold the same weights and different parts of each sequence, so the dense grads reduce over DP x CP (`dp_cp`).

The routed experts of MoE layers have a second grid over the same world, Megatron's "MoE parallel folding":
`numpy.arange(world).reshape(pp, edp, ep, etp)` (order tp-ep-dp-pp), expert-tensor-parallel x expert-parallel
x expert-data-parallel x the same pipeline stages. EP is carved out of the dense DP x CP x TP ranks (at EP 1 the
expert-DP group is dp_cp; CP with EP > 1 is refused until built): a rank owns
experts [ep_rank * E/EP, (ep_rank + 1) * E/EP), and their grads are summed over its expert-DP group.

Under torch.distributed every group is a real ProcessGroup, even of one rank; only a world of one
without it has None groups. torch reads `group=None` as the WHOLE world, so a None standing for a
trivial group would turn a forgotten size check into a world-wide collective.
"""

import gc
import os
from dataclasses import dataclass, field
from datetime import timedelta

import numpy
import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from megalite.config import ParallelConfig
from megalite.errors import UserError

# Every rank creates every group in this order (torch requires the same new_group calls everywhere).
GROUP_KINDS = ("tp", "dp", "pp", "mp", "embedding", "ep", "expert_dp", "tp_ep", "expert_mp", "cp", "dp_cp", "tp_cp")


def rank_grid(world_size: int, tp: int, pp: int, cp: int = 1) -> numpy.ndarray:
    """The global ranks as an int array of shape [pp, dp, cp, tp], for sizes ParallelConfig.validate accepted."""
    return numpy.arange(world_size).reshape(pp, world_size // (tp * cp * pp), cp, tp)


def expert_rank_grid(world_size: int, pp: int, ep: int, etp: int) -> numpy.ndarray:
    """The global ranks as the experts see them, an int array of shape [pp, edp, ep, etp]."""
    return numpy.arange(world_size).reshape(pp, world_size // (pp * ep * etp), ep, etp)


def group_ranks(world_size: int, tp: int, pp: int, ep: int = 1, etp: int | None = None,
                cp: int = 1, cp_a2a: int = 1) -> dict[str, list[list[int]]]:
    """The rank lists of every group of each kind: "tp" shares (pp, dp, cp), "cp" (pp, dp, tp), "dp" (pp, cp, tp),
    "dp_cp" (the dense grads' data-parallel ranks) (pp, tp), "tp_cp" (pp, dp), "pp" (dp, cp, tp), "mp" (a model
    replica) (dp, cp); "embedding" is each pipeline's first and last stage, which hold tied embeddings.
    Expert groups (`etp` None: tp): "ep" shares (pp, edp, etp), "expert_dp" (pp, ep, etp), "tp_ep" (pp, edp),
    "expert_mp" (the ranks holding distinct expert shards, ETP x EP x PP) edp. With `cp_a2a` strictly between 1 and
    CP (--cp-comm-type a2a+p2p) also "cp_a2a", each CP group's runs of `cp_a2a` adjacent ranks, and "cp_p2p", its
    ranks a multiple of `cp_a2a` apart (one from each run)."""
    grid = rank_grid(world_size, tp, pp, cp)
    dp = grid.shape[1]
    pipelines = grid.transpose(1, 2, 3, 0).reshape(-1, pp).tolist()
    etp = tp if etp is None else etp
    experts = expert_rank_grid(world_size, pp, ep, etp)
    cp_groups = grid.transpose(0, 1, 3, 2).reshape(-1, cp)
    hierarchical = {}
    if 1 < cp_a2a < cp:
        hierarchical = {"cp_a2a": cp_groups.reshape(-1, cp_a2a).tolist(),
                        "cp_p2p": cp_groups.reshape(-1, cp // cp_a2a, cp_a2a).transpose(0, 2, 1).reshape(
                            -1, cp // cp_a2a).tolist()}
    return {
        "tp": grid.reshape(-1, tp).tolist(),
        "dp": grid.transpose(0, 2, 3, 1).reshape(-1, dp).tolist(),
        "pp": pipelines,
        "mp": grid.transpose(1, 2, 0, 3).reshape(-1, pp * tp).tolist(),
        "embedding": [[ranks[0], ranks[-1]] if pp > 1 else [ranks[0]] for ranks in pipelines],
        "ep": experts.transpose(0, 1, 3, 2).reshape(-1, ep).tolist(),
        "expert_dp": experts.transpose(0, 2, 3, 1).reshape(-1, experts.shape[1]).tolist(),
        "tp_ep": experts.reshape(-1, ep * etp).tolist(),
        "expert_mp": experts.transpose(1, 0, 2, 3).reshape(-1, pp * ep * etp).tolist(),
        "cp": cp_groups.tolist(),
        "dp_cp": grid.transpose(0, 3, 1, 2).reshape(-1, dp * cp).tolist(),
        "tp_cp": grid.reshape(-1, cp * tp).tolist(),
        **hierarchical,
    }


def coordinates(rank: int, world_size: int, tp: int, pp: int, cp: int = 1) -> tuple[int, int, int, int]:
    """(pp_rank, dp_rank, cp_rank, tp_rank) of global `rank`; the inverse of indexing `rank_grid`."""
    dp = rank_grid(world_size, tp, pp, cp).shape[1]
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a world of {world_size}")
    return rank // (dp * cp * tp), rank // (cp * tp) % dp, rank // tp % cp, rank % tp


def expert_coordinates(rank: int, world_size: int, pp: int, ep: int, etp: int) -> tuple[int, int, int]:
    """(edp_rank, ep_rank, etp_rank) of global `rank` in `expert_rank_grid` (its pp_rank is the dense one's)."""
    edp = expert_rank_grid(world_size, pp, ep, etp).shape[1]
    return rank // (etp * ep) % edp, rank // etp % ep, rank % etp


@dataclass
class ParallelState:
    """This rank's place in the grid, its process groups, and its device; the defaults are a process on
    its own. Groups are None only there, and `embedding_group` on middle pipeline stages too: check
    `in_embedding_group` before using it."""

    rank: int = 0
    world_size: int = 1
    tp_size: int = 1
    tp_rank: int = 0
    tp_group: ProcessGroup | None = None
    pp_size: int = 1
    pp_rank: int = 0
    pp_group: ProcessGroup | None = None
    dp_size: int = 1
    dp_rank: int = 0
    dp_group: ProcessGroup | None = None
    # Context parallelism: CP ranks hold the same weights and different chunks of each sequence (the loader's
    # load-balanced split); dp_cp is the dense grads' data-parallel group, DP x CP ranks.
    cp_size: int = 1
    cp_rank: int = 0
    cp_group: ProcessGroup | None = None
    dp_cp_group: ProcessGroup | None = None
    tp_cp_group: ProcessGroup | None = None
    # --cp-comm-type a2a+p2p's levels (None otherwise): heads all-to-all among adjacent CP ranks, a ring between them.
    cp_a2a_group: ProcessGroup | None = None
    cp_p2p_group: ProcessGroup | None = None
    mp_group: ProcessGroup | None = None
    embedding_group: ProcessGroup | None = None
    # This rank's pipeline's embedding ranks, whether or not it is one.
    embedding_ranks: list[int] = field(default_factory=lambda: [0])
    # The routed experts' grid (expert_rank_grid): EP ranks hold different experts; each expert is split over
    # expert_tp_size ranks (1, or the TP group); expert-DP ranks hold the same expert shards.
    ep_size: int = 1
    ep_rank: int = 0
    ep_group: ProcessGroup | None = None
    expert_tp_size: int = 1
    expert_dp_size: int = 1
    expert_dp_rank: int = 0
    expert_dp_group: ProcessGroup | None = None
    tp_ep_group: ProcessGroup | None = None  # ETP x EP: the ranks among which one layer's experts are spread
    expert_mp_group: ProcessGroup | None = None  # ETP x EP x PP: the ranks holding distinct expert shards
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    sequence_parallel: bool = False
    owns_process_group: bool = field(default=False, repr=False)  # set by initialize; destroy reads it

    @property
    def is_logging_rank(self) -> bool:
        """The last rank of the world: a last pipeline stage, where the loss is (as Megatron logs)."""
        return self.rank == self.world_size - 1

    @property
    def in_embedding_group(self) -> bool:
        return self.rank in self.embedding_ranks

    @property
    def dp_cp_size(self) -> int:
        return self.dp_size * self.cp_size

    @property
    def dp_cp_rank(self) -> int:
        """This rank's place in its dp_cp group (whose ranks are listed DP-major, CP-minor)."""
        return self.dp_rank * self.cp_size + self.cp_rank

    @property
    def expert_tp_rank(self) -> int:
        """This rank's place in its expert's split: the TP rank when experts split over TP, else 0."""
        return self.tp_rank if self.expert_tp_size > 1 else 0

    def stage_rank(self, pp_rank: int) -> int:
        """Global rank of pipeline stage `pp_rank` in this rank's pipeline (same dp, cp and tp rank)."""
        return (pp_rank * self.dp_cp_size + self.dp_cp_rank) * self.tp_size + self.tp_rank


def build_parallel_state(tp: int = 1, pp: int = 1, *, cp: int = 1, ep: int = 1, etp: int | None = None,
                         cp_a2a: int = 1, sequence_parallel: bool = False, device: torch.device | None = None,
                         timeout: timedelta | None = None) -> ParallelState:
    """This rank's ParallelState for sizes `tp`, `pp`, `cp`, `ep` and `etp` (None: tp) in the torch.distributed
    world (a world of one without it); every rank calls it, creating every group (one ProcessGroup per distinct
    rank list: at EP 1 the expert groups are the dense ones, at CP 1 dp_cp is dp and tp_cp is tp). `device` None:
    CUDA under nccl (or without torch.distributed when CUDA is there), else the CPU. `timeout` None: the backend's
    default."""
    distributed = dist.is_available() and dist.is_initialized()
    rank, world_size = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    etp = tp if etp is None else etp
    groups = group_ranks(world_size, tp, pp, ep, etp, cp, cp_a2a)
    pp_rank, dp_rank, cp_rank, tp_rank = coordinates(rank, world_size, tp, pp, cp)
    edp_rank, ep_rank, _ = expert_coordinates(rank, world_size, pp, ep, etp)
    own = dict.fromkeys(groups)
    if distributed:
        made: dict[tuple[int, ...], ProcessGroup] = {}
        for kind in groups:
            for ranks in groups[kind]:
                if tuple(ranks) not in made:
                    made[tuple(ranks)] = dist.new_group(ranks, timeout=timeout)
                if rank in ranks:
                    own[kind] = made[tuple(ranks)]
    backend = dist.get_backend() if distributed else None
    if device is None:
        cuda = backend == "nccl" or (backend is None and torch.cuda.is_available())
        device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    device = torch.device(device)
    return ParallelState(
        rank=rank, world_size=world_size,
        tp_size=tp, tp_rank=tp_rank, tp_group=own["tp"],
        pp_size=pp, pp_rank=pp_rank, pp_group=own["pp"],
        dp_size=world_size // (tp * cp * pp), dp_rank=dp_rank, dp_group=own["dp"],
        cp_size=cp, cp_rank=cp_rank, cp_group=own["cp"], dp_cp_group=own["dp_cp"], tp_cp_group=own["tp_cp"],
        cp_a2a_group=own.get("cp_a2a"), cp_p2p_group=own.get("cp_p2p"),
        mp_group=own["mp"], embedding_group=own["embedding"],
        # pipelines are listed in (dp, cp, tp) order
        embedding_ranks=groups["embedding"][(dp_rank * cp + cp_rank) * tp + tp_rank],
        ep_size=ep, ep_rank=ep_rank, ep_group=own["ep"], expert_tp_size=etp,
        expert_dp_size=world_size // (pp * ep * etp), expert_dp_rank=edp_rank, expert_dp_group=own["expert_dp"],
        tp_ep_group=own["tp_ep"], expert_mp_group=own["expert_mp"],
        device=device, sequence_parallel=sequence_parallel)


# The default state of library functions (model constructors, the optimizer's DDP): one process on the CPU.
# Shared, so never modify it; build your own `ParallelState(device=...)` for another device.
ONE_PROCESS = ParallelState()


def world_size_from_env() -> int:
    """The world size torchrun launched (WORLD_SIZE), 1 for a plain `python` run."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def initialize(parallel_config: ParallelConfig) -> ParallelState:
    """Join torchrun's world (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT), or none without WORLD_SIZE,
    and build the state. An initialised world is used as is, and `destroy` leaves it alone."""
    world_size = world_size_from_env()
    if parallel_config.world_size != world_size:
        raise ValueError(f"the ParallelConfig was made for a world of {parallel_config.world_size} but "
                         f"WORLD_SIZE is {world_size}; pass world_size_from_env() to parse_args")
    parallel_config.validate()  # the sizes fit the world (a config built in code may not have been validated)
    tp, pp = parallel_config.tensor_model_parallel_size, parallel_config.pipeline_model_parallel_size
    already = dist.is_available() and dist.is_initialized()
    backend = dist.get_backend() if already else choose_backend(parallel_config.distributed_backend)
    device = _bind_device(backend, int(os.environ.get("LOCAL_RANK", "0")))
    if device.type == "cpu":
        _limit_cpu_threads(int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    timeout = timedelta(minutes=parallel_config.distributed_timeout_minutes)
    owns = "WORLD_SIZE" in os.environ and not already
    if owns:
        missing = [name for name in ("RANK", "MASTER_ADDR", "MASTER_PORT") if name not in os.environ]
        if missing:
            raise UserError(f"WORLD_SIZE is set but {', '.join(missing)} is not; launch with `torchrun "
                            f"--nproc_per_node N pretrain_gpt.py ...`, or unset WORLD_SIZE for one process")
        dist.init_process_group(backend, timeout=timeout, device_id=device if device.type == "cuda" else None,
                                **_restart_scoped_rendezvous(world_size, timeout))
    state = build_parallel_state(tp, pp, cp=parallel_config.context_parallel_size,
                                 cp_a2a=parallel_config.cp_a2a_size,  # its groups exist under a2a+p2p only
                                 ep=parallel_config.expert_model_parallel_size,
                                 etp=parallel_config.expert_tensor_size,
                                 sequence_parallel=parallel_config.sequence_parallel, device=device, timeout=timeout)
    state.owns_process_group = owns
    return state


def destroy(state: ParallelState) -> None:
    """Tear down the process groups if `initialize` created them; otherwise do nothing."""
    if state.owns_process_group and dist.is_initialized():
        # Unreachable cycles (a model's hooks and its optimizer) can hold the groups: freed now, not at
        # interpreter exit, where a gloo group torn down late aborts the process.
        gc.collect()
        dist.destroy_process_group()
        state.owns_process_group = False


def choose_backend(requested: str | None) -> str:
    """`requested` (--distributed-backend), else nccl with CUDA and gloo without."""
    if requested is None:
        return "nccl" if torch.cuda.is_available() else "gloo"
    if requested == "nccl" and not torch.cuda.is_available():
        raise UserError("--distributed-backend nccl needs CUDA, but no GPU is available; "
                        "use --distributed-backend gloo (or drop the flag) to train on CPUs")
    return requested


def bf16_is_default(requested_backend: str | None) -> bool:
    """With no precision flag: bf16 where the run trains on a GPU with bf16 units (CUDA and not gloo), fp32
    elsewhere (many CPUs have no bf16 matrix units, and fp32 is the reference arithmetic)."""
    return torch.cuda.is_available() and requested_backend != "gloo" and torch.cuda.is_bf16_supported()


def _bind_device(backend: str, local_rank: int) -> torch.device:
    """cuda:LOCAL_RANK (made current) under nccl; the CPU under gloo, even when a GPU is present."""
    if backend != "nccl":
        return torch.device("cpu")
    count = torch.cuda.device_count()
    if local_rank >= count:
        raise UserError(f"LOCAL_RANK {local_rank} has no GPU: only {count} are visible; launch at most "
                        f"{count} processes per node (torchrun --nproc_per_node {count})")
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def _limit_cpu_threads(local_world_size: int) -> None:
    """Share the cores among this node's ranks, unless OMP_NUM_THREADS already says how."""
    if local_world_size > 1 and "OMP_NUM_THREADS" not in os.environ:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        torch.set_num_threads(max(1, cores // local_world_size))


def _restart_scoped_rendezvous(world_size: int, timeout: timedelta) -> dict:
    """init_process_group's store, rank and world size after a torchrun restart ({} on the first attempt).
    The store still holds the last attempt's keys, such as rank addresses: a rank reading one before its
    peer overwrote it connects to a dead process ("connectFullMesh failed"), so each attempt gets a prefix."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if attempt == "0":
        return {}
    rank = int(os.environ["RANK"])
    store, _, _ = next(dist.rendezvous("env://", rank, world_size, timeout=timeout))
    return {"store": dist.PrefixStore(f"megalite/attempt-{attempt}", store), "rank": rank, "world_size": world_size}
