"""DDP: the one gradient synchronisation of an iteration (Megatron's DDP and finalize_model_grads).

Losses are already divided by the global batch's token count, so the global grad is the plain
SUM over DP ranks. `finish_grad_sync`, after the last backward: (1) sums the tied embedding's
grads over the first and last stage; (2) all-reduces each grad-buffer bucket over DP, or
reduce-scatters it (distributed optimizer: rank d gets shard d, the rest goes stale); (3) under
SP sums TP-replicated grads over TP. With `overlap`, a bucket's collective starts in the last
backward once its grads are final; (2) launches the others (the tied embedding's among them).
"""

import torch
import torch.distributed as dist
from torch import nn

from megalite.data_parallel.grad_buffer import Bucket, GradBuffer
from megalite.parallel_state import ONE_PROCESS, ParallelState
from megalite.tensor_parallel.comm import allreduce_sequence_parallel_grads, reduce_scatter_single


class DataParallelGrads:
    """The grad buffer of `model`'s (or ModelChunks') trainable parameters and its reduction over `parallel`.

    shard: reduce-scatter into dp_size shards (distributed optimizer) instead of all-reduce. overlap:
    start each bucket's collective from the backward hooks. Per iteration: `zero_grad()`,
    `start_iteration(...)`, the backwards, `finish_grad_sync()`.
    """

    def __init__(self, model: nn.Module, parallel: ParallelState = ONE_PROCESS, bucket_size: int | None = None,
                 shard: bool = False, overlap: bool = False):
        self.model, self.parallel = model, parallel
        self.shard, self.overlap = shard, overlap and parallel.dp_size > 1
        chunks = list(model) if isinstance(model, nn.ModuleList) else [model]
        self.buffer = GradBuffer([[p for p in chunk.parameters() if p.requires_grad] for chunk in chunks],
                                 bucket_size=bucket_size, shard_count=parallel.dp_size if shard else 1)
        # The tied embedding's copies sit in differently laid out buffers on the two stages, so
        # their sum (step 1) runs on whole local grads: its buckets wait for finish_grad_sync.
        self._tied = [p for p in self.buffer.params if parallel.pp_size > 1 and getattr(p, "shared_embedding", False)]
        self._deferred = {i for i, bucket in enumerate(self.buffer.buckets)
                          if any(getattr(p, "shared_embedding", False) for p in bucket.params) and self._tied}
        self._pending: dict[int, int] = {}  # bucket index -> grads still expected this iteration
        self._remaining: dict[int, int] = {}  # id(param) -> backwards still expected this iteration
        self._launched: dict[int, object] = {}  # bucket index -> async work (or None when done)
        self._index = {id(bucket): i for i, bucket in enumerate(self.buffer.buckets)}
        if self.overlap:
            self.buffer.on_grad_ready = self._grad_ready

    def zero_grad(self) -> None:
        """Zero the grad buffer, before an iteration's first backward."""
        self.buffer.zero()

    def start_iteration(self, backwards_per_param: int) -> None:
        """Before the first backward: each parameter will receive `backwards_per_param` grads."""
        self._launched = {}
        if not self.overlap:
            return
        self._remaining = {id(param): backwards_per_param for param in self.buffer.params}
        self._pending = {i: len(bucket.params) for i, bucket in enumerate(self.buffer.buckets)}

    def finish_grad_sync(self) -> None:
        """After the last backward: the three sums of the module docstring; then the step may read the grads."""
        if self._tied and self.parallel.in_embedding_group:
            for param in self._tied:
                dist.all_reduce(param.main_grad, group=self.parallel.embedding_group)
        if self.parallel.dp_size > 1:
            for index in range(len(self.buffer.buckets)):
                if index not in self._launched:
                    self._launch(index, async_op=False)
            for work in self._launched.values():
                if work is not None:
                    work.wait()
        self._launched = {}
        if self.parallel.sequence_parallel:
            allreduce_sequence_parallel_grads(self.model.parameters(), self.parallel.tp_group)

    def _grad_ready(self, param) -> None:
        key = id(param)
        self._remaining[key] -= 1
        if self._remaining[key]:
            return
        index = self._index[id(self.buffer.bucket_of[param])]
        self._pending[index] -= 1
        if self._pending[index] == 0 and index not in self._deferred:
            self._launch(index, async_op=True)

    def _launch(self, index: int, async_op: bool) -> None:
        bucket: Bucket = self.buffer.buckets[index]
        data = self.buffer.data[bucket.start:bucket.end]
        group = self.parallel.dp_group
        if self.shard:
            start, end = bucket.shard(self.parallel.dp_rank, self.parallel.dp_size)
            # The output is a view of the input's storage; collectives must not alias, so reduce a copy.
            work = reduce_scatter_single(self.buffer.data[start:end], data.clone(), group=group, async_op=async_op)
        else:
            work = dist.all_reduce(data, group=group, async_op=async_op)
        self._launched[index] = work


def global_token_count(micro_batches, parallel: ParallelState, device) -> float:
    """Unmasked tokens of the whole global batch: this rank's micro-batches, summed over DP."""
    count = torch.tensor(sum(float(mb["loss_mask"].sum()) for mb in micro_batches), dtype=torch.float64, device=device)
    if parallel.dp_size > 1:
        dist.all_reduce(count, group=parallel.dp_group)
    return float(count)
