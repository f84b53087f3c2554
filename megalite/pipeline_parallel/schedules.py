"""Pipeline schedules as data (the same for the run, the tests and the bench), and running them.

`operation_order(pp, vp, m, rank)`: the forwards `F(chunk, mb)` and backwards `B(chunk, mb)` rank
r runs for m micro-batches, P = `pp` ranks, V = `vp` chunks per rank. P = 1: F0 B0 F1 B1 ...;
V = 1: 1F1B, min(P - r - 1, m) warm-up forwards, one forward and one backward in turn, then the
remaining backwards; V > 1: Megatron's interleaved 1F1B, virtual micro-batch k running chunk
`(k mod P*V) // P` (backwards in reverse) on micro-batch `(k // P*V) * P + k mod P`, after
`(P - r - 1) * 2 + (V - 1) * P` warm-up forwards (all when m == P). `schedule_steps` adds the
communication in Megatron's pairing: each step receives what its op (V > 1: its steady-state
forward-backward pair) needs and sends what the previous step produced, in one batch.
"""

from dataclasses import dataclass

import torch
from torch.autograd.variable import Variable

from megalite.config.rules import check_microbatches
from megalite.pipeline_parallel.comm import Message


@dataclass(frozen=True)
class Op:
    """One forward ("F") or backward ("B") of model chunk `chunk` on micro-batch `microbatch`."""

    kind: str
    chunk: int
    microbatch: int

    def __str__(self) -> str:
        return f"{self.kind}(chunk {self.chunk}, mb {self.microbatch})"


@dataclass(frozen=True)
class Step:
    """Receive `recvs` and send `sends` (one batch), then run `ops` in order (none: the final sends)."""

    recvs: tuple[Message, ...]
    sends: tuple[Message, ...]
    ops: tuple[Op, ...]


def warmup_forwards(pp: int, vp: int, num_microbatches: int, rank: int) -> int:
    """How many forwards rank `rank` runs before its first backward."""
    total = num_microbatches * vp
    if vp == 1:
        return min(pp - rank - 1, total)
    if num_microbatches == pp:
        return total
    return min((pp - rank - 1) * 2 + (vp - 1) * pp, total)


def _virtual_microbatch(k: int, pp: int, vp: int, forward: bool) -> tuple[int, int]:
    """(chunk, micro-batch) of the k-th forward (or backward) in Megatron's interleaved order."""
    chunk = k % (pp * vp) // pp
    return chunk if forward else vp - 1 - chunk, (k // (pp * vp)) * pp + k % pp


def operation_units(pp: int, vp: int, num_microbatches: int, rank: int,
                    forward_only: bool = False) -> list[tuple[Op, ...]]:
    """Rank `rank`'s ops in order, in the units `schedule_steps` communicates around: single ops, or with
    V > 1 each steady-state forward and backward pair (run back to back, as Megatron's)."""
    check_microbatches(num_microbatches, pp, vp)
    total = num_microbatches * vp
    forwards = [Op("F", *_virtual_microbatch(k, pp, vp, True)) for k in range(total)]
    if forward_only:
        return [(op,) for op in forwards]
    backwards = [Op("B", *_virtual_microbatch(k, pp, vp, False)) for k in range(total)]
    warmup = warmup_forwards(pp, vp, num_microbatches, rank)
    units = [(op,) for op in forwards[:warmup]]
    for k in range(total - warmup):
        pair = (forwards[warmup + k], backwards[k])
        units += [pair] if vp > 1 else [(op,) for op in pair]
    return units + [(op,) for op in backwards[total - warmup:]]


def operation_order(pp: int, vp: int, num_microbatches: int, rank: int, forward_only: bool = False) -> list[Op]:
    """Rank `rank`'s forwards and backwards, in the order it runs them."""
    return [op for unit in operation_units(pp, vp, num_microbatches, rank, forward_only) for op in unit]


def max_in_flight(ops: list[Op]) -> int:
    """The most micro-batch chunks forwarded but not yet backwarded at any point of `ops`."""
    live = peak = 0
    for op in ops:
        live += 1 if op.kind == "F" else -1
        peak = max(peak, live)
    return peak


def _messages(op: Op, pp: int, vp: int, rank: int) -> tuple[Message | None, Message | None]:
    """(what `op` receives, what it sends); None at the ends of the pipeline."""
    stage, last = op.chunk * pp + rank, pp * vp - 1
    if op.kind == "F":
        recv = Message("activation", (rank - 1) % pp, rank, stage, op.microbatch) if stage > 0 else None
        send = Message("activation", rank, (rank + 1) % pp, stage + 1, op.microbatch) if stage < last else None
    else:
        recv = Message("grad", (rank + 1) % pp, rank, stage, op.microbatch) if stage < last else None
        send = Message("grad", rank, (rank - 1) % pp, stage - 1, op.microbatch) if stage > 0 else None
    return recv, send


def schedule_steps(pp: int, vp: int, num_microbatches: int, rank: int, forward_only: bool = False) -> list[Step]:
    """The steps rank `rank` runs for one global batch: `operation_units` with their communication, and a
    final step that sends the last unit's output. Receiving a steady-state backward's gradient with its paired
    forward's input (V > 1) keeps the interleaved schedule deadlock-free when sends wait for receives (NCCL)."""
    steps, pending = [], ()
    for unit in operation_units(pp, vp, num_microbatches, rank, forward_only):
        messages = [_messages(op, pp, vp, rank) for op in unit]
        steps.append(Step(tuple(recv for recv, _ in messages if recv), pending, unit))
        pending = tuple(send for _, send in messages if send)
    if pending:
        steps.append(Step((), pending, ()))
    return steps


def _release(tensor: torch.Tensor) -> None:
    """Free a sent output's memory, keeping its autograd node (Megatron's deallocate_output_tensor)."""
    tensor.data = torch.empty((1,), device=tensor.device, dtype=tensor.dtype)


def _backward_from(output: torch.Tensor, grad: torch.Tensor) -> None:
    """`output.backward(grad)` for an output whose memory `_release` freed: torch.autograd.backward
    would compare `grad` with the 1-element `output`; the node still checks the recorded shape."""
    Variable._execution_engine.run_backward(
        tensors=(output,), grad_tensors=(grad,), keep_graph=False, create_graph=False, inputs=(),
        allow_unreachable=True, accumulate_grad=True)


class ScheduleRunner:
    """Runs one rank's steps for one global batch on its model chunks, freeing each output once sent. The
    model and the loss come from outside (Megatron's forward_step_func and loss_func): `forward_step(chunk,
    micro_batch, hidden_states)` runs a chunk on a micro-batch (hidden_states None on the first stage) or on
    the received hidden states; on the last stage `loss_fn(chunk, output, micro_batch)` turns its output into
    losses whose sum over total_tokens (the global batch's unmasked tokens) is the micro-batch's loss.
    micro_batches: dicts of `[b, s]` tensors. comm: a PipelineComm, or None for one stage. scale_loss: the
    optimizer's loss scaling; None runs forward only."""

    def __init__(self, chunks, micro_batches, total_tokens: float, forward_step, loss_fn, comm=None,
                 scale_loss=None, log=None, rank: int = 0):
        self.chunks, self.micro_batches, self.total_tokens = chunks, micro_batches, total_tokens
        self.forward_step, self.loss_fn = forward_step, loss_fn
        self.comm, self.scale_loss, self.log, self.rank = comm, scale_loss, log, rank
        self.pp, self.pp_rank = (comm.parallel.pp_size, comm.parallel.pp_rank) if comm is not None else (1, 0)
        self.received: dict[Message, torch.Tensor] = {}  # not yet used by their op
        self.saved: dict[tuple[int, int], tuple] = {}  # (input, output or loss) kept for the backward
        self.outbox: dict[Message, torch.Tensor] = {}  # produced, sent by the next step
        self.loss = None  # accumulated on the last stage, float64

    def run(self, steps: list[Step]) -> torch.Tensor | None:
        """Execute `steps`; returns this rank's summed loss (last stage) or None."""
        for step in steps:
            self._communicate(step)
            for op in step.ops:
                self._trace(str(op))
                (self._forward if op.kind == "F" else self._backward)(op)
        return self.loss

    def _communicate(self, step: Step) -> None:
        sends = [(message, self.outbox.pop(message)) for message in step.sends]
        for message in step.recvs:
            self._trace(f"recv {message}")
        received = self.comm.exchange(sends, list(step.recvs)) if sends or step.recvs else {}  # comm: None at P = 1
        for message, _ in sends:
            self._trace(f"sent {message}")
        self.received.update(received)

    def _forward(self, op: Op) -> None:
        chunk, mb = self.chunks[op.chunk], self.micro_batches[op.microbatch]
        recv, send = _messages(op, self.pp, len(self.chunks), self.pp_rank)  # None: the first (last) stage
        hidden = self.received.pop(recv).requires_grad_(self.scale_loss is not None) if recv is not None else None
        output = self.forward_step(chunk, mb, hidden)
        if send is None:
            output = self.loss_fn(chunk, output, mb).sum() / self.total_tokens
            self.loss = (self.loss if self.loss is not None else 0) + output.detach().double()
        else:
            self.outbox[send] = output.detach()
        if self.scale_loss is None:
            return
        self.saved[(op.chunk, op.microbatch)] = (hidden, output)
        if send is not None and output._base is None and output is not hidden:
            # The outbox's detached alias keeps the values until the send; then only the graph remains.
            _release(output)

    def _backward(self, op: Op) -> None:
        recv, send = _messages(op, self.pp, len(self.chunks), self.pp_rank)
        hidden, output = self.saved.pop((op.chunk, op.microbatch))
        if recv is None:  # the last stage: the loss
            self.scale_loss(output).backward()
        else:
            _backward_from(output, self.received.pop(recv))
        if send is not None:
            self.outbox[send] = hidden.grad

    def _trace(self, text: str) -> None:
        if self.log is not None:
            self.log(f"[pipeline rank {self.rank}] {text}")
