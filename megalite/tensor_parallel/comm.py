"""Autograd collectives of tensor and sequence parallelism (Megatron's f and g operators), and the uneven
all-to-all of expert parallelism. TP acts on the last (hidden) dimension; SP splits the sequence of `[s, b, h]`
activations into TP equal chunks, rank r holding chunk r (the first-dim gather and reduce-scatter serve any
equal row blocks, such as the expert-parallel ranks' tokens). Every collective is the identity for a group of
one (or None) and modifies nothing a caller passes in; the same code runs on gloo and NCCL."""

import torch
import torch.distributed as dist

# torch 2.13 renamed the single-tensor collectives (the old names warn); the GPU machines' torch 2.11 has only
# the old ones. Both take (output, input, group=None, async_op=False): output size x input (gather) or input / size
# (scatter). DDP and the distributed optimizer use them too.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def group_size(group) -> int:
    """Number of ranks in `group`; 1 for None (no tensor parallelism)."""
    return 1 if group is None else dist.get_world_size(group)


def all_reduce(tensor: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """All-reduce `tensor` in place over `group` (nothing for one rank); returns it."""
    if group_size(group) > 1:
        dist.all_reduce(tensor, op=op, group=group)
    return tensor


def divide(length: int, size: int, what: str) -> int:
    """`length / size`; ValueError naming `what` when the tensor-parallel size does not divide it."""
    if length % size:
        raise ValueError(f"{what} {length} is not divisible by the tensor-parallel size {size}")
    return length // size


# The forward and backward halves of the collectives: (x, group) -> tensor, for groups of two or more.
def _identity(x: torch.Tensor, group) -> torch.Tensor:
    return x


def _all_reduce_copy(x: torch.Tensor, group) -> torch.Tensor:
    return all_reduce(x.clone(memory_format=torch.contiguous_format), group)


def _split_last_dim(x: torch.Tensor, group) -> torch.Tensor:
    width = divide(x.shape[-1], group_size(group), "last dimension")
    return x.narrow(-1, dist.get_rank(group) * width, width).contiguous()


def _gather_last_dim(x: torch.Tensor, group) -> torch.Tensor:
    # Gathered along the first dim (the one form gloo accepts), then laid side by side.
    return torch.cat(_gather_first_dim(x, group).chunk(group_size(group), dim=0), dim=-1)


def _split_first_dim(x: torch.Tensor, group) -> torch.Tensor:
    length = divide(x.shape[0], group_size(group), "sequence length")
    return x.narrow(0, dist.get_rank(group) * length, length).contiguous()


def _gather_first_dim(x: torch.Tensor, group) -> torch.Tensor:
    output = x.new_empty((group_size(group) * x.shape[0], *x.shape[1:]))
    all_gather_single(output, x.contiguous(), group=group)
    return output


def _reduce_scatter_first_dim(x: torch.Tensor, group) -> torch.Tensor:
    output = x.new_empty((divide(x.shape[0], group_size(group), "sequence length"), *x.shape[1:]))
    reduce_scatter_single(output, x.contiguous(), group=group)
    return output


class _Collective(torch.autograd.Function):
    """`forward(x, group)` in the forward, `backward(grad, group)` in the backward."""

    @staticmethod
    def forward(ctx, x, group, forward, backward):
        ctx.group, ctx.backward_fn = group, backward
        return forward(x, group)

    @staticmethod
    def backward(ctx, grad):
        return ctx.backward_fn(grad, ctx.group), None, None, None


def _collective(x: torch.Tensor, group, forward, backward) -> torch.Tensor:
    """The differentiable collective, or `x` itself when the group has one rank (TP=1)."""
    return x if group_size(group) == 1 else _Collective.apply(x, group, forward, backward)


def copy_to_tensor_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """Identity forward (every rank holds the full input), all-reduced grad backward (f in Megatron's paper)."""
    return _collective(x, group, _identity, _all_reduce_copy)


def reduce_from_tensor_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """All-reduce of the ranks' partial results forward, identity backward (g in Megatron's paper)."""
    return _collective(x, group, _all_reduce_copy, _identity)


def gather_from_tensor_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """`[*, h/tp] -> [*, h]` (all-gather, rank order); grads sliced."""
    return _collective(x, group, _gather_last_dim, _split_last_dim)


def scatter_to_sequence_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """`[s, b, h] -> [s/tp, b, h]` (this rank's chunk); grads all-gathered."""
    return _collective(x, group, _split_first_dim, _gather_first_dim)


def gather_from_sequence_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """`[s/tp, b, h] -> [s, b, h]` (all-gather); grads reduce-scattered, since the gathered output
    feeds a TP-sharded computation whose grads are partial sums over TP."""
    return _collective(x, group, _gather_first_dim, _reduce_scatter_first_dim)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """`[s, b, h] -> [s/tp, b, h]` summed over ranks (reduce-scatter); grads all-gathered."""
    return _collective(x, group, _reduce_scatter_first_dim, _gather_first_dim)


class _AllToAll(torch.autograd.Function):
    """Rows sent by `input_splits` and received by `output_splits` forward; the grads the reverse way back."""

    @staticmethod
    def forward(ctx, x, group, output_splits, input_splits):
        ctx.group, ctx.splits = group, (output_splits, input_splits)
        return _all_to_all_rows(x, group, output_splits, input_splits)

    @staticmethod
    def backward(ctx, grad):
        output_splits, input_splits = ctx.splits
        return _all_to_all_rows(grad, ctx.group, input_splits, output_splits), None, None, None


def _all_to_all_rows(x: torch.Tensor, group, output_splits: list[int], input_splits: list[int]) -> torch.Tensor:
    output = x.new_empty((sum(output_splits), *x.shape[1:]))
    # The single-tensor form: the list form with uneven sizes fails on gloo.
    dist.all_to_all_single(output, x.contiguous(), output_splits, input_splits, group=group)
    return output


def all_to_all(x: torch.Tensor, group, output_splits: list[int], input_splits: list[int]) -> torch.Tensor:
    """`[sum(input_splits), *]` -> `[sum(output_splits), *]`: the next `input_splits[r]` rows go to rank r of
    `group`, and `output_splits[r]` rows come from it, in rank order (sizes may differ and be zero); grads go
    back the reverse way. `x` itself for a group of one."""
    return x if group_size(group) == 1 else _AllToAll.apply(x, group, output_splits, input_splits)


def allreduce_sequence_parallel_grads(params, group) -> None:
    """Sum over TP, in one all-reduce, the grads (`main_grad`, else `grad`) of the parameters marked
    `sequence_parallel`: under SP each TP rank has the grad of its own s/tp tokens only."""
    if group_size(group) == 1:
        return
    grads_by_dtype: dict[torch.dtype, dict[int, torch.Tensor]] = {}
    for param in params:  # keyed by id: a parameter listed twice is summed once
        grad = getattr(param, "main_grad", None)
        grad = param.grad if grad is None else grad
        if getattr(param, "sequence_parallel", False) and grad is not None:
            grads_by_dtype.setdefault(grad.dtype, {})[id(param)] = grad
    for grads in grads_by_dtype.values():
        all_reduce_together(list(grads.values()), group)


def all_reduce_together(tensors: list[torch.Tensor], group) -> None:
    """Sum each of `tensors` (one dtype) over `group` in place, with one all-reduce for all of them."""
    if tensors and group_size(group) > 1:
        flat = all_reduce(torch.cat([tensor.reshape(-1) for tensor in tensors]), group)
        for tensor, summed in zip(tensors, flat.split([tensor.numel() for tensor in tensors])):
            tensor.copy_(summed.view_as(tensor))
