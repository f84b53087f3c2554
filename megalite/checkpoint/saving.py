"""Saving a checkpoint: every rank writes its pieces and RNG states (`write_rank_files`), rank 0
publishes (`finalize_save`). A failed save raises `CheckpointSaveError` on every rank once rank 0 has
removed the partial folder, so the previous checkpoint stays the latest."""

import dataclasses
import os
import shutil

import torch
from safetensors import SafetensorError

from megalite.checkpoint.folder import (LATEST_FILE, STAGING_SUFFIX, checkpoint_dir, create_staging, fsync_dir,
                                        fsync_file, move_into_place, read_latest_iteration, write_latest)
from megalite.checkpoint.format import FORMAT_VERSION, METADATA_FILE, index_pieces, metadata_text, write_pieces
from megalite.checkpoint.pieces import Piece, model_pieces, optimizer_pieces
from megalite.checkpoint.rng import write_rng_state
from megalite.config import ModelConfig
from megalite.errors import UserError
from megalite.parallel_state import ONE_PROCESS, ParallelState


class CheckpointSaveError(UserError):
    """A save failed (disk full, permission denied, ...): its partial folder is gone and the
    previous checkpoint is still the latest."""


def _no_barrier() -> None:
    pass


def save_checkpoint(save: str, iteration: int, model: torch.nn.Module, optimizer=None, *,
                    consumed_samples: int, model_config: ModelConfig, consumed_valid_samples: int | None = None,
                    extra: dict | None = None, rank: int = 0, parallel: ParallelState = ONE_PROCESS,
                    barrier=_no_barrier, failed_ranks=None) -> str:
    """Save model (+ optimizer, + this rank's RNG) as `<save>/iter_XXXXXXX`; return that folder. Every rank
    calls this. `extra`: JSON that `load_checkpoint` hands back. `failed_ranks(ok)` returns the ranks whose
    step failed (`failed_ranks_across`); without it, `barrier` syncs the ranks and each sees its own failure."""
    failed_ranks = failed_ranks or _own_failures(barrier, rank)
    final = checkpoint_dir(save, iteration)
    staging = final + STAGING_SUFFIX

    def step(what: str, action) -> None:
        error = None
        try:
            action()
        except (OSError, SafetensorError) as caught:  # disk full, permission denied, I/O error
            error = caught
        failed = failed_ranks(error is None)
        if failed:
            raise CheckpointSaveError(_save_failure(save, iteration, what, error, failed, rank)) from error

    step("create its folder", lambda: create_staging(save, staging) if rank == 0 else None)
    tp_rank, tp_size = parallel.tp_rank, parallel.tp_size
    # Data-parallel replicas hold the same model (and, without the distributed optimizer, the
    # same optimizer state): only DP rank 0 writes those; each DP rank writes its ZeRO shards.
    replica = parallel.dp_rank > 0
    sharded_model = getattr(model, "param_shards", None) is not None
    optim_pieces = optim_meta = None
    if optimizer is not None:
        optim_state = optimizer.state_dict()
        optim_meta = optim_state["meta"]
        optim_pieces = {} if replica and not getattr(optimizer, "distributed", False) else \
            optimizer_pieces(optim_state["tensors"], model, tp_rank, tp_size, optim_state.get("flat_ranges"))
    model_part = {} if replica and not sharded_model else model_pieces(model, tp_rank, tp_size)
    step("write its files", lambda: write_rank_files(staging, rank, model_part, optim_pieces))
    header = {"iteration": iteration, "consumed_samples": consumed_samples,
              "consumed_valid_samples": consumed_valid_samples,
              "model_config": dataclasses.asdict(model_config),
              "optimizer": None if optimizer is None else {"meta": optim_meta},
              "extra": extra or {}}
    step("publish it", lambda: finalize_save(save, iteration, header) if rank == 0 else None)
    return final


def failed_ranks_across(parallel):
    """A `failed_ranks(ok)` for `save_checkpoint`: the ranks whose step failed, known to every rank
    (one all-reduce of a world-size vector)."""
    def failed_ranks(ok: bool) -> list[int]:
        if parallel.world_size == 1:
            return [] if ok else [0]
        flags = torch.zeros(parallel.world_size, dtype=torch.int32, device=parallel.device)
        flags[parallel.rank] = 0 if ok else 1
        torch.distributed.all_reduce(flags)
        return [rank for rank, flag in enumerate(flags.tolist()) if flag]
    return failed_ranks


def _own_failures(barrier, rank: int):
    """`failed_ranks` for callers that only have a barrier: this rank's own failure, after the barrier."""
    def failed_ranks(ok: bool) -> list[int]:
        if ok:  # a failed rank raises at once; the others must not wait for it at a barrier
            barrier()
        return [] if ok else [rank]
    return failed_ranks


def _save_failure(save: str, iteration: int, what: str, error, failed: list[int], rank: int) -> str:
    """The one sentence a failed save reports; rank 0 removes the partial folder first."""
    final = checkpoint_dir(save, iteration)
    cause = f"could not {what} ({error})" if error is not None else \
        f"rank(s) {', '.join(map(str, failed))} could not {what} (see their error)"
    try:
        latest = read_latest_iteration(save)
    except UserError:
        latest = None
    removed = ""
    if rank == 0:
        partial = [final + STAGING_SUFFIX]
        if what == "publish it" and latest != iteration:
            partial.append(final)  # moved into place, but the latest file never named it
        for path in partial:
            shutil.rmtree(path, ignore_errors=True)
        left = [path for path in partial if os.path.exists(path)]
        removed = f"; could not remove the partial folder {left[0]}, delete it by hand" if left else \
            "; removed the partial folder"
    kept = f"{os.path.join(save, LATEST_FILE)} still names iteration {latest}, so nothing saved before is lost" \
        if latest is not None else "no earlier checkpoint exists in this folder"
    return (f"saving checkpoint {final} failed: {cause}{removed}; {kept}; free disk space or fix the folder's "
            f"permissions, then rerun the same command to resume")


def begin_save(save: str, iteration: int, rank: int = 0, barrier=_no_barrier) -> str:
    """Rank 0 clears crash leftovers and creates the empty staging folder; all ranks get its path."""
    staging = checkpoint_dir(save, iteration) + STAGING_SUFFIX
    if rank == 0:
        create_staging(save, staging)
    barrier()
    return staging


def write_rank_files(staging: str, rank: int, model: dict[str, list[Piece]],
                     optimizer: dict[str, list[Piece]] | None = None) -> None:
    """Write this rank's model pieces, optimizer pieces and RNG states into `staging`, fsynced."""
    for prefix, section, pieces in (("model", "model", model), ("optim", "optimizer", optimizer)):
        if pieces is not None:
            path = os.path.join(staging, f"{prefix}_{rank:05d}.safetensors")
            write_pieces(path, section, pieces)
            fsync_file(path)
    rng_file = os.path.join(staging, f"rng_{rank:05d}.safetensors")
    write_rng_state(rng_file)
    fsync_file(rng_file)


def finalize_save(save: str, iteration: int, header: dict) -> str:
    """Rank 0, after every rank wrote: index the pieces, write metadata.json (`header`'s fields, the
    version, every file's size and the index), publish the folder, and only then name it in the
    latest file."""
    final = checkpoint_dir(save, iteration)
    staging = final + STAGING_SUFFIX
    names = sorted(os.listdir(staging))
    ranks = sum(1 for name in names if name.startswith("rng_"))
    # Sizes let a loader refuse a truncated or altered file before reading it.
    files = {name: os.path.getsize(os.path.join(staging, name)) for name in names if name.endswith(".safetensors")}
    metadata = {"format": "megalite", "version": FORMAT_VERSION, **header, "ranks": ranks, "files": files,
                "tensors": index_pieces(staging)}
    with open(os.path.join(staging, METADATA_FILE), "w") as file:
        file.write(metadata_text(metadata))
        file.flush()
        os.fsync(file.fileno())
    fsync_dir(staging)
    move_into_place(staging, final)
    write_latest(save, iteration)
    return final
