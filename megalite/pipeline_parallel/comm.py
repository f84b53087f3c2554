"""Point-to-point exchange of activations and gradients (`[s or s/tp, b, h]`) between pipeline stages. A
step's sends and receives go as one `batch_isend_irecv`: NCCL's sends complete only once the peer posts the
receive, so batching both directions avoids deadlock. Messages between two ranks match in posting order (NCCL
ignores tags), which the schedule keeps and simulation.py checks."""

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Message:
    """One tensor, "activation" (forward) or "grad" (backward), from pipeline rank `src` to `dst`
    for virtual stage `stage` and micro-batch `microbatch`."""

    kind: str
    src: int
    dst: int
    stage: int
    microbatch: int

    def __str__(self) -> str:
        short = "act" if self.kind == "activation" else "grad"
        return f"{short}(stage {self.stage}, mb {self.microbatch}) {self.src}->{self.dst}"


class PipelineComm:
    """Batched send/receive of `shape` (`[s or s/tp, micro_batch, hidden]`) tensors over the pipeline group."""

    def __init__(self, parallel, shape: tuple[int, ...], dtype: torch.dtype):
        self.parallel, self.shape, self.dtype, self.device = parallel, tuple(shape), dtype, parallel.device
        # NCCL creates a communicator on its first call, which every rank of the group must join: this barrier.
        dist.barrier(group=parallel.pp_group)

    def exchange(self, sends: list[tuple[Message, torch.Tensor]], recvs: list[Message]) -> dict:
        """Send each `(message, tensor)` and receive each message (at least one of either); {message: received
        tensor}. Blocks until the whole batch has completed, so send tensors may be reused after."""
        received = {message: torch.empty(self.shape, dtype=self.dtype, device=self.device) for message in recvs}
        group = self.parallel.pp_group
        ops = [dist.P2POp(dist.isend, tensor.contiguous(), self.parallel.stage_rank(message.dst), group)
               for message, tensor in sends]
        ops += [dist.P2POp(dist.irecv, received[message], self.parallel.stage_rank(message.src), group)
                for message in recvs]
        for request in dist.batch_isend_irecv(ops):
            request.wait()
        return received
