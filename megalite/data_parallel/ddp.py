"""Gradient reduction across data-parallel ranks, bucket by bucket.

Each DP rank runs its share of the global batch; its micro-batch losses are already
divided by the token count of the whole global batch (training.forward_backward), so
the gradient of the global mean loss is the plain SUM of the ranks' accumulated
gradients. Summing (rather than averaging) is what keeps gradient accumulation exact:
no rank's token count is assumed equal to another's.

After the last micro-batch, each bucket of the grad buffer (grad_buffer.py) is
- all-reduced across DP (plain data parallelism): every rank holds the summed grads;
- or reduce-scattered (distributed optimizer): DP rank d receives the summed shard d
  of every bucket, the part its optimizer owns; the rest of its buffer is stale.

With `overlap` (--overlap-grad-reduce), a bucket's collective starts during the last
backward as soon as every parameter in it has received its last gradient of the
iteration; `finish()` launches any bucket that is not done yet (parameters that got no
gradient, or a pipeline-tied embedding, which is first summed across its two stages)
and waits for all of them.
"""

import torch
import torch.distributed as dist

from megalite.data_parallel.grad_buffer import Bucket, GradBuffer
from megalite.tensor_parallel.comm import _reduce_scatter_single


class DataParallelGrads:
    """Reduces `buffer`'s buckets over `dp_group` once per iteration.

    dp_group / dp_size / dp_rank: the data-parallel group (None or size 1: nothing to do).
    shard: reduce-scatter for the distributed optimizer instead of all-reduce.
    overlap: start each bucket's collective from the backward hooks.
    """

    def __init__(self, buffer: GradBuffer, dp_group, dp_size: int, dp_rank: int, shard: bool = False,
                 overlap: bool = False, defer_shared_embedding: bool = False):
        self.buffer, self.group, self.size, self.rank = buffer, dp_group, dp_size, dp_rank
        self.shard, self.overlap = shard, overlap and dp_size > 1
        # Buckets holding a pipeline-tied embedding wait for `finish`: its grad is first summed
        # with the other stage's copy (before_reduce), whose buffer is laid out differently.
        self._deferred = {i for i, bucket in enumerate(buffer.buckets)
                          if defer_shared_embedding and any(getattr(p, "shared_embedding", False)
                                                            for p in bucket.params)}
        self._pending: dict[int, int] = {}  # bucket index -> grads still expected this iteration
        self._remaining: dict[int, int] = {}  # id(param) -> backwards still expected this iteration
        self._launched: dict[int, object] = {}  # bucket index -> async work (or None when done)
        self._index = {id(bucket): i for i, bucket in enumerate(buffer.buckets)}
        if self.overlap:
            buffer.on_grad_ready = self._grad_ready

    def start_iteration(self, backwards_per_param: int) -> None:
        """Before the first backward: each parameter will receive `backwards_per_param` grads
        (one per micro-batch its chunk runs)."""
        self._launched = {}
        if not self.overlap:
            return
        self._remaining = {id(param): backwards_per_param for param in self.buffer.params}
        self._pending = {i: len(bucket.params) for i, bucket in enumerate(self.buffer.buckets)}

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
        if self.shard:
            start, end = bucket.shard(self.rank, self.size)
            # The output is a view of the input's storage; collectives must not alias, so reduce a copy.
            work = _reduce_scatter_single(self.buffer.data[start:end], data.clone(), group=self.group,
                                          async_op=async_op)
        else:
            work = dist.all_reduce(data, group=self.group, async_op=async_op)
        self._launched[index] = work

    def finish(self, before_reduce=None) -> None:
        """After the last backward: every bucket reduced (the step may read the grads).

        before_reduce: runs first, on grads of buckets not reduced yet (deferred ones).
        """
        if before_reduce is not None:
            before_reduce()
        if self.size == 1:
            return
        for index in range(len(self.buffer.buckets)):
            if index not in self._launched:
                self._launch(index, async_op=False)
        for work in self._launched.values():
            if work is not None:
                work.wait()
        self._launched = {}


def global_token_count(micro_batches, dp_group, dp_size: int, device) -> float:
    """Unmasked tokens of the whole global batch: this rank's micro-batches, summed over DP."""
    count = torch.tensor(sum(float(mb["loss_mask"].sum()) for mb in micro_batches), dtype=torch.float64,
                         device=device)
    if dp_size > 1:
        dist.all_reduce(count, group=dp_group)
    return float(count)
