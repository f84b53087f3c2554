"""A contiguous fp32 gradient buffer in buckets: every trainable parameter's `main_grad` is a view of it.

Why one buffer: gradients accumulate over micro-batches in fp32 whatever the model's
dtype, no per-parameter `.grad` outlives its micro-batch, and data-parallel reduction
and the optimizer's elementwise work (unscale, clip) run on a few large flat tensors.

Layout, for the parameters of each model chunk in turn (a chunk's grads are one
contiguous range):

- parameters in reverse registration order, the order backward produces their
  gradients, so the first bucket fills first;
- cut into buckets at parameter boundaries once a bucket holds `bucket_size` elements
  (Megatron's --ddp-bucket-size); a bucket is the unit one collective reduces;
- each bucket zero-padded to a multiple of `shard_count` (the data-parallel size), so
  it splits into equal contiguous shards: DP rank d owns shard d of every bucket (the
  distributed optimizer's ownership, and the reduce-scatter's output).

Sharded grads (ZeRO-2 and 3, `sharded=True`): there is no whole-model buffer. Each bucket
has its own full-length `grad` tensor whose memory exists only from the bucket's first
gradient of an iteration until its reduce-scatter (`free`), and `shards` holds this rank's
reduced shard of every bucket, one after the other.
"""

from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass
class Bucket:
    """`data[start:end]` of the buffer (padding included) and the parameters in it."""

    start: int
    end: int
    params: list[nn.Parameter] = field(default_factory=list)
    grad: torch.Tensor | None = None  # sharded grads only: this bucket's full grads (freed when empty)
    shard_offset: int = 0  # sharded grads only: where this rank's shard sits in `GradBuffer.shards`

    def shard(self, rank: int, count: int) -> tuple[int, int]:
        """Buffer range `[start, end)` of shard `rank` of `count` equal shards."""
        size = (self.end - self.start) // count
        return self.start + rank * size, self.start + (rank + 1) * size


class GradBuffer:
    """The fp32 buffer holding every trainable parameter's gradient (`param.main_grad`).

    chunks: lists of parameters, one per model chunk, in registration order; duplicates
    (tied weights) count once. dtype: of the buffer (fp32: gradients accumulate in fp32
    for bf16/fp16 models too). bucket_size: elements per bucket before it is closed
    (None: one bucket per chunk). shard_count: each bucket's length is rounded up to a
    multiple of this. shard_rank: this rank's shard (reduce-scatter output, optimizer
    ownership). sharded: ZeRO-2/3 grads (module docstring).

    Attributes: `data` (the flat buffer, 1-D; None when sharded), `shards` (this rank's
    shard of every bucket, 1-D; sharded only), `params` (buffer order), `offsets` (param ->
    (start, numel) in buffer coordinates), `buckets`, `numel` (unpadded parameter count).
    After each backward, `param.main_grad` (shaped like the param) holds the sum of its
    gradients since the last `zero()`, and `param.grad` is None; `on_grad_ready(param)`,
    if set, runs after each such accumulation (the DDP bucket hook).
    """

    def __init__(self, chunks: list[list[nn.Parameter]], dtype: torch.dtype = torch.float32,
                 bucket_size: int | None = None, shard_count: int = 1, shard_rank: int = 0, sharded: bool = False):
        if shard_count < 1:
            raise ValueError(f"shard_count must be >= 1, got {shard_count}")
        if bucket_size is not None and bucket_size < 1:
            raise ValueError(f"bucket_size must be >= 1, got {bucket_size}")
        seen: set[int] = set()
        per_chunk = [_unique_in_backward_order(params, seen) for params in chunks]
        self.params = [param for params in per_chunk for param in params]
        devices = {param.device for param in self.params}
        if len(devices) > 1:
            raise ValueError(f"the parameters of one grad buffer must share a device, got {devices}")
        device = devices.pop() if devices else torch.device("cpu")

        self.offsets: dict[nn.Parameter, tuple[int, int]] = {}
        self.buckets: list[Bucket] = []
        start = 0
        for params in per_chunk:
            start = self._lay_out_chunk(params, start, bucket_size, shard_count)
        self.numel = sum(param.numel() for param in self.params)
        self.shard_count, self.shard_rank, self.sharded = shard_count, shard_rank, sharded
        self.data = None if sharded else torch.zeros(start, dtype=dtype, device=device)
        self.shards = torch.zeros(start // shard_count, dtype=dtype, device=device) if sharded else None
        self.bucket_of = {param: bucket for bucket in self.buckets for param in bucket.params}
        offset = 0
        for bucket in self.buckets if sharded else ():
            bucket.grad = torch.empty(bucket.end - bucket.start, dtype=dtype, device=device)
            bucket.shard_offset, offset = offset, offset + (bucket.end - bucket.start) // shard_count

        self.on_grad_ready = None
        self._hooks = []
        for param in self.params:
            param.main_grad = self.view(param)
            self._hooks.append(param.register_post_accumulate_grad_hook(self._accumulate))
        for bucket in self.buckets if sharded else ():
            free(bucket.grad)  # after the views above were cut from it

    def _lay_out_chunk(self, params: list[nn.Parameter], start: int, bucket_size: int | None,
                       shard_count: int) -> int:
        """Place `params` from `start` in buckets; returns the end of the chunk's range."""
        bucket = Bucket(start, start)
        for param in params:
            self.offsets[param] = (bucket.end, param.numel())
            bucket.end += param.numel()
            bucket.params.append(param)
            if bucket_size is not None and bucket.end - bucket.start >= bucket_size:
                start = self._close(bucket, shard_count)
                bucket = Bucket(start, start)
        if bucket.params:
            start = self._close(bucket, shard_count)
        return start

    def _close(self, bucket: Bucket, shard_count: int) -> int:
        bucket.end = bucket.start + -(-(bucket.end - bucket.start) // shard_count) * shard_count
        self.buckets.append(bucket)
        return bucket.end

    def view(self, param: nn.Parameter) -> torch.Tensor:
        """The slice of the buffer that holds `param`'s gradient, shaped like `param`."""
        start, numel = self.offsets[param]
        if not self.sharded:
            return self.data[start:start + numel].view(param.shape)
        bucket = self.bucket_of[param]
        return bucket.grad[start - bucket.start:start - bucket.start + numel].view(param.shape)

    def bucket_grads(self, bucket: Bucket) -> torch.Tensor:
        """`bucket`'s full grads, 1-D (padding included), allocated and zeroed if they were freed."""
        if not self.sharded:
            return self.data[bucket.start:bucket.end]
        if bucket.grad.untyped_storage().size() == 0:
            bucket.grad.untyped_storage().resize_(bucket.grad.numel() * bucket.grad.element_size())
            bucket.grad.zero_()
        return bucket.grad

    def shard_view(self, bucket: Bucket) -> torch.Tensor:
        """This rank's shard of `bucket`'s grads, 1-D: where the reduce-scatter leaves them."""
        size = (bucket.end - bucket.start) // self.shard_count
        if self.sharded:
            return self.shards[bucket.shard_offset:bucket.shard_offset + size]
        start = bucket.start + self.shard_rank * size
        return self.data[start:start + size]

    def step_grads(self) -> torch.Tensor:
        """The flat tensor whose values the optimizer reads (unscale, clip): `data`, or `shards`."""
        return self.shards if self.sharded else self.data

    def zero(self) -> None:
        """Zero every main_grad (and the padding) before the first micro-batch of an iteration."""
        if not self.sharded:
            self.data.zero_()
            return
        self.shards.zero_()
        for bucket in self.buckets:
            free(bucket.grad)

    def remove_hooks(self) -> None:
        """Stop accumulating into this buffer: later backwards leave grads in `param.grad`."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def _accumulate(self, param: nn.Parameter) -> None:
        """Add this backward's `param.grad` (any dtype) into the fp32 `main_grad`; free `.grad`.

        Runs once per backward per parameter, after autograd has summed every use of it
        (a tied weight's two uses arrive as one gradient).
        """
        if self.sharded:
            self.bucket_grads(self.bucket_of[param])  # its memory exists from the first grad on
        param.main_grad.add_(param.grad)
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


def free(tensor: torch.Tensor) -> None:
    """Release `tensor`'s memory but keep the tensor and its views (their storage is empty until
    it is allocated again with `untyped_storage().resize_`)."""
    tensor.untyped_storage().resize_(0)
