"""The learning-rate schedule: Megatron's OptimizerParamScheduler, counted in iterations.

`lr_at(iteration)` is the learning rate of the optimizer step at 0-based `iteration`.
It is a pure function of the iteration and the settings, so resuming needs only the
iteration (from the checkpoint) and the settings (`state_dict`), not a step counter.

Warmup is linear: `lr * (iteration + 1) / warmup_iters` for iteration < warmup_iters.
Megatron uses `lr * iteration / warmup_iters`, so its first step runs at lr 0 and is
wasted; here the first step already moves and the last warmup step reaches `lr`.
After warmup, with decay_ratio = (iteration - warmup_iters) / (decay_iters - warmup_iters):

- constant: `lr` forever (also beyond decay_iters).
- linear: `min_lr + (1 - ratio) * (lr - min_lr)`.
- cosine: `min_lr + 0.5 * (1 + cos(pi * ratio)) * (lr - min_lr)`.
- inverse-square-root: `max(min_lr, lr * sqrt(max(warmup_iters, 1) / (iteration + 1)))`.
  In steps taken t = iteration + 1, warmup is `lr * t / w` and decay `lr * sqrt(w / t)`:
  both equal `lr` at t = w, so the curve is continuous and peaks exactly once.
  (Megatron divides by sqrt(iteration), which repeats `lr` for one step.)
- WSD (warmup-stable-decay): `lr` until decay_iters - wsd_decay_iters, then annealed to
  `min_lr` at decay_iters over wsd_decay_iters iterations, with r the anneal ratio and
  the coefficient of (lr - min_lr) given by `wsd_decay_style`: exponential
  `2 * 0.5**r - 1`, linear `1 - r`, cosine `0.5 * (1 + cos(pi * r))`, minus_sqrt `1 - sqrt(r)`.

Every style but constant gives `min_lr` beyond decay_iters.
"""

import math

from megalite.config.rules import LR_SCHEDULE_FLAGS as FLAGS
from megalite.config.rules import check_schedule_settings
from megalite.errors import UserError

_WSD_SETTINGS = ("wsd_decay_style", "wsd_decay_iters")


def _wsd_coefficient(style: str, ratio: float) -> float:
    """Fraction of (lr - min_lr) left at anneal ratio `ratio` in [0, 1]: 1 at 0, 0 at 1."""
    if style == "exponential":
        return 2.0 * 0.5 ** ratio - 1.0
    if style == "linear":
        return 1.0 - ratio
    if style == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * ratio))
    return 1.0 - math.sqrt(ratio)  # minus_sqrt


class LRSchedule:
    """Learning rate per iteration; see the module docstring for the formulas."""

    def __init__(self, lr: float, min_lr: float, warmup_iters: int, decay_iters: int,
                 decay_style: str = "cosine", wsd_decay_style: str = "exponential",
                 wsd_decay_iters: int | None = None):
        self._configure(dict(lr=lr, min_lr=min_lr, warmup_iters=warmup_iters, decay_iters=decay_iters,
                             decay_style=decay_style, wsd_decay_style=wsd_decay_style,
                             wsd_decay_iters=wsd_decay_iters))

    def _configure(self, settings: dict) -> None:
        """Validate `settings` (UserError naming the flag) and adopt them."""
        check_schedule_settings(**settings)
        self.lr, self.min_lr = float(settings["lr"]), float(settings["min_lr"])
        self.warmup_iters, self.decay_iters = int(settings["warmup_iters"]), int(settings["decay_iters"])
        self.decay_style = settings["decay_style"]
        self.wsd_decay_style = settings["wsd_decay_style"]
        wsd_decay_iters = settings["wsd_decay_iters"]
        self.wsd_decay_iters = None if wsd_decay_iters is None else int(wsd_decay_iters)

    def lr_at(self, iteration: int) -> float:
        """Learning rate of the optimizer step at 0-based `iteration` (>= 0)."""
        if iteration < self.warmup_iters:
            return self.lr * (iteration + 1) / self.warmup_iters
        if self.decay_style == "constant":
            return self.lr
        if iteration > self.decay_iters:
            return self.min_lr
        if self.decay_style == "inverse-square-root":
            return max(self.min_lr, self.lr * math.sqrt(max(self.warmup_iters, 1) / (iteration + 1)))
        if self.decay_style == "WSD":
            return self.min_lr + self._wsd_coefficient(iteration) * (self.lr - self.min_lr)
        decay_span = self.decay_iters - self.warmup_iters
        # A zero-length decay (warmup_iters == decay_iters) is already over at its first step.
        ratio = (iteration - self.warmup_iters) / decay_span if decay_span > 0 else 1.0
        if self.decay_style == "linear":
            coefficient = 1.0 - ratio
        else:  # cosine
            coefficient = 0.5 * (1.0 + math.cos(math.pi * ratio))
        return self.min_lr + coefficient * (self.lr - self.min_lr)

    def _wsd_coefficient(self, iteration: int) -> float:
        anneal_start = self.decay_iters - self.wsd_decay_iters
        if iteration <= anneal_start:
            return 1.0
        return _wsd_coefficient(self.wsd_decay_style, (iteration - anneal_start) / self.wsd_decay_iters)

    def state_dict(self) -> dict:
        """The settings, JSON-able; the iteration is the checkpoint's own."""
        return dict(lr=self.lr, min_lr=self.min_lr, warmup_iters=self.warmup_iters,
                    decay_iters=self.decay_iters, decay_style=self.decay_style,
                    wsd_decay_style=self.wsd_decay_style, wsd_decay_iters=self.wsd_decay_iters)

    def load_state_dict(self, state: dict, override: bool = False, use_checkpoint: bool = False) -> None:
        """Reconcile this run's settings with a checkpoint's (`state`), as Megatron does.

        Equal settings: nothing changes. Differing settings: `override` keeps this run's,
        `use_checkpoint` adopts the checkpoint's (validated), neither raises a UserError
        naming every differing setting. The WSD settings count only when either side is WSD.
        """
        if override and use_checkpoint:
            raise UserError("--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler "
                            "contradict each other; pass at most one of them")
        if override:
            return
        differing = self._differences(state)
        if not differing:
            return
        if use_checkpoint:
            settings = self.state_dict()
            settings.update({key: state[key] for key in differing if key in state})
            self._configure(settings)
            return
        described = ", ".join(f"{FLAGS[key]} is {_show(state, key)} in the checkpoint but "
                              f"{getattr(self, key)!r} in this run" for key in differing)
        raise UserError(f"the learning-rate schedule differs from the checkpoint's ({described}); pass "
                        f"--override-opt_param-scheduler to keep this run's values or "
                        f"--use-checkpoint-opt_param-scheduler to take the checkpoint's")

    def _differences(self, state: dict) -> list[str]:
        """Settings whose checkpoint value (absent counts as different) is not this run's."""
        mine = self.state_dict()
        uses_wsd = "WSD" in (self.decay_style, state.get("decay_style"))
        keys = [key for key in mine if uses_wsd or key not in _WSD_SETTINGS]
        return [key for key in keys if key not in state or state[key] != mine[key]]


def _show(state: dict, key: str) -> str:
    return repr(state[key]) if key in state else "absent"
