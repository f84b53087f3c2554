"""The mixed-precision optimizer: fp32 main params and grads, loss scaling, clipping, AdamW.

One step, in the order Megatron's MixedPrecisionOptimizer takes it:

1. prepare grads: the grad buffer (fp32, summed over micro-batches) is divided by the
   loss scale; with a scaler, any inf/nan skips the step and backs the scale off;
2. clip: the global L2 norm over every gradient, each counted once; scale all
   gradients by clip_grad / norm when the norm exceeds clip_grad;
3. AdamW on the fp32 main params (decoupled weight decay, none on 1-D params);
4. copy the main params into the model params (cast to the model's dtype).

The comments marked "TP:", "PP:", "DP:" and "ZeRO:" say where the collectives of a
parallel run go; at one process none are needed.

Main params: for an fp32 model they are the model's own parameters (no copy); for a
bf16/fp16 model, fp32 clones. The optimizer state is keyed by full parameter names,
which are the same under every layout, so checkpoints load into any layout.
"""

import math
from typing import NamedTuple

import torch
from torch import nn

from megalite.data_parallel.grad_buffer import GradBuffer
from megalite.errors import UserError

STATE_KINDS = ("main_param", "exp_avg", "exp_avg_sq")


class NonFiniteGradError(RuntimeError):
    """The gradient norm is inf or nan and no loss scaler may skip the step; nothing was updated."""


class DynamicLossScaler:
    """Megatron's DynamicGradScaler: a loss scale that backs off on overflow and grows when clean.

    On a step with inf/nan grads the growth count restarts and the hysteresis count
    drops by one; once it reaches 0, every further overflow multiplies the scale by
    `backoff_factor` (not below `min_scale`). After `growth_interval` clean steps in a
    row the scale grows by `growth_factor` and the hysteresis count is refilled.
    """

    def __init__(self, initial_scale: float = 2.0 ** 32, min_scale: float = 1.0, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 1000, hysteresis: int = 2):
        if not 0 < min_scale <= initial_scale:
            raise UserError(f"--initial-loss-scale {initial_scale} and --min-loss-scale {min_scale} must satisfy "
                            f"0 < min <= initial; pass a smaller --min-loss-scale")
        if growth_interval < 1:
            raise UserError(f"--loss-scale-window is {growth_interval} but must be at least 1; pass 1 or more")
        if hysteresis < 1:
            raise UserError(f"--hysteresis is {hysteresis} but must be at least 1; pass 1 or more")
        if not (growth_factor > 1 and 0 < backoff_factor < 1):
            raise ValueError(f"need growth_factor > 1 and 0 < backoff_factor < 1, got {growth_factor}, "
                             f"{backoff_factor}")
        self.scale = float(initial_scale)
        self.min_scale, self.growth_factor, self.backoff_factor = float(min_scale), growth_factor, backoff_factor
        self.growth_interval, self.hysteresis = growth_interval, hysteresis
        self.growth_tracker = 0  # clean steps since the last overflow or growth
        self.hysteresis_tracker = hysteresis  # overflows still tolerated before backing off

    def update(self, found_inf: bool) -> None:
        """Account for one step, which had inf/nan grads when `found_inf`."""
        if found_inf:
            self.growth_tracker = 0
            self.hysteresis_tracker -= 1
            if self.hysteresis_tracker <= 0:
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
            return
        self.growth_tracker += 1
        if self.growth_tracker == self.growth_interval:
            self.growth_tracker = 0
            self.hysteresis_tracker = self.hysteresis
            self.scale *= self.growth_factor

    def state_dict(self) -> dict:
        """JSON-able: the scale and both trackers (the settings come from this run's flags)."""
        return {"scale": self.scale, "growth_tracker": self.growth_tracker,
                "hysteresis_tracker": self.hysteresis_tracker}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self.growth_tracker = int(state["growth_tracker"])
        self.hysteresis_tracker = int(state["hysteresis_tracker"])


class StepResult(NamedTuple):
    """What `MixedPrecisionOptimizer.step` did: unpacks as `updated, grad_norm`."""

    updated: bool  # False: inf/nan grads, the step was skipped (params and Adam state untouched)
    grad_norm: float  # global L2 norm of the unscaled grads before clipping; nan when skipped


class MixedPrecisionOptimizer:
    """AdamW on fp32 main params for a model in fp32, bf16 or fp16.

    model: its trainable parameters (`named_parameters()`, tied ones once) are optimised.
    lr: the initial lr (each `step` takes its own). weight_decay: decoupled, on params
    with ndim >= 2 only. clip_grad: max global grad norm, 0 disables clipping.
    loss_scaler: dynamic loss scaling (fp16); None means a scale of 1 and no skipping.

    Usage per iteration: `zero_grad()`, then for each micro-batch
    `optimizer.scale_loss(loss).backward()`, then `step(lr)`.
    """

    def __init__(self, model: nn.Module, lr: float, weight_decay: float = 0.01, betas=(0.9, 0.999),
                 eps: float = 1e-8, clip_grad: float = 1.0, loss_scaler: DynamicLossScaler | None = None,
                 parallel=None):
        _validate_hyperparameters(lr, weight_decay, betas, eps, clip_grad)
        self.clip_grad, self.weight_decay, self.loss_scaler = clip_grad, weight_decay, loss_scaler
        # The model-parallel group (TP x PP) over which found_inf and the grad norm are combined.
        self.tp_rank, self.pp_rank = getattr(parallel, "tp_rank", 0), getattr(parallel, "pp_rank", 0)
        model_parallel = getattr(parallel, "tp_size", 1) * getattr(parallel, "pp_size", 1)
        self.model_parallel_group = parallel.mp_group if model_parallel > 1 else None
        named = [(name, param) for name, param in model.named_parameters() if param.requires_grad]
        if not named:
            raise ValueError("the model has no trainable parameters to optimise")
        self.grad_buffer = GradBuffer([param for _, param in named])
        name_of = {id(param): name for name, param in named}
        # Three aligned lists, in grad-buffer order.
        self.model_params = self.grad_buffer.params
        self.names = [name_of[id(param)] for param in self.model_params]
        self.main_params = [_main_param(param) for param in self.model_params]

        decay = [main for main in self.main_params if main.ndim >= 2]
        no_decay = [main for main in self.main_params if main.ndim < 2]
        groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        self.adam = torch.optim.AdamW([group for group in groups if group["params"]], lr=lr, betas=betas,
                                      eps=eps, foreach=True)

    @property
    def loss_scale(self) -> float:
        """The factor `scale_loss` multiplies by: the scaler's scale, or 1.0 without one."""
        return 1.0 if self.loss_scaler is None else self.loss_scaler.scale

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """`loss * loss_scale` (the loss itself without a scaler); call backward on the result."""
        return loss if self.loss_scaler is None else loss * self.loss_scaler.scale

    def zero_grad(self) -> None:
        """Zero the grad buffer, before an iteration's first backward."""
        self.grad_buffer.zero()

    @torch.no_grad()
    def step(self, lr: float) -> StepResult:
        """Unscale, check, clip and apply AdamW at `lr`; then refresh the model params.

        With a loss scaler, inf/nan grads skip the step (StepResult(False, nan)) and
        update the scaler. Without one, a non-finite grad norm raises NonFiniteGradError
        before anything is changed (every rank sees the same global norm, so all raise).
        """
        found_inf = self._unscale_and_check_grads()
        if self.loss_scaler is not None:
            self.loss_scaler.update(found_inf)
            if found_inf:
                return StepResult(False, math.nan)
        grad_norm = self._grad_norm()
        if not math.isfinite(grad_norm):
            raise NonFiniteGradError(
                f"the gradient norm is {grad_norm} and no loss scaler may skip the step, so the update was "
                f"not applied; the run diverged or met bad data: resume from an earlier checkpoint, "
                f"perhaps with a lower --lr")
        self._clip_grads(grad_norm)
        self._adam_step(lr)
        self._copy_main_params_to_model_params()
        return StepResult(True, grad_norm)

    def _unscale_and_check_grads(self) -> bool:
        """Divide the grad buffer by the loss scale; True when it holds an inf or nan.

        Checked only with a scaler (without one the grad norm catches non-finite grads).
        """
        if self.loss_scaler is None:
            return False
        grads = self.grad_buffer.data
        grads.mul_(1.0 / self.loss_scaler.scale)
        found_inf = torch.tensor(0.0 if bool(torch.isfinite(grads).all()) else 1.0, device=grads.device)
        # Every model-parallel rank skips together. (DP needs nothing: grads are reduced across DP first.)
        if self.model_parallel_group is not None:
            torch.distributed.all_reduce(found_inf, torch.distributed.ReduceOp.MAX, group=self.model_parallel_group)
        return bool(found_inf > 0)

    def _grads_for_norm(self) -> list[torch.Tensor]:
        """The grads this rank counts in the global norm: each gradient exactly once overall.

        TP: a param replicated on TP ranks (`tensor_model_parallel` False) counts only on
        TP rank 0. PP: the last stage's copy of a tied embedding (`shared_embedding`)
        counts only on the first stage. ZeRO: only this rank's shard of the buffer.
        One process: every parameter once.
        """
        return [param.main_grad for param in self.model_params
                if (self.tp_rank == 0 or getattr(param, "tensor_model_parallel", False))
                and (self.pp_rank == 0 or not getattr(param, "shared_embedding", False))]

    def _grad_norm(self) -> float:
        """Global L2 norm of all main grads (fp32)."""
        grads = self._grads_for_norm()
        norms = torch._foreach_norm(grads, 2.0) if grads else []
        squared_norm = torch.stack(norms).square().sum() if norms else torch.zeros((), device=self.grad_buffer.data.device)
        # ZeRO: the data-parallel group will join this all-reduce.
        if self.model_parallel_group is not None:
            torch.distributed.all_reduce(squared_norm, group=self.model_parallel_group)
        return float(squared_norm.sqrt())

    def _clip_grads(self, grad_norm: float) -> None:
        """Scale every grad by clip_grad / grad_norm when that is below 1 (Megatron's rule)."""
        if self.clip_grad <= 0:
            return
        clip_coefficient = self.clip_grad / (grad_norm + 1e-6)
        if clip_coefficient < 1.0:
            self.grad_buffer.data.mul_(clip_coefficient)

    def _adam_step(self, lr: float) -> None:
        """AdamW on the main params with the grad buffer's views as their grads."""
        for group in self.adam.param_groups:
            group["lr"] = lr
        # Grads are lent only for the step: on an fp32 model the main params are the model
        # params, whose `.grad` must be None again before the next backward.
        for main, param in zip(self.main_params, self.model_params):
            main.grad = param.main_grad
        self.adam.step()
        for main in self.main_params:
            main.grad = None

    def _copy_main_params_to_model_params(self) -> None:
        """Cast the updated fp32 main params into the model params (nothing to do on fp32 models)."""
        for main, param in zip(self.main_params, self.model_params):
            if main is not param:
                param.copy_(main)
        # ZeRO: all-gather the updated shards into every DP rank's model params.

    def state_dict(self) -> dict:
        """`{"tensors": {name: Tensor}, "meta": JSON-able}`; layout-free.

        tensors: `"<param name>.main_param"`, `".exp_avg"`, `".exp_avg_sq"`, fp32, each of
        the param's (global) shape; the moments are zeros before the first step. These are
        the live tensors, not copies: save (or clone) them before the next step.
        meta: `step` (Adam steps taken), the hyper-parameters, and `loss_scaler` (or None).
        """
        tensors = {}
        for name, main in zip(self.names, self.main_params):
            state = self.adam.state.get(main, {})
            tensors[f"{name}.main_param"] = main.detach()
            for kind in ("exp_avg", "exp_avg_sq"):
                tensors[f"{name}.{kind}"] = state[kind] if kind in state else torch.zeros_like(main.detach())
        group = self.adam.param_groups[0]
        meta = {"step": self._adam_steps(), "betas": list(group["betas"]), "eps": group["eps"],
                "weight_decay": self.weight_decay, "clip_grad": self.clip_grad,
                "loss_scaler": None if self.loss_scaler is None else self.loss_scaler.state_dict()}
        return {"tensors": tensors, "meta": meta}

    def _adam_steps(self) -> int:
        steps = {int(self.adam.state[main]["step"]) for main in self.main_params if main in self.adam.state}
        if len(steps) > 1:
            raise RuntimeError(f"the parameters have taken different numbers of Adam steps: {sorted(steps)}")
        return steps.pop() if steps else 0

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        """Restore `state_dict()` output bitwise (copies; `state` may be reused) and refresh the model.

        Names and shapes must match this model's exactly (UserError naming the bad entries).
        This run's hyper-parameters (lr, betas, eps, weight decay, clipping) stay in force;
        the scaler state is restored when both the checkpoint and this run have a scaler.
        """
        tensors, meta = state["tensors"], state["meta"]
        _check_tensors(tensors, dict(zip(self.names, self.main_params)))
        steps = int(meta["step"])
        for name, main in zip(self.names, self.main_params):
            main.copy_(tensors[f"{name}.main_param"])
            self.adam.state.pop(main, None)
            if steps > 0:
                # Adam's own state layout: a float32 step count beside fp32 moments.
                self.adam.state[main] = {
                    "step": torch.tensor(float(steps), dtype=torch.float32),
                    "exp_avg": tensors[f"{name}.exp_avg"].to(main.device, torch.float32, copy=True),
                    "exp_avg_sq": tensors[f"{name}.exp_avg_sq"].to(main.device, torch.float32, copy=True)}
        if self.loss_scaler is not None and meta.get("loss_scaler") is not None:
            self.loss_scaler.load_state_dict(meta["loss_scaler"])
        self._copy_main_params_to_model_params()


def _main_param(param: nn.Parameter) -> torch.Tensor:
    """The fp32 tensor AdamW updates for `param`: the param itself when fp32, else an fp32 clone."""
    if param.dtype == torch.float32:
        return param
    return param.detach().to(torch.float32, copy=True)


def _check_tensors(tensors: dict, main_params: dict) -> None:
    """UserError naming missing, unexpected and mis-shaped optimizer entries, if any."""
    expected = {f"{name}.{kind}": main for name, main in main_params.items() for kind in STATE_KINDS}
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    misshaped = [f"{key} {list(tensors[key].shape)} vs {list(main.shape)} here"
                 for key, main in expected.items() if key in tensors and tensors[key].shape != main.shape]
    problems = [f"{label}: {_first_few(entries)}" for label, entries in
                (("missing", missing), ("unexpected", unexpected), ("mis-shaped", misshaped)) if entries]
    if problems:
        raise UserError(f"the optimizer state in the checkpoint does not fit this model ({'; '.join(problems)}); "
                        f"load a checkpoint of the same architecture, or pass --no-load-optim to start "
                        f"the optimizer afresh")


def _first_few(entries: list[str], limit: int = 5) -> str:
    more = f" and {len(entries) - limit} more" if len(entries) > limit else ""
    return ", ".join(entries[:limit]) + more


def _validate_hyperparameters(lr, weight_decay, betas, eps, clip_grad) -> None:
    """UserError naming the flag for an AdamW setting out of range."""
    checks = (("--lr", lr, lr >= 0, "a value >= 0"),
              ("--weight-decay", weight_decay, weight_decay >= 0, "a value >= 0"),
              ("--adam-beta1", betas[0], 0 <= betas[0] < 1, "a value in [0, 1)"),
              ("--adam-beta2", betas[1], 0 <= betas[1] < 1, "a value in [0, 1)"),
              ("--adam-eps", eps, eps > 0, "a value > 0"),
              ("--clip-grad", clip_grad, clip_grad >= 0, "a value >= 0 (0 disables clipping)"))
    for flag, value, ok, wanted in checks:
        if not ok:
            raise UserError(f"{flag} is {value}; pass {wanted}")
