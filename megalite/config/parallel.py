"""ParallelConfig: how the world is cut, TP x CP x PP x DP = world size (DP is what remains); the routed experts cut
the same world as ETP x EP x EDP x PP (EDP is what remains, parallel_state.expert_rank_grid)."""

from dataclasses import dataclass
from enum import Enum

from megalite.config.options import derived, option
from megalite.errors import UserError


class Sharding(Enum):
    """What data-parallel ranks shard, by ZeRO `stage` (0-3); each value is Megatron's
    --data-parallel-sharding-strategy. Read `optimizer_state`, `grads`, `params`: whether that is sharded."""

    NO_SHARD = "no_shard"
    OPTIM = "optim"  # the optimizer state (ZeRO-1, the distributed optimizer)
    OPTIM_GRADS = "optim_grads"  # + gradients (ZeRO-2)
    OPTIM_GRADS_PARAMS = "optim_grads_params"  # + parameters (ZeRO-3)

    stage = property(lambda self: list(Sharding).index(self))
    optimizer_state = property(lambda self: self.stage >= 1)
    grads = property(lambda self: self.stage >= 2)
    params = property(lambda self: self.stage == 3)


SHARDING_STRATEGIES = tuple(sharding.value for sharding in Sharding)
SHARDING_NAMES = (None, "distributed optimizer", "ZeRO-2 (optim_grads)", "ZeRO-3 (optim_grads_params)")  # by stage


@dataclass(frozen=True)
class ParallelConfig:
    tensor_model_parallel_size: int = option(1, "tensor-parallel ranks (TP)")
    pipeline_model_parallel_size: int = option(1, "pipeline stages (PP)")
    context_parallel_size: int = option(1, "context-parallel ranks (CP): each holds 2 of 2 x CP chunks of every "
                                           "sequence (load-balanced for causal attention)")
    cp_comm_type: str = option("p2p", "how context-parallel attention meets the other ranks' keys and values: a ring "
                                      "(p2p), gathered (all_gather), heads exchanged (a2a, Ulysses), or heads "
                                      "exchanged within groups of adjacent CP ranks and a ring between the groups "
                                      "(a2a+p2p, with --hierarchical-context-parallel-sizes)",
                               choices=("p2p", "all_gather", "a2a", "a2a+p2p"))
    hierarchical_context_parallel_sizes: list[int] | None = option(
        None, "A2A P2P: --cp-comm-type a2a+p2p's levels, the all-to-all among A adjacent CP ranks and the ring over P "
              "such groups (A x P = --context-parallel-size)")
    num_layers_per_virtual_pipeline_stage: int | None = option(
        None, "interleaved 1F1B: layers per model chunk (or give --num-virtual-stages-per-pipeline-rank)")
    num_virtual_stages_per_pipeline_rank: int | None = option(
        None, "interleaved 1F1B: model chunks per pipeline rank", default_text="1 (plain 1F1B)")
    virtual_pipeline_model_parallel_size: int = derived(
        1, "V, model chunks per pipeline rank: from the two flags above and --num-layers (virtual_stages)")
    decoder_first_pipeline_num_layers: int | None = option(
        None, "layers on the first pipeline stage (the rest split evenly)")
    decoder_last_pipeline_num_layers: int | None = option(
        None, "layers on the last pipeline stage (the rest split evenly)")
    expert_model_parallel_size: int = option(1, "expert-parallel ranks (EP): each holds 1/EP of every MoE layer's "
                                                "routed experts, EP carved out of the data-parallel x tensor-"
                                                "parallel ranks")
    expert_tensor_parallel_size: int | None = option(
        None, "ranks each routed expert is split over (ETP): 1, or the tensor-parallel size (1 suits fine-grained "
              "experts)", default_text="--tensor-model-parallel-size")
    sequence_parallel: bool = option(False, "split norms, dropout and activations along the sequence over TP")
    use_distributed_optimizer: bool = option(False, "shard the optimizer state over data-parallel ranks (ZeRO-1, "
                                                    "the same as --data-parallel-sharding-strategy optim)")
    data_parallel_sharding_strategy: str = option(
        "no_shard", "what data-parallel ranks shard: nothing, the optimizer state (ZeRO-1), + gradients (ZeRO-2), "
                    "+ parameters (ZeRO-3, fully sharded)", choices=SHARDING_STRATEGIES)
    overlap_grad_reduce: bool = option(False, "start each bucket's data-parallel reduction during the last backward")
    overlap_param_gather: bool = option(False, "sharded optimizer: all-gather the updated parameters asynchronously "
                                               "after the step; the next forward waits for each bucket just before "
                                               "its first use (ZeRO-3 always gathers ahead of use)")
    grad_reduce_in_bf16: bool = option(False, "reduce gradients over data-parallel ranks in bf16 (half the bytes, "
                                              "rounded sums); micro-batch accumulation stays fp32")
    gradient_accumulation_fusion: bool = option(
        True, "turn off Megatron's gradient-accumulation fusion, by which each linear layer's weight-grad GEMM adds "
              "into the fp32 main grad itself (layers under --compile never fuse: autograd's grad, then the add)",
        inverted=True,
        flag="--no-gradient-accumulation-fusion")
    ddp_bucket_size: int | None = option(40_000_000, "gradient elements per data-parallel bucket")
    distributed_backend: str | None = option(None, "collective backend", choices=("nccl", "gloo"),
                                             default_text="nccl with CUDA, else gloo")
    distributed_timeout_minutes: float = option(10.0, "a collective waiting longer (a dead or hung rank) fails the run")
    world_size: int = derived(1, "the processes the launcher started (torchrun); --world-size with --dry-run")

    @classmethod
    def from_flags(cls, **given) -> "ParallelConfig":
        """The validated ParallelConfig of the flags `given`. Megatron's rule: sequence parallelism splits over
        TP ranks, so at TP 1 it is off (the flag is accepted)."""
        if given.get("tensor_model_parallel_size", 1) == 1:
            given["sequence_parallel"] = False
        return cls(**given).validate()

    @property
    def sharding(self) -> Sharding:
        """The sharding in force, the one place the two flags are read: --data-parallel-sharding-strategy, at
        least `optim` with --use-distributed-optimizer."""
        chosen = Sharding(self.data_parallel_sharding_strategy)
        return Sharding.OPTIM if self.use_distributed_optimizer and chosen is Sharding.NO_SHARD else chosen

    @property
    def data_parallel_size(self) -> int:
        """DP, the ranks holding different samples: world / (TP x CP x PP)."""
        return self.world_size // (self.tensor_model_parallel_size * self.context_parallel_size
                                   * self.pipeline_model_parallel_size)

    @property
    def expert_tensor_size(self) -> int:
        """ETP: --expert-tensor-parallel-size, by default --tensor-model-parallel-size."""
        given = self.expert_tensor_parallel_size
        return self.tensor_model_parallel_size if given is None else given

    @property
    def expert_data_parallel_size(self) -> int:
        """EDP, the ranks holding the same expert shards: world / (ETP x EP x PP)."""
        return self.world_size // (self.expert_tensor_size * self.expert_model_parallel_size
                                   * self.pipeline_model_parallel_size)

    def describe(self) -> str:
        """The layout in words, e.g. "8 ranks = TP 2 x PP 2 x DP 2, 2 virtual stages per pipeline rank,
        sequence parallel, distributed optimizer" (what is off is left out; CP is named when above 1)."""
        vp, cp = self.virtual_pipeline_model_parallel_size, self.context_parallel_size
        parts = [f"{self.world_size} rank{'s' * (self.world_size > 1)} = TP {self.tensor_model_parallel_size} x "
                 f"{f'CP {cp} x ' if cp > 1 else ''}PP {self.pipeline_model_parallel_size} x "
                 f"DP {self.data_parallel_size}",
                 f"{vp} virtual stages per pipeline rank" if vp > 1 else None,
                 "sequence parallel" if self.sequence_parallel else None, SHARDING_NAMES[self.sharding.stage]]
        if self.expert_model_parallel_size > 1:
            parts.insert(1, f"experts ETP {self.expert_tensor_size} x EP {self.expert_model_parallel_size} x "
                            f"EDP {self.expert_data_parallel_size}")
        return ", ".join(part for part in parts if part)

    def validate(self) -> "ParallelConfig":
        """Raise a UserError naming the flag for the first problem found; return self."""
        if self.overlap_param_gather and not self.sharding.optimizer_state:
            raise UserError("--overlap-param-gather overlaps the distributed optimizer's parameter all-gather, so it "
                            "needs --use-distributed-optimizer (or a --data-parallel-sharding-strategy); add one")
        tp, cp, pp = self.tensor_model_parallel_size, self.context_parallel_size, self.pipeline_model_parallel_size
        for flag, size in [("--tensor-model-parallel-size", tp), ("--pipeline-model-parallel-size", pp),
                           ("--context-parallel-size", cp),
                           ("--ddp-bucket-size", self.ddp_bucket_size),
                           ("--num-virtual-stages-per-pipeline-rank", self.num_virtual_stages_per_pipeline_rank)]:
            if size is not None and size < 1:
                raise UserError(f"{flag} must be at least 1, got {size}")
        if self.world_size % (tp * cp * pp):
            sizes = f"--tensor-model-parallel-size {tp} x {f'--context-parallel-size {cp} x ' if cp > 1 else ''}" \
                    f"--pipeline-model-parallel-size {pp} = {tp * cp * pp}"
            raise UserError(f"{sizes} does not divide the world size {self.world_size}; launch a multiple of "
                            f"{tp * cp * pp} processes")
        self._validate_experts()
        self._validate_hierarchical_context_parallel()
        if not self.distributed_timeout_minutes > 0:
            raise UserError(f"--distributed-timeout-minutes must be positive, got {self.distributed_timeout_minutes}")
        if self.num_layers_per_virtual_pipeline_stage is not None \
                and self.num_virtual_stages_per_pipeline_rank is not None:
            raise UserError("--num-layers-per-virtual-pipeline-stage and --num-virtual-stages-per-pipeline-rank "
                            "both given; pick one")
        return self

    def _validate_hierarchical_context_parallel(self) -> None:
        """a2a+p2p needs its two levels, whose product is CP; the levels go with a2a+p2p only."""
        sizes, cp = self.hierarchical_context_parallel_sizes, self.context_parallel_size
        if self.cp_comm_type != "a2a+p2p":
            if sizes is not None:
                raise UserError("--hierarchical-context-parallel-sizes sets --cp-comm-type a2a+p2p's levels; add "
                                "--cp-comm-type a2a+p2p, or drop it")
            return
        if (sizes is not None or cp > 1) and (sizes is None or len(sizes) != 2 or min(sizes) < 1
                                              or sizes[0] * sizes[1] != cp):
            given = "none" if sizes is None else " ".join(map(str, sizes))
            raise UserError(f"--cp-comm-type a2a+p2p needs --hierarchical-context-parallel-sizes A P, the "
                            f"all-to-all and ring sizes with A x P = --context-parallel-size {cp} (given: {given})")

    @property
    def cp_a2a_size(self) -> int:
        """The CP ranks whose heads are exchanged all-to-all: all of them under a2a, the first level under
        a2a+p2p, none (1) otherwise."""
        if self.cp_comm_type == "a2a":
            return self.context_parallel_size
        return self.hierarchical_context_parallel_sizes[0] if self.cp_comm_type == "a2a+p2p" \
            and self.context_parallel_size > 1 else 1

    def _validate_experts(self) -> None:
        """The expert grid's rules: ETP is 1 or TP, and ETP x EP divides the DP x CP x TP ranks of a stage, which
        the experts' grid is carved from (Megatron's MoE parallel folding)."""
        tp, ep, etp = self.tensor_model_parallel_size, self.expert_model_parallel_size, self.expert_tensor_size
        if ep < 1:
            raise UserError(f"--expert-model-parallel-size must be at least 1, got {ep}")
        if etp not in (1, tp):
            raise UserError(f"--expert-tensor-parallel-size {etp} must be 1 or the --tensor-model-parallel-size "
                            f"{tp}; pass one of them")
        cp = self.context_parallel_size
        ranks = self.data_parallel_size * cp * tp
        if ranks % (ep * etp):
            kinds = "data-parallel x " + ("context-parallel x " if cp > 1 else "") + "tensor-parallel"
            raise UserError(f"--expert-model-parallel-size {ep} x --expert-tensor-parallel-size {etp} = {ep * etp} "
                            f"does not divide the {ranks} {kinds} ranks per pipeline stage; "
                            f"pick sizes whose product divides {ranks}, or launch more processes")

    def virtual_stages(self, num_layers: int) -> int:
        """V, the model chunks per pipeline rank for `num_layers` layers (derived only here); UserError
        when the virtual-stage flags do not fit the layers or the pipeline."""
        pp, per_stage = self.pipeline_model_parallel_size, self.num_layers_per_virtual_pipeline_stage
        chunks = self.num_virtual_stages_per_pipeline_rank or 1
        if per_stage is not None:
            if per_stage < 1 or num_layers % (per_stage * pp):
                raise UserError(f"--num-layers {num_layers} is not divisible by --num-layers-per-virtual-"
                                f"pipeline-stage {per_stage} x --pipeline-model-parallel-size {pp}; pick values "
                                f"whose product divides the layer count")
            chunks = num_layers // (per_stage * pp)
        if chunks > 1 and pp == 1:
            raise UserError("virtual pipeline stages interleave model chunks across pipeline ranks, so they need "
                            "--pipeline-model-parallel-size 2 or more; drop the virtual-stage flag")
        if chunks > 1 and (self.decoder_first_pipeline_num_layers or self.decoder_last_pipeline_num_layers):
            raise UserError("--decoder-first/last-pipeline-num-layers work without virtual stages only; drop "
                            "one or the other")
        return chunks
