"""CheckpointConfig, LoggingConfig and RunConfig, the whole run: its groups, the checks that span
groups, and the values derived from several groups."""

import importlib.util
import netrc
import os
from dataclasses import dataclass, replace
from urllib.parse import urlparse

from megalite.config.data import DataConfig
from megalite.config.model import ModelConfig, with_tokenizer_vocab
from megalite.config.options import option
from megalite.config.parallel import ParallelConfig
from megalite.config.rules import (check_a2a_heads, check_batch_sizes, check_microbatches, check_rampup_layout,
                                   check_sequence_split, check_tensor_parallel_split, global_batch_at,
                                   virtual_stage_layers)
from megalite.config.train import TrainConfig
from megalite.errors import UserError

WANDB_MODES = ("online", "offline", "disabled")
DEFAULT_WANDB_HOST = "https://api.wandb.ai"
DEFAULT_RUN_SAVE = "runs/default"  # where the default run (`python pretrain_gpt.py`, no flags) saves and resumes


@dataclass(frozen=True)
class CheckpointConfig:
    """Where checkpoints go and what a load restores."""

    save: str | None = option(None, "checkpoint folder",
                              default_text=f"{DEFAULT_RUN_SAVE} for the default run (no flags at all), else none")
    load: str | None = option(None, "resume from the latest checkpoint in this folder",
                              default_text="--save when it holds one")
    save_interval: int | None = option(None, "save every this many iterations",
                                       default_text="only at the end (and on exit)")
    keep_last_n_checkpoints: int | None = option(None, "after each save, delete all but the newest N checkpoints "
                                                       "(never the one resumed from)", default_text="keep all")
    save_retain_interval: int | None = option(
        None, "with --keep-last-n-checkpoints: also keep checkpoints at multiples of this iteration")
    no_load_optim: bool = option(False, "on --load, leave the optimizer state behind")
    no_load_rng: bool = option(False, "on --load, leave the RNG states behind")
    finetune: bool = option(False, "load only the model weights and start at iteration 0")

    def validate(self) -> "CheckpointConfig":
        """Raise a UserError naming the flag for the first problem found; return self."""
        for flag, value in [("--save-interval", self.save_interval),
                            ("--keep-last-n-checkpoints", self.keep_last_n_checkpoints)]:
            if value is not None and self.save is None:
                raise UserError(f"{flag} needs --save DIR (the folder checkpoints go to)")
        for flag, value in [("--save-interval", self.save_interval),
                            ("--keep-last-n-checkpoints", self.keep_last_n_checkpoints),
                            ("--save-retain-interval", self.save_retain_interval)]:
            if value is not None and value < 1:
                raise UserError(f"{flag} must be at least 1, got {value}")
        if self.save_retain_interval is not None and self.keep_last_n_checkpoints is None:
            raise UserError("--save-retain-interval only matters with --keep-last-n-checkpoints N (every "
                            "checkpoint is kept otherwise); add it or drop --save-retain-interval")
        if (self.finetune or self.no_load_optim or self.no_load_rng) and self.load is None:
            flag = "--finetune" if self.finetune else "--no-load-optim" if self.no_load_optim else "--no-load-rng"
            raise UserError(f"{flag} needs --load DIR (the checkpoint to start from)")
        return self


@dataclass(frozen=True)
class LoggingConfig:
    """Console and metrics cadence, and experiment tracking (megalite/run/tracking.py)."""

    log_interval: int = option(10, "print a progress line every this many iterations")
    metrics_file: str | None = option(None, "JSONL metrics", default_text="<save>/metrics.jsonl with --save")
    debug_pipeline_schedule: bool = option(False, "print each rank's sends, receives, forwards and backwards live")
    wandb_project: str | None = option(None, "track the run in this wandb project (wandb is off without it)")
    wandb_exp_name: str | None = option(None, "the wandb run name", default_text="model, layout and start time")
    wandb_entity: str | None = option(None, "wandb team or user", default_text="the account's default entity")
    wandb_save_dir: str | None = option(None, "where wandb writes its files", default_text="<save>/wandb")
    wandb_mode: str | None = option(None, "wandb's mode", choices=WANDB_MODES,
                                    default_text="WANDB_MODE, else online with an API key configured, else offline")
    tensorboard_dir: str | None = option(None, "also write the scalars as TensorBoard events here")

    @classmethod
    def from_flags(cls, save: str | None = None, **given) -> "LoggingConfig":
        """The validated LoggingConfig of the flags `given`, with wandb's mode and folder filled in where not
        given (from the environment, and `save`: --save); UserError when wandb would run but is not installed."""
        logging = cls(**given).validate()  # on the flags as given: the defaults below are no flags
        mode = logging.wandb_mode or default_wandb_mode()
        if logging.wandb_project and mode != "disabled" and importlib.util.find_spec("wandb") is None:
            raise UserError("--wandb-project needs the wandb package, which is not installed; "
                            "pip install -r requirements.txt (or use --wandb-mode disabled)")
        if logging.wandb_save_dir is None and save is not None:
            logging = replace(logging, wandb_save_dir=os.path.join(save, "wandb"))
        return replace(logging, wandb_mode=mode)

    def validate(self) -> "LoggingConfig":
        """Raise a UserError naming the flag for the first problem found; return self."""
        if self.log_interval < 1:
            raise UserError(f"--log-interval must be at least 1, got {self.log_interval}")
        if self.wandb_project is None:
            for flag in ("--wandb-exp-name", "--wandb-entity", "--wandb-save-dir", "--wandb-mode"):
                if getattr(self, flag[2:].replace("-", "_")) is not None:
                    raise UserError(f"{flag} needs --wandb-project NAME (wandb tracks a run only when a project "
                                    f"is given); add it or drop {flag}")
        elif not self.wandb_project.strip():
            raise UserError("--wandb-project is empty; give a project name (or drop the flag)")
        if self.tensorboard_dir is not None and importlib.util.find_spec("tensorboard") is None:
            raise UserError("--tensorboard-dir needs the tensorboard package, which is not installed; "
                            "pip install tensorboard (or drop --tensorboard-dir)")
        return self


def wandb_api_key_configured() -> bool:
    """Whether wandb has a key: WANDB_API_KEY, or a netrc entry (NETRC or ~/.netrc) for its host."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL") or DEFAULT_WANDB_HOST).hostname
    path = os.environ.get("NETRC") or os.path.expanduser("~/.netrc")
    try:
        return bool(host) and netrc.netrc(path).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def default_wandb_mode() -> str:
    """WANDB_MODE when it names a mode; otherwise online with an API key and offline without."""
    requested = os.environ.get("WANDB_MODE")
    requested = {"dryrun": "offline", "run": "online"}.get(requested, requested)
    if requested in WANDB_MODES:
        return requested
    return "online" if wandb_api_key_configured() else "offline"


@dataclass(frozen=True)
class RunConfig:
    """Everything one run needs, validated and frozen. What lies outside the flags (the built-in corpus, the
    tokenizer's vocabulary, a resumed LR schedule) completes it once, before the run builds anything
    (megalite/run/data.py's `final_run_config`); the Trainer holds, and checkpoints save, that final one."""

    model_name: str  # --model
    model: ModelConfig
    parallel: ParallelConfig
    train: TrainConfig
    data: DataConfig
    checkpoint: CheckpointConfig
    logging: LoggingConfig
    dry_run: bool = False  # --dry-run: print what every rank needs and exit (megalite/plan/dry_run.py)
    dry_run_gpu_memory: float = 80.0  # --dry-run-gpu-memory: GiB per rank above which the plan warns

    @property
    def num_microbatches(self) -> int:
        """Micro-batches per data-parallel rank per iteration: G / (micro-batch x DP)."""
        return self.train.global_batch_size // (self.train.micro_batch_size * self.parallel.data_parallel_size)

    def global_batch_at(self, consumed_samples: int) -> int:
        """The global batch of the training iteration that starts after `consumed_samples` samples:
        --global-batch-size, or under --rampup-batch-size the ramp's size at that point."""
        return global_batch_at(consumed_samples, self.train.global_batch_size, self.train.rampup_batch_size)

    def num_microbatches_at(self, consumed_samples: int) -> int:
        """Micro-batches per data-parallel rank of the training iteration after `consumed_samples` samples."""
        per_step = self.train.micro_batch_size * self.parallel.data_parallel_size
        return self.global_batch_at(consumed_samples) // per_step

    def with_tokenizer_vocab(self, tokenizer_vocab_size: int) -> "RunConfig":
        """A copy whose model holds the tokenizer's vocabulary, padded per --make-vocab-size-divisible-by x TP;
        beside a real tokenizer, --vocab-size is the vocabulary the model is built for (at least the tokenizer's)."""
        capacity = None if self.data.tokenizer_type == "NullTokenizer" else self.data.vocab_size
        return replace(self, model=with_tokenizer_vocab(self.model, tokenizer_vocab_size,
                                                        self.parallel.tensor_model_parallel_size, capacity))

    def validate(self) -> "RunConfig":
        """The checks that span groups (each group has validated itself); return self."""
        model, parallel, train = self.model, self.parallel, self.train
        tp = parallel.tensor_model_parallel_size
        check_tensor_parallel_split(model.num_attention_heads, model.query_groups, model.ffn_hidden_size, tp)
        if model.fused_output_cross_entropy and tp > 1:
            raise UserError(f"--fused-output-cross-entropy works at --tensor-model-parallel-size 1 (got {tp}); "
                            f"under TP the vocab-parallel cross-entropy already keeps only a 1/TP slice of the "
                            f"logits, so drop the flag")
        if model.num_experts is not None and tp > 1 and not parallel.sequence_parallel:
            raise UserError(f"--num-experts with --tensor-model-parallel-size {tp} needs --sequence-parallel (the "
                            f"MoE layer all-gathers the tokens over TP, as Megatron's); add it")
        ep = parallel.expert_model_parallel_size
        if ep > 1 and model.num_experts is None:
            raise UserError(f"--expert-model-parallel-size {ep} spreads the experts of MoE layers, but the model has "
                            f"none; add --num-experts or drop the flag")
        if ep > 1 and model.num_experts % ep:
            raise UserError(f"--expert-model-parallel-size {ep} does not divide --num-experts {model.num_experts}; "
                            f"each expert-parallel rank holds an equal share, so pick a divisor of "
                            f"{model.num_experts}")
        self._validate_sequence_split()
        # The layers must split over every (virtual) pipeline stage.
        virtual_stage_layers(model.num_layers, parallel.pipeline_model_parallel_size,
                             parallel.virtual_pipeline_model_parallel_size,
                             parallel.decoder_first_pipeline_num_layers, parallel.decoder_last_pipeline_num_layers)
        if train.compile and model.recompute_granularity:
            raise UserError("--compile with --recompute-* is not supported; drop one of them")
        if train.compile and parallel.sharding.params:
            raise UserError("--compile with --data-parallel-sharding-strategy optim_grads_params is not supported "
                            "(its gather hooks run around each compiled layer); use optim_grads, or drop --compile")
        check_batch_sizes(train.global_batch_size, train.micro_batch_size, parallel.data_parallel_size)
        check_microbatches(self.num_microbatches, parallel.pipeline_model_parallel_size,
                           parallel.virtual_pipeline_model_parallel_size)
        if train.rampup_batch_size is not None:
            check_rampup_layout(train.global_batch_size, train.rampup_batch_size, train.micro_batch_size,
                                parallel.data_parallel_size, parallel.pipeline_model_parallel_size,
                                parallel.virtual_pipeline_model_parallel_size)
        if train.exit_signal_handler and self.checkpoint.save is None:
            raise UserError("--exit-signal-handler saves a checkpoint on SIGTERM, so it needs --save DIR")
        return self

    def _validate_sequence_split(self) -> None:
        """The sequence splits over CP (and SP over TP); a2a splits the heads over CP."""
        model, parallel = self.model, self.parallel
        tp, cp = parallel.tensor_model_parallel_size, parallel.context_parallel_size
        check_sequence_split(model.seq_length, cp, tp, parallel.sequence_parallel)
        if cp > 1 and parallel.cp_a2a_size > 1:
            check_a2a_heads(model.num_attention_heads // tp, parallel.cp_a2a_size)
