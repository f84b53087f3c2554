"""Point-to-point exchange of activations and gradients between pipeline stages.

Every message between stages is one tensor of a shape known from the config: the hidden
states `[s, b, h]` a stage hands to the next (or their gradient, handed back), with
`s` divided by TP under sequence parallelism. Nothing about shapes travels over the wire.

One `exchange` call posts all the sends and receives of one schedule step as a single
`torch.distributed.batch_isend_irecv` batch and waits for it. Batching matters for
NCCL, whose sends only complete once the peer has posted the matching receive: a
stage that sends its output and receives the next gradient in one batch cannot
deadlock against a neighbour doing the mirror image. Messages between two ranks in
one direction are matched in posting order (NCCL ignores tags), which is why the
schedule (schedules.py `plan_steps`) posts them in the same order on both sides;
`simulation.py` checks that order for every schedule.
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Message:
    """One tensor sent from pipeline rank `src` to `dst`.

    kind: "activation" (forward) or "grad" (backward). stage: the virtual stage that
    receives it. microbatch: its micro-batch.
    """

    kind: str
    src: int
    dst: int
    stage: int
    microbatch: int

    def __str__(self) -> str:
        short = "act" if self.kind == "activation" else "grad"
        return f"{short}(stage {self.stage}, mb {self.microbatch}) {self.src}->{self.dst}"


class PipelineComm:
    """Batched send/receive of `[s, b, h]` tensors over this rank's pipeline group.

    parallel: the ParallelState (pp_group, pp_rank, stage_rank). shape: the message
    shape `[s (or s/tp under SP), micro_batch, hidden]`. dtype: the activation dtype.
    """

    def __init__(self, parallel, shape: tuple[int, ...], dtype: torch.dtype):
        self.parallel, self.shape, self.dtype = parallel, tuple(shape), dtype
        self.device = parallel.device
        # NCCL creates a communicator lazily on its first call, which must involve every rank
        # of the group; one collective over the pipeline group does that here.
        dist.barrier(group=parallel.pp_group)

    def exchange(self, sends: list[tuple[Message, torch.Tensor]], recvs: list[Message]) -> dict:
        """Send each `(message, tensor)` and receive each message; {message: received tensor}.

        Blocks until the whole batch has completed, so send tensors may be reused after.
        """
        if not sends and not recvs:
            return {}
        received = {message: torch.empty(self.shape, dtype=self.dtype, device=self.device) for message in recvs}
        group = self.parallel.pp_group
        ops = [dist.P2POp(dist.isend, tensor.contiguous(), self.parallel.stage_rank(message.dst), group)
               for message, tensor in sends]
        ops += [dist.P2POp(dist.irecv, received[message], self.parallel.stage_rank(message.src), group)
                for message in recvs]
        for request in dist.batch_isend_irecv(ops):
            request.wait()
        return received
