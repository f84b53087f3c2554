"""A contiguous fp32 gradient buffer in buckets: every trainable parameter's `main_grad` is a view of it.

Grads accumulate in fp32 whatever the model's dtype, and DP reduction and the optimizer work on
a few flat tensors. Each model chunk is one range, its parameters in backward's (reverse) order,
cut into buckets (one collective each) of `bucket_size` elements at parameter boundaries, each
padded to a multiple of `shard_count` so that DP rank d owns shard d of every bucket.

Sharded grads (ZeRO-2/3, `sharded=True`): no whole-model buffer. Each bucket has its own full-length
`grad` tensor, with memory from the bucket's first grad of a micro-batch until its reduce-scatter
(`free`), and `shards` holds this rank's reduced shard of every bucket, one after the other, where
each micro-batch's reduction is added.

`hold_params()` lays the parameters' values out the same way (the model's dtype): each bucket's
`param` tensor holds its parameters, which become views of it, so that the distributed optimizer
all-gathers into them in place. Whole, the buckets' values are views of one tensor `param_data`;
sharded (ZeRO-3), each bucket's `param` has memory only while gathered, and `param_shards` holds this
rank's shard of every bucket, laid out like the grads' `shards`.

A model has one buffer per `GradDomain`: the dense parameters, reduced over DP, and the routed experts'
(`expert_parallel`), reduced over expert-DP (Megatron's expert_parallel_buffers).
"""

import functools
from dataclasses import dataclass, field

import torch
from torch import nn


def is_expert(param: nn.Parameter) -> bool:
    """Whether `param` belongs to the routed experts, whose grads are summed over expert-DP instead of DP."""
    return getattr(param, "expert_parallel", False)


@dataclass
class Bucket:
    """`data[start:end]` of the buffer (padding included) and the parameters in it."""

    start: int
    end: int
    params: list[nn.Parameter] = field(default_factory=list)
    grad: torch.Tensor | None = None  # sharded grads: this bucket's full grads (no memory while freed)
    param: torch.Tensor | None = None  # after hold_params(): its parameters' values, 1-D (padding included)

    def shard(self, rank: int, count: int) -> tuple[int, int]:
        """Buffer range `[start, end)` of shard `rank` of `count` equal shards."""
        size = (self.end - self.start) // count
        return self.start + rank * size, self.start + (rank + 1) * size


@dataclass(eq=False)
class GradDomain:
    """Parameters whose grads are summed over one group: the dense ones over DP, the experts' over expert-DP.
    `buffer` holds them; `size` ranks form `group` (None in a world of one), this one is `rank` of them; the
    distributed optimizer cuts each bucket into `size` shards and owns shard `rank`."""

    buffer: "GradBuffer"
    group: object
    size: int
    rank: int


class GradBuffer:
    """The buffer of `chunks` (per model chunk, its parameters; tied ones count once); bucket_size None: one
    bucket per chunk. `data` (1-D; None when sharded), `shards` (sharded only), `params` (buffer
    order), `offsets` (param -> (start, numel)), `buckets`, `numel` (unpadded), `size` (padded). After each backward
    `param.main_grad` holds its grads' sum since `zero()`, `param.grad` is None, and
    `on_grad_ready(param)` runs if set (the DDP bucket hook). shard_rank: this rank's shard. fuse_weight_grads:
    each parameter's `add_to_main_grad` lets a linear layer's backward add its weight grad into `main_grad`
    directly (Megatron's gradient-accumulation fusion); else it is None.
    """

    def __init__(self, chunks: list[list[nn.Parameter]], bucket_size: int | None = None, shard_count: int = 1,
                 shard_rank: int = 0, sharded: bool = False, fuse_weight_grads: bool = False):
        if shard_count < 1:
            raise ValueError(f"shard_count must be >= 1, got {shard_count}")
        seen: set[int] = set()
        per_chunk = [_unique_in_backward_order(params, seen) for params in chunks]
        self.params = [param for params in per_chunk for param in params]
        device = self.params[0].device if self.params else torch.device("cpu")

        self.offsets: dict[nn.Parameter, tuple[int, int]] = {}
        self.buckets: list[Bucket] = []
        start = 0
        for params in per_chunk:
            start = self._lay_out_chunk(params, start, bucket_size, shard_count)
        self.numel = sum(param.numel() for param in self.params)
        self.size = start  # padding included
        self.shard_count, self.shard_rank, self.sharded = shard_count, shard_rank, sharded
        self.data = None if sharded else torch.zeros(start, dtype=torch.float32, device=device)
        self.shards = torch.zeros(start // shard_count, device=device) if sharded else None
        self.bucket_of = {param: bucket for bucket in self.buckets for param in bucket.params}
        for bucket in self.buckets if sharded else ():
            bucket.grad = torch.empty(bucket.end - bucket.start, device=device)

        self.param_data = self.param_shards = None  # hold_params(): the parameters' values, laid out as the grads
        self.before_grad = None  # called with a bucket before a grad is added into it (DDP: wait for its reduction)
        self.on_grad_ready = None
        for param in self.params:
            offset, numel = self.offsets[param]
            bucket = self.bucket_of[param]
            whole, offset = (bucket.grad, offset - bucket.start) if sharded else (self.data, offset)
            param.main_grad = whole[offset:offset + numel].view(param.shape)
            param.register_post_accumulate_grad_hook(self._accumulate)
            # tensor_parallel/grad_accumulation.py: a linear's backward adds its weight grad into main_grad itself.
            param.add_to_main_grad = functools.partial(self.add_to_main_grad, param) if fuse_weight_grads else None
        for bucket in self.buckets if sharded else ():
            free(bucket.grad)  # after the main_grad views were cut from it

    def _lay_out_chunk(self, params: list[nn.Parameter], start: int, bucket_size: int | None, shard_count: int) -> int:
        """Place `params` from `start` in buckets; returns the end of the chunk's range."""
        bucket = Bucket(start, start)
        for i, param in enumerate(params):
            self.offsets[param] = (bucket.end, param.numel())
            bucket.end += param.numel()
            bucket.params.append(param)
            if i == len(params) - 1 or (bucket_size is not None and bucket.end - bucket.start >= bucket_size):
                bucket.end = bucket.start + -(-(bucket.end - bucket.start) // shard_count) * shard_count  # padded
                self.buckets.append(bucket)
                bucket = Bucket(bucket.end, bucket.end)
        return bucket.start

    def bucket_grads(self, bucket: Bucket) -> torch.Tensor:
        """`bucket`'s full grads, 1-D (padding included), allocated and zeroed if they were freed."""
        if not self.sharded:
            return self.data[bucket.start:bucket.end]
        if bucket.grad.untyped_storage().size() == 0:
            allocate(bucket.grad).zero_()
        return bucket.grad

    @torch.no_grad()
    def hold_params(self, sharded: bool = False) -> None:
        """Move every parameter's values into its bucket's `param` (1-D, the parameters' dtype, padding zero): the
        parameters become views of it. sharded: keep only this rank's shard of each bucket, in `param_shards`,
        and free the buckets' `param` (ZeRO-3 gathers them when they are needed)."""
        dtypes = {param.dtype for param in self.params}
        if len(dtypes) > 1:
            raise ValueError(f"the parameters of one grad buffer must share a dtype to be held together, got {dtypes}")
        dtype, device = dtypes.pop(), self.params[0].device
        self.param_data = None if sharded else torch.zeros(self.size, dtype=dtype, device=device)
        self.param_shards = torch.empty(self.size // self.shard_count, dtype=dtype, device=device) if sharded else None
        for bucket in self.buckets:
            length = bucket.end - bucket.start
            bucket.param = (torch.zeros(length, dtype=dtype, device=device) if sharded
                            else self.param_data[bucket.start:bucket.end])
            for param in bucket.params:
                offset, numel = self.offsets[param]
                values = bucket.param[offset - bucket.start:offset - bucket.start + numel]
                values.copy_(param.detach().reshape(-1))
                # `.data` of the bucket: the parameter keeps its own version counter, so refilling the bucket
                # (an all-gather) does not look like an in-place change of a tensor autograd saved.
                param.data = values.data.view(param.shape)
            if sharded:
                self.param_shard(bucket).copy_(self.own_slice(bucket, bucket.param))
                free(bucket.param)

    def own_slice(self, bucket: Bucket, values: torch.Tensor) -> torch.Tensor:
        """This rank's shard of `values`, a 1-D tensor of `bucket`'s length (its grads or its parameters): a view,
        where an in-place reduce-scatter leaves its output and an in-place all-gather takes its input."""
        low, high = bucket.shard(self.shard_rank, self.shard_count)
        return values[low - bucket.start:high - bucket.start]

    def param_shard(self, bucket: Bucket) -> torch.Tensor:
        """This rank's shard of `bucket`'s parameter values: of `param_shards` (sharded), else of `bucket.param`."""
        if self.param_shards is None:
            return self.own_slice(bucket, bucket.param)
        return self.param_shards[self._stored_shard(bucket)]

    def owned(self, rank: int | None = None):
        """Yield (bucket, param, local, in_shard) for each parameter's part inside shard `rank` (default: this
        rank's) of its bucket, one contiguous range per parameter at most: `local` its (start, end) in the
        parameter's flat values, `in_shard` the same elements' (start, end) in the bucket's shard."""
        for bucket in self.buckets:
            shard_start, shard_end = bucket.shard(self.shard_rank if rank is None else rank, self.shard_count)
            for param in bucket.params:
                start, numel = self.offsets[param]
                low, high = max(start, shard_start), min(start + numel, shard_end)
                if low < high:
                    yield bucket, param, (low - start, high - start), (low - shard_start, high - shard_start)

    def shard_view(self, bucket: Bucket) -> torch.Tensor:
        """This rank's shard of `bucket`'s grads, 1-D: where its reduce-scatter leaves them."""
        if self.sharded:
            return self.shards[self._stored_shard(bucket)]
        return self.data[slice(*bucket.shard(self.shard_rank, self.shard_count))]

    def _stored_shard(self, bucket: Bucket) -> slice:
        """Where this rank's shard of `bucket` lies in `shards` and `param_shards` (one shard per bucket, in order)."""
        return slice(bucket.start // self.shard_count, bucket.end // self.shard_count)

    def step_grads(self) -> torch.Tensor:
        """The flat tensor whose values the optimizer clips: `data`, or `shards`."""
        return self.shards if self.sharded else self.data

    def zero(self) -> None:
        """Zero every main_grad (and the padding) before the first micro-batch of an iteration."""
        if not self.sharded:
            self.data.zero_()
            return
        self.shards.zero_()
        for bucket in self.buckets:
            free(bucket.grad)

    def _accumulate(self, param: nn.Parameter) -> None:
        """Add this backward's `param.grad` (a tied weight's uses summed) into the fp32 `main_grad`; free it."""
        if param.grad is None:  # the linear's fused GEMM added it (autograd still runs the hook, with no grad)
            return
        self.add_to_main_grad(param, lambda main_grad: main_grad.add_(param.grad))

    def add_to_main_grad(self, param: nn.Parameter, add) -> None:
        """Run `add(param.main_grad)`, which adds this backward's whole grad of `param` into it in place (the hook
        above, or a linear's fused weight-grad GEMM), once its bucket can take it; then report the grad ready."""
        bucket = self.bucket_of[param]
        if self.before_grad is not None:
            self.before_grad(bucket)
        if self.sharded:
            self.bucket_grads(bucket)  # its memory exists from the bucket's first grad on
        add(param.main_grad)
        param.grad = None
        if self.on_grad_ready is not None:
            self.on_grad_ready(param)


def _unique_in_backward_order(params: list[nn.Parameter], seen: set[int]) -> list[nn.Parameter]:
    """Reverse of `params`, keeping each parameter once (at its first registration)."""
    unique = []
    for param in params:
        if id(param) in seen:
            continue
        if not param.requires_grad:
            raise ValueError("a grad buffer holds trainable parameters only; got one with requires_grad=False")
        seen.add(id(param))
        unique.append(param)
    return unique[::-1]


def allocate(tensor: torch.Tensor) -> torch.Tensor:
    """Give a `free`d tensor (and its views) memory again, uninitialised; returns it."""
    tensor.untyped_storage().resize_(tensor.numel() * tensor.element_size())
    return tensor


def free(tensor: torch.Tensor) -> None:
    """Release `tensor`'s memory but keep it and its views (empty until `untyped_storage().resize_`)."""
    tensor.untyped_storage().resize_(0)
