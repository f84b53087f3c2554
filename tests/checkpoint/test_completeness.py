"""A checkpoint is indexed from what every rank reports it wrote, never from rank 0's listing of the
folder, and is published only when its pieces cover every tensor: on a shared filesystem rank 0's
listing may be stale, and a checkpoint published without another rank's pieces would let
--keep-last-n-checkpoints delete the last good one."""

import os

import pytest
import torch

from megalite.arguments import parse_args
from megalite.checkpoint import (STAGING_SUFFIX, Checkpointer, CheckpointSaveError, Piece, begin_save, finalize_save,
                                 load_checkpoint, read_latest_iteration, read_metadata, save_checkpoint, saving,
                                 write_rank_files)
from megalite.checkpoint.pieces import first_gap
from megalite.checkpoint.saving import IncompleteCheckpointError
from megalite.data_parallel.ddp import ParallelModel
from megalite.parallel_state import ParallelState
from megalite.run.lr_schedule import LRSchedule
from megalite.run.training import TrainState
from tests.helpers.checkpoint import ShardedOptimizer, WholeOptimizer, small_config
from tests.helpers.distributed import run_world

VALUES = torch.arange(24, dtype=torch.float32).view(6, 4)  # the moment whose rows [3r, 3r+3) rank r holds


def test_first_gap_finds_what_overlapping_pieces_leave_uncovered():
    halves = [((0, 0), (3, 4)), ((3, 0), (3, 4))]
    assert first_gap((6, 4), halves) is None
    assert first_gap((6, 4), halves[:1]) == ([3, 0], [3, 4])
    # A tied embedding on two pipeline stages, each cut into flat ranges at other places: overlaps are fine.
    stage_0 = [((0, 0), (1, 4)), ((1, 0), (1, 3)), ((1, 3), (1, 1)), ((2, 0), (4, 4))]
    stage_1 = [((0, 0), (2, 2)), ((2, 2), (4, 2))]
    assert first_gap((6, 4), stage_0 + stage_1) is None
    assert first_gap((6, 4), stage_1) == ([0, 2], [2, 2])
    assert first_gap((), [((), ())]) is None and first_gap((), []) == ([], [])
    assert first_gap((5,), []) == ([0], [5])


def linear() -> torch.nn.Module:
    """The replicated model beside the sharded moment: the same weights on every rank."""
    torch.manual_seed(0)
    return torch.nn.Linear(2, 2)


def tp_rank_state(rank: int, world_size: int) -> ParallelState:
    """Two TP ranks in a gloo world: each writes its own half of the optimizer's moment."""
    return ParallelState(rank=rank, world_size=world_size, tp_size=world_size, tp_rank=rank)


def stale_listing_world(rank, world_size, folder):
    if rank == 0:  # rank 0's view of the shared folder does not show rank 1's files yet
        real_listdir = os.listdir
        os.listdir = lambda path: [name for name in real_listdir(path) if "_00001." not in name] \
            if str(path).endswith(STAGING_SUFFIX) else real_listdir(path)
    parallel = tp_rank_state(rank, world_size)
    save_checkpoint(folder, 1, linear(), ShardedOptimizer(rank, VALUES), consumed_samples=0,
                    model_config=small_config(), rank=rank, parallel=parallel,
                    failed_ranks=saving.failed_ranks_across(parallel))


def test_the_index_holds_every_rank_s_files_though_rank_0_cannot_list_them(tmp_path):
    run_world(2, stale_listing_world, str(tmp_path))
    metadata = read_metadata(str(tmp_path / "iter_0000001"))
    assert sorted(metadata["files"]) == [f"{kind}_{rank:05d}.safetensors" for kind in ("model", "optim", "rng")
                                         for rank in range(2)]
    assert metadata["ranks"] == 2
    model, whole = torch.nn.Linear(2, 2), WholeOptimizer()
    load_checkpoint(str(tmp_path), model, whole, model_config=small_config(), rank=1)
    assert torch.equal(whole.moment, VALUES)
    assert all(torch.equal(model.state_dict()[name], value) for name, value in linear().state_dict().items())


def run_config(folder: str, world_size: int):
    return parse_args(["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "99", "--num-layers",
                       "1", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
                       "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "4",
                       "--save", folder, "--keep-last-n-checkpoints", "1"], world_size=world_size)


def missing_piece_world(rank, world_size, folder):
    run = run_config(folder, world_size)
    checkpointer = Checkpointer(run, tp_rank_state(rank, world_size), log=lambda line: None)
    model, optimizer = ParallelModel(linear()), ShardedOptimizer(rank, VALUES)
    schedule = LRSchedule(**run.train.lr_schedule_settings())
    checkpointer.save(TrainState(iteration=1), model, optimizer, schedule)
    if rank == 1:  # a rank that saves less than it holds: its half of the moment is never written
        saving.optimizer_pieces = lambda *args: {}
    try:
        checkpointer.save(TrainState(iteration=2), model, optimizer, schedule)
    except CheckpointSaveError as error:
        return str(error)
    return None


def test_a_checkpoint_missing_a_rank_s_piece_is_refused_and_retention_keeps_the_last_good_one(tmp_path):
    messages = run_world(2, missing_piece_world, str(tmp_path))
    assert messages[0] is not None and messages[1] is not None, "the incomplete checkpoint was published"
    assert f"saving checkpoint {tmp_path / 'iter_0000002'} failed: could not publish it (the pieces its 2 rank(s) " \
           f"wrote miss part of optimizer tensor 'w.exp_avg' of shape [6, 4] (offsets [3, 0], shape [3, 4]))" \
           in messages[0]
    assert "still names iteration 1" in messages[0] and "rank(s) 0 could not publish it" in messages[1]
    assert read_latest_iteration(str(tmp_path)) == 1
    assert sorted(os.listdir(tmp_path)) == ["iter_0000001", "latest_checkpointed_iteration.txt"]
    whole = WholeOptimizer()
    load_checkpoint(str(tmp_path), linear(), whole, model_config=run_config(str(tmp_path), 2).model, load_rng=False)
    assert torch.equal(whole.moment, VALUES)


def test_finalize_refuses_reports_without_a_tensor_a_rank_holds(tmp_path):
    staging = begin_save(str(tmp_path), 1)
    reports = [write_rank_files(staging, rank, {"w": [Piece(VALUES[3 * rank:3 * rank + 3], (6, 4), (3 * rank, 0))]})
               for rank in range(2)]
    reports[1]["holds"] = {"model": ["w", "b"]}  # rank 1 holds "b" too, but wrote no piece of it
    with pytest.raises(IncompleteCheckpointError, match=r"its 2 rank\(s\) wrote miss all of model tensor 'b'"):
        finalize_save(str(tmp_path), 1, {"iteration": 1, "model_config": {}, "extra": {}}, reports)
    assert read_latest_iteration(str(tmp_path)) is None and not (tmp_path / "iter_0000001").exists()
