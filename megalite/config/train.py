"""TrainConfig: batch, length of training, optimizer, LR schedule, precision and stopping rules."""

import math
from dataclasses import dataclass, fields, replace

from megalite.config.options import derived, option
from megalite.config.rules import (DECAY_STYLES, WSD_DECAY_STYLES, check_loss_scale_settings, check_rampup,
                                   check_schedule_settings, iterations_for_samples, schedule_fields)
from megalite.errors import UserError

DEFAULT_INITIAL_LOSS_SCALE = 2.0 ** 32
KERNEL_MODES = ("auto", "triton", "torch")
# The --help groups of the options below that are not in the "training" group.
LR, PRECISION, REGULARIZATION, INITIALIZATION, VALIDATION = (
    "learning rate", "mixed precision", "regularization", "initialization", "validation")


@dataclass(frozen=True)
class TrainConfig:
    micro_batch_size: int = option(8, "samples per micro-batch on each data-parallel rank")
    global_batch_size: int = option(16, "samples per iteration, over all data-parallel ranks")
    train_iters: int = option(200, "iterations to train (or give --train-samples)")
    train_samples: int | None = option(None, "instead of --train-iters: samples to train (iterations = samples "
                                             "// global batch, as in Megatron); the LR schedule then counts samples")
    lr: float = option(1e-3, "peak learning rate", group=LR)
    min_lr: float = option(1e-4, "learning rate at the end of the decay", group=LR)
    lr_decay_style: str = option("cosine", "learning-rate decay after warmup", choices=DECAY_STYLES, group=LR)
    lr_wsd_decay_style: str = option("exponential", "WSD: the shape of the final anneal", choices=WSD_DECAY_STYLES,
                                     group=LR)
    lr_wsd_decay_iters: int | None = option(None, "WSD: the length of the final anneal", group=LR)
    lr_warmup_iters: int | None = option(None, "linear warmup iterations (or give --lr-warmup-fraction)",
                                         default_text="10% of the decay iterations", group=LR)
    lr_warmup_fraction: float | None = option(None, "instead of --lr-warmup-iters: a fraction of the decay "
                                                    "iterations", group=LR)
    lr_decay_iters: int | None = option(None, "iterations the decay spans", default_text="--train-iters", group=LR)
    lr_warmup_samples: int | None = option(None, "with --train-samples: linear warmup samples",
                                           default_text="10% of the decay samples", group=LR)
    lr_decay_samples: int | None = option(None, "with --train-samples: samples the decay spans",
                                          default_text="--train-samples", group=LR)
    lr_wsd_decay_samples: int | None = option(None, "with --train-samples, WSD: samples of the final anneal", group=LR)
    override_opt_param_scheduler: bool = option(
        False, "on --load, keep this run's LR schedule flags",
        flag=("--override-opt_param-scheduler", "--override-opt-param-scheduler"), group=LR)
    use_checkpoint_opt_param_scheduler: bool = option(
        False, "on --load, take the LR schedule from the checkpoint",
        flag=("--use-checkpoint-opt_param-scheduler", "--use-checkpoint-opt-param-scheduler"), group=LR)
    weight_decay: float = option(0.1, "AdamW weight decay", group=REGULARIZATION)
    adam_beta1: float = option(0.9, "AdamW beta1", group=REGULARIZATION)
    adam_beta2: float = option(0.95, "AdamW beta2", group=REGULARIZATION)
    adam_eps: float = option(1e-8, "AdamW epsilon", group=REGULARIZATION)
    clip_grad: float = option(1.0, "clip the global gradient norm to this; 0 turns clipping off", group=REGULARIZATION)
    seed: int = option(1234, "seed of weights, data order and dropout", group=INITIALIZATION)
    bf16: bool = option(False, "bf16 params and compute, fp32 main params",
                        default_text="on for GPUs with bf16 units and in a dry run, unless --fp16 or --fp32",
                        group=PRECISION)
    bf16_default: bool = derived(False, "bf16 because no precision flag was given and the run is on a bf16 GPU, "
                                        "or is a dry run (which plans a GPU job)")
    fp16: bool = option(False, "fp16 params and compute with dynamic loss scaling", group=PRECISION)
    initial_loss_scale: float = option(DEFAULT_INITIAL_LOSS_SCALE, "fp16: the initial loss scale", default_text="2^32",
                                       group=PRECISION)
    min_loss_scale: float = option(1.0, "fp16: the scale never goes below", group=PRECISION)
    loss_scale_window: int = option(1000, "fp16: clean steps before the scale grows", group=PRECISION)
    hysteresis: int = option(2, "fp16: overflows tolerated before backing off", group=PRECISION)
    compile: bool = option(False, "torch.compile each transformer layer (regional; no faster on CPUs)")
    kernels: str = option("auto", "fused Triton kernels: auto = on CUDA GPUs; triton on a CPU needs "
                                  "TRITON_INTERPRET=1", choices=KERNEL_MODES)
    eval_interval: int = option(100, "evaluate every this many iterations; 0: only at the end", group=VALIDATION)
    eval_iters: int = option(5, "global batches per evaluation", group=VALIDATION)
    exit_interval: int | None = option(None, "stop (and save) when the iteration is a multiple")
    exit_duration_in_mins: float | None = option(None, "stop (and save) after this many minutes")
    exit_signal_handler: bool | None = option(
        None, "on SIGTERM or SIGINT (any rank), all ranks save at the next iteration boundary and exit 0",
        off_flag="--no-exit-signal-handler", default_text="on whenever --save is set")
    check_for_nan_in_loss_and_grad: bool = option(
        True, "stop at a NaN/Inf loss or grad norm (bf16, fp32), naming the last good checkpoint; off: skip "
              "such steps", off_flag="--no-check-for-nan-in-loss-and-grad")
    loss_spike_threshold: float = option(1.5, "warn when an iteration's loss exceeds this multiple of the "
                                              "median of the previous 20; 0 turns it off")
    rampup_batch_size: list[int] | None = option(
        None, "START INCREMENT RAMPUP_SAMPLES: the global batch starts at START and grows by INCREMENT in equal "
              "steps over the first RAMPUP_SAMPLES consumed samples up to --global-batch-size (Megatron's ramp-up)")
    decoupled_lr: float | None = option(None, "peak learning rate of the word embeddings and the output layer, "
                                              "on the same schedule", default_text="--lr", group=LR)
    decoupled_min_lr: float | None = option(None, "with --decoupled-lr: the embeddings' and output layer's "
                                                  "learning rate at the end of the decay", default_text="--min-lr",
                                            group=LR)
    manual_gc: bool = option(False, "turn Python's automatic garbage collector off while training and collect at "
                                    "fixed points instead: the start, every --manual-gc-interval iterations and "
                                    "around each evaluation (the pauses fall at the same iteration on every rank)")
    manual_gc_interval: int = option(0, "with --manual-gc: collect every this many iterations; 0: only at the start "
                                        "and around evaluations")
    manual_gc_eval: bool = option(True, "with --manual-gc: no collection around evaluations", inverted=True,
                                  flag="--no-manual-gc-eval")
    empty_unused_memory_level: int = option(
        0, "return the CUDA allocator's unused cached memory (torch.cuda.empty_cache) after each forward-backward "
           "and evaluation batch (1), and after each optimizer step too (2); fewer fragmentation OOMs, slower "
           "steps; nothing to return on a CPU", choices=(0, 1, 2))
    profile: bool = option(False, "write a PyTorch profiler trace (Chrome trace JSON, one ProfilerStep#N per "
                                  "iteration) of iterations --profile-step-start + 1 to --profile-step-end into "
                                  "profile/rank-R.json under --tensorboard-dir, else --save, else here")
    profile_step_start: int = option(10, "with --profile: the trace starts after this iteration")
    profile_step_end: int = option(12, "with --profile: the trace ends after this iteration")
    profile_ranks: list[int] | None = option(None, "with --profile: the global ranks that write a trace",
                                             default_text="all ranks")

    @classmethod
    def from_flags(cls, **given) -> "TrainConfig":
        """The validated TrainConfig of the flags `given`, with the lengths not given derived as Megatron
        derives them: the iterations of --train-samples, the decay over the whole run, the warmup 10% of the
        decay (or --lr-warmup-fraction of it), in the schedule's unit."""
        _check_schedule_unit(given)
        fraction = given.get("lr_warmup_fraction")
        if fraction is not None and given.get("lr_warmup_iters") is not None:
            raise UserError("--lr-warmup-iters and --lr-warmup-fraction both given; pick one")
        if fraction is not None and not 0 <= fraction <= 1:
            raise UserError(f"--lr-warmup-fraction must be in [0, 1], got {fraction}")
        values = {field.name: field.default for field in fields(cls)} | given

        def warmup(decay: int) -> int:
            return decay // 10 if fraction is None else math.floor(fraction * decay)

        samples, batch, rampup = values["train_samples"], values["global_batch_size"], values["rampup_batch_size"]
        if samples is not None and batch >= 1:  # below 1: validate says
            if rampup is not None:
                check_rampup(rampup, batch)
            values["train_iters"] = iterations_for_samples(samples, batch, rampup)
            if values["lr_decay_samples"] is None:
                values["lr_decay_samples"] = samples
            if values["lr_warmup_samples"] is None or fraction is not None:
                values["lr_warmup_samples"] = warmup(values["lr_decay_samples"])
        if values["lr_decay_iters"] is None:
            values["lr_decay_iters"] = values["train_iters"]
        if values["lr_warmup_iters"] is None:
            values["lr_warmup_iters"] = warmup(values["lr_decay_iters"])
        return cls(**values).validate()

    @property
    def lr_schedule_unit(self) -> str:
        """What the LR schedule counts: samples with --train-samples (Megatron's rule), else iterations."""
        return "iterations" if self.train_samples is None else "samples"

    def lr_schedule_settings(self) -> dict:
        """The LRSchedule's keyword arguments (megalite/run/lr_schedule.py), in the schedule's unit."""
        fields = schedule_fields(self.lr_schedule_unit)
        return {key: getattr(self, field) for key, field in fields.items()} | {"unit": self.lr_schedule_unit}

    def with_lr_schedule(self, settings: dict) -> "TrainConfig":
        """A copy holding an LRSchedule's `settings` (its state_dict): lr_schedule_settings' inverse."""
        return replace(self, **{field: settings[key] for key, field in schedule_fields(settings["unit"]).items()})

    @property
    def params_dtype(self):
        import torch

        return torch.bfloat16 if self.bf16 else torch.float16 if self.fp16 else torch.float32

    def validate(self) -> "TrainConfig":
        """Raise a UserError naming the flag for the first problem found; return self."""
        for flag, value in [("--micro-batch-size", self.micro_batch_size),
                            ("--global-batch-size", self.global_batch_size), ("--exit-interval", self.exit_interval)]:
            if value is not None and value < 1:
                raise UserError(f"{flag} must be at least 1, got {value}")
        if self.train_samples is not None and self.train_samples < self.global_batch_size:
            raise UserError(f"--train-samples {self.train_samples} is less than one --global-batch-size "
                            f"{self.global_batch_size}; train for at least {self.global_batch_size} samples")
        if self.train_iters < 1:
            raise UserError(f"--train-iters must be at least 1, got {self.train_iters}")
        if self.bf16 and self.fp16:
            raise UserError("--bf16 and --fp16 both given; pick one")
        if self.initial_loss_scale != DEFAULT_INITIAL_LOSS_SCALE and not self.fp16:
            raise UserError("--initial-loss-scale only applies with --fp16; add --fp16 or drop it")
        for flag, value in [("--initial-loss-scale", self.initial_loss_scale), ("--adam-eps", self.adam_eps),
                            ("--exit-duration-in-mins", self.exit_duration_in_mins)]:
            if value is not None and not value > 0:
                raise UserError(f"{flag} must be positive, got {value}")
        if self.fp16:
            check_loss_scale_settings(self.initial_loss_scale, self.min_loss_scale, self.loss_scale_window,
                                      self.hysteresis)
        check_schedule_settings(**self.lr_schedule_settings())
        if self.rampup_batch_size is not None:
            check_rampup(self.rampup_batch_size, self.global_batch_size)
        if self.override_opt_param_scheduler and self.use_checkpoint_opt_param_scheduler:
            raise UserError("--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler both "
                            "given; pick one")
        if not 0 <= self.adam_beta1 < 1 or not 0 <= self.adam_beta2 < 1:
            raise UserError(f"--adam-beta1 {self.adam_beta1} and --adam-beta2 {self.adam_beta2} must be in [0, 1)")
        for flag, value in [("--weight-decay", self.weight_decay), ("--clip-grad", self.clip_grad),
                            ("--eval-interval", self.eval_interval), ("--eval-iters", self.eval_iters)]:
            if value < 0:
                raise UserError(f"{flag} must be 0 or more, got {value}")
        if self.loss_spike_threshold != 0 and not self.loss_spike_threshold > 1:
            raise UserError(f"--loss-spike-threshold must be above 1 (a multiple of the recent median loss) or 0 "
                            f"to turn the warning off, got {self.loss_spike_threshold}")
        self._check_housekeeping()
        if self.kernels not in KERNEL_MODES:  # whether this machine can run them: kernels.check_kernels
            raise UserError(f"--kernels {self.kernels} is not one of {', '.join(KERNEL_MODES)}")
        return self

    def _check_housekeeping(self) -> None:
        """The --manual-gc and --profile settings: sane values, and no setting without its switch."""
        if self.manual_gc_interval < 0:
            raise UserError(f"--manual-gc-interval must be 0 (collect only around evaluations) or more, got "
                            f"{self.manual_gc_interval}")
        if not self.manual_gc and (self.manual_gc_interval or not self.manual_gc_eval):
            flag = "--manual-gc-interval" if self.manual_gc_interval else "--no-manual-gc-eval"
            raise UserError(f"{flag} only matters with --manual-gc (Python's own collector runs otherwise); add "
                            f"--manual-gc or drop {flag}")
        if not 0 <= self.profile_step_start < self.profile_step_end:
            raise UserError(f"--profile-step-start {self.profile_step_start} and --profile-step-end "
                            f"{self.profile_step_end} must satisfy 0 <= start < end (the trace covers the "
                            f"iterations after start up to end)")
        if self.profile_ranks is not None and (not self.profile or min(self.profile_ranks) < 0):
            raise UserError("--profile-ranks needs --profile and ranks of 0 or more; fix the ranks or add "
                            "--profile")


def _check_schedule_unit(given: dict) -> None:
    """Megatron's rule: a run given in samples sets its LR schedule in samples, one given in iterations
    in iterations."""
    samples = given.get("train_samples") is not None
    if samples and given.get("train_iters") is not None:
        raise UserError("--train-iters and --train-samples both given; pick one")
    unit, other = ("samples", "iters") if samples else ("iters", "samples")
    for flag in ("--lr-warmup", "--lr-decay", "--lr-wsd-decay"):
        if given.get(f"{flag[2:]}_{other}".replace("-", "_")) is not None:
            raise UserError(f"{flag}-{other} given with --train-{unit}; the schedule counts "
                            f"{'samples' if samples else 'iterations'}, so pass {flag}-{unit} instead")
