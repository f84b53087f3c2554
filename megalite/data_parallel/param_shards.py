"""ZeRO-3 (`--data-parallel-sharding-strategy optim_grads_params`): parameters sharded over DP.

A unit is a group of parameters gathered together, declared by the model as a list of modules
(`GPTModel.sharding_units`): each transformer layer, the embedding, and the head. Each unit is one
grad-buffer bucket, whose parameter values (`Bucket.param`, the model's dtype) have memory only
while the unit is gathered; DP rank d keeps shard d of every unit in the buffer's `param_shards`,
which the optimizer updates and the checkpoint saves. A declared unit's routed experts
(`expert_parallel`) are a unit of their own, in the experts' buffer, sharded and gathered over
expert-DP: the same modules' hooks gather and release both (the dense part first).

Hooks applied to the built model from outside it (the model stays plain):
- before a unit's first module runs: wait for its all-gather (start it if no prefetch
  did), then start the next unit's all-gather (prefetch, asynchronous);
- after its last module's forward: while autograd records, hook the outputs' grads so the unit is
  gathered again (and the unit whose backward comes next is prefetched) before its
  backward; release it;
- when every parameter of the unit has accumulated its grad in a backward: release it.
A unit whose last module does not run (the fused output loss reads the head's weight without calling
the output layer) stays gathered until the backwards of the forwards that used it are done.
So at most the running unit and the prefetched one are gathered, plus, with tied
embeddings, the head, which holds the embedding from the first layer to the last.
A recomputed layer (--recompute-granularity full) runs again inside the backward: its unit
is gathered (the layers of a recomputed group together) and stays so until its grads are in.
"""

from dataclasses import dataclass

import torch
from torch import nn

from megalite.data_parallel.grad_buffer import Bucket, GradDomain, allocate, free
from megalite.tensor_parallel.comm import all_gather_single
from megalite.tensor_parallel.random import recomputing


@dataclass(eq=False)
class Unit:
    """One gathered group: its bucket (whose `param` holds all its values, model dtype, while gathered),
    `shard` (this rank's stored part) and `domain` (its buffer and the group it is gathered over)."""

    bucket: Bucket
    shard: torch.Tensor
    domain: GradDomain
    forward_next: "Unit | None" = None  # the unit whose forward starts after this one's
    backward_next: "Unit | None" = None  # the unit whose backward comes after this one's
    work: object = None  # a pending asynchronous all-gather
    gathered: bool = False
    grads_seen: int = 0
    kept_for: int = 0  # backwards due of forwards that ended with the unit gathered (read after the chunk)


def unit_modules(chunk: nn.Module) -> list[list[nn.Module]]:
    """The units `chunk` declares (its `sharding_units()`), without those that hold no trainable parameter."""
    return [modules for modules in chunk.sharding_units()
            if any(param.requires_grad for module in modules for param in module.parameters())]


def unit_params(modules: list[nn.Module]) -> list[nn.Parameter]:
    """A unit's parameters, each once (a module may list a shared weight again)."""
    return list({id(param): param for module in modules for param in module.parameters()}.values())


class ParamShards:
    """ZeRO-3's gathering of `chunks`' parameters, per the units each chunk declares, each over its domain's
    group. domains: the dense and the experts' grad buffers, each one bucket per unit (that holds any of its
    parameters) in `unit_modules` order, holding the parameters sharded (`GradBuffer.hold_params(sharded=True)`)."""

    def __init__(self, chunks: list[nn.Module], domains: list[GradDomain]):
        self.domains = domains
        self.units: list[Unit] = []
        self.unit_of: dict[int, Unit] = {}
        for chunk in chunks:
            self._hook_chunk(chunk)

    def _unit(self, modules: list[nn.Module], bucket: Bucket, domain: GradDomain) -> Unit:
        """The unit of `bucket`'s parameters, gathered before any of `modules` runs, released after the last."""
        unit = Unit(bucket, domain.buffer.param_shard(bucket), domain)
        self.units.append(unit)
        self.unit_of.update((id(param), unit) for param in bucket.params)
        for module in modules:
            module.register_forward_pre_hook(lambda *_: self._before_forward(unit))
        modules[-1].register_forward_hook(lambda _module, _args, output: self._after_forward(unit, output))
        return unit

    def _hook_chunk(self, chunk: nn.Module) -> None:
        declared, units = [], []
        for modules in unit_modules(chunk):
            params = [param for param in unit_params(modules) if param.requires_grad]
            for domain in self.domains:
                bucket = next((domain.buffer.bucket_of[p] for p in params if p in domain.buffer.bucket_of), None)
                if bucket is not None:
                    declared.append(modules)
                    units.append(self._unit(modules, bucket, domain))
        for unit, following in zip(units, units[1:]):
            unit.forward_next = following
        chunk.register_forward_hook(lambda *_: self._after_chunk_forward(units))
        # The backward runs the units in the reverse order of their last modules' forwards (a module's place in
        # `chunk.modules()` is its place in the forward; a sort keeps a layer's dense unit before its experts').
        position = {id(module): i for i, module in enumerate(chunk.modules())}
        backward = [unit for _, unit in sorted(zip(declared, units), key=lambda pair: -position[id(pair[0][-1])])]
        for unit, following in zip(backward, backward[1:]):
            unit.backward_next = following

    # -- gathering ---------------------------------------------------------------------------

    def prefetch(self, unit: Unit) -> None:
        """Start gathering `unit`'s parameters (over a group of one: gather them)."""
        if unit.gathered or unit.work is not None:
            return
        allocate(unit.bucket.param)
        if unit.domain.size == 1:
            unit.bucket.param.copy_(unit.shard)
            unit.gathered = True
            return
        unit.work = all_gather_single(unit.bucket.param, unit.shard, group=unit.domain.group, async_op=True)

    def gather(self, unit: Unit) -> None:
        """Make `unit`'s parameters whole (waiting for a prefetch in flight)."""
        self.prefetch(unit)
        self._wait(unit)

    def _wait(self, unit: Unit) -> None:
        if unit.work is not None:
            unit.work.wait()
            unit.work = None
            unit.gathered = True

    def release(self, unit: Unit) -> None:
        """Free `unit`'s whole values (a prefetch in flight too); its shard stays."""
        self._wait(unit)
        if unit.gathered:
            free(unit.bucket.param)
            unit.gathered = False
        unit.grads_seen = unit.kept_for = 0

    def release_all(self) -> None:
        for unit in self.units:
            self.release(unit)

    # -- hooks --------------------------------------------------------------------------------

    def _before_forward(self, unit: Unit) -> None:
        # Only a unit's first entry prefetches the next one: not a tied head's second entry (the final norm,
        # whose forward_next would then stay gathered through the backward), nor a layer recomputed in its backward.
        entering = not unit.gathered  # a prefetched unit is not gathered until waited for
        self.gather(unit)
        if entering and unit.forward_next is not None:
            self.prefetch(unit.forward_next)

    def _after_forward(self, unit: Unit, output) -> None:
        if recomputing():  # inside the backward: the unit's own backward comes next, and grad_ready releases it
            return
        outputs = [t for t in (output if isinstance(output, (tuple, list)) else (output,))
                   if isinstance(t, torch.Tensor) and t.requires_grad]
        if torch.is_grad_enabled() and outputs:
            torch.autograd.graph.register_multi_grad_hook(outputs, lambda _grads: self._before_backward(unit),
                                                          mode="any")
        self.release(unit)

    def _before_backward(self, unit: Unit) -> None:
        self.gather(unit)
        if unit.backward_next is not None:
            self.prefetch(unit.backward_next)

    def grad_ready(self, param: nn.Parameter) -> None:
        """A grad-buffer hook: `param` accumulated its grad; release its unit once all of them did."""
        unit = self.unit_of[id(param)]
        unit.grads_seen += 1
        if unit.grads_seen < len(unit.bucket.params):
            return
        unit.grads_seen, unit.kept_for = 0, max(unit.kept_for - 1, 0)
        if not unit.kept_for:
            self.release(unit)

    def _after_chunk_forward(self, units: list[Unit]) -> None:
        """A unit still gathered after its chunk's forward (a head whose last module did not run: the fused
        output loss reads its weight directly) stays so until the backward of that forward is done (with
        several micro-batches in flight, of each one's)."""
        if torch.is_grad_enabled() and not recomputing():
            for unit in units:
                unit.kept_for += unit.gathered

    def owned_values(self, param: nn.Parameter, start: int, end: int) -> torch.Tensor:
        """This rank's stored values of `param`'s local flat elements `[start, end)` (inside its shard)."""
        unit = self.unit_of[id(param)]
        buffer = unit.domain.buffer
        shard_start = unit.bucket.shard(buffer.shard_rank, buffer.shard_count)[0]
        offset = buffer.offsets[param][0] + start - shard_start
        return unit.shard[offset:offset + end - start]

    def owned(self):
        """`GradBuffer.owned()` of every domain's buffer: (bucket, param, local, in_shard) of this rank's shards."""
        for domain in self.domains:
            yield from domain.buffer.owned()
