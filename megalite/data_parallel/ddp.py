"""DDP: the grad buffer and the one gradient synchronisation of an iteration (Megatron's
DistributedDataParallel plus finalize_model_grads).

Each DP rank runs its share of the global batch; its micro-batch losses are already
divided by the token count of the whole global batch (training.forward_backward), so
the gradient of the global mean loss is the plain SUM of the ranks' accumulated
gradients. Summing (rather than averaging) is what keeps gradient accumulation exact:
no rank's token count is assumed equal to another's.

After the last micro-batch, `finish_grad_sync` makes the grads whole, in this order:
1. pipeline: the tied word embedding's grads on the first and last stage are summed
   over the embedding group, so both copies take the same step;
2. data parallel: each bucket of the grad buffer (grad_buffer.py) is
   - all-reduced across DP (plain data parallelism): every rank holds the summed grads;
   - or reduce-scattered (distributed optimizer): DP rank d receives the summed shard d
     of every bucket, the part its optimizer owns; the rest of its buffer is stale;
3. sequence parallel: the grads of parameters replicated over TP that act on
   sequence-split activations (norms, row-parallel biases) are summed over TP. TP peers
   lay out their buffers alike, so this also holds for a reduce-scattered shard.
The optimizer (optimizer.py) then only reads the reduced grads.

With `overlap` (--overlap-grad-reduce), a bucket's DP collective starts during the last
backward as soon as every parameter in it has received its last gradient of the
iteration; `finish_grad_sync` launches any bucket that is not done yet (parameters that
got no gradient, or a pipeline-tied embedding, which step 1 must sum first) and waits
for all of them.

The sharding strategy (--data-parallel-sharding-strategy, docs/parallelism.md):
- no_shard: all-reduce; optim (ZeRO-1, --use-distributed-optimizer): reduce-scatter into
  the own shard of the whole-model buffer;
- optim_grads (ZeRO-2): no whole-model buffer; a bucket's grads exist from its first
  gradient of the iteration until its reduce-scatter, which always starts from the last
  backward (as with overlap) and frees them; under sequence parallelism step 3 then sums
  the owned shard's parts of those grads over TP (TP peers own the same ranges);
- optim_grads_params (ZeRO-3): optim_grads, with one bucket per unit and the parameters
  sharded too (param_shards.py).
"""

import torch
import torch.distributed as dist
from torch import nn

from megalite.config.parallel import SHARDING_STRATEGIES
from megalite.data_parallel.grad_buffer import Bucket, GradBuffer, free
from megalite.data_parallel.param_shards import ParamShards, unit_params
from megalite.parallel_state import ONE_PROCESS, ParallelState
from megalite.tensor_parallel.comm import all_reduce, allreduce_sequence_parallel_grads, reduce_scatter_single


class DataParallelGrads:
    """The grad buffer of `model`'s trainable parameters and its reduction over `parallel`.

    model: a module, or ModelChunks (one buffer range per chunk). parallel: this rank's
    ParallelState. bucket_size: elements per bucket (--ddp-bucket-size; None: one per
    chunk). strategy: one of SHARDING_STRATEGIES (module docstring); every one but
    no_shard reduce-scatters (the buckets are then padded to split into dp_size shards)
    for the distributed optimizer. overlap: start each bucket's DP collective from the
    backward hooks (--overlap-grad-reduce; always on when the grads are sharded).

    Per iteration: `zero_grad()`, `start_iteration(num_microbatches)`, the backwards,
    then `finish_grad_sync()`.
    """

    def __init__(self, model: nn.Module, parallel: ParallelState = ONE_PROCESS, bucket_size: int | None = None,
                 strategy: str = "no_shard", overlap: bool = False):
        if strategy not in SHARDING_STRATEGIES:
            raise ValueError(f"unknown sharding strategy {strategy!r}; pick one of {', '.join(SHARDING_STRATEGIES)}")
        self.model, self.parallel, self.strategy = model, parallel, strategy
        self.shard = strategy != "no_shard"
        self.sharded_grads = strategy in ("optim_grads", "optim_grads_params")
        self.overlap = (overlap and parallel.dp_size > 1) or self.sharded_grads
        chunks = list(model) if hasattr(model, "chunks") else [model]
        self.buffer = GradBuffer(buffer_groups(chunks, strategy),
                                 bucket_size=None if strategy == "optim_grads_params" else bucket_size,
                                 shard_count=parallel.dp_size if self.shard else 1,
                                 shard_rank=parallel.dp_rank if self.shard else 0, sharded=self.sharded_grads)
        self.param_shards = None
        if strategy == "optim_grads_params":
            # The attribute tells checkpoints (and readers of the weights) that the model is sharded.
            self.param_shards = model.param_shards = ParamShards(chunks, self.buffer, parallel)
        # The tied embedding's copies sit in differently laid out buffers on the two stages, so
        # their sum (step 1) runs on whole local grads: its buckets wait for finish_grad_sync.
        self._tied = [p for p in self.buffer.params if parallel.pp_size > 1 and getattr(p, "shared_embedding", False)]
        self._deferred = {i for i, bucket in enumerate(self.buffer.buckets)
                          if any(getattr(p, "shared_embedding", False) for p in bucket.params) and self._tied}
        self._pending: dict[int, int] = {}  # bucket index -> grads still expected this iteration
        self._remaining: dict[int, int] = {}  # id(param) -> backwards still expected this iteration
        self._launched: dict[int, object] = {}  # bucket index -> async work (or None when done)
        self._index = {id(bucket): i for i, bucket in enumerate(self.buffer.buckets)}
        if self.overlap or self.param_shards is not None:
            self.buffer.on_grad_ready = self._grad_ready

    def zero_grad(self) -> None:
        """Zero the grad buffer, before an iteration's first backward."""
        self.buffer.zero()

    def start_iteration(self, backwards_per_param: int) -> None:
        """Before the first backward: each parameter will receive `backwards_per_param` grads
        (one per micro-batch its chunk runs)."""
        self._launched = {}
        if self.param_shards is not None:
            self.param_shards.release_all()
        if not self.overlap:
            return
        self._remaining = {id(param): backwards_per_param for param in self.buffer.params}
        self._pending = {i: len(bucket.params) for i, bucket in enumerate(self.buffer.buckets)}

    def finish_grad_sync(self) -> None:
        """After the last backward: the tied-embedding sum over pipeline stages, the DP reduction,
        then the sequence-parallel sum over TP (module docstring); the step may read the grads."""
        if self._tied and self.parallel.in_embedding_group:
            for param in self._tied:
                dist.all_reduce(param.main_grad, group=self.parallel.embedding_group)
        if self.parallel.dp_size > 1 or self.sharded_grads:
            for index in range(len(self.buffer.buckets)):
                if index not in self._launched:
                    self._launch(index, async_op=False)
            for index, work in self._launched.items():
                if work is not None:
                    work.wait()
                if self.sharded_grads:
                    free(self.buffer.buckets[index].grad)
        self._launched = {}
        if self.param_shards is not None:
            self.param_shards.release_all()  # a unit whose params got no grad this time
        if not self.parallel.sequence_parallel:
            return
        if self.sharded_grads:
            all_reduce_views(self._sequence_parallel_shard_grads(), self.parallel.tp_group)
        else:
            allreduce_sequence_parallel_grads(self.model.parameters(), self.parallel.tp_group)

    def _sequence_parallel_shard_grads(self) -> list[torch.Tensor]:
        """The parts of this rank's grad shards that belong to sequence-parallel parameters."""
        views = []
        for bucket in self.buffer.buckets:
            shard = self.buffer.shard_view(bucket)
            low = bucket.start + self.parallel.dp_rank * shard.numel()
            for param in bucket.params:
                start, numel = self.buffer.offsets[param]
                if getattr(param, "sequence_parallel", False) and start < low + shard.numel() and low < start + numel:
                    views.append(shard[max(start, low) - low:min(start + numel, low + shard.numel()) - low])
        return views

    def _grad_ready(self, param) -> None:
        if self.param_shards is not None:
            self.param_shards.grad_ready(param)
        if not self.overlap:
            return
        key = id(param)
        self._remaining[key] -= 1
        if self._remaining[key]:
            return
        index = self._index[id(self.buffer.bucket_of[param])]
        self._pending[index] -= 1
        if self._pending[index] == 0 and index not in self._deferred:
            self._launch(index, async_op=True)

    def _launch(self, index: int, async_op: bool) -> None:
        if self.sharded_grads:
            self._free_reduced()
        bucket: Bucket = self.buffer.buckets[index]
        data = self.buffer.bucket_grads(bucket)
        group = self.parallel.dp_group
        if self.sharded_grads and self.parallel.dp_size == 1:
            self.buffer.shard_view(bucket).copy_(data)
            work = None
        elif self.sharded_grads:  # the output is a separate tensor: no copy needed
            work = reduce_scatter_single(self.buffer.shard_view(bucket), data, group=group, async_op=async_op)
        elif self.shard:
            # The output is a view of the input's storage; collectives must not alias, so reduce a copy.
            work = reduce_scatter_single(self.buffer.shard_view(bucket), data.clone(), group=group,
                                         async_op=async_op)
        else:
            work = dist.all_reduce(data, group=group, async_op=async_op)
        if self.sharded_grads and work is None:
            free(bucket.grad)
        self._launched[index] = work

    def _free_reduced(self) -> None:
        """Wait for the reduce-scatters in flight and free their buckets' full grads (ZeRO-2/3): one
        reduction overlaps the next bucket's backward, and at most two buckets' full grads exist."""
        for index, work in self._launched.items():
            if work is not None:
                work.wait()
                free(self.buffer.buckets[index].grad)
                self._launched[index] = None


def buffer_groups(chunks: list[nn.Module], strategy: str) -> list[list[nn.Parameter]]:
    """The trainable parameters the grad buffer lays out range after range: each model chunk's, or
    under ZeRO-3 each unit's (param_shards.py), since a unit is gathered and reduced as one bucket."""
    if strategy == "optim_grads_params":
        groups = [params for chunk in chunks for params, _, _ in unit_params(chunk)]
    else:
        groups = [list(chunk.parameters()) for chunk in chunks]
    return [[param for param in params if param.requires_grad] for params in groups]


def all_reduce_views(views: list[torch.Tensor], group) -> None:
    """Sum each tensor of `views` over `group` in place, with one all-reduce for all of them."""
    if not views:
        return
    flat = all_reduce(torch.cat([view.reshape(-1) for view in views]), group)
    for view, summed in zip(views, flat.split([view.numel() for view in views])):
        view.copy_(summed.view_as(view))


def global_token_count(micro_batches, parallel: ParallelState, device) -> float:
    """Unmasked tokens of the whole global batch: this rank's micro-batches, summed over DP."""
    count = torch.tensor(sum(float(mb["loss_mask"].sum()) for mb in micro_batches), dtype=torch.float64,
                         device=device)
    if parallel.dp_size > 1:
        dist.all_reduce(count, group=parallel.dp_group)
    return float(count)
