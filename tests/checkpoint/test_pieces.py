"""Piece geometry: TP shards, expert-parallel experts, distributed-optimizer ranges and optimizer shards as
pieces of global tensors, read back by any layout."""

import pytest
import torch

from megalite.checkpoint import (CheckpointReader, flat_range_pieces, load_checkpoint, param_pieces, read_metadata,
                                 tensor_parallel_pieces)
from megalite.parallel_state import ParallelState
from megalite.tensor_parallel.layers import mark_parameter, shard_full_tensor
from tests.helpers.checkpoint import ShardedOptimizer, WholeOptimizer, run_ranks, save, save_pieces, small_config


def test_tensor_parallel_shards_of_chunked_weights_load_into_any_tp_size(tmp_path):
    # A SwiGLU fc1 weight [gate; up] sharded block by block over TP=2, as ColumnParallelLinear does.
    full = torch.randn(8, 3)
    shards = [shard_full_tensor(full, 0, rank, 2, chunks=2) for rank in range(2)]
    params = [mark_parameter(torch.nn.Parameter(shard), True, 0, partition_chunks=2) for shard in shards]
    pieces = [tensor_parallel_pieces(p.detach(), p, rank, 2) for rank, p in enumerate(params)]
    assert [piece.offsets for piece in pieces[1]] == [(2, 0), (6, 0)]
    path = save_pieces(tmp_path, 1, [{"fc1": rank_pieces} for rank_pieces in pieces])
    with CheckpointReader(path, read_metadata(path)) as reader:
        assert torch.equal(reader.read("model", "fc1"), full)  # TP=1
        for rank in range(4):  # TP=4: load through the same pieces, into views of an empty shard
            shard = torch.empty(2, 3)
            param = mark_parameter(torch.nn.Parameter(shard), True, 0, partition_chunks=2)
            for piece in tensor_parallel_pieces(shard, param, rank, 4):
                piece.tensor.copy_(reader.read("model", "fc1", piece.offsets, piece.tensor.shape))
            assert torch.equal(shard, shard_full_tensor(full, 0, rank, 4, chunks=2))


def test_optimizer_shards_saved_as_pieces_load_whole_and_back(tmp_path):
    values, model = torch.randn(6, 4), torch.nn.Linear(2, 2)
    run_ranks(2, lambda world: save(tmp_path, 1, model, ShardedOptimizer(world["rank"], values),
                                    config=small_config(), **world))
    whole = WholeOptimizer()
    load_checkpoint(str(tmp_path), model, whole, model_config=small_config(), load_rng=False)
    assert torch.equal(whole.moment, values)

    save(tmp_path, 2, model, WholeOptimizer(values * 2), config=small_config())
    for rank in range(2):
        shard = ShardedOptimizer(rank)
        load_checkpoint(str(tmp_path), model, shard, model_config=small_config(), load_rng=False)
        assert torch.equal(shard.shard, values[3 * rank:3 * rank + 3] * 2)


@pytest.mark.parametrize("shape, dim, chunks", [((8, 6), 0, 2), ((8, 6), 1, 1), ((8, 6), 0, 1), ((12,), 0, 1),
                                                 ((4, 8, 6), 1, 2), ((4, 8, 6), 2, 1)])  # 3-D: stacked experts
@pytest.mark.parametrize("tp_size", [1, 2])
def test_flat_range_pieces_place_every_distributed_optimizer_range_in_the_global_tensor(shape, dim, chunks, tp_size):
    """Any contiguous range of a TP shard's flattened values maps to pieces holding exactly
    those values at the right global offsets (partial rows, whole rows, chunked dims)."""
    full = torch.arange(float(torch.Size(shape).numel())).view(shape)
    for tp_rank in range(tp_size):
        local = shard_full_tensor(full, dim, tp_rank, tp_size, chunks)
        param = mark_parameter(torch.nn.Parameter(local.clone()), tp_size > 1, dim, partition_chunks=chunks)
        flat = local.reshape(-1)
        for start, end in [(0, flat.numel()), (1, 5), (3, flat.numel() - 2), (2, 3), (local.shape[-1], flat.numel()),
                           *([(5, flat.numel() - local[0].numel() - 3)] if local.dim() == 3 else [])]:  # 3-D: all kinds
            values = flat[start:end].clone()
            pieces = flat_range_pieces(values, param, start, tp_rank, tp_size)
            assert sum(piece.tensor.numel() for piece in pieces) == end - start
            for piece in pieces:  # views of `values`: loading into them fills the optimizer's state
                assert piece.tensor.untyped_storage().data_ptr() == values.untyped_storage().data_ptr()
                assert piece.global_shape == shape
                region = full[tuple(slice(o, o + n) for o, n in zip(piece.offsets, piece.tensor.shape))]
                assert torch.equal(region, piece.tensor), (start, end, piece.offsets)


@pytest.mark.parametrize("ep_size", [2, 4])
@pytest.mark.parametrize("tp_size, expert_tp_size", [(1, 1), (2, 2), (2, 1)])
@pytest.mark.parametrize("partition_dim, chunks", [(1, 2), (2, 1)])  # fc1's [gate; up] rows, fc2's columns
def test_expert_pieces_place_each_rank_s_local_experts_by_global_index(ep_size, tp_size, expert_tp_size,
                                                                       partition_dim, chunks):
    """An expert weight `[E/EP, out, in]` (its experts on dim 0, split over expert-TP as TP splits a dense one;
    whole on every TP rank at ETP 1) and any flat range of it are boxes of the global `[E, out, in]`: the
    experts of EP rank r start at r * E/EP. Together the ranks cover every element."""
    full = torch.arange(4 * 8 * 6.0).view(4, 8, 6)
    covered = torch.zeros(full.shape, dtype=torch.int)
    for ep_rank in range(ep_size):
        for tp_rank in range(tp_size):
            parallel = ParallelState(tp_size=tp_size, tp_rank=tp_rank, ep_size=ep_size, ep_rank=ep_rank,
                                     expert_tp_size=expert_tp_size)
            local = shard_full_tensor(full.chunk(ep_size)[ep_rank], partition_dim, parallel.expert_tp_rank,
                                      expert_tp_size, chunks)
            param = mark_parameter(torch.nn.Parameter(local.clone()), expert_tp_size > 1, partition_dim,
                                   partition_chunks=chunks)
            param.expert_parallel = True
            flat = local.reshape(-1)
            ranges = [(0, flat.numel()), (1, flat.numel() - 3), (local[0].numel() + 2, flat.numel()), (5, 6)]
            for start, end in [(None, None), *ranges]:
                values = local if start is None else flat[start:end]
                pieces = param_pieces(values, param, parallel, start)
                assert sum(piece.tensor.numel() for piece in pieces) == values.numel()
                for piece in pieces:
                    assert piece.global_shape == tuple(full.shape)
                    region = tuple(slice(o, o + n) for o, n in zip(piece.offsets, piece.tensor.shape))
                    assert torch.equal(full[region], piece.tensor), (ep_rank, tp_rank, start, piece.offsets)
                    if start is None:
                        covered[region] += 1
    assert torch.equal(covered, torch.full(full.shape, tp_size // expert_tp_size, dtype=torch.int))
