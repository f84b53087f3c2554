"""Model configuration with Megatron-LM's names, its validation, and named architectures.

`ModelConfig` holds one model's shape. Field names are Megatron's argument names
(`--num-query-groups` -> `num_query_groups`), except `add_bias_linear`, which
`--disable-bias-linear` sets False. `vocab_size` is the *padded* vocabulary the model
holds; `tokenizer_vocab_size` is the tokenizer's, and the rows and logits in between
are padding that never reaches the loss (see megalite/model/gpt.py).

`MODEL_PRESETS` maps a `--model` name to field values with the published numbers;
a preset's `vocab_size` is the tokenizer's vocabulary, padded by `model_config_from_preset`.

The other dataclasses hold the rest of a run, grouped as Megatron groups its flags;
`megalite/arguments.py` fills them from the command line and validates them together.
"""

import dataclasses
import math
from dataclasses import dataclass

from megalite.errors import UserError

POSITION_EMBEDDING_TYPES = ("learned_absolute", "rope")
NORMALIZATIONS = ("LayerNorm", "RMSNorm")
RECOMPUTE_GRANULARITIES = (None, "full", "selective")


@dataclass
class ModelConfig:
    """One GPT / LLaMA architecture. None fields are derived as Megatron derives them."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    seq_length: int
    vocab_size: int  # padded: what the embedding and output layer hold
    tokenizer_vocab_size: int | None = None  # None: no padding (== vocab_size)
    ffn_hidden_size: int | None = None  # None: 4h, or Megatron's 2/3 of that for SwiGLU
    num_query_groups: int | None = None  # None: multi-head attention (groups == heads)
    kv_channels: int | None = None  # None: hidden_size // num_attention_heads
    max_position_embeddings: int | None = None  # None: seq_length
    position_embedding_type: str = "learned_absolute"
    rotary_base: float = 10000.0
    use_rope_scaling: bool = False  # Llama 3.1's frequency scaling (low 1, high 4, context 8192)
    rope_scaling_factor: float = 8.0
    normalization: str = "LayerNorm"
    norm_epsilon: float = 1e-5
    swiglu: bool = False
    openai_gelu: bool = False  # tanh-approximated GELU (GPT-2's `gelu_new`) instead of exact erf
    untie_embeddings_and_output_weights: bool = False
    add_bias_linear: bool = True
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    init_method_std: float = 0.02
    make_vocab_size_divisible_by: int = 128
    recompute_granularity: str | None = None
    z_loss_weight: float = 0.0  # adds w * logsumexp(logits)^2 per token to the loss (PaLM's z-loss)
    fused_output_cross_entropy: bool = False  # output layer + loss chunked over tokens (TP = 1)

    def __post_init__(self):
        if self.ffn_hidden_size is None:
            if self.swiglu:
                # Megatron: keep the parameter count of a 4h GELU MLP, rounded down to 64.
                self.ffn_hidden_size = int(4 * self.hidden_size * 2 / 3 / 64) * 64
            else:
                self.ffn_hidden_size = 4 * self.hidden_size
        if self.max_position_embeddings is None:
            self.max_position_embeddings = self.seq_length

    @property
    def head_dim(self) -> int:
        """Channels per attention head (`--kv-channels`)."""
        if self.kv_channels is not None:
            return self.kv_channels
        return self.hidden_size // self.num_attention_heads

    @property
    def query_groups(self) -> int:
        """Key/value heads: `--num-query-groups`, or one per query head."""
        return self.num_query_groups or self.num_attention_heads

    @property
    def real_vocab_size(self) -> int:
        """The tokenizer's vocabulary: ids at or above it are padding."""
        return self.tokenizer_vocab_size or self.vocab_size

    def validate(self) -> "ModelConfig":
        """Raise a UserError naming the flag for the first problem found; return self."""
        for flag, value in [("--num-layers", self.num_layers), ("--hidden-size", self.hidden_size),
                            ("--num-attention-heads", self.num_attention_heads),
                            ("--seq-length", self.seq_length), ("--vocab-size", self.vocab_size),
                            ("--ffn-hidden-size", self.ffn_hidden_size),
                            ("--max-position-embeddings", self.max_position_embeddings),
                            ("--make-vocab-size-divisible-by", self.make_vocab_size_divisible_by)]:
            if not isinstance(value, int) or value < 1:
                raise UserError(f"{flag} must be a positive integer, got {value!r}")
        if self.kv_channels is None and self.hidden_size % self.num_attention_heads:
            raise UserError(
                f"--hidden-size {self.hidden_size} is not divisible by --num-attention-heads "
                f"{self.num_attention_heads}; change one of them or set --kv-channels")
        if not self.z_loss_weight >= 0:
            raise UserError(f"--z-loss-weight must be 0 or more, got {self.z_loss_weight} (1e-4 is a common value)")
        if self.kv_channels is not None and self.kv_channels < 1:
            raise UserError(f"--kv-channels must be a positive integer, got {self.kv_channels}")
        if self.num_query_groups is not None and (
                self.num_query_groups < 1 or self.num_attention_heads % self.num_query_groups):
            raise UserError(
                f"--num-query-groups {self.num_query_groups} does not divide --num-attention-heads "
                f"{self.num_attention_heads}; use a group count that divides the head count")
        if self.position_embedding_type not in POSITION_EMBEDDING_TYPES:
            raise UserError(
                f"--position-embedding-type {self.position_embedding_type!r} is unknown; "
                f"use one of {', '.join(POSITION_EMBEDDING_TYPES)}")
        if (self.position_embedding_type == "learned_absolute"
                and self.seq_length > self.max_position_embeddings):
            raise UserError(
                f"--seq-length {self.seq_length} exceeds --max-position-embeddings "
                f"{self.max_position_embeddings} with learned positions; raise "
                f"--max-position-embeddings or lower --seq-length")
        if self.position_embedding_type == "rope":
            if self.head_dim % 2:
                raise UserError(
                    f"rotary embeddings need an even head size, got {self.head_dim}; "
                    f"change --kv-channels or --hidden-size / --num-attention-heads")
            if self.rotary_base <= 0:
                raise UserError(f"--rotary-base must be positive, got {self.rotary_base}")
        if self.use_rope_scaling and self.position_embedding_type != "rope":
            raise UserError("--use-rope-scaling needs --position-embedding-type rope; "
                            "drop --use-rope-scaling or switch to rope")
        if self.use_rope_scaling and self.rope_scaling_factor <= 0:
            raise UserError(f"--rope-scaling-factor must be positive, got {self.rope_scaling_factor}")
        if self.normalization not in NORMALIZATIONS:
            raise UserError(f"--normalization {self.normalization!r} is unknown; "
                            f"use one of {', '.join(NORMALIZATIONS)}")
        if self.norm_epsilon <= 0:
            raise UserError(f"--norm-epsilon must be positive, got {self.norm_epsilon}")
        for flag, value in [("--hidden-dropout", self.hidden_dropout),
                            ("--attention-dropout", self.attention_dropout)]:
            if not 0.0 <= value < 1.0:
                raise UserError(f"{flag} must be in [0, 1), got {value}")
        if self.init_method_std <= 0:
            raise UserError(f"--init-method-std must be positive, got {self.init_method_std}")
        if self.tokenizer_vocab_size is not None and not 1 <= self.tokenizer_vocab_size <= self.vocab_size:
            raise UserError(
                f"the tokenizer's vocabulary ({self.tokenizer_vocab_size}) does not fit the model's "
                f"padded vocabulary ({self.vocab_size}); check --vocab-size and the tokenizer flags")
        if self.recompute_granularity not in RECOMPUTE_GRANULARITIES:
            raise UserError(f"--recompute-granularity {self.recompute_granularity!r} is unknown; "
                            f"use full or selective")
        return self


def pad_vocab_size(vocab_size: int, make_vocab_size_divisible_by: int = 128,
                   tensor_model_parallel_size: int = 1) -> int:
    """Round the tokenizer's vocabulary up to a multiple of divisible_by x TP (Megatron's rule)."""
    multiple = make_vocab_size_divisible_by * tensor_model_parallel_size
    return math.ceil(vocab_size / multiple) * multiple


def _gpt2(num_layers: int, hidden_size: int, num_attention_heads: int) -> dict:
    """GPT-2: learned positions, LayerNorm, GELU (tanh form, HF's `gelu_new`), biases, tied."""
    return dict(num_layers=num_layers, hidden_size=hidden_size, num_attention_heads=num_attention_heads,
                ffn_hidden_size=4 * hidden_size, seq_length=1024, max_position_embeddings=1024,
                vocab_size=50257, position_embedding_type="learned_absolute", normalization="LayerNorm",
                norm_epsilon=1e-5, openai_gelu=True, add_bias_linear=True,
                untie_embeddings_and_output_weights=False, hidden_dropout=0.1, attention_dropout=0.1)


def _llama(num_layers: int, hidden_size: int, ffn_hidden_size: int, num_attention_heads: int,
           num_query_groups: int | None, vocab_size: int, seq_length: int, rotary_base: float,
           tied: bool = False, max_position_embeddings: int | None = None, **extra) -> dict:
    """LLaMA: rope, RMSNorm, SwiGLU, no biases, no dropout."""
    return dict(num_layers=num_layers, hidden_size=hidden_size, ffn_hidden_size=ffn_hidden_size,
                num_attention_heads=num_attention_heads, num_query_groups=num_query_groups,
                vocab_size=vocab_size, seq_length=seq_length,
                max_position_embeddings=max_position_embeddings or seq_length,
                position_embedding_type="rope", rotary_base=rotary_base, normalization="RMSNorm",
                norm_epsilon=1e-5, swiglu=True, add_bias_linear=False,
                untie_embeddings_and_output_weights=not tied, hidden_dropout=0.0,
                attention_dropout=0.0, **extra)


MODEL_PRESETS: dict[str, dict] = {
    # The default CPU model: LLaMA-shaped, about 7.1M parameters with an 8192-token vocabulary.
    "tiny": _llama(num_layers=4, hidden_size=256, ffn_hidden_size=688, num_attention_heads=4,
                   num_query_groups=2, vocab_size=8192, seq_length=256, rotary_base=10000.0),
    "gpt2-124m": _gpt2(num_layers=12, hidden_size=768, num_attention_heads=12),
    "gpt2-350m": _gpt2(num_layers=24, hidden_size=1024, num_attention_heads=16),
    "llama2-7b": _llama(num_layers=32, hidden_size=4096, ffn_hidden_size=11008, num_attention_heads=32,
                        num_query_groups=None, vocab_size=32000, seq_length=4096, rotary_base=10000.0),
    "llama3-8b": _llama(num_layers=32, hidden_size=4096, ffn_hidden_size=14336, num_attention_heads=32,
                        num_query_groups=8, vocab_size=128256, seq_length=8192, rotary_base=500000.0),
    "llama3.2-1b": _llama(num_layers=16, hidden_size=2048, ffn_hidden_size=8192, num_attention_heads=32,
                          num_query_groups=8, vocab_size=128256, seq_length=8192, rotary_base=500000.0,
                          tied=True, max_position_embeddings=131072, use_rope_scaling=True,
                          rope_scaling_factor=32.0),
    # TinyLlama-1.1B's shape: the ~1B LLaMA-2-style model (32000-token vocabulary).
    "llama-1b": _llama(num_layers=22, hidden_size=2048, ffn_hidden_size=5632, num_attention_heads=32,
                       num_query_groups=4, vocab_size=32000, seq_length=2048, rotary_base=10000.0),
}


def model_config_from_preset(name: str, tensor_model_parallel_size: int = 1, **overrides) -> ModelConfig:
    """The validated ModelConfig of preset `name` with `overrides` applied.

    `vocab_size` (from the preset or the overrides) is the tokenizer's vocabulary; the
    config's `vocab_size` is it padded per `make_vocab_size_divisible_by` x TP.
    """
    if name not in MODEL_PRESETS:
        raise UserError(f"--model {name!r} is not a known preset; use one of "
                        f"{', '.join(MODEL_PRESETS)} (see --list-models)")
    fields = {field.name for field in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ValueError(f"unknown ModelConfig fields: {unknown}")
    values = {**MODEL_PRESETS[name], **overrides}
    tokenizer_vocab = values["vocab_size"]
    values["tokenizer_vocab_size"] = tokenizer_vocab
    values["vocab_size"] = pad_vocab_size(
        tokenizer_vocab, values.get("make_vocab_size_divisible_by", 128), tensor_model_parallel_size)
    return ModelConfig(**values).validate()


def num_parameters(config: ModelConfig) -> int:
    """Parameters of the whole model (padded vocabulary included), in closed form."""
    hidden, heads, groups, head_dim = (config.hidden_size, config.num_attention_heads,
                                       config.query_groups, config.head_dim)
    bias = 1 if config.add_bias_linear else 0
    norm = hidden * (2 if config.normalization == "LayerNorm" else 1)
    qkv_out = (heads + 2 * groups) * head_dim
    fc1_out = config.ffn_hidden_size * (2 if config.swiglu else 1)
    layer = (norm + hidden * qkv_out + bias * qkv_out          # input norm, QKV
             + heads * head_dim * hidden + bias * hidden       # attention projection
             + norm + hidden * fc1_out + bias * fc1_out        # pre-MLP norm, fc1
             + config.ffn_hidden_size * hidden + bias * hidden)  # fc2
    embedding = config.vocab_size * hidden
    if config.position_embedding_type == "learned_absolute":
        embedding += config.max_position_embeddings * hidden
    output = config.vocab_size * hidden if config.untie_embeddings_and_output_weights else 0
    return embedding + config.num_layers * layer + norm + output


@dataclass
class ParallelConfig:
    """How the world is cut: TP x PP x DP = world size (DP is what remains)."""

    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    num_layers_per_virtual_pipeline_stage: int | None = None
    num_virtual_stages_per_pipeline_rank: int | None = None
    virtual_pipeline_model_parallel_size: int = 1  # V: model chunks per pipeline rank, from the two flags above
    decoder_first_pipeline_num_layers: int | None = None
    decoder_last_pipeline_num_layers: int | None = None
    sequence_parallel: bool = False
    use_distributed_optimizer: bool = False
    overlap_grad_reduce: bool = False
    ddp_bucket_size: int | None = 40_000_000  # grad elements per data-parallel bucket (None: one per chunk)
    distributed_backend: str | None = None  # None: nccl with CUDA, else gloo
    distributed_timeout_minutes: float = 10  # a collective waiting longer than this fails (a dead or hung peer)
    world_size: int = 1

    @property
    def data_parallel_size(self) -> int:
        return self.world_size // (self.tensor_model_parallel_size * self.pipeline_model_parallel_size)


@dataclass
class TrainConfig:
    """Batch, length of training, optimizer, LR schedule, precision and stopping rules."""

    micro_batch_size: int = 8
    global_batch_size: int = 16
    train_iters: int = 200
    lr: float = 1e-3
    min_lr: float = 1e-4
    lr_decay_style: str = "cosine"
    lr_wsd_decay_style: str = "exponential"
    lr_wsd_decay_iters: int | None = None
    lr_warmup_iters: int = 0
    lr_decay_iters: int | None = None  # None: train_iters
    override_opt_param_scheduler: bool = False
    use_checkpoint_opt_param_scheduler: bool = False
    weight_decay: float = 0.1
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    seed: int = 1234
    bf16: bool = False
    bf16_default: bool = False  # bf16 because no precision flag was given and the run is on a bf16 GPU
    fp16: bool = False
    initial_loss_scale: float = 2.0 ** 32
    min_loss_scale: float = 1.0
    loss_scale_window: int = 1000
    hysteresis: int = 2
    compile: bool = False
    kernels: str = "auto"  # --kernels: auto (Triton on CUDA), triton, torch
    eval_interval: int = 100  # 0: no evaluation during training
    eval_iters: int = 5
    exit_interval: int | None = None
    exit_duration_in_mins: float | None = None
    exit_signal_handler: bool = False  # arguments.py turns it on whenever --save is set
    check_for_nan_in_loss_and_grad: bool = True  # False: skip non-finite steps instead of stopping
    loss_spike_threshold: float = 1.5  # warn when a loss exceeds this x the recent median; 0: never

    @property
    def params_dtype(self):
        import torch

        return torch.bfloat16 if self.bf16 else torch.float16 if self.fp16 else torch.float32


@dataclass
class DataConfig:
    """Where tokens come from (`--data-path` blends, per-split paths, or `--mock-data`)."""

    data_path: list[str] | None = None
    split: str = "969,30,1"
    train_data_path: list[str] | None = None
    valid_data_path: list[str] | None = None
    test_data_path: list[str] | None = None
    data_cache_path: str | None = None
    mock_data: bool = False
    tokenizer_type: str | None = None
    tokenizer_model: str | None = None
    vocab_size: int | None = None
    eod_mask_loss: bool = False
    reset_position_ids: bool = False
    num_workers: int = 0
    builtin_corpus: bool = False  # True: the default run's corpus, built under data/build/


@dataclass
class CheckpointConfig:
    save: str | None = None
    load: str | None = None
    save_interval: int | None = None  # None: save only at the end (and on exit)
    keep_last_n_checkpoints: int | None = None  # None: keep every checkpoint
    save_retain_interval: int | None = None  # with the above: also keep multiples of this iteration
    no_load_optim: bool = False
    no_load_rng: bool = False
    finetune: bool = False


@dataclass
class LoggingConfig:
    log_interval: int = 10
    metrics_file: str | None = None  # None: <save>/metrics.jsonl when --save is set
    debug_pipeline_schedule: bool = False  # print every rank's sends, receives, forwards and backwards
    # Experiment tracking (megalite/tracking.py); wandb is on when wandb_project is set.
    wandb_project: str | None = None
    wandb_exp_name: str | None = None  # None: model, layout and start time
    wandb_entity: str | None = None
    wandb_save_dir: str | None = None  # None: <save>/wandb, or wandb's default without --save
    wandb_mode: str = "offline"  # online, offline or disabled; arguments.py picks the default
    tensorboard_dir: str | None = None


@dataclass
class RunConfig:
    """Everything one run needs; `megalite/arguments.py` builds it from the command line."""

    model_name: str
    model: ModelConfig
    parallel: ParallelConfig
    train: TrainConfig
    data: DataConfig
    checkpoint: CheckpointConfig
    logging: LoggingConfig
    dry_run: bool = False  # --dry-run: print what every rank needs and exit (megalite/dry_run.py)
