"""Autograd collectives of tensor and sequence parallelism (Megatron's f and g operators).

Each collective is a small autograd Function whose docstring says what happens forward
and backward; the lower-case wrappers are what layers call. Every one is the identity
when `group` is None or has one rank, so TP=1 code runs no collective at all.

Tensor parallelism acts on the last (hidden) dimension, sequence parallelism on the
first: activations are `[s, b, h]` and SP splits `s` into TP equal chunks, rank r
holding chunk r.

The same code runs on gloo (CPU) and NCCL (CUDA): torch 2.13's gloo implements every
collective used here (all_reduce with SUM and MAX, all_gather_single and
reduce_scatter_single, which older torch called all_gather_into_tensor and
reduce_scatter_tensor), so no emulation is needed. Collectives need contiguous
tensors; inputs are made contiguous here, and nothing a caller passes in (forward
input or incoming grad) is modified in place.
"""

import torch
import torch.distributed as dist

# torch 2.13 renamed the single-tensor collectives; the old names still work but warn. Public:
# DDP reduce-scatters grad buckets and the distributed optimizer all-gathers params with them.
# (output, input, group=None, async_op=False), as torch's: output is size x input, or input / size.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def group_size(group) -> int:
    """Number of ranks in `group`; 1 for None (no tensor parallelism)."""
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group) -> int:
    """This process's rank in `group`; 0 for None."""
    return 0 if group is None else dist.get_rank(group)


def all_reduce(tensor: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """All-reduce `tensor` in place over `group` (nothing for one rank); returns it."""
    if group_size(group) > 1:
        dist.all_reduce(tensor, op=op, group=group)
    return tensor


# The helpers below run inside the Functions, which only the wrappers at the end call, and
# those only for groups of two or more ranks.


def _all_reduce_copy(x: torch.Tensor, group) -> torch.Tensor:
    return all_reduce(x.clone(memory_format=torch.contiguous_format), group)


def _chunk_size(length: int, size: int, what: str) -> int:
    if length % size:
        raise ValueError(f"{what} {length} is not divisible by the tensor-parallel size {size}")
    return length // size


def _split_last_dim(x: torch.Tensor, group) -> torch.Tensor:
    size = group_size(group)
    width = _chunk_size(x.shape[-1], size, "last dimension")
    return x.narrow(-1, group_rank(group) * width, width).contiguous()


def _gather_last_dim(x: torch.Tensor, group) -> torch.Tensor:
    size = group_size(group)
    # Gathered along the first dim (the one form gloo accepts), then laid side by side.
    return torch.cat(_gather_first_dim(x, group).chunk(size, dim=0), dim=-1)


def _split_first_dim(x: torch.Tensor, group) -> torch.Tensor:
    size = group_size(group)
    length = _chunk_size(x.shape[0], size, "sequence length")
    return x.narrow(0, group_rank(group) * length, length).contiguous()


def _gather_first_dim(x: torch.Tensor, group) -> torch.Tensor:
    size = group_size(group)
    output = x.new_empty((size * x.shape[0], *x.shape[1:]))
    all_gather_single(output, x.contiguous(), group=group)
    return output


def _reduce_scatter_first_dim(x: torch.Tensor, group) -> torch.Tensor:
    size = group_size(group)
    length = _chunk_size(x.shape[0], size, "sequence length")
    output = x.new_empty((length, *x.shape[1:]))
    reduce_scatter_single(output, x.contiguous(), group=group)
    return output


class _CopyToTensorParallelRegion(torch.autograd.Function):
    """Forward: identity (every rank already holds the full input).

    Backward: all-reduce (sum) the grad, since each rank's partial computation
    contributed only part of the input's gradient.
    """

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce_copy(grad, ctx.group), None


class _ReduceFromTensorParallelRegion(torch.autograd.Function):
    """Forward: all-reduce (sum) the partial results of every rank.

    Backward: identity (the summed output's grad is every rank's partial's grad).
    """

    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce_copy(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToTensorParallelRegion(torch.autograd.Function):
    """Forward: keep this rank's slice of the last dimension `[*, h] -> [*, h/tp]`.

    Backward: all-gather the grad slices along the last dimension `[*, h/tp] -> [*, h]`.
    """

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_last_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_last_dim(grad, ctx.group), None


class _GatherFromTensorParallelRegion(torch.autograd.Function):
    """Forward: all-gather the slices along the last dimension `[*, h/tp] -> [*, h]`.

    Backward: keep this rank's slice of the grad `[*, h] -> [*, h/tp]`.
    """

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_last_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _split_last_dim(grad, ctx.group), None


class _ScatterToSequenceParallelRegion(torch.autograd.Function):
    """Forward: keep this rank's chunk of the sequence `[s, b, h] -> [s/tp, b, h]`.

    Backward: all-gather the grad chunks along the sequence `[s/tp, b, h] -> [s, b, h]`.
    """

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_first_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_first_dim(grad, ctx.group), None


class _GatherFromSequenceParallelRegion(torch.autograd.Function):
    """Forward: all-gather the sequence chunks `[s/tp, b, h] -> [s, b, h]`.

    Backward: reduce-scatter the grad `[s, b, h] -> [s/tp, b, h]`: the gathered output
    feeds a TP-sharded computation, so each rank's grad is a partial sum over TP.
    """

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_first_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_first_dim(grad, ctx.group), None


class _ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    """Forward: sum the ranks' partial results and keep this rank's sequence chunk
    `[s, b, h] -> [s/tp, b, h]` (reduce-scatter).

    Backward: all-gather the grad chunks along the sequence `[s/tp, b, h] -> [s, b, h]`.
    """

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter_first_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_first_dim(grad, ctx.group), None


def _unless_single_rank(function, x: torch.Tensor, group) -> torch.Tensor:
    """`function.apply(x, group)`, or `x` itself when the group has one rank (TP=1)."""
    return x if group_size(group) == 1 else function.apply(x, group)


def copy_to_tensor_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """Identity forward, all-reduced grad backward (f in Megatron's paper)."""
    return _unless_single_rank(_CopyToTensorParallelRegion, x, group)


def reduce_from_tensor_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """All-reduce forward, identity backward (g in Megatron's paper)."""
    return _unless_single_rank(_ReduceFromTensorParallelRegion, x, group)


def scatter_to_tensor_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """`[*, h] -> [*, h/tp]` (this rank's slice); grads all-gathered."""
    return _unless_single_rank(_ScatterToTensorParallelRegion, x, group)


def gather_from_tensor_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """`[*, h/tp] -> [*, h]` (all-gather, rank order); grads sliced."""
    return _unless_single_rank(_GatherFromTensorParallelRegion, x, group)


def scatter_to_sequence_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """`[s, b, h] -> [s/tp, b, h]` (this rank's chunk); grads all-gathered."""
    return _unless_single_rank(_ScatterToSequenceParallelRegion, x, group)


def gather_from_sequence_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """`[s/tp, b, h] -> [s, b, h]` (all-gather); grads reduce-scattered."""
    return _unless_single_rank(_GatherFromSequenceParallelRegion, x, group)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """`[s, b, h] -> [s/tp, b, h]` summed over ranks (reduce-scatter); grads all-gathered."""
    return _unless_single_rank(_ReduceScatterToSequenceParallelRegion, x, group)


def allreduce_sequence_parallel_grads(params, group) -> None:
    """Sum over TP the grads of the parameters marked `sequence_parallel` (under SP only).

    Under sequence parallelism a replicated parameter that acts on sequence-split
    activations (norm weights and biases, row-parallel biases) gets on each TP rank the
    grad of its own s/tp tokens only; the true grad is their sum. Works on
    `param.main_grad` (the fp32 grad buffer) when the parameter has one, else on
    `param.grad`; parameters without either are skipped. One all-reduce for all.

    When: once per iteration, after the backward of the last micro-batch and before
    grad clipping and the optimizer step; the DDP's finish_grad_sync calls it last, after
    the data-parallel reduction, as Megatron does (the TP and DP sums commute). Without
    SP these grads are already complete and identical on every TP rank: do not call it.
    """
    if group_size(group) == 1:
        return
    grads_by_dtype: dict[torch.dtype, dict[int, torch.Tensor]] = {}
    for param in params:
        if not getattr(param, "sequence_parallel", False):
            continue
        grad = getattr(param, "main_grad", None)
        grad = param.grad if grad is None else grad
        if grad is not None:  # keyed by id: a parameter listed twice is summed once
            grads_by_dtype.setdefault(grad.dtype, {})[id(param)] = grad
    for grads in grads_by_dtype.values():
        grads = list(grads.values())
        flat = all_reduce(torch.cat([grad.reshape(-1) for grad in grads]), group)
        for grad, summed in zip(grads, flat.split([grad.numel() for grad in grads])):
            grad.copy_(summed.view_as(grad))
