"""ModelConfig, one model's shape with Megatron-LM's names. `vocab_size` is the *padded* vocabulary;
the rows past `tokenizer_vocab_size` are padding that never reaches the loss."""

import ast
import math
from dataclasses import MISSING, dataclass, replace

from megalite.config.options import derived, option, option_fields
from megalite.errors import UserError

POSITION_EMBEDDING_TYPES = ("learned_absolute", "rope")
NORMALIZATIONS = ("LayerNorm", "RMSNorm")
RECOMPUTE_GRANULARITIES = (None, "full", "selective")
# The --help groups of the options below that are not in the "network size" group: they set how the model
# is trained, not what it is.
REGULARIZATION, INITIALIZATION, TRAINING = "regularization", "initialization", "training"
RECOMPUTE_METHODS = ("uniform", "block")
MOE = "moe"  # the --help group of the mixture-of-experts options (Megatron's)
MOE_SCORE_FUNCTIONS = ("softmax", "sigmoid")
MOE_LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "global_aux_loss", "none")
MOE_TOKEN_DROP_POLICIES = ("probs", "position")


def rotary_dim(head_dim: int, rotary_percent: float = 1.0) -> int:
    """The channels of a head that rope rotates: int(head_dim x rotary_percent), as Megatron counts them."""
    return int(head_dim * rotary_percent)


@dataclass(frozen=True)
class ModelConfig:
    """One GPT / LLaMA architecture. On the command line the defaults are the `--model` preset's
    (config/presets.py); these serve configs built in code, whose None fields `of` derives as Megatron does."""

    num_layers: int = option(MISSING, "transformer layers")
    hidden_size: int = option(MISSING, "hidden size h")
    num_attention_heads: int = option(MISSING, "attention (query) heads")
    seq_length: int = option(MISSING, "tokens per sample")
    vocab_size: int = derived(MISSING, "padded: the tokenizer's vocabulary rounded up to "
                                       "--make-vocab-size-divisible-by x TP (what the embedding holds)")
    tokenizer_vocab_size: int | None = derived(None, "the tokenizer's vocabulary; None: no padding")
    ffn_hidden_size: int | None = option(None, "MLP hidden size", default_text="4h, or 2/3 of that (rounded down "
                                                                                "to 64) with --swiglu")
    num_query_groups: int | None = option(None, "key/value heads (with --group-query-attention)",
                                          default_text="one per query head")
    kv_channels: int | None = option(None, "channels per head", default_text="hidden size / heads")
    max_position_embeddings: int | None = option(None, "the model's context length (the learned position "
                                                       "table's size)", default_text="--seq-length")
    position_embedding_type: str = option("learned_absolute", "position encoding", choices=POSITION_EMBEDDING_TYPES)
    rotary_base: float = option(10000.0, "rope's base period")
    rotary_percent: float = option(1.0, "rope rotates the first int(head size x this) channels of each head and "
                                        "passes the rest through (0 < P <= 1)")
    use_rope_scaling: bool = option(False, "Llama 3.1's rope frequency scaling (low 1, high 4, context 8192)")
    rope_scaling_factor: float = option(8.0, "with --use-rope-scaling: the scaling factor")
    normalization: str = option("LayerNorm", "normalization layer", choices=NORMALIZATIONS)
    norm_epsilon: float = option(1e-5, "epsilon of the normalization layers")
    apply_layernorm_1p: bool = option(False, "norm weights stored as w - 1 (initialised to 0) and applied as 1 + w "
                                             "(Megatron's zero-centred gamma)")
    swiglu: bool = option(False, "SwiGLU MLP (LLaMA) instead of GELU")
    openai_gelu: bool = option(False, "tanh-approximated GELU (GPT-2's `gelu_new`) instead of exact erf")
    untie_embeddings_and_output_weights: bool = option(False, "an output layer of its own, not the embedding's")
    add_bias_linear: bool = option(True, "no biases in the linear layers", flag="--disable-bias-linear", inverted=True)
    add_qkv_bias: bool = option(False, "a bias on the QKV projection only, also with --disable-bias-linear (Qwen2)")
    qk_layernorm: bool = option(False, "normalise each query and key head over its channels before rotary, with "
                                       "--normalization's kind and one weight shared by all heads (Qwen3)")
    hidden_dropout: float = option(0.1, "dropout after attention and MLP", group=REGULARIZATION)
    attention_dropout: float = option(0.1, "dropout of the attention probabilities", group=REGULARIZATION)
    init_method_std: float = option(0.02, "standard deviation of the weight initialisation", group=INITIALIZATION)
    make_vocab_size_divisible_by: int = option(128, "pad the vocabulary to a multiple of this x TP")
    recompute_granularity: str | None = option(None, "recompute full layers or the attention core (selective)",
                                               choices=RECOMPUTE_GRANULARITIES[1:], default_text="none", group=TRAINING)
    recompute_method: str | None = option(None, "with --recompute-granularity full, per pipeline chunk: uniform "
                                                "checkpoints each group of --recompute-num-layers layers as one "
                                                "unit (keeping only its input), block only the first "
                                                "--recompute-num-layers layers", choices=RECOMPUTE_METHODS,
                                          default_text="each layer its own unit, as uniform with 1", group=TRAINING)
    recompute_num_layers: int | None = option(None, "with --recompute-method: the layers of a unit (uniform) or "
                                                    "the layers recomputed per chunk (block)", default_text="none",
                                              group=TRAINING)
    z_loss_weight: float = option(0.0, "PaLM's z-loss: adds w * logsumexp(logits)^2 per token (1e-4 is common)",
                                  group=REGULARIZATION)
    fused_output_cross_entropy: bool = option(False, "output layer + loss in token chunks, never the full "
                                                     "logits (TP = 1); costs one more output-layer matmul",
                                              group=TRAINING)
    num_experts: int | None = option(None, "routed experts per MoE layer", default_text="none: dense MLPs only",
                                     group=MOE)
    moe_layer_freq: str | int = option(1, "which layers are MoE layers: N (every N-th, from layer 0) or a "
                                          "Python-style list of 0/1 per layer such as \"([0]*3+[1]*29)\"", group=MOE)
    moe_ffn_hidden_size: int | None = option(None, "each routed expert's hidden size",
                                             default_text="--ffn-hidden-size", group=MOE)
    moe_router_topk: int = option(2, "experts each token is routed to", group=MOE)
    moe_router_score_function: str = option("softmax", "router score: softmax (top-k on the logits, then a "
                                                       "softmax over the k) or sigmoid (normalised over the k)",
                                            choices=MOE_SCORE_FUNCTIONS, group=MOE)
    moe_router_pre_softmax: bool = option(False, "softmax over all experts before top-k, not renormalised "
                                                 "(Qwen2-MoE, OLMoE)", group=MOE)
    moe_router_topk_scaling_factor: float | None = option(None, "multiply the top-k routing probabilities by this",
                                                          group=MOE)
    moe_router_num_groups: int | None = option(None, "group-limited routing: expert groups (equal, consecutive)",
                                               group=MOE)
    moe_router_group_topk: int | None = option(None, "group-limited routing: groups each token may use, picked "
                                                     "by the sum of each group's top topk/group-topk scores",
                                               group=MOE)
    moe_router_load_balancing_type: str = option("aux_loss", "load-balancing loss: aux_loss (GShard/Switch, over "
                                                             "the micro-batch), seq_aux_loss (per sequence, "
                                                             "DeepSeek-V2), global_aux_loss (its counts over the "
                                                             "micro-batch on all data-parallel ranks, averaged over "
                                                             "the step's micro-batches) or none",
                                                 choices=MOE_LOAD_BALANCING_TYPES, group=MOE)
    moe_aux_loss_coeff: float = option(0.0, "weight of the load-balancing loss (1e-2 is common)", group=MOE)
    moe_z_loss_coeff: float | None = option(None, "weight of the router z-loss (ST-MoE; 1e-3 is common)",
                                            default_text="none", group=MOE)
    moe_router_enable_expert_bias: bool = option(False, "aux-loss-free balancing (DeepSeek-V3): a per-expert bias "
                                                        "added to the scores for the top-k choice only, moved after "
                                                        "each step towards the mean load (sigmoid scores)", group=MOE)
    moe_router_bias_update_rate: float = option(1e-3, "with --moe-router-enable-expert-bias: the bias step",
                                                group=MOE)
    moe_grouped_gemm: bool = option(False, "all experts' matmuls as one torch._grouped_mm (else a loop over "
                                           "experts, the reference; the same bits)", group=MOE)
    moe_token_dispatcher_type: str = option("allgather", "how tokens reach experts on other expert-parallel ranks: "
                                                         "all-gathered (allgather) or sent with uneven "
                                                         "all-to-alls (alltoall)", choices=("allgather", "alltoall"),
                                            group=MOE)
    moe_shared_expert_intermediate_size: int | None = option(None, "hidden size of the shared experts (their "
                                                                   "total), which see every token",
                                                             default_text="none", group=MOE)
    moe_shared_expert_gate: bool = option(False, "scale the shared experts' output by sigmoid(x w) (Qwen2-MoE)",
                                          group=MOE)
    moe_expert_capacity_factor: float | None = option(None, "each expert takes at most ceil(tokens x topk / "
                                                            "experts x this) tokens and drops the rest",
                                                      default_text="none: dropless", group=MOE)
    moe_token_drop_policy: str = option("probs", "with a capacity: drop the lowest-probability tokens (probs) or "
                                                 "the last ones (position)", choices=MOE_TOKEN_DROP_POLICIES,
                                        group=MOE)
    moe_pad_expert_input_to_capacity: bool = option(False, "with a capacity: pad each expert's tokens to it",
                                                    group=MOE)

    @classmethod
    def of(cls, **values) -> "ModelConfig":
        """ModelConfig(**values) with the None fields Megatron derives filled in first: ffn_hidden_size 4h (with
        swiglu 2/3 of that, rounded down to 64: a 4h GELU MLP's parameter count), max_position_embeddings the
        sequence length."""
        if values.get("ffn_hidden_size") is None:
            hidden = values["hidden_size"]
            values["ffn_hidden_size"] = int(4 * hidden * 2 / 3 / 64) * 64 if values.get("swiglu") else 4 * hidden
        if values.get("max_position_embeddings") is None:
            values["max_position_embeddings"] = values.get("seq_length")
        return cls(**values)

    @property
    def head_dim(self) -> int:
        """Channels per attention head (`--kv-channels`)."""
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def rotary_dim(self) -> int:
        """Channels per head that rope rotates (`--rotary-percent` of the head size)."""
        return rotary_dim(self.head_dim, self.rotary_percent)

    @property
    def query_groups(self) -> int:
        """Key/value heads: `--num-query-groups`, or one per query head."""
        return self.num_query_groups or self.num_attention_heads

    @property
    def expert_ffn_hidden_size(self) -> int:
        """Each routed expert's hidden size: `--moe-ffn-hidden-size`, or `--ffn-hidden-size`."""
        return self.moe_ffn_hidden_size or self.ffn_hidden_size

    def is_moe_layer(self, layer_id: int) -> bool:
        """Whether global layer `layer_id` holds the MoE layer (else the dense MLP), per --moe-layer-freq."""
        return self.num_experts is not None and moe_layer_pattern(self.moe_layer_freq, self.num_layers)[layer_id]

    @property
    def real_vocab_size(self) -> int:
        """The tokenizer's vocabulary: ids at or above it are padding."""
        return self.tokenizer_vocab_size or self.vocab_size

    def validate(self) -> "ModelConfig":
        """Raise a UserError naming the flag for the first problem found; return self."""
        for flag, value in [("--num-layers", self.num_layers), ("--hidden-size", self.hidden_size),
                            ("--num-attention-heads", self.num_attention_heads), ("--seq-length", self.seq_length),
                            ("--vocab-size", self.vocab_size), ("--ffn-hidden-size", self.ffn_hidden_size),
                            ("--max-position-embeddings", self.max_position_embeddings),
                            ("--make-vocab-size-divisible-by", self.make_vocab_size_divisible_by)]:
            if not isinstance(value, int) or value < 1:
                raise UserError(f"{flag} must be a positive integer, got {value!r}")
        if self.kv_channels is None and self.hidden_size % self.num_attention_heads:
            raise UserError(f"--hidden-size {self.hidden_size} is not divisible by --num-attention-heads "
                            f"{self.num_attention_heads}; change one of them or set --kv-channels")
        if not self.z_loss_weight >= 0:
            raise UserError(f"--z-loss-weight must be 0 or more, got {self.z_loss_weight} (1e-4 is a common value)")
        if self.kv_channels is not None and self.kv_channels < 1:
            raise UserError(f"--kv-channels must be a positive integer, got {self.kv_channels}")
        groups = self.num_query_groups
        if groups is not None and (groups < 1 or self.num_attention_heads % groups):
            raise UserError(f"--num-query-groups {groups} does not divide --num-attention-heads "
                            f"{self.num_attention_heads}; use a group count that divides the head count")
        for flag, value, known in [("--normalization", self.normalization, NORMALIZATIONS),
                                   ("--position-embedding-type", self.position_embedding_type,
                                    POSITION_EMBEDDING_TYPES)]:
            if value not in known:
                raise UserError(f"{flag} {value!r} is unknown; use one of {', '.join(known)}")
        if self.position_embedding_type == "learned_absolute" and self.seq_length > self.max_position_embeddings:
            raise UserError(f"--seq-length {self.seq_length} exceeds --max-position-embeddings "
                            f"{self.max_position_embeddings} with learned positions; raise "
                            f"--max-position-embeddings or lower --seq-length")
        if self.position_embedding_type == "rope":
            if self.head_dim % 2:
                raise UserError(f"rotary embeddings need an even head size, got {self.head_dim}; "
                                f"change --kv-channels or --hidden-size / --num-attention-heads")
            if self.rotary_base <= 0:
                raise UserError(f"--rotary-base must be positive, got {self.rotary_base}")
        if not 0.0 < self.rotary_percent <= 1.0:
            raise UserError(f"--rotary-percent must be in (0, 1], got {self.rotary_percent}; 1.0 rotates whole heads")
        if self.position_embedding_type == "rope" and (self.rotary_dim < 2 or self.rotary_dim % 2):
            raise UserError(f"--rotary-percent {self.rotary_percent} rotates {self.rotary_dim} of a head's "
                            f"{self.head_dim} channels, but rope rotates channel pairs; pick a percent that gives "
                            f"an even count of at least 2")
        if self.use_rope_scaling and self.position_embedding_type != "rope":
            raise UserError("--use-rope-scaling needs --position-embedding-type rope; "
                            "drop --use-rope-scaling or switch to rope")
        if self.use_rope_scaling and self.rope_scaling_factor <= 0:
            raise UserError(f"--rope-scaling-factor must be positive, got {self.rope_scaling_factor}")
        for flag, value in [("--norm-epsilon", self.norm_epsilon), ("--init-method-std", self.init_method_std)]:
            if value <= 0:
                raise UserError(f"{flag} must be positive, got {value}")
        for flag, value in [("--hidden-dropout", self.hidden_dropout), ("--attention-dropout", self.attention_dropout)]:
            if not 0.0 <= value < 1.0:
                raise UserError(f"{flag} must be in [0, 1), got {value}")
        if self.tokenizer_vocab_size is not None and not 1 <= self.tokenizer_vocab_size <= self.vocab_size:
            raise UserError(f"the tokenizer's vocabulary ({self.tokenizer_vocab_size}) does not fit the model's "
                            f"padded vocabulary ({self.vocab_size}); check --vocab-size and the tokenizer flags")
        if self.recompute_granularity not in RECOMPUTE_GRANULARITIES:
            raise UserError(f"--recompute-granularity {self.recompute_granularity!r} is unknown; "
                            f"use full or selective")
        self._validate_recompute_method()
        self._validate_moe()
        return self

    def _validate_moe(self) -> None:
        """Megatron's MoE rules, each once; a --moe-* option without --num-experts is refused, not ignored."""
        moe_fields = [field for field, spec in option_fields(ModelConfig) if spec.group == MOE]
        if self.num_experts is None:
            # str(): --moe-layer-freq comes as a string from the command line.
            given = [field for field in moe_fields if str(getattr(self, field.name)) != str(field.default)]
            if given:
                flag = "--" + given[0].name.replace("_", "-")
                raise UserError(f"{flag} configures mixture-of-experts layers, which need --num-experts N; "
                                f"add it or drop the --moe-* flags")
            return
        experts, topk = self.num_experts, self.moe_router_topk
        for flag, value in [("--num-experts", experts), ("--moe-router-topk", topk),
                            ("--moe-ffn-hidden-size", self.expert_ffn_hidden_size),
                            ("--moe-shared-expert-intermediate-size", self.moe_shared_expert_intermediate_size or 1)]:
            if not isinstance(value, int) or value < 1:
                raise UserError(f"{flag} must be a positive integer, got {value!r}")
        if topk > experts:
            raise UserError(f"--moe-router-topk {topk} exceeds --num-experts {experts}; route to at most "
                            f"{experts} experts")
        moe_layer_pattern(self.moe_layer_freq, self.num_layers)  # names --moe-layer-freq when it is wrong
        score = self.moe_router_score_function
        for flag, value, known in [("--moe-router-score-function", score, MOE_SCORE_FUNCTIONS),
                                   ("--moe-router-load-balancing-type", self.moe_router_load_balancing_type,
                                    MOE_LOAD_BALANCING_TYPES),
                                   ("--moe-token-drop-policy", self.moe_token_drop_policy, MOE_TOKEN_DROP_POLICIES)]:
            if value not in known:
                raise UserError(f"{flag} {value!r} is not built in megalite; use one of {', '.join(known)}")
        if score == "softmax" and topk == 1 and not self.moe_router_pre_softmax:
            raise UserError("--moe-router-topk 1 with softmax scores gives every token probability 1 (a softmax "
                            "over one logit); add --moe-router-pre-softmax")
        if self.moe_router_pre_softmax and score != "softmax":
            raise UserError("--moe-router-pre-softmax applies to --moe-router-score-function softmax only; "
                            "drop one of them")
        if self.moe_router_enable_expert_bias and score != "sigmoid":
            raise UserError("--moe-router-enable-expert-bias needs --moe-router-score-function sigmoid")
        for flag, value in [("--moe-aux-loss-coeff", self.moe_aux_loss_coeff),
                            ("--moe-z-loss-coeff", self.moe_z_loss_coeff or 0.0),
                            ("--moe-router-bias-update-rate", self.moe_router_bias_update_rate)]:
            if not value >= 0:
                raise UserError(f"{flag} must be 0 or more, got {value}")
        for flag, value in [("--moe-router-topk-scaling-factor", self.moe_router_topk_scaling_factor),
                            ("--moe-expert-capacity-factor", self.moe_expert_capacity_factor)]:
            if value is not None and not value > 0:
                raise UserError(f"{flag} must be positive, got {value}")
        self._validate_moe_groups()
        if self.moe_pad_expert_input_to_capacity and self.moe_expert_capacity_factor is None:
            raise UserError("--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor, the capacity "
                            "it pads to")
        if self.moe_shared_expert_gate and self.moe_shared_expert_intermediate_size is None:
            raise UserError("--moe-shared-expert-gate gates the shared experts, which need "
                            "--moe-shared-expert-intermediate-size")
        if self.moe_grouped_gemm and (self.hidden_size % 8 or self.expert_ffn_hidden_size % 8):
            raise UserError(f"--moe-grouped-gemm needs --hidden-size ({self.hidden_size}) and --moe-ffn-hidden-size "
                            f"({self.expert_ffn_hidden_size}) to be multiples of 8 (torch._grouped_mm's 16-byte "
                            f"rows); change them or drop --moe-grouped-gemm")

    def _validate_moe_groups(self) -> None:
        """Group-limited routing: both flags, groups that split the experts and hold topk experts."""
        groups, group_topk, topk = self.moe_router_num_groups, self.moe_router_group_topk, self.moe_router_topk
        if (groups is None) != (group_topk is None):
            raise UserError("--moe-router-num-groups and --moe-router-group-topk go together; give both or neither")
        if groups is None:
            return
        if groups < 1 or self.num_experts % groups:
            raise UserError(f"--moe-router-num-groups {groups} does not divide --num-experts {self.num_experts}; "
                            f"use a group count that divides it")
        if not 1 <= group_topk <= min(groups, topk) or topk > group_topk * (self.num_experts // groups):
            raise UserError(f"--moe-router-group-topk {group_topk} must be between 1 and both "
                            f"--moe-router-num-groups {groups} and --moe-router-topk {topk}, and its groups must "
                            f"hold at least {topk} experts; pick another group count")

    def _validate_recompute_method(self) -> None:
        """Megatron's rules: a method and its layer count go together, only with full granularity (selective
        always recomputes every layer's attention core); megalite's full without them is uniform with 1."""
        method, count = self.recompute_method, self.recompute_num_layers
        if method is not None and method not in RECOMPUTE_METHODS:
            raise UserError(f"--recompute-method {method!r} is unknown; use uniform or block")
        given = "--recompute-method" if method is not None else "--recompute-num-layers" if count is not None else None
        if given and self.recompute_granularity == "selective":
            raise UserError(f"{given} applies only to --recompute-granularity full (selective recomputation, also "
                            f"--recompute-activations, covers every layer); drop --recompute-method and "
                            f"--recompute-num-layers, or use --recompute-granularity full")
        if given and self.recompute_granularity != "full":
            raise UserError(f"{given} needs --recompute-granularity full")
        if method is not None and count is None:
            meaning = "the layers of each unit" if method == "uniform" else "the layers recomputed per pipeline chunk"
            raise UserError(f"--recompute-method {method} needs --recompute-num-layers N ({meaning})")
        if count is not None and method is None:
            raise UserError("--recompute-num-layers needs --recompute-method uniform or block")
        if count is not None and (not isinstance(count, int) or count < 1):
            raise UserError(f"--recompute-num-layers must be a positive integer, got {count!r}")


def moe_layer_pattern(freq: int | str, num_layers: int) -> list[bool]:
    """--moe-layer-freq as one bool per layer (True: MoE): N or "N" is every N-th layer from layer 0; a list
    string in Megatron's form ("([0]*3+[1]*29)", "[1,0,1,0]") is read without eval, from list literals of 0/1,
    `*` by an integer and `+` only."""
    text = str(freq).strip().strip("'\"")  # launch scripts often quote the list twice
    if text.isdigit():
        every = int(text)
        if every < 1:
            raise UserError(f"--moe-layer-freq must be at least 1, got {every}")
        return [i % every == 0 for i in range(num_layers)]
    try:
        pattern = _layer_list(ast.parse(text, mode="eval").body)
    except (SyntaxError, ValueError):
        raise UserError(f"--moe-layer-freq {text!r} is neither an integer nor a list of 0/1 such as "
                        f"\"([0]*3+[1]*29)\"; pass one of those forms") from None
    if len(pattern) != num_layers:
        raise UserError(f"--moe-layer-freq {text!r} gives {len(pattern)} layers but --num-layers is {num_layers}; "
                        f"give one 0/1 per layer")
    return [bool(value) for value in pattern]


def _layer_list(node: ast.AST) -> list[int]:
    """The list of 0/1 an expression of list literals, `list * int` and `list + list` means; ValueError else."""
    if isinstance(node, ast.List) and all(isinstance(item, ast.Constant) and item.value in (0, 1)
                                          and type(item.value) is int for item in node.elts):
        return [item.value for item in node.elts]
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _layer_list(node.left) + _layer_list(node.right)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):
        count = node.right if isinstance(node.right, ast.Constant) else node.left
        items = node.left if count is node.right else node.right
        if isinstance(count, ast.Constant) and type(count.value) is int and 0 <= count.value <= 100_000:
            return _layer_list(items) * count.value
    raise ValueError("not a list of 0/1")


def recompute_segments(num_layers: int, method: str | None = None,
                       recompute_num_layers: int | None = None) -> list[tuple[range, bool]]:
    """A chunk's `num_layers` layers (positions in the chunk, in order) cut into the segments full
    recomputation runs: (positions, checkpointed). As Megatron counts them, per pipeline chunk: "uniform"
    checkpoints consecutive groups of `recompute_num_layers` (the last group shorter if need be), "block"
    the first `recompute_num_layers` layers one by one and runs the rest plainly; None checkpoints each layer."""
    if method == "uniform":
        return [(range(start, min(start + recompute_num_layers, num_layers)), True)
                for start in range(0, num_layers, recompute_num_layers)]
    recomputed = num_layers if method is None else min(recompute_num_layers, num_layers)
    return [(range(i, i + 1), i < recomputed) for i in range(num_layers)]


def pad_vocab_size(vocab_size: int, make_vocab_size_divisible_by: int = 128,
                   tensor_model_parallel_size: int = 1) -> int:
    """Round the tokenizer's vocabulary up to a multiple of divisible_by x TP (Megatron's rule)."""
    multiple = make_vocab_size_divisible_by * tensor_model_parallel_size
    return math.ceil(vocab_size / multiple) * multiple


def with_tokenizer_vocab(model: ModelConfig, tokenizer_vocab_size: int, tensor_model_parallel_size: int = 1,
                         capacity: int | None = None) -> ModelConfig:
    """A validated copy of `model` holding the tokenizer's vocabulary, padded per
    --make-vocab-size-divisible-by x TP (the one place the padded size is computed). `capacity`
    (--vocab-size beside a real tokenizer) is the vocabulary the model is built for, padded the same way;
    it must cover the tokenizer's."""
    if capacity is not None and capacity < tokenizer_vocab_size:
        raise UserError(f"the tokenizer has {tokenizer_vocab_size} tokens, more than --vocab-size {capacity}; "
                        f"raise --vocab-size to at least {tokenizer_vocab_size} (or drop it)")
    padded = pad_vocab_size(capacity or tokenizer_vocab_size, model.make_vocab_size_divisible_by,
                            tensor_model_parallel_size)
    return replace(model, vocab_size=padded, tokenizer_vocab_size=tokenizer_vocab_size).validate()


def num_parameters(config: ModelConfig, active: bool = False) -> int:
    """Parameters of the whole model (padded vocabulary included), in closed form. `active`: those one token
    goes through, an MoE layer's top-k routed experts instead of all of them (shared experts and router
    included)."""
    hidden, heads, groups, head_dim = (config.hidden_size, config.num_attention_heads,
                                       config.query_groups, config.head_dim)
    bias = 1 if config.add_bias_linear else 0
    qkv_bias = 1 if config.add_bias_linear or config.add_qkv_bias else 0
    per_channel = 2 if config.normalization == "LayerNorm" else 1  # weight (and bias) per normalised channel
    norm = hidden * per_channel
    qk_norms = 2 * head_dim * per_channel if config.qk_layernorm else 0
    qkv_out = (heads + 2 * groups) * head_dim
    attention = (norm + hidden * qkv_out + qkv_bias * qkv_out + qk_norms  # input norm, QKV, q/k norms
                 + heads * head_dim * hidden + bias * hidden   # attention projection
                 + norm)                                       # pre-MLP norm

    def mlp(ffn: int) -> int:  # fc1, fc2
        fc1_out = ffn * (2 if config.swiglu else 1)
        return hidden * fc1_out + bias * fc1_out + ffn * hidden + bias * hidden

    dense = attention + mlp(config.ffn_hidden_size)
    layers = dense * config.num_layers
    if config.num_experts is not None:
        shared = config.moe_shared_expert_intermediate_size
        routed = config.moe_router_topk if active else config.num_experts
        moe = (attention + config.num_experts * hidden + routed * mlp(config.expert_ffn_hidden_size)  # router, experts
               + (mlp(shared) if shared else 0) + (hidden if config.moe_shared_expert_gate else 0))
        layers = sum(moe if config.is_moe_layer(i) else dense for i in range(config.num_layers))
    embedding = config.vocab_size * hidden
    if config.position_embedding_type == "learned_absolute":
        embedding += config.max_position_embeddings * hidden
    output = config.vocab_size * hidden if config.untie_embeddings_and_output_weights else 0
    return embedding + layers + norm + output
