"""ParallelModel: data parallelism of a built model, Megatron's DDP and finalize_model_grads in one object.

Losses are already divided by the global batch's token count, so the global grad is the plain SUM over
DP ranks. The routed experts' parameters (`expert_parallel`) have their own buffer, summed over expert-DP
instead (the ranks holding the same expert shards), with no other scale; everything below applies to each
buffer with its own group (`GradDomain`). `finish_grad_sync`, after the last backward: (1) sums the tied
embedding's grads over the first and last stage; (2) all-reduces each bucket over its group, or
reduce-scatters it into this rank's shard (every sharding strategy but no_shard; ZeRO-2/3 already did so
bucket by bucket in each backward, freeing the full grads); (3) under SP sums TP-replicated grads over TP.
With overlap, a bucket's collective starts in the last backward once its grads are final; with
--grad-reduce-in-bf16 it runs on a bf16 copy. The parameters live in the buffers' layout under every
strategy, so the distributed optimizer's all-gather lands in them in place. docs/parallelism.md has each
strategy's memory and communication.
"""

import torch
import torch.distributed as dist
from torch import nn

from megalite.config.parallel import Sharding
from megalite.data_parallel.grad_buffer import Bucket, GradBuffer, GradDomain, free, is_expert
from megalite.data_parallel.param_shards import ParamShards, unit_modules, unit_params
from megalite.parallel_state import ONE_PROCESS, ParallelState
from megalite.tensor_parallel.comm import (all_gather_single, all_reduce_together, allreduce_sequence_parallel_grads,
                                           reduce_scatter_single)


class ParallelModel:
    """`model` (a GPTModel or ModelChunks, tensor- and pipeline-parallel as built) made data-parallel over
    `parallel`: the parameter-and-grad buffers of its trainable parameters, their reduction, their gathering.
    `domains`: the dense parameters' buffer over DP, then (where this rank's chunks hold any) the experts' over
    expert-DP; `buffer`: the dense one.

    sharding: what DP ranks shard (ParallelConfig.sharding); all but NO_SHARD reduce-scatter into dp_size
    shards (expert_dp_size for the experts) for the distributed optimizer. overlap_grad_reduce: start each
    bucket's collective from the backward hooks (always, when the grads are sharded). gradient_accumulation_fusion:
    the linear layers' backwards add their weight grads into the buffers directly. overlap_param_gather:
    the step only starts the parameters' all-gathers (ZeRO-1/2), and each forward waits for its own. Per
    iteration: `zero_grad()`, `start_iteration(...)`, the backwards, `finish_grad_sync()`, the optimizer's step.
    """

    def __init__(self, model: nn.Module, parallel: ParallelState = ONE_PROCESS, bucket_size: int | None = None,
                 sharding: Sharding = Sharding.NO_SHARD, overlap_grad_reduce: bool = False,
                 overlap_param_gather: bool = False, grad_reduce_in_bf16: bool = False,
                 gradient_accumulation_fusion: bool = False):
        self.model, self.parallel, self.sharding = model, parallel, sharding
        self.fuse_weight_grads = gradient_accumulation_fusion
        self.reduce_dtype = torch.bfloat16 if grad_reduce_in_bf16 else None
        self.shard, self.sharded_grads = sharding.optimizer_state, sharding.grads
        self.chunks = list(model) if isinstance(model, nn.ModuleList) else [model]
        # Dense grads sum over DP x CP: context-parallel ranks hold the same parameters, other tokens.
        self.domains = [self._domain(False, bucket_size, parallel.dp_cp_group, parallel.dp_cp_size,
                                     parallel.dp_cp_rank)]
        if any(buffer_groups(self.chunks, sharding, expert=True)):  # a stage without experts has no such buffer
            self.domains.append(self._domain(True, bucket_size, parallel.expert_dp_group, parallel.expert_dp_size,
                                             parallel.expert_dp_rank))
        self.buffer = self.domains[0].buffer
        self.overlap = (overlap_grad_reduce and any(domain.size > 1 for domain in self.domains)) or self.sharded_grads
        self.param_shards = ParamShards(self.chunks, self.domains) if sharding.params else None
        # Every bucket of every domain, by one index (the dense ones first): index -> (its domain, the bucket).
        self._buckets = [(domain, bucket) for domain in self.domains for bucket in domain.buffer.buckets]
        self._bucket_of = {param: bucket for buffer in self.buffers for param, bucket in buffer.bucket_of.items()}
        self._gathers = None  # overlap_param_gather: id(bucket) -> its parameters' all-gather in flight
        if overlap_param_gather and self.gathers_params:
            self._wait_for_params_in_forward()
        # The tied embedding's copies sit in differently laid out buffers on the two stages, so
        # their sum (step 1) runs on whole local grads: its buckets wait for finish_grad_sync.
        self._tied = [p for p in self.buffer.params if parallel.pp_size > 1 and getattr(p, "shared_embedding", False)]
        self._deferred = {i for i, (_, bucket) in enumerate(self._buckets)
                          if any(getattr(p, "shared_embedding", False) for p in bucket.params) and self._tied}
        self._pending: dict[int, int] = {}  # bucket index -> grads still expected this round
        self._remaining: dict[int, int] = {}  # id(param) -> backwards still expected this iteration
        self._launched: dict[int, object] = {}  # bucket index -> its reduction in flight (None when done)
        self._unreduced: set[int] = set()  # sharded grads: buckets with grads added since their last reduction
        self._wait_queued = False  # sharded grads: the end of this backward waits for its last reduction
        self._index = {id(bucket): i for i, (_, bucket) in enumerate(self._buckets)}
        for domain in self.domains:
            if self.overlap or self.param_shards is not None:
                domain.buffer.on_grad_ready = self._grad_ready
            if self.sharded_grads:
                domain.buffer.before_grad = self._before_grad

    def _domain(self, expert: bool, bucket_size: int | None, group, size: int, rank: int) -> GradDomain:
        """The buffer of the dense (or the experts') trainable parameters, sharded over `size` ranks of `group`
        under the distributed optimizer, holding the parameters' values."""
        sharding = self.sharding
        buffer = GradBuffer(buffer_groups(self.chunks, sharding, expert),
                            bucket_size=None if sharding.params else bucket_size,
                            shard_count=size if self.shard else 1, shard_rank=rank if self.shard else 0,
                            sharded=self.sharded_grads, fuse_weight_grads=self.fuse_weight_grads)
        buffer.hold_params(sharded=sharding.params)
        return GradDomain(buffer, group, size, rank)

    @property
    def buffers(self) -> list[GradBuffer]:
        """Every domain's buffer, the dense one first."""
        return [domain.buffer for domain in self.domains]

    def _gathers_params(self, domain: GradDomain) -> bool:
        """Whether the step's parameter all-gather runs for `domain`: ZeRO-1/2 over more than one rank
        (ZeRO-3's forward gathers)."""
        return self.shard and not self.sharding.params and domain.size > 1

    @property
    def gathers_params(self) -> bool:
        """Whether the step gathers any parameters here (see `_gathers_params`)."""
        return any(self._gathers_params(domain) for domain in self.domains)

    def param_values(self, param: nn.Parameter, start: int, end: int) -> torch.Tensor:
        """The model's values of `param`'s local flat elements `[start, end)`, 1-D (a view; ZeRO-3: of its shard)."""
        if self.param_shards is not None:
            return self.param_shards.owned_values(param, start, end)
        return param.detach().view(-1)[start:end]

    def start_param_sync(self) -> None:
        """After the distributed optimizer wrote this rank's shard of every bucket's parameters: all-gather each
        bucket in place over its domain's group, in forward order (with overlap_param_gather started here and
        waited for by the forward). ZeRO-3 gathers nothing here: the next forward does."""
        for domain in self.domains:
            if not self._gathers_params(domain):
                continue
            for bucket in reversed(domain.buffer.buckets):
                work = all_gather_single(bucket.param, domain.buffer.param_shard(bucket), group=domain.group,
                                         async_op=self._gathers is not None)
                if self._gathers is not None:
                    self._gathers[id(bucket)] = work

    def finish_param_sync(self, buckets=None) -> None:
        """Wait for the parameter all-gathers still in flight (of the buckets with ids in `buckets`; all by
        default): before anything reads or writes the weights."""
        for key in [key for key in self._gathers or () if buckets is None or key in buckets]:
            self._gathers.pop(key).wait()

    def _wait_for_params_in_forward(self) -> None:
        """overlap_param_gather: each unit of the model (the modules whose forward reads a group of parameters,
        also weights read outside their own module's forward) waits for its parameters' buckets in a forward
        pre-hook."""
        self._gathers = {}
        for chunk in self.chunks:
            for modules in unit_modules(chunk):
                buckets = {id(self._bucket_of[param]) for param in unit_params(modules) if param in self._bucket_of}
                for module in modules:
                    module.register_forward_pre_hook(lambda *_, buckets=buckets: self.finish_param_sync(buckets))

    def zero_grad(self) -> None:
        """Zero the grad buffers, before an iteration's first backward."""
        for buffer in self.buffers:
            buffer.zero()

    def start_iteration(self, backwards_per_param: int) -> None:
        """Before the first backward: each parameter will receive `backwards_per_param` grads."""
        self._launched, self._unreduced, self._wait_queued = {}, set(), False
        if self.param_shards is not None:
            self.param_shards.release_all()
        if not self.overlap:
            return
        self._remaining = {id(param): backwards_per_param for buffer in self.buffers for param in buffer.params}
        self._pending = {i: len(bucket.params) for i, (_, bucket) in enumerate(self._buckets)}

    def finish_grad_sync(self) -> None:
        """After the last backward: the three sums of the module docstring; then the step may read the grads."""
        if self._tied and self.parallel.in_embedding_group:
            for param in self._tied:
                dist.all_reduce(param.main_grad, group=self.parallel.embedding_group)
        if self.sharded_grads:
            for index in sorted(self._unreduced):  # the same buckets, in the same order, on every rank of a group
                self._launch(index, async_op=False)
        else:
            for index in range(len(self._buckets)):
                if index not in self._launched:
                    self._launch(index, async_op=False)
        self._wait_launched()
        self._launched = {}
        if self.param_shards is not None:
            self.param_shards.release_all()  # a unit whose parameters got no grad this time
        if not self.parallel.sequence_parallel:
            return
        if self.sharded_grads:
            all_reduce_together(self._sequence_parallel_shard_grads(), self.parallel.tp_group)
        else:
            allreduce_sequence_parallel_grads(self.model.parameters(), self.parallel.tp_group)

    def _sequence_parallel_shard_grads(self) -> list[torch.Tensor]:
        """The parts of this rank's grad shards that belong to sequence-parallel parameters."""
        return [buffer.shard_view(bucket)[slice(*in_shard)] for buffer in self.buffers
                for bucket, param, _, in_shard in buffer.owned() if getattr(param, "sequence_parallel", False)]

    def _before_grad(self, bucket: Bucket) -> None:
        """Sharded grads: a bucket whose reduction is in flight takes no new grad until it is done."""
        index = self._index[id(bucket)]
        work = self._launched.get(index)
        if work is not None:
            work.wait()
            self._launched[index] = None
        self._unreduced.add(index)

    def _grad_ready(self, param) -> None:
        if self.param_shards is not None:
            self.param_shards.grad_ready(param)
        if not self.overlap:
            return
        if not self.sharded_grads:  # reduced after the last backward: count them
            self._remaining[id(param)] -= 1
            if self._remaining[id(param)]:
                return
        index = self._index[id(self._bucket_of[param])]
        self._pending[index] -= 1
        if self._pending[index]:
            return
        if self.sharded_grads:  # reduced after each backward: the next one starts a new round
            self._pending[index] = len(self._buckets[index][1].params)
        if index not in self._deferred:
            self._launch(index, async_op=True)

    def _wait_launched(self) -> None:
        for index, work in self._launched.items():
            if work is not None:
                work.wait()
                self._launched[index] = None

    def _launch(self, index: int, async_op: bool) -> None:
        if self.sharded_grads:  # one reduction overlaps the next bucket's backward: two full buckets at most
            self._wait_launched()
            self._unreduced.discard(index)
            if async_op and not self._wait_queued:  # and none outlives its backward, into the next micro-batch
                torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
                self._wait_queued = True
        self._launched[index] = self._reduce(*self._buckets[index], async_op)

    def reduction_tensors(self) -> list[torch.Tensor]:
        """The tensors the reductions in flight hold (what they read and write), for memory accounting."""
        return [tensor for work in self._launched.values() if work is not None
                for tensor in (work.source, work.output)]

    def _end_of_backward(self) -> None:
        self._wait_queued = False
        self._wait_launched()

    def _reduce(self, domain: GradDomain, bucket: Bucket, async_op: bool):
        """Start summing `bucket`'s grads over its domain's group: in place (no_shard), into its shard of the
        buffer (ZeRO-1), or added to its owned shard (ZeRO-2/3, whose full grads are then freed); in bf16 with
        grad_reduce_in_bf16. The reduction in flight (an object with wait()), or None when already done."""
        group, low, buffer = domain.group, self.reduce_dtype, domain.buffer
        if domain.size == 1 and not self.sharded_grads:  # the grads are this rank's alone: already the sum
            return None
        data = buffer.bucket_grads(bucket)
        shard = buffer.shard_view(bucket)
        if domain.size == 1:
            shard.add_(data)
            free(data)
            return None
        source = data.to(low) if low else data
        if not self.shard:
            work = dist.all_reduce(source, group=group, async_op=async_op)
            reduction = _Reduction(work, source, source, data if low else None)
        else:
            output = buffer.own_slice(bucket, source)  # in place: this rank's own slice of the input
            work = reduce_scatter_single(output, source, group=group, async_op=async_op)
            if self.sharded_grads:
                reduction = _Reduction(work, source, output, shard, accumulate=True, release=data)
            else:
                reduction = _Reduction(work, source, output, shard if low else None)
        if work is None:
            reduction.wait()
            return None
        return reduction


class _Reduction:
    """A bucket's sum over DP in flight: holds its input and output (an async collective needs both alive until
    it completes) and, on wait(), copies the result into the fp32 `target` (or adds it, `accumulate`) unless the
    output is the target itself, then frees `release` (ZeRO-2/3's full grads of the bucket)."""

    def __init__(self, work, source: torch.Tensor, output: torch.Tensor, target: torch.Tensor | None,
                 accumulate: bool = False, release: torch.Tensor | None = None):
        self.work, self.source, self.output, self.target = work, source, output, target
        self.accumulate, self.release = accumulate, release

    def wait(self) -> None:
        if self.work is not None:
            self.work.wait()
        if self.target is not None:
            self.target.add_(self.output) if self.accumulate else self.target.copy_(self.output)
        if self.release is not None:
            free(self.release)
        self.work = self.source = self.output = self.target = self.release = None


def buffer_groups(chunks: list[nn.Module], sharding: Sharding, expert: bool | None = None) -> list[list[nn.Parameter]]:
    """The trainable parameters a grad buffer lays out range after range: each model chunk's, or under ZeRO-3
    each unit's (param_shards.py), since a unit is gathered and reduced as one bucket. `expert` False: only the
    dense ones, True: only the routed experts' (a unit's experts are a unit of their own, gathered over
    expert-DP), None: all."""
    if sharding.params:
        groups = [unit_params(modules) for chunk in chunks for modules in unit_modules(chunk)]
    else:
        groups = [list(chunk.parameters()) for chunk in chunks]
    return [[param for param in params if param.requires_grad and expert in (None, is_expert(param))]
            for params in groups]


def global_token_count(micro_batches, parallel: ParallelState, device) -> float:
    """Unmasked tokens of the whole global batch: this rank's micro-batches (the loader's, in host memory),
    summed over DP x CP (CP ranks hold different tokens of the same samples, so each token counts once); only
    that sum waits for the device."""
    count = sum(float(mb["loss_mask"].sum()) for mb in micro_batches)
    if parallel.dp_cp_size == 1:
        return count
    count = torch.tensor(count, dtype=torch.float64, device=device)
    dist.all_reduce(count, group=parallel.dp_cp_group)
    return float(count)
