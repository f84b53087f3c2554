"""ZeRO-3 (`--data-parallel-sharding-strategy optim_grads_params`): parameters sharded over DP.

A unit is a group of parameters gathered together: each transformer layer, the embedding,
and the head (final norm and untied output layer; with tied embeddings the embedding joins
the head, since the output layer reads its weight). Each unit is one grad-buffer bucket
(grad_buffer.py), and its parameters are laid out in the same order in a flat tensor `full`
of the model's dtype: they are views of it. `full` has memory only while the unit is
gathered; DP rank d keeps shard d of every unit in `shards`, which the optimizer updates
and the checkpoint saves.

Hooks applied to the built model from outside it (the model stays plain):
- before a unit's first module runs: wait for its all-gather (start it if no prefetch
  did), then start the next unit's all-gather (prefetch, asynchronous);
- after its last module: while autograd records, hook the outputs' grads so the unit is
  gathered again (and the unit whose backward comes next is prefetched) before its
  backward; release it, except the head, which the loss reads after the chunk's forward
  (model/loss.py) and whose backward comes first: it stays gathered;
- when every parameter of the unit has accumulated its grad in a backward: release it (the
  head once every micro-batch forwarded through it has).
So at most the running unit and the prefetched one are gathered, plus, with tied
embeddings, the embedding unit, which the head needs from the first layer to the last.
A recomputed layer (--recompute-granularity full) runs again inside the backward: its unit
is gathered (the layers of a recomputed group together) and stays so until its grads are in.
"""

import contextlib
from dataclasses import dataclass

import torch
from torch import nn

from megalite.data_parallel.grad_buffer import Bucket, GradBuffer, allocate, free
from megalite.parallel_state import ParallelState
from megalite.tensor_parallel.comm import all_gather_single
from megalite.tensor_parallel.random import recomputing


@dataclass(eq=False)
class Unit:
    """One gathered group: `full` (all its values, model dtype) and `shard` (this rank's part)."""

    bucket: Bucket
    full: torch.Tensor
    shard: torch.Tensor
    forward_next: "Unit | None" = None  # the unit whose forward starts after this one's
    backward_next: "Unit | None" = None  # the unit whose backward comes after this one's
    work: object = None  # a pending asynchronous all-gather
    gathered: bool = False
    grads_seen: int = 0
    held: bool = False  # the head: kept gathered after its forward, for the loss and the backward
    backwards_due: int = 0  # a held unit's forwards whose backward has not finished


def unit_params(chunk: nn.Module) -> list[tuple[list[nn.Parameter], list[nn.Module], nn.Module]]:
    """The units of one GPTModel chunk, in forward order: (parameters, the modules whose forward
    needs them gathered, the module after whose forward they are released)."""
    units = []
    tied_head = chunk.post_process and chunk.embedding is not None and chunk.tied
    head_params = [] if chunk.final_layernorm is None else list(chunk.final_layernorm.parameters())
    if chunk.output_layer is not None:
        head_params += list(chunk.output_layer.parameters())
    if chunk.embedding is not None and not tied_head:
        units.append((list(chunk.embedding.parameters()), [chunk.embedding], chunk.embedding))
    if tied_head:
        entry = [chunk.embedding] if chunk.pre_process else []
        units.append((list(chunk.embedding.parameters()) + head_params, entry + [chunk.final_layernorm], chunk))
    units += [(list(layer.parameters()), [layer], layer) for layer in chunk.layers.values()]
    if chunk.post_process and not tied_head:
        units.append((head_params, [chunk.final_layernorm], chunk))
    return [unit for unit in units if any(p.requires_grad for p in unit[0])]


class ParamShards:
    """The sharded parameters of `chunks` (GPTModel chunks) over `parallel`'s DP group.

    buffer: the grad buffer, built with one bucket per unit of `unit_params` (in that order
    within each chunk); the parameter values are laid out like their grads. Construction
    moves every parameter into its unit's `full` tensor, keeps this rank's shard and
    releases the rest.
    """

    def __init__(self, chunks: list[nn.Module], buffer: GradBuffer, parallel: ParallelState):
        self.parallel = parallel
        self.buffer = buffer
        param = buffer.params[0]
        self.shards = torch.empty(sum((b.end - b.start) for b in buffer.buckets) // buffer.shard_count,
                                  dtype=param.dtype, device=param.device)
        self.units: list[Unit] = []
        self.unit_of: dict[int, Unit] = {}
        for chunk in chunks:
            self._shard_chunk(chunk)

    def _shard_chunk(self, chunk: nn.Module) -> None:
        groups = unit_params(chunk)
        units = []
        for params, entries, exit_module in groups:
            bucket = self.buffer.bucket_of[next(p for p in params if p.requires_grad)]
            unit = self._shard_bucket(bucket)
            unit.held = exit_module is chunk
            units.append(unit)
            for module in entries:
                module.register_forward_pre_hook(lambda *_, unit=unit: self._before_forward(unit))
            exit_module.register_forward_hook(
                lambda _module, _args, output, unit=unit: self._after_forward(unit, output))
        for unit, following in zip(units, units[1:]):
            unit.forward_next = following
        # Held after the chunk's forward, the head (and a tied embedding) is the first unit
        # needed by the backward; the layers follow from the top down, then the embedding.
        exits = [unit for unit, (_, _, exit_module) in zip(units, groups) if exit_module is not chunk]
        backward = [unit for unit, (_, _, exit_module) in zip(units, groups) if exit_module is chunk]
        backward += exits[::-1]
        for unit, following in zip(backward, backward[1:]):
            unit.backward_next = following

    @torch.no_grad()
    def _shard_bucket(self, bucket: Bucket) -> Unit:
        """Move `bucket`'s parameters into one flat `full` tensor, keep this rank's shard, free the rest."""
        size = (bucket.end - bucket.start) // self.buffer.shard_count
        first = bucket.params[0]
        full = torch.zeros(bucket.end - bucket.start, dtype=first.dtype, device=first.device)
        for param in bucket.params:
            start, numel = self.buffer.offsets[param]
            view = full[start - bucket.start:start - bucket.start + numel]
            view.copy_(param.detach().reshape(-1))
            # `.data` of `full`: the parameter keeps its own version counter, so refilling `full`
            # for the backward does not look like an in-place change of a tensor autograd saved.
            param.data = full.data[start - bucket.start:start - bucket.start + numel].view(param.shape)
        shard = self.shards[bucket.shard_offset:bucket.shard_offset + size]
        rank = self.buffer.shard_rank
        shard.copy_(full[rank * size:(rank + 1) * size])
        unit = Unit(bucket, full, shard)
        free(full)
        self.units.append(unit)
        for param in bucket.params:
            self.unit_of[id(param)] = unit
        return unit

    # -- gathering ---------------------------------------------------------------------------

    def _start_gather(self, unit: Unit) -> None:
        if unit.gathered or unit.work is not None:
            return
        allocate(unit.full)
        if self.parallel.dp_size == 1:
            unit.full.copy_(unit.shard)
            unit.gathered = True
            return
        unit.work = all_gather_single(unit.full, unit.shard, group=self.parallel.dp_group, async_op=True)

    def gather(self, unit: Unit) -> None:
        """Make `unit`'s parameters whole (waiting for a prefetch in flight)."""
        self._start_gather(unit)
        if unit.work is not None:
            unit.work.wait()
            unit.work = None
            unit.gathered = True

    def release(self, unit: Unit) -> None:
        """Free `unit`'s whole values; its shard stays."""
        if unit.work is not None:
            unit.work.wait()
            unit.work = None
        if unit.gathered:
            free(unit.full)
            unit.gathered = False
        unit.grads_seen = unit.backwards_due = 0

    def release_all(self) -> None:
        for unit in self.units:
            self.release(unit)

    @contextlib.contextmanager
    def gathered(self):
        """Every parameter whole for the block (reading or writing the model's weights directly)."""
        for unit in self.units:
            self.gather(unit)
        try:
            yield
        finally:
            self.release_all()

    # -- hooks --------------------------------------------------------------------------------

    def _before_forward(self, unit: Unit) -> None:
        # Only a unit's first entry prefetches the next one: not a tied head's second entry (the final norm,
        # whose forward_next would then stay gathered through the backward), nor a layer recomputed in its backward.
        entering = not unit.gathered  # a prefetched unit is not gathered until waited for
        self.gather(unit)
        if entering and unit.forward_next is not None:
            self._start_gather(unit.forward_next)

    def _after_forward(self, unit: Unit, output) -> None:
        if recomputing():  # inside the backward: the unit's own backward comes next, and grad_ready releases it
            return
        outputs = [t for t in (output if isinstance(output, (tuple, list)) else (output,))
                   if isinstance(t, torch.Tensor) and t.requires_grad]
        if torch.is_grad_enabled() and outputs:
            torch.autograd.graph.register_multi_grad_hook(outputs, lambda _grads: self._before_backward(unit),
                                                          mode="any")
            unit.backwards_due += 1
        if not unit.held:
            self.release(unit)

    def _before_backward(self, unit: Unit) -> None:
        self.gather(unit)
        if unit.backward_next is not None:
            self._start_gather(unit.backward_next)

    def grad_ready(self, param: nn.Parameter) -> None:
        """A grad-buffer hook: `param` accumulated its grad; release its unit once all of them did."""
        unit = self.unit_of[id(param)]
        unit.grads_seen += 1
        if unit.grads_seen < len(unit.bucket.params):
            return
        if unit.held and unit.backwards_due > 1:  # another micro-batch's loss backward still reads the head
            unit.backwards_due -= 1
            unit.grads_seen = 0
        else:
            self.release(unit)

    # -- ownership -----------------------------------------------------------------------------

    def owned_values(self, param: nn.Parameter, start: int, end: int) -> torch.Tensor:
        """This rank's stored values of `param`'s local flat elements `[start, end)` (inside its shard)."""
        unit = self.unit_of[id(param)]
        shard_start = unit.bucket.shard(self.buffer.shard_rank, self.buffer.shard_count)[0]
        offset = self.buffer.offsets[param][0] + start - shard_start
        return unit.shard[offset:offset + end - start]

    def owned_ranges(self) -> dict[nn.Parameter, tuple[int, int]]:
        """Each parameter with elements in this rank's shards -> its local flat range `[start, end)`."""
        return {param: local for _, param, local, _ in self.buffer.owned()}
