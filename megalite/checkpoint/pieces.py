"""Piece geometry: what a process holds, as pieces of global tensors, so that any other layout
finds the parts it needs."""

import math
from dataclasses import dataclass

import torch

from megalite.parallel_state import ParallelState


@dataclass
class Piece:
    """`tensor` is `global[o0:o0+n0, o1:o1+n1, ...]` of a tensor of `global_shape`. It may be a view of
    a live tensor: loading copies into it, restoring that part of the parameter."""

    tensor: torch.Tensor
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]

    @classmethod
    def full(cls, tensor: torch.Tensor) -> "Piece":
        """The whole tensor as one piece."""
        return cls(tensor, tuple(tensor.shape), (0,) * tensor.dim())


def tensor_parallel_pieces(tensor: torch.Tensor, param, tp_rank: int, tp_size: int,
                           local_offsets: tuple[int, ...] | None = None) -> list[Piece]:
    """Where this TP rank's local `tensor` sits in the global tensor. A sharded `param` (attributes of
    tensor_parallel/layers.py) holds this rank's 1/tp_size of each of its `partition_chunks` blocks along
    `partition_dim`. `local_offsets`: `tensor` is only the part of the local shard starting there."""
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
    """`values`, `param`'s local flat elements `[start, start + len)` (a distributed-optimizer range), as boxes
    of the global tensor: along each dimension at most a partial first block, whole blocks and a partial last
    block (2-D: a partial first row, whole rows, a partial last row)."""
    return [piece for region, offsets in _flat_boxes(values, tuple(param.shape), start)
            for piece in tensor_parallel_pieces(region, param, tp_rank, tp_size, offsets)]


def expert_parallel_pieces(pieces: list[Piece], ep_rank: int, ep_size: int) -> list[Piece]:
    """`pieces` of an expert parameter's local experts (dim 0, `E/ep_size` of them, model/moe.py) placed among
    all `E`: EP rank `ep_rank` holds the global experts `[ep_rank * E/ep_size, (ep_rank + 1) * E/ep_size)`."""
    if ep_size == 1:
        return pieces
    return [Piece(piece.tensor, (piece.global_shape[0] * ep_size, *piece.global_shape[1:]),
                  (ep_rank * piece.global_shape[0] + piece.offsets[0], *piece.offsets[1:])) for piece in pieces]


def param_pieces(tensor: torch.Tensor, param, parallel: ParallelState, flat_start: int | None = None) -> list[Piece]:
    """Where this rank's `tensor` of `param` (its local value, or a state of the same shape; with `flat_start`,
    its local flat elements from there on) sits in the global tensor: the one rule every checkpointed tensor
    follows. An expert parameter (`expert_parallel`) splits over the expert-TP ranks, then over EP on dim 0;
    any other over TP. `param` None: a buffer, whole on every rank."""
    expert = getattr(param, "expert_parallel", False)
    tp_rank, tp_size = (parallel.expert_tp_rank, parallel.expert_tp_size) if expert else \
        (parallel.tp_rank, parallel.tp_size)
    pieces = tensor_parallel_pieces(tensor, param, tp_rank, tp_size) if flat_start is None else \
        flat_range_pieces(tensor, param, flat_start, tp_rank, tp_size)
    return expert_parallel_pieces(pieces, parallel.ep_rank, parallel.ep_size) if expert else pieces


def _flat_boxes(values: torch.Tensor, shape: tuple[int, ...], start: int) -> list[tuple[torch.Tensor, tuple]]:
    """(view of `values`, its offsets) boxes covering the flat elements `[start, start + len)` of a C-ordered
    tensor of `shape`."""
    if len(shape) == 1:
        return [(values, (start,))]
    inner = math.prod(shape[1:])
    end, boxes, cursor = start + values.numel(), [], start
    while cursor < end:
        block, within = divmod(cursor, inner)
        if within or end - cursor < inner:  # part of one block: its own boxes, one block deep
            stop = min(end, (block + 1) * inner)
            boxes += [(region.unsqueeze(0), (block, *offsets))
                      for region, offsets in _flat_boxes(values[cursor - start:stop - start], shape[1:], within)]
        else:  # whole blocks
            stop = (end // inner) * inner
            boxes.append((values[cursor - start:stop - start].view(-1, *shape[1:]), (block,) + (0,) * len(shape[1:])))
        cursor = stop
    return boxes


def model_pieces(model: torch.nn.Module, parallel: ParallelState, param_shards=None,
                 buffers: bool = True) -> dict[str, list[Piece]]:
    """Every tensor of `model.state_dict()` (global names) as pieces of views of the live tensors; under
    ZeRO-3 (`param_shards`, data_parallel/param_shards.py) the flat ranges of this rank's shards, and the
    buffers (an MoE router's expert bias), which every rank holds whole, unless `buffers` is False."""
    params = dict(model.named_parameters())
    if param_shards is not None:
        names, shards = {id(param): name for name, param in params.items()}, param_shards
        pieces = {names[id(param)]: param_pieces(shards.owned_values(param, start, end), param, parallel, start)
                  for _, param, (start, end), _ in shards.owned()}
        if buffers:
            pieces.update({name: [Piece.full(tensor)] for name, tensor in model.state_dict().items()
                           if name not in params})
        return pieces
    return {name: param_pieces(tensor, params.get(name), parallel) for name, tensor in model.state_dict().items()}


def optimizer_pieces(tensors: dict, model: torch.nn.Module, parallel: ParallelState,
                     flat_ranges: dict[str, int] | None) -> dict[str, list[Piece]]:
    """The tensors of an optimizer's `state_dict()`, named `<param name>.<kind>`, as pieces: a `Piece`
    as it is, a flat range from `flat_ranges[param name]` on, or a local tensor placed like its param."""
    params, flat_ranges, pieces = dict(model.named_parameters()), flat_ranges or {}, {}
    for name, value in tensors.items():
        param_name = name.rsplit(".", 1)[0]
        pieces[name] = [value] if isinstance(value, Piece) else \
            param_pieces(value, params.get(param_name), parallel, flat_ranges.get(param_name))
    return pieces


def first_gap(global_shape, boxes) -> tuple[list[int], list[int]] | None:
    """The first box (offsets, shape) of a tensor of `global_shape` that none of `boxes` ((offsets, shape)
    pairs; they may overlap) covers, or None when they cover every element. The boxes' edges cut each
    dimension into intervals, so each cell of that grid lies wholly inside a box or wholly outside all."""
    edges = [sorted({0, size, *(offsets[dim] for offsets, _ in boxes),
                     *(offsets[dim] + shape[dim] for offsets, shape in boxes)})
             for dim, size in enumerate(global_shape)]
    cell_of = [{edge: number for number, edge in enumerate(dim_edges)} for dim_edges in edges]
    covered = torch.zeros([len(dim_edges) - 1 for dim_edges in edges], dtype=torch.bool)
    for offsets, shape in boxes:
        covered[tuple(slice(cells[offset], cells[offset + size])
                      for cells, offset, size in zip(cell_of, offsets, shape))] = True
    gaps = (~covered).nonzero()
    if not len(gaps):
        return None
    cell = gaps[0].tolist()
    return ([dim_edges[i] for dim_edges, i in zip(edges, cell)],
            [dim_edges[i + 1] - dim_edges[i] for dim_edges, i in zip(edges, cell)])
