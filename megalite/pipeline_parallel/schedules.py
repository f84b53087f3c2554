"""Pipeline schedules: the order of forwards and backwards on each rank, and running it.

A schedule is pure data, the same for the real run, the tests and the bench:

- `operation_order(pp, vp, m, rank)`: the forwards `F(chunk, mb)` and backwards
  `B(chunk, mb)` rank `rank` runs for `m` micro-batches, P = `pp` ranks, V = `vp`
  chunks per rank:
  * P = 1: no pipelining, F0 B0 F1 B1 ... (plain gradient accumulation);
  * V = 1: 1F1B. Rank r runs min(P - r - 1, m) warm-up forwards, then alternates one
    forward and one backward, then runs the remaining backwards (cool-down). At most
    P - r micro-batches are in flight on rank r;
  * V > 1: interleaved 1F1B in Megatron's order. Virtual micro-batch k runs chunk
    `(k mod P*V) // P` on micro-batch `(k // P*V) * P + k mod P` (backwards take the
    chunks in reverse), so micro-batches move through the chunks in groups of P. The
    warm-up is `(P - r - 1) * 2 + (V - 1) * P` forwards (all of them when m == P), then
    1F1B steady state and cool-down as above. Needs m to be a multiple of P.
- `plan_steps(ops, pp, vp, rank)`: the same order with its communication, in
  Megatron's pairing: each step receives what its op (or, with V > 1, its steady-state
  forward-backward pair) needs and sends what the previous step's ops produced, in one
  batch (comm.py). A final step sends the last output.

`run_schedule` executes the steps on real model chunks: only the last stage computes
the loss; a stage frees its output's memory once sent and keeps only what the backward
needs (at most the schedule's in-flight count of micro-batches). Gradient reductions
(SP, tied embeddings, DP) happen once after it returns, i.e. after the last backward.
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
    in_group = k % (pp * vp)
    chunk = in_group // pp
    if not forward:
        chunk = vp - 1 - chunk
    return chunk, (k // (pp * vp)) * pp + k % pp


def operation_units(pp: int, vp: int, num_microbatches: int, rank: int,
                    forward_only: bool = False) -> list[tuple[Op, ...]]:
    """Rank `rank`'s ops in order, grouped into the units that `plan_steps` communicates
    around: single ops, except that with V > 1 each steady-state forward and backward
    form one unit, run back to back as in Megatron's interleaved schedule."""
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
    """Rank `rank`'s forwards and backwards, in the order it runs them (see the module docstring)."""
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


def plan_steps(units: list[tuple[Op, ...]], pp: int, vp: int, rank: int) -> list[Step]:
    """`operation_units` with their communication.

    The batch before a unit receives what the unit needs and sends what the previous
    unit produced; a final step sends the last unit's output. Receiving a steady-state
    backward's gradient together with its paired forward's input (V > 1) is what keeps
    the interleaved schedule deadlock-free when sends wait for their receives (NCCL).
    """
    steps, pending = [], ()
    for unit in units:
        messages = [_messages(op, pp, vp, rank) for op in unit]
        steps.append(Step(tuple(recv for recv, _ in messages if recv), pending, unit))
        pending = tuple(send for _, send in messages if send)
    if pending:
        steps.append(Step((), pending, ()))
    return steps


def schedule_steps(pp: int, vp: int, num_microbatches: int, rank: int, forward_only: bool = False) -> list[Step]:
    """The steps rank `rank` runs for one global batch."""
    return plan_steps(operation_units(pp, vp, num_microbatches, rank, forward_only), pp, vp, rank)


# -- running a schedule on model chunks ------------------------------------------------------


def _release(tensor: torch.Tensor) -> None:
    """Free an output's memory once sent, keeping its autograd node for the backward.

    The next stage has its own copy; the backward only needs `tensor.grad_fn`.
    Megatron does the same (deallocate_output_tensor).
    """
    tensor.data = torch.empty((1,), device=tensor.device, dtype=tensor.dtype)


def _backward_from(output: torch.Tensor, grad: torch.Tensor) -> None:
    """`output.backward(grad)` for an output whose memory `_release` freed.

    torch.autograd.backward compares `grad` with the (now 1-element) `output`, so this
    calls the autograd engine directly; the node still checks `grad` against the shape
    it recorded in the forward.
    """
    Variable._execution_engine.run_backward(
        tensors=(output,), grad_tensors=(grad,), keep_graph=False, create_graph=False, inputs=(),
        allow_unreachable=True, accumulate_grad=True)


class ScheduleRunner:
    """Runs one rank's steps for one global batch on its model chunks.

    chunks: the rank's model chunks (callables like GPTModel.forward). micro_batches:
    dicts of `[b, s]` tensors on the device. total_tokens: unmasked tokens of the global
    batch (each micro-batch loss is divided by it). comm: a PipelineComm, or None for one
    stage. scale_loss: the optimizer's loss scaling; None runs forward only.
    """

    def __init__(self, chunks, micro_batches, total_tokens: float, comm=None, scale_loss=None,
                 log=None, rank: int = 0):
        self.chunks, self.micro_batches, self.total_tokens = chunks, micro_batches, total_tokens
        self.comm, self.scale_loss, self.log, self.rank = comm, scale_loss, log, rank
        self.inputs: dict[tuple[int, int], torch.Tensor] = {}  # received, not yet used by a forward
        self.grads: dict[tuple[int, int], torch.Tensor] = {}  # received, not yet used by a backward
        self.saved: dict[tuple[int, int], tuple] = {}  # (input, output or loss) kept for the backward
        self.outbox: dict[Message, torch.Tensor] = {}  # produced, sent by the next step
        self.peak_in_flight = 0
        self.loss = None  # accumulated on the last stage, float64

    def run(self, steps: list[Step]) -> torch.Tensor | None:
        """Execute `steps`; returns this rank's summed loss (last stage) or None."""
        for step in steps:
            self._communicate(step)
            for op in step.ops:
                self._trace(str(op))
                (self._forward if op.kind == "F" else self._backward)(op)
        if self.saved or self.outbox:
            raise RuntimeError(f"schedule left work behind: saved {sorted(self.saved)}, unsent {list(self.outbox)}")
        return self.loss

    def _communicate(self, step: Step) -> None:
        sends = [(message, self.outbox.pop(message)) for message in step.sends]
        for message in step.recvs:
            self._trace(f"recv {message}")
        received = self.comm.exchange(sends, list(step.recvs)) if sends or step.recvs else {}
        for message, _ in sends:
            self._trace(f"sent {message}")
        for message, tensor in received.items():
            key = (message.stage, message.microbatch)
            if message.kind == "activation":
                self.inputs[key] = tensor.requires_grad_(self.scale_loss is not None)
            else:
                self.grads[key] = tensor

    def _forward(self, op: Op) -> None:
        chunk = self.chunks[op.chunk]
        stage = self._stage(op.chunk)
        mb = self.micro_batches[op.microbatch]
        hidden = self.inputs.pop((stage, op.microbatch)) if not chunk.pre_process else None
        labels = mb["labels"] if chunk.post_process else None
        output = chunk(mb["tokens"], mb["position_ids"], labels, mb["loss_mask"] if labels is not None else None,
                       hidden_states=hidden)
        if chunk.post_process:
            output = output.sum() / self.total_tokens
            self.loss = (self.loss if self.loss is not None else 0) + output.detach().double()
        else:
            send = Message("activation", self._pp_rank, (self._pp_rank + 1) % self._pp, stage + 1, op.microbatch)
            self.outbox[send] = output.detach()
        if self.scale_loss is None:
            return
        self.saved[(op.chunk, op.microbatch)] = (hidden, output)
        self.peak_in_flight = max(self.peak_in_flight, len(self.saved))
        if not chunk.post_process and output._base is None and output is not hidden:
            # The outbox's detached alias keeps the values until the send; then only the graph remains.
            _release(output)

    def _backward(self, op: Op) -> None:
        chunk = self.chunks[op.chunk]
        stage = self._stage(op.chunk)
        hidden, output = self.saved.pop((op.chunk, op.microbatch))
        if chunk.post_process:
            self.scale_loss(output).backward()
        else:
            _backward_from(output, self.grads.pop((stage, op.microbatch)))
        if not chunk.pre_process:
            send = Message("grad", self._pp_rank, (self._pp_rank - 1) % self._pp, stage - 1, op.microbatch)
            self.outbox[send] = hidden.grad

    @property
    def _pp(self) -> int:
        return getattr(self.comm, "parallel", None).pp_size if self.comm is not None else 1

    @property
    def _pp_rank(self) -> int:
        return self.comm.parallel.pp_rank if self.comm is not None else 0

    def _stage(self, chunk: int) -> int:
        return chunk * self._pp + self._pp_rank

    def _trace(self, text: str) -> None:
        if self.log is not None:
            self.log(f"[pipeline rank {self.rank}] {text}")
