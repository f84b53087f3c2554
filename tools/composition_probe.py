"""Invariants checked inside a training process, applied to a built Trainer from outside it (the
composition matrix, tools/check_compositions.py); the model and the training loop know nothing of it.

    probe = Probe(trainer, budget_bytes)   # after Trainer(run), before trainer.train()
    trainer.train()
    probe.report()                         # {"violations": [...], "peak_bytes": ..., ...}

Each rank checks the part of the optimizer it owns (all of it without sharding, its shard of every
bucket under ZeRO-1/2/3):
- a step applied: every owned main param whose grad holds a nonzero value changed (a step the fp16
  scaler skipped changes nothing and is not checked);
- the model computes with what the optimizer wrote: at each parameter's first grad of an iteration
  (in backward, where even a weight read outside its module's forward is used, and where ZeRO-3 has
  gathered it), its owned values equal the main params after the last step, cast to the model's dtype;
- the live model state (params, grads, optimizer state, as tools/bench/memory.py measures it) stays
  within the dry run's plan of this rank (megalite/plan/dry_run.py): its peak, sampled where ZeRO-3
  gathers or releases parameters and at every grad accumulation, within params + grads + optimizer +
  working bytes, and after each step each of params, grads and optimizer within its planned figure.
"""

import torch

from megalite.data_parallel.param_shards import unit_modules
from tools.bench.memory import PeakSampler, model_state_bytes

MAX_VIOLATIONS = 20  # per rank: the first ones say what went wrong; a flood says nothing more


class _Measured:
    """What PeakSampler and model_state_bytes ask of a model, at less cost: the parameters, walked once,
    and, as the modules to sample around, those where ZeRO-3 gathers or releases a unit (the modules of
    each unit, param_shards.unit_modules). Nothing else changes the model state in a forward."""

    def __init__(self, chunks):
        self.params = list(chunks.parameters())
        boundaries = {id(module): module for chunk in chunks for modules in unit_modules(chunk) for module in modules}
        self.boundaries = list(boundaries.values())

    def parameters(self):
        return iter(self.params)

    def modules(self):
        return iter(self.boundaries)


class Probe:
    """The invariants of the module docstring on `trainer` (a megalite.run.training.Trainer), against
    `planned`: this rank's {"params", "grads", "optimizer", "working"} bytes from the dry run."""

    def __init__(self, trainer, planned: dict[str, int]):
        self.trainer, self.optimizer, self.planned = trainer, trainer.optimizer, planned
        self.violations: list[str] = []
        self.iteration = trainer.state.iteration
        self.steps_checked = 0
        self.owned = self._owned_by_param()
        self.written = self._main_values()  # what the model must compute with: after load, after each step
        self.seen: set[int] = set()  # params whose first grad of this iteration was checked
        self.handles = [param.register_hook(lambda grad, param=param: self._check_values(param))
                        for param in {id(p): p for p in self.optimizer.model_params}.values()]
        self.sampler = PeakSampler(_Measured(trainer.model), trainer.parallel_model, self.optimizer)
        self.steady: dict[str, int] = {}  # the most bytes of each kind seen after a step
        self.reported_peak = 0
        self._step = self.optimizer.step
        self.optimizer.step = self._checked_step  # the Trainer calls it once per iteration

    def _owned_by_param(self) -> dict[int, list[tuple[int, int, int]]]:
        """id(model param) -> [(index in the optimizer's lists, start, end of its owned flat range)]."""
        ranges = getattr(self.optimizer, "ranges", None)
        owned: dict[int, list[tuple[int, int, int]]] = {}
        for index, param in enumerate(self.optimizer.model_params):
            start, end = ranges[index] if ranges is not None else (0, param.numel())
            owned.setdefault(id(param), []).append((index, start, end))
        return owned

    def _main_values(self) -> list[torch.Tensor]:
        """The main params as the model's dtype would hold them (copies)."""
        return [main.detach().to(param.dtype, copy=True).view(-1)
                for main, param in zip(self.optimizer.main_params, self.optimizer.model_params)]

    def _violation(self, line: str) -> None:
        if len(self.violations) < MAX_VIOLATIONS:
            self.violations.append(f"iteration {self.iteration + 1}: {line}")

    def _check_values(self, param) -> None:
        """A grad hook: the first time `param` gets a grad this iteration, compare its owned values."""
        if id(param) in self.seen:
            return
        self.seen.add(id(param))
        values = param.detach().reshape(-1)
        for index, start, end in self.owned[id(param)]:
            expected = self.written[index]
            if not torch.equal(values[start:end], expected):
                difference = (values[start:end].float() - expected.float()).abs().max().item()
                self._violation(f"{self.optimizer.names[index]} [{start}:{end}] computes with values other than "
                                f"the optimizer's last step wrote (largest difference {difference:.3g})")

    def _checked_step(self, *args, **kwargs):
        """The optimizer's step, with the step and memory checks around it."""
        optimizer = self.optimizer
        before = [main.detach().clone() for main in optimizer.main_params]
        has_grad = [bool(grad.count_nonzero()) for grad in optimizer.main_grads]
        result = self._step(*args, **kwargs)
        updated = result[0]
        if updated:
            self.steps_checked += 1
            for name, old, main, nonzero in zip(optimizer.names, before, optimizer.main_params, has_grad):
                if nonzero and torch.equal(old, main.detach()):
                    self._violation(f"{name}: the step left its owned values unchanged although its grad is "
                                    f"nonzero")
        self.written = self._main_values()
        self.seen = set()
        self._check_memory()
        self.iteration += 1
        return result

    def _check_memory(self) -> None:
        """After a step: each kind of state within its plan, and the peak so far within the plan's sum (each
        excess reported once: the first iteration it shows in)."""
        self.sampler.sample()
        for kind, value in model_state_bytes(self.sampler.model, self.sampler.parallel_model, self.optimizer).items():
            if value > self.planned[kind] >= self.steady.get(kind, 0):
                self._violation(f"{kind} take {value} bytes after the step, above the plan's {self.planned[kind]}")
            self.steady[kind] = max(self.steady.get(kind, 0), value)
        budget = sum(self.planned.values())
        if self.sampler.peak > budget >= self.reported_peak:
            self._violation(f"the model state peaked at {self.sampler.peak} bytes, above the plan's {budget} "
                            f"(params + grads + optimizer + working)")
        self.reported_peak = self.sampler.peak

    def report(self) -> dict:
        """What this rank found: violations (sentences), steps checked, peak and planned bytes."""
        for handle in self.handles:
            handle.remove()
        self.sampler.remove()
        return {"violations": self.violations, "steps_checked": self.steps_checked, "peak_bytes": self.sampler.peak,
                "steady_bytes": self.steady, "planned_bytes": self.planned}
