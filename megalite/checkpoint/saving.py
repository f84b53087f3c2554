"""Saving a checkpoint: every rank writes its pieces and RNG states (`write_rank_files`) and reports what
it wrote; rank 0 indexes the reports, checks that they cover every tensor and publishes (`finalize_save`).
A failed save raises `CheckpointSaveError` on every rank once rank 0 has removed the partial folder, so
the previous checkpoint stays the latest."""

import dataclasses
import os
import shutil

import torch
from safetensors import SafetensorError

from megalite.checkpoint.folder import (LATEST_FILE, STAGING_SUFFIX, checkpoint_dir, create_staging, fsync_dir,
                                        fsync_file, move_into_place, read_latest_iteration, write_latest)
from megalite.checkpoint.format import (FORMAT_VERSION, METADATA_FILE, index_pieces, metadata_text, missing_parts,
                                        write_pieces)
from megalite.checkpoint.pieces import Piece, model_pieces, optimizer_pieces
from megalite.checkpoint.rng import write_rng_state
from megalite.config import ModelConfig
from megalite.errors import UserError
from megalite.parallel_state import ONE_PROCESS, ParallelState


class CheckpointSaveError(UserError):
    """A save failed (disk full, permission denied, ...): its partial folder is gone and the
    previous checkpoint is still the latest."""


class IncompleteCheckpointError(UserError):
    """The ranks' reports leave part of a tensor unwritten: the checkpoint is not published."""


def save_checkpoint(save: str, iteration: int, model: torch.nn.Module, optimizer=None, *,
                    consumed_samples: int, model_config: ModelConfig, consumed_valid_samples: int | None = None,
                    extra: dict | None = None, rank: int = 0, parallel: ParallelState = ONE_PROCESS,
                    failed_ranks=None, gather=None, param_shards=None) -> str:
    """Save model (+ optimizer, + this rank's RNG) as `<save>/iter_XXXXXXX`; return that folder. Every rank
    calls this. `extra`: JSON that `load_checkpoint` hands back. `failed_ranks(ok)` returns the ranks whose
    step failed (default: `failed_ranks_across(parallel)`); `gather(report)` every rank's report on rank 0
    (default: `gathered_at_rank_0(parallel)`). `param_shards`: ZeRO-3's ParamShards, which hold the weights."""
    failed_ranks = failed_ranks or failed_ranks_across(parallel)
    if gather is None:
        if rank >= parallel.world_size:
            raise ValueError(f"rank {rank} saves in a world of {parallel.world_size}: pass its parallel state "
                             f"or a gather that brings every rank's report to rank 0")
        gather = gathered_at_rank_0(parallel)
    final = checkpoint_dir(save, iteration)
    staging = final + STAGING_SUFFIX

    def step(what: str, action) -> None:
        error = None
        try:
            action()
        except (OSError, SafetensorError, IncompleteCheckpointError) as caught:  # disk full, permission denied
            error = caught
        failed = failed_ranks(error is None)
        if failed:
            raise CheckpointSaveError(_save_failure(save, iteration, what, error, failed, rank)) from error

    step("create its folder", lambda: create_staging(save, staging) if rank == 0 else None)
    optim_pieces = optim_meta = None
    # What this rank holds: every one of these tensors must be covered by some rank's pieces.
    holds = {"model": list(model.state_dict()), "optimizer": []}
    if optimizer is not None:
        optim_state = optimizer.state_dict()
        optim_meta, holds["optimizer"] = optim_state["meta"], list(optim_state["tensors"])
        optim_pieces = optimizer_pieces(optim_state["tensors"], model, parallel, optim_state.get("flat_ranges"))
        if not getattr(optimizer, "distributed", False):  # each rank writes its own shards of a distributed one
            optim_pieces = _unreplicated(optim_pieces, model, parallel)
    model_part = model_pieces(model, parallel, param_shards, buffers=parallel.dp_cp_rank == 0)
    if param_shards is None:  # ZeRO-3's model pieces are this rank's own shards
        model_part = _unreplicated(model_part, model, parallel)
    report = {"holds": holds}
    step("write its files", lambda: report.update(write_rank_files(staging, rank, model_part, optim_pieces)))
    reports = gather(report)  # one gather of small metadata: file names, sizes, piece places
    header = {"iteration": iteration, "consumed_samples": consumed_samples,
              "consumed_valid_samples": consumed_valid_samples,
              "model_config": dataclasses.asdict(model_config),
              "optimizer": None if optimizer is None else {"meta": optim_meta},
              "extra": extra or {}}
    step("publish it", lambda: finalize_save(save, iteration, header, reports) if rank == 0 else None)
    return final


def _unreplicated(pieces: dict[str, list[Piece]], model: torch.nn.Module,
                  parallel: ParallelState) -> dict[str, list[Piece]]:
    """The `pieces` (named `<param name>[.<kind>]`) this rank writes of tensors that replicas hold alike: an
    expert parameter's by expert-DP rank 0 (with EP folded over DP, other DP ranks hold other experts), any
    other's and the buffers by rank 0 of DP x CP (context-parallel ranks hold the same parameters)."""
    params = dict(model.named_parameters())

    def writes(name: str) -> bool:
        param = params.get(name, params.get(name.rsplit(".", 1)[0]))
        return (parallel.expert_dp_rank if getattr(param, "expert_parallel", False) else parallel.dp_cp_rank) == 0
    return {name: name_pieces for name, name_pieces in pieces.items() if writes(name)}


def gathered_at_rank_0(parallel):
    """A `gather(report)` for `save_checkpoint`: every rank's report in rank order on rank 0 (one
    `gather_object` over the world), None on the others."""
    def gather(report: dict) -> list[dict] | None:
        if parallel.world_size == 1:
            return [report]
        reports = [None] * parallel.world_size if parallel.rank == 0 else None
        torch.distributed.gather_object(report, reports, dst=0)
        return reports
    return gather


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
    fix = "a rank saved less than it holds, which is a bug: report it with the run's flags" \
        if isinstance(error, IncompleteCheckpointError) else \
        "free disk space or fix the folder's permissions, then rerun the same command to resume"
    return f"saving checkpoint {final} failed: {cause}{removed}; {kept}; {fix}"


def begin_save(save: str, iteration: int) -> str:
    """Clear crash leftovers and create the empty staging folder of a save by one process; return its path."""
    staging = checkpoint_dir(save, iteration) + STAGING_SUFFIX
    create_staging(save, staging)
    return staging


def write_rank_files(staging: str, rank: int, model: dict[str, list[Piece]],
                     optimizer: dict[str, list[Piece]] | None = None) -> dict:
    """Write this rank's model pieces, optimizer pieces and RNG states into `staging`, fsynced. Return the
    report `finalize_save` indexes: `{"files": {file name: bytes}, "pieces": {file name: its header's
    description}}`."""
    report = {"files": {}, "pieces": {}}
    for prefix, section, pieces in (("model", "model", model), ("optim", "optimizer", optimizer)):
        if pieces is not None:
            name = f"{prefix}_{rank:05d}.safetensors"
            report["pieces"][name] = write_pieces(os.path.join(staging, name), section, pieces)
            report["files"][name] = _fsynced_size(os.path.join(staging, name))
    rng_name = f"rng_{rank:05d}.safetensors"
    write_rng_state(os.path.join(staging, rng_name))
    report["files"][rng_name] = _fsynced_size(os.path.join(staging, rng_name))
    return report


def _fsynced_size(path: str) -> int:
    fsync_file(path)
    return os.path.getsize(path)


def finalize_save(save: str, iteration: int, header: dict, reports: list[dict]) -> str:
    """Rank 0, after every rank wrote: steps 3 and 4 of docs/checkpoints.md's atomic save on the pieces that
    `reports` (every rank's `write_rank_files` report, in rank order) name, with `header`'s fields in
    metadata.json. The reports, not a listing of the folder (maybe stale on a shared filesystem), say what was
    written. IncompleteCheckpointError, publishing nothing, when the pieces leave part of a tensor uncovered."""
    final = checkpoint_dir(save, iteration)
    staging = final + STAGING_SUFFIX
    index = index_pieces(reports)
    holds = {section: {name for report in reports for name in report.get("holds", {}).get(section, [])}
             for section in index}
    missing = missing_parts(index, holds)
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise IncompleteCheckpointError(f"the pieces its {len(reports)} rank(s) wrote miss "
                                        f"{'; '.join(missing[:3])}{more}")
    # Sizes let a loader refuse a truncated or altered file before reading it.
    files = dict(sorted((name, size) for report in reports for name, size in report["files"].items()))
    metadata = {"format": "megalite", "version": FORMAT_VERSION, **header, "ranks": len(reports), "files": files,
                "tensors": index}
    with open(os.path.join(staging, METADATA_FILE), "w") as file:
        file.write(metadata_text(metadata))
        file.flush()
        os.fsync(file.fileno())
    fsync_dir(staging)
    move_into_place(staging, final)
    write_latest(save, iteration)
    return final
