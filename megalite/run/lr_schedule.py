"""The learning-rate schedule: Megatron's OptimizerParamScheduler, counted in iterations, or in samples
when the run is given in samples (--train-samples). `lr_at` is a pure function of the run's position and
the settings, so a resume needs only the checkpoint's position and settings (`state_dict`); the styles
and megalite's two departures from Megatron are in docs/training.md."""

import math

from megalite.config.rules import check_schedule_settings, schedule_flags
from megalite.errors import UserError

# The fraction of (lr - min_lr) left at decay ratio r in [0, 1]: 1 at 0, 0 at 1.
COEFFICIENTS = {
    "linear": lambda r: 1.0 - r,
    "cosine": lambda r: 0.5 * (1.0 + math.cos(math.pi * r)),
    "exponential": lambda r: 2.0 * 0.5 ** r - 1.0,
    "minus_sqrt": lambda r: 1.0 - math.sqrt(r),
}


class LRSchedule:
    """The learning rate of every iteration, and its settings for a checkpoint. The lengths (`*_iters`) count
    `unit`s: iterations, or samples."""

    def __init__(self, lr: float, min_lr: float, warmup_iters: int, decay_iters: int,
                 decay_style: str = "cosine", wsd_decay_style: str = "exponential",
                 wsd_decay_iters: int | None = None, unit: str = "iterations", decoupled_lr: float | None = None,
                 decoupled_min_lr: float | None = None):
        self.unit = unit
        self.lr, self.min_lr = float(lr), float(min_lr)
        self.decoupled_lr = None if decoupled_lr is None else float(decoupled_lr)
        self.decoupled_min_lr = None if decoupled_lr is None else float(
            min_lr if decoupled_min_lr is None else decoupled_min_lr)
        self.warmup_iters, self.decay_iters = int(warmup_iters), int(decay_iters)
        self.decay_style, self.wsd_decay_style = decay_style, wsd_decay_style
        self.wsd_decay_iters = None if wsd_decay_iters is None else int(wsd_decay_iters)

    def lr_at(self, iteration: int, consumed_samples: int = 0, batch: int = 1) -> float:
        """Learning rate of the optimizer step at 0-based `iteration` (>= 0), which trains `batch` samples
        after `consumed_samples` (read when the schedule counts samples)."""
        return self._lr_between(iteration, consumed_samples, batch, self.lr, self.min_lr)

    def decoupled_lr_at(self, iteration: int, consumed_samples: int = 0, batch: int = 1) -> float | None:
        """The word embeddings' and output layer's learning rate at that step; None without --decoupled-lr."""
        if self.decoupled_lr is None:
            return None
        return self._lr_between(iteration, consumed_samples, batch, self.decoupled_lr, self.decoupled_min_lr)

    def _lr_between(self, iteration: int, consumed_samples: int, batch: int, lr: float, min_lr: float) -> float:
        """The schedule's value at that step for peak `lr` and floor `min_lr`."""
        position, step = (consumed_samples, batch) if self.unit == "samples" else (iteration, 1)
        if position < self.warmup_iters:
            return lr * min(1.0, (position + step) / self.warmup_iters)
        if self.decay_style == "constant":
            return lr
        if position > self.decay_iters:
            return min_lr
        if self.decay_style == "inverse-square-root":
            return max(min_lr, lr * math.sqrt(max(self.warmup_iters, step) / (position + step)))
        if self.decay_style == "WSD":
            anneal_start = self.decay_iters - self.wsd_decay_iters
            if position <= anneal_start:
                return lr
            style, ratio = self.wsd_decay_style, (position - anneal_start) / self.wsd_decay_iters
        else:
            decay_span = self.decay_iters - self.warmup_iters
            # A zero-length decay (warmup_iters == decay_iters) is already over at its first step.
            style, ratio = self.decay_style, (position - self.warmup_iters) / decay_span if decay_span > 0 else 1.0
        return min_lr + COEFFICIENTS[style](ratio) * (lr - min_lr)

    def state_dict(self) -> dict:
        """The settings, JSON-able; the iteration is the checkpoint's own."""
        return dict(lr=self.lr, min_lr=self.min_lr, warmup_iters=self.warmup_iters,
                    decay_iters=self.decay_iters, decay_style=self.decay_style,
                    wsd_decay_style=self.wsd_decay_style, wsd_decay_iters=self.wsd_decay_iters, unit=self.unit,
                    decoupled_lr=self.decoupled_lr, decoupled_min_lr=self.decoupled_min_lr)

    def load_state_dict(self, state: dict, override: bool = False, use_checkpoint: bool = False) -> None:
        """Reconcile this run's settings with a checkpoint's (`state`), as Megatron does: where they differ,
        `override` keeps this run's, `use_checkpoint` adopts the checkpoint's, and neither raises a UserError
        naming every differing setting. The WSD settings count only when either side is WSD."""
        if override:
            return
        mine = self.state_dict()
        uses_wsd = "WSD" in (self.decay_style, state.get("decay_style"))
        differing = [key for key, value in mine.items()  # a setting absent from `state` differs too
                     if (uses_wsd or not key.startswith("wsd_")) and (key not in state or state[key] != value)]
        if not differing:
            return
        if use_checkpoint:
            adopted = {**mine, **{key: state[key] for key in differing if key in state}}
            check_schedule_settings(**adopted)  # a file's settings: checked as this run's flags were
            self.__init__(**adopted)
            return
        raise UserError(schedule_mismatch(state, mine, differing))


def schedule_mismatch(checkpoint: dict, mine: dict, differing: list[str]) -> str:
    """The sentence for a resume whose LR settings differ: each difference, the flags that keep the checkpoint's
    schedule (usually a larger --train-iters moved the default warmup and decay), and the two switches."""
    if "unit" in differing:
        return (f"the checkpoint's learning-rate schedule counts {checkpoint['unit']} but this run's counts "
                f"{mine['unit']} (--train-samples counts samples); pass --use-checkpoint-opt_param-scheduler to "
                f"take the checkpoint's or --override-opt_param-scheduler to start this run's")
    flags = schedule_flags(mine["unit"])
    described = ", ".join(f"{flags[key]} is {repr(checkpoint[key]) if key in checkpoint else 'absent'} in the "
                          f"checkpoint but {mine[key]!r} in this run" for key in differing)
    keep = " ".join(f"{flags[key]} {checkpoint[key]}" for key in differing if checkpoint.get(key) is not None)
    return (f"the learning-rate schedule differs from the checkpoint's ({described}); to train on with the "
            f"checkpoint's schedule (e.g. after raising --train-iters) pass {keep + ' or ' if keep else ''}"
            f"--use-checkpoint-opt_param-scheduler, or pass --override-opt_param-scheduler to switch to this "
            f"run's values")
