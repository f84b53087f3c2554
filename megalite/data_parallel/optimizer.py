"""The mixed-precision optimizer (Megatron's order), on the grads DDP's `finish_grad_sync` made whole:
unscale the fp32 grad buffer (with a scaler, inf/nan on any rank backs the scale off), clip by the
global L2 norm, AdamW on fp32 main params (an fp32 model's own params, else fp32 clones), copy them
into the model. A step whose grads hold inf or nan is skipped. All of it stays on the device, as
torch.amp's GradScaler does: the step never waits for the device, and the caller reads the grad norm
and whether the step was applied when it needs them. `DistributedOptimizer` (every sharding strategy,
ZeRO-1/2/3) keeps main params and moments for this DP rank's shard only. State is keyed by global
names: checkpoints fit any layout.
"""

import math
from typing import NamedTuple

import torch

from megalite.data_parallel.ddp import ParallelModel
from megalite.data_parallel.grad_buffer import is_expert
from megalite.errors import UserError

STATE_KINDS = ("main_param", "exp_avg", "exp_avg_sq")
# The parameters --decoupled-lr applies to, as Megatron's is_embedding_or_output_parameter: the word
# embeddings (a tied last stage's copy too, as it is the output layer's weight) and the output layer.
DECOUPLED_PARAM_SUFFIXES = ("word_embeddings.weight", "output_layer.weight")


class DynamicLossScaler:
    """Megatron's DynamicGradScaler: after `hysteresis` overflows each further one multiplies the scale by
    `backoff_factor` (down to `min_scale`); `growth_interval` clean steps in a row grow it by
    `growth_factor` and refill the hysteresis count. TrainConfig.validate checks the flags' settings. The scale
    (float64, as Python computes it) and both trackers are 0-dim tensors on `device`, updated there: no step
    waits for the device."""

    def __init__(self, initial_scale: float = 2.0 ** 32, min_scale: float = 1.0, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 1000, hysteresis: int = 2, device="cpu"):
        self.min_scale, self.growth_factor, self.backoff_factor = float(min_scale), growth_factor, backoff_factor
        self.growth_interval, self.hysteresis = growth_interval, hysteresis
        self.device = torch.device(device)
        self.load_state_dict({"scale": initial_scale, "growth_tracker": 0, "hysteresis_tracker": hysteresis})

    def update(self, found_inf) -> None:
        """Account for one step, which had inf/nan grads where `found_inf` (a bool, or a 0-dim tensor) is true."""
        found = torch.as_tensor(found_inf, device=self.device).bool()
        hysteresis = torch.where(found, self.hysteresis_tracker - 1, self.hysteresis_tracker)
        growth = torch.where(found, 0, self.growth_tracker + 1)
        grow = growth == self.growth_interval
        backed_off = (self.scale * self.backoff_factor).clamp(min=self.min_scale)
        grown = torch.where(grow, self.scale * self.growth_factor, self.scale)
        self.scale = torch.where(found & (hysteresis <= 0), backed_off, grown)
        self.growth_tracker = torch.where(grow, 0, growth)
        self.hysteresis_tracker = torch.where(grow, self.hysteresis, hysteresis)

    def state_dict(self) -> dict:
        """JSON-able: the scale and both trackers (the settings come from this run's flags)."""
        return {"scale": float(self.scale), "growth_tracker": int(self.growth_tracker),
                "hysteresis_tracker": int(self.hysteresis_tracker)}

    def load_state_dict(self, state: dict) -> None:
        self.scale = torch.tensor(float(state["scale"]), dtype=torch.float64, device=self.device)
        self.growth_tracker = torch.tensor(int(state["growth_tracker"]), device=self.device)
        self.hysteresis_tracker = torch.tensor(int(state["hysteresis_tracker"]), device=self.device)


class StepResult(NamedTuple):
    """What `MixedPrecisionOptimizer.step` did, as 0-dim tensors on the device: unpacks as `updated, grad_norm`."""

    updated: torch.Tensor  # bool; False: the step was skipped (params, Adam's moments and step count untouched)
    grad_norm: torch.Tensor  # fp32: global L2 norm of the unscaled grads before clipping; nan when skipped


class MixedPrecisionOptimizer:
    """AdamW on fp32 main params for the trainable parameters of `model` (fp32, bf16 or fp16).

    model: the ParallelModel owning the parameter-and-grad buffer (sharded for a DistributedOptimizer only).
    weight_decay: decoupled, on params with ndim >= 2 only. clip_grad: 0 disables clipping.
    loss_scaler: dynamic loss scaling (fp16); None means a scale of 1.
    Per iteration: `zero_grad()`, `model.start_iteration(...)`, `scale_loss(loss).backward()` per
    micro-batch, `model.finish_grad_sync()`, `step(lr)` (or `step(lr, decoupled_lr)`: the word embeddings and
    the output layer at their own rate, DECOUPLED_PARAM_SUFFIXES).
    """

    distributed = False

    def __init__(self, model: ParallelModel, lr: float, weight_decay: float = 0.01, betas=(0.9, 0.999),
                 eps: float = 1e-8, clip_grad: float = 1.0, loss_scaler: DynamicLossScaler | None = None):
        if model.shard != self.distributed:
            raise ValueError(f"{type(self).__name__} needs a ParallelModel with shard={self.distributed}")
        self.clip_grad, self.weight_decay, self.loss_scaler = clip_grad, weight_decay, loss_scaler
        self.model, parallel = model, model.parallel
        self.tp_rank, self.pp_rank, self.expert_tp_rank = parallel.tp_rank, parallel.pp_rank, parallel.expert_tp_rank
        # found_inf and the grad norm are combined over every rank whose grads differ: TP x PP
        # (data-parallel replicas hold the same reduced grads), and DP too for the distributed optimizer.
        self.model_parallel_group = parallel.mp_group if parallel.tp_size * parallel.pp_size > 1 else None
        # The experts' distinct grads lie on ETP x EP x PP (expert-DP replicas hold the same): a norm of their own
        # where that differs from TP x PP, on every rank (a stage without experts adds zero).
        self.experts_apart = not self.distributed and (parallel.ep_size > 1
                                                       or parallel.expert_tp_size != parallel.tp_size)
        expert_ranks = parallel.expert_tp_size * parallel.ep_size * parallel.pp_size
        self.expert_model_parallel_group = parallel.expert_mp_group if expert_ranks > 1 else None
        self.world = parallel.world_size > 1
        self.name_of = {id(param): name for name, param in model.model.named_parameters() if param.requires_grad}
        self.grad_buffers = model.buffers  # the dense parameters', then the experts' (if any)
        self.grad_buffer = model.buffer  # the dense one
        self._build_main_params()
        # One AdamW group per (weight decay, decoupled LR) pair: decay on matrices, the decoupled rate on
        # the embeddings and output layer.
        grouped: dict[tuple[bool, bool], list[torch.Tensor]] = {}
        for main, param, name in zip(self.main_params, self.model_params, self.names):
            grouped.setdefault((param.ndim >= 2, name.endswith(DECOUPLED_PARAM_SUFFIXES)), []).append(main)
        groups = [{"params": mains, "weight_decay": weight_decay if decay else 0.0, "decoupled": decoupled}
                  for (decay, decoupled), mains in grouped.items()]
        # fused: one kernel pass per tensor (CPU and CUDA), faster than foreach (docs/benchmarks.md).
        self.adam = torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, fused=True)

    def _build_main_params(self) -> None:
        """Aligned lists in grad-buffer order: model params, names, fp32 main params, their grads."""
        self.model_params = [param for buffer in self.grad_buffers for param in buffer.params]
        self.names = [self.name_of[id(param)] for param in self.model_params]
        self.main_params = [_main_param(param) for param in self.model_params]
        self.main_grads = [param.main_grad for param in self.model_params]

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """`loss` times the scaler's scale (the loss itself without a scaler); call backward on the result."""
        return loss if self.loss_scaler is None else loss * self.loss_scaler.scale.to(loss.dtype)

    def zero_grad(self) -> None:
        """Zero the grad buffer (the model's), before an iteration's first backward."""
        self.model.zero_grad()

    @torch.no_grad()
    def step(self, lr: float, decoupled_lr: float | None = None, skip: torch.Tensor | None = None) -> StepResult:
        """Unscale, check, clip, AdamW at `lr` (the word embeddings and output layer at `decoupled_lr` when
        given), refresh the model params. Inf/nan grads (on any rank: every rank decides alike), or `skip` (a
        0-dim bool tensor: the caller's reason, say a non-finite loss), skip the update on the device; a loss
        scaler backs off for inf/nan grads. Nothing here waits for the device."""
        self.model.finish_param_sync()  # no step writes main params (an fp32 model's own values) under a gather
        found_inf = self._unscale_and_check_grads()
        grad_norm = self._grad_norm()
        skipped = ~torch.isfinite(grad_norm)
        if found_inf is not None:
            self.loss_scaler.update(found_inf)
            skipped |= found_inf
        if skip is not None:
            skipped |= skip
        self._clip_grads(grad_norm)
        self._adam_step(lr, decoupled_lr, skipped)
        self._copy_main_params_to_model_params()
        return StepResult(~skipped, torch.where(skipped, math.nan, grad_norm))

    def _unscale_and_check_grads(self) -> torch.Tensor | None:
        """With a scaler, divide the grads by the loss scale; a 0-dim bool tensor, true when any rank's grads
        hold inf or nan (None without a scaler)."""
        if self.loss_scaler is None:
            return None
        found_inf = torch.zeros((), device=self.loss_scaler.device)
        inverse_scale = (1.0 / self.loss_scaler.scale).float()  # Python's 1 / scale, as the fp32 grads take it
        if self.main_grads:  # torch.amp's one pass per tensor that unscales and checks
            torch._amp_foreach_non_finite_check_and_unscale_(self.main_grads, found_inf, inverse_scale)
        if self.world:
            torch.distributed.all_reduce(found_inf, torch.distributed.ReduceOp.MAX)
        return found_inf > 0

    def _counted(self, param) -> bool:
        """Whether this rank counts `param`'s grad in the global norm, so each counts once overall:
        TP-replicated params on TP rank 0 only, a tied embedding's last-stage copy not at all (DP
        replicas count once as the norm is combined over TP x PP; shards over every rank). An expert's
        on every rank but, if replicated over the expert's TP split, expert TP rank 0 (expert-DP replicas
        count once as its norm is combined over ETP x EP x PP)."""
        if is_expert(param):
            return self.expert_tp_rank == 0 or getattr(param, "tensor_model_parallel", False)
        return ((self.tp_rank == 0 or getattr(param, "tensor_model_parallel", False))
                and (self.pp_rank == 0 or not getattr(param, "shared_embedding", False)))

    def _grad_norm(self) -> torch.Tensor:
        """The global L2 norm of the grads, a 0-dim fp32 tensor."""
        grads, expert_grads = [], []
        for grad, param in zip(self.main_grads, self.model_params):
            if self._counted(param):
                (expert_grads if self.experts_apart and is_expert(param) else grads).append(grad)
        squared_norm = self._squared_norm(grads)
        if self.distributed and self.world:
            torch.distributed.all_reduce(squared_norm)
        elif self.model_parallel_group is not None:
            torch.distributed.all_reduce(squared_norm, group=self.model_parallel_group)
        if self.experts_apart:
            expert_squared_norm = self._squared_norm(expert_grads)
            if self.expert_model_parallel_group is not None:
                torch.distributed.all_reduce(expert_squared_norm, group=self.expert_model_parallel_group)
            squared_norm = squared_norm + expert_squared_norm
        return squared_norm.sqrt()

    def _squared_norm(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """The sum of `grads`' squared L2 norms, a 0-dim fp32 tensor."""
        norms = torch._foreach_norm(grads, 2.0) if grads else []
        device = self.grad_buffer.step_grads().device
        return torch.stack(norms).square().sum() if norms else torch.zeros((), device=device)

    def _clip_grads(self, grad_norm: torch.Tensor) -> None:
        """Scale every grad by clip_grad / grad_norm when that is below 1, the factor computed in float64 as
        Python would (a factor clamped to 1 leaves every grad as it was)."""
        if self.clip_grad > 0:
            clip_coefficient = (self.clip_grad / (grad_norm.double() + 1e-6)).clamp(max=1.0)
            for buffer in self.grad_buffers:
                buffer.step_grads().mul_(clip_coefficient.float())

    def _adam_step(self, lr: float, decoupled_lr: float | None, skipped: torch.Tensor) -> None:
        for group in self.adam.param_groups:
            group["lr"] = decoupled_lr if group["decoupled"] and decoupled_lr is not None else lr
        # Grads are lent only for the step: on an fp32 model the main params are the model
        # params, whose `.grad` must be None again before the next backward.
        for main, grad in zip(self.main_params, self.main_grads):
            main.grad = grad
        # torch.amp's protocol for fused AdamW: where found_inf is 1 it leaves params, moments and step count.
        self.adam.found_inf = skipped.float()
        self.adam.step()
        for main in self.main_params:
            main.grad = None

    def _copy_main_params_to_model_params(self) -> None:
        """Cast the updated fp32 main params into the model params (nothing to do on fp32 models)."""
        for main, param in zip(self.main_params, self.model_params):
            if main is not param:
                param.copy_(main)

    @torch.no_grad()
    def reload_model_params(self) -> None:
        """Copy the model params into the main params, after weights were loaded without optimizer state."""
        self.model.finish_param_sync()
        for main, param in zip(self.main_params, self._model_values()):
            if main.untyped_storage().data_ptr() != param.untyped_storage().data_ptr():
                main.copy_(param)

    def _model_values(self) -> list[torch.Tensor]:  # what each main param stands for
        return self.model_params

    def _adam_states(self) -> list[dict]:
        """Adam's state of each main param, created (zero moments, step 0) where it has none yet, as torch
        would at the first step, so that checkpoint pieces are views of the live tensors."""
        for main in self.main_params:
            if main not in self.adam.state:
                self.adam.state[main] = _adam_state(self.adam, main, 0)
        return [self.adam.state[main] for main in self.main_params]

    def _state_tensors(self) -> dict[str, torch.Tensor]:
        """`"<param name>.<kind>"` -> the live fp32 tensor, for each of STATE_KINDS."""
        tensors = {}
        for name, main, state in zip(self.names, self.main_params, self._adam_states()):
            tensors[f"{name}.main_param"] = main.detach()
            tensors[f"{name}.exp_avg"], tensors[f"{name}.exp_avg_sq"] = state["exp_avg"], state["exp_avg_sq"]
        return tensors

    def state_dict(self) -> dict:
        """`{"tensors": {"<param name>.<kind>": the live fp32 tensor of the param's global shape}, "meta":
        {step (Adam steps taken), the hyper-parameters, loss_scaler}}`: save it before the next step."""
        return {"tensors": self._state_tensors(), "meta": self._meta()}

    def _meta(self) -> dict:
        group = self.adam.param_groups[0]
        return {"step": self._adam_steps(), "betas": list(group["betas"]), "eps": group["eps"],
                "weight_decay": self.weight_decay, "clip_grad": self.clip_grad,
                "loss_scaler": None if self.loss_scaler is None else self.loss_scaler.state_dict()}

    def _adam_steps(self) -> int:
        steps = {int(state["step"]) for state in self._adam_states()}
        if len(steps) > 1:
            raise RuntimeError(f"the parameters have taken different numbers of Adam steps: {sorted(steps)}")
        return steps.pop() if steps else 0

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        """Restore `state_dict()` output bitwise (UserError naming entries that do not fit) and refresh the
        model; this run's hyper-parameters stay, the scaler state loads when both sides have a scaler."""
        tensors, meta = state["tensors"], state["meta"]
        _check_tensors(tensors, dict(zip(self.names, self.main_params)))
        self.model.finish_param_sync()
        self._load_tensors(tensors, int(meta["step"]))
        if self.loss_scaler is not None and meta.get("loss_scaler") is not None:
            self.loss_scaler.load_state_dict(meta["loss_scaler"])
        self._copy_main_params_to_model_params()

    def _load_tensors(self, tensors: dict, steps: int) -> None:
        for name, main in zip(self.names, self.main_params):
            main.copy_(tensors[f"{name}.main_param"])
            self.adam.state.pop(main, None)
            if steps > 0:
                self.adam.state[main] = _adam_state(
                    self.adam, main, steps, tensors[f"{name}.exp_avg"], tensors[f"{name}.exp_avg_sq"])


class DistributedOptimizer(MixedPrecisionOptimizer):
    """ZeRO-1/2/3: DP rank d keeps main params and moments for shard d of every bucket of the model's dense
    parameter-and-grad buffer, and expert-DP rank e shard e of the experts' buffer's (one contiguous range of a
    param's flat values each), where its grads arrive by reduce-scatter; after AdamW it writes the shard into
    the parameters and the model all-gathers them in place (`ParallelModel.start_param_sync`). ZeRO-2 reads
    the grads from the buffers' shards; ZeRO-3 updates the stored parameter shards, which the next forward
    gathers (param_shards.py)."""

    distributed = True

    def _build_main_params(self) -> None:
        """The base class's lists, 1-D, for the params in this rank's shards; `ranges`: their (start, end)."""
        self.model_params, self.names, self.main_params, self.main_grads, self.ranges = [], [], [], [], []
        for buffer in self.grad_buffers:
            for bucket, param, local, in_shard in buffer.owned():
                self.model_params.append(param)
                self.names.append(self.name_of[id(param)])
                self.main_params.append(_main_param(self.model.param_values(param, *local)))
                self.main_grads.append(buffer.shard_view(bucket)[slice(*in_shard)])
                self.ranges.append(local)

    def _model_values(self) -> list[torch.Tensor]:
        return [self.model.param_values(param, *local) for param, local in zip(self.model_params, self.ranges)]

    @torch.no_grad()
    def _copy_main_params_to_model_params(self) -> None:
        """Write the owned ranges into the model params, then have every DP rank's shards gathered."""
        for main, values in zip(self.main_params, self._model_values()):
            if main.dtype != values.dtype:
                values.copy_(main)
        self.model.start_param_sync()

    def state_dict(self) -> dict:
        """As the base class's, but each tensor 1-D, the param's local flat values from `flat_ranges[name]`
        on (the checkpoint cuts them into pieces of the global tensors)."""
        flat_ranges = {name: start for name, (start, _) in zip(self.names, self.ranges)}
        return {"tensors": self._state_tensors(), "flat_ranges": flat_ranges, "meta": self._meta()}

    def _load_tensors(self, tensors: dict, steps: int) -> None:
        """Into the live tensors of `state_dict()` (the same ranges), with every state's step count."""
        for key, values in self._state_tensors().items():
            values.copy_(tensors[key])
        for adam_state in self._adam_states():
            adam_state["step"].fill_(float(steps))


def _adam_state(adam: torch.optim.AdamW, main: torch.Tensor, steps: int, exp_avg: torch.Tensor | None = None,
                exp_avg_sq: torch.Tensor | None = None) -> dict:
    """Adam's state for `main` as torch builds it: fp32 moments (copies, or zeros) and a float32 step on
    the param's device for fused and capturable kernels (a CPU checkpoint resumes on a GPU), else the CPU."""
    group = next(group for group in adam.param_groups if any(p is main for p in group["params"]))
    on_device = group.get("fused") or group.get("capturable")
    moments = [torch.zeros_like(main, dtype=torch.float32) if values is None
               else values.to(main.device, torch.float32, copy=True) for values in (exp_avg, exp_avg_sq)]
    return {"step": torch.tensor(float(steps), dtype=torch.float32, device=main.device if on_device else "cpu"),
            "exp_avg": moments[0], "exp_avg_sq": moments[1]}


def _main_param(param: torch.Tensor) -> torch.Tensor:
    """The fp32 tensor AdamW updates for `param` (or a view of it): itself when fp32, else a detached clone."""
    return param if param.dtype == torch.float32 else param.detach().to(torch.float32, copy=True)


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
