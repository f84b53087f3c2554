"""Piece geometry: how a tensor a process holds is cut into pieces of the global tensor.

A piece is a hyper-rectangle of a global tensor with its offsets. Pieces are what make
checkpoints layout-free: every layout describes what it holds in global coordinates, so
any other layout finds the parts it needs (docs/checkpoints.md).
"""

from dataclasses import dataclass

import torch


@dataclass
class Piece:
    """A hyper-rectangle of a global tensor: `tensor` is `global[o0:o0+n0, o1:o1+n1, ...]`.

    `tensor` may be a view of a live tensor: loading copies into it, so a piece built
    from a parameter's view restores that part of the parameter.
    """

    tensor: torch.Tensor
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]

    @classmethod
    def full(cls, tensor: torch.Tensor) -> "Piece":
        """The whole tensor as one piece."""
        return cls(tensor, tuple(tensor.shape), (0,) * tensor.dim())


def tensor_parallel_pieces(tensor: torch.Tensor, param, tp_rank: int, tp_size: int,
                           local_offsets: tuple[int, ...] | None = None) -> list[Piece]:
    """Where this TP rank's local `tensor` sits in the global tensor, as pieces.

    The one place that maps a TP shard to global coordinates, from the parameter
    attributes of megalite/tensor_parallel/layers.py. A replicated parameter (or TP=1) is
    one full piece. A sharded one holds, for each of its `partition_chunks` equal blocks
    along `partition_dim`, this rank's `1/tp_size` of that block (`shard_full_tensor`).
    local_offsets: `tensor` is only the region of the local shard starting there (a
    distributed-optimizer range); None: the whole local shard.
    """
    local_shape = tuple(param.shape) if param is not None and local_offsets is not None else tuple(tensor.shape)
    local_offsets = tuple(local_offsets) if local_offsets is not None else (0,) * tensor.dim()
    sharded = tp_size > 1 and param is not None and getattr(param, "tensor_model_parallel", False)
    if not sharded:
        return [Piece(tensor, local_shape, local_offsets)]
    dim = param.partition_dim % tensor.dim()
    global_shape = list(local_shape)
    global_shape[dim] *= tp_size
    global_block = global_shape[dim] // param.partition_chunks
    local_block = local_shape[dim] // param.partition_chunks
    pieces, low, high = [], local_offsets[dim], local_offsets[dim] + tensor.shape[dim]
    for chunk in range(param.partition_chunks):
        start, stop = max(low, chunk * local_block), min(high, (chunk + 1) * local_block)
        if start >= stop:
            continue
        offsets = list(local_offsets)
        offsets[dim] = chunk * global_block + tp_rank * local_block + start - chunk * local_block
        pieces.append(Piece(tensor.narrow(dim, start - low, stop - start), tuple(global_shape), tuple(offsets)))
    return pieces


def flat_range_pieces(values: torch.Tensor, param, start: int, tp_rank: int, tp_size: int) -> list[Piece]:
    """`values` = `param`'s local flat elements `[start, start + len)` as pieces of the global tensor.

    A distributed-optimizer shard owns a contiguous range of a parameter's flattened
    local shard; split into at most three rectangles (a partial first row, whole rows,
    a partial last row), each is a view of `values` that `tensor_parallel_pieces` places.
    """
    shape = tuple(param.shape)
    if len(shape) == 1:
        return tensor_parallel_pieces(values, param, tp_rank, tp_size, (start,))
    if len(shape) != 2:
        raise ValueError(f"flat ranges of {len(shape)}-D parameters are not supported (shape {list(shape)})")
    row = shape[1]
    end, pieces, cursor = start + values.numel(), [], start
    while cursor < end:
        first_row, column = divmod(cursor, row)
        if column or end - cursor < row:  # a partial row
            stop = min(end, (first_row + 1) * row)
            region, offsets = values[cursor - start:stop - start].view(1, stop - cursor), (first_row, column)
        else:  # whole rows
            stop = (end // row) * row
            region, offsets = values[cursor - start:stop - start].view(-1, row), (first_row, 0)
        pieces += tensor_parallel_pieces(region, param, tp_rank, tp_size, offsets)
        cursor = stop
    return pieces


def model_pieces(model: torch.nn.Module, tp_rank: int = 0, tp_size: int = 1) -> dict[str, list[Piece]]:
    """Every tensor of `model.state_dict()` (full global names) as pieces of views of the live tensors.

    Under ZeRO-3 (the model has `param_shards`, megalite/data_parallel/param_shards.py) the
    parameters this rank stores: the flat ranges of its shards, views of the stored values.
    """
    shards = getattr(model, "param_shards", None)
    if shards is not None:
        names = {id(param): name for name, param in model.named_parameters()}
        return {names[id(param)]: flat_range_pieces(shards.owned_values(param, start, end), param, start,
                                                    tp_rank, tp_size)
                for param, (start, end) in shards.owned_ranges().items()}
    params = dict(model.named_parameters())
    return {name: tensor_parallel_pieces(tensor, params.get(name), tp_rank, tp_size)
            for name, tensor in model.state_dict().items()}


def optimizer_pieces(tensors: dict, model: torch.nn.Module | None = None, tp_rank: int = 0,
                     tp_size: int = 1, flat_ranges: dict[str, int] | None = None) -> dict[str, list[Piece]]:
    """The tensors of an optimizer's `state_dict()` as pieces of global tensors (views of them).

    Tensors are named `<param name>.<kind>`. A value is the whole local tensor, placed
    like its TP-sharded param of `model` (`tensor_parallel_pieces`); or, when
    `flat_ranges` maps its param name to `start`, the param's local flat elements from
    `start` on (a distributed-optimizer range, `flat_range_pieces`); or a `Piece` or a
    list of `Piece`s already placed in the global tensor.
    """
    params = dict(model.named_parameters()) if model is not None else {}
    flat_ranges = flat_ranges or {}

    def pieces(name: str, value) -> list[Piece]:
        if isinstance(value, Piece):
            return [value]
        if isinstance(value, list):
            return list(value)
        param_name = name.rsplit(".", 1)[0]
        if param_name in flat_ranges:
            return flat_range_pieces(value, params[param_name], flat_ranges[param_name], tp_rank, tp_size)
        return tensor_parallel_pieces(value, params.get(param_name), tp_rank, tp_size)

    return {name: pieces(name, value) for name, value in tensors.items()}
