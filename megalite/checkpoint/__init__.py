"""Layout-free, atomic, pickle-free checkpoints that resume a run exactly.

On disk (see docs/checkpoints.md):

    <save>/latest_checkpointed_iteration.txt   the iteration number as text (Megatron's file)
    <save>/iter_0000100/
        metadata.json             version, iteration, consumed samples, model config, `extra`,
                                  optimizer meta, and the tensor index
        model_00000.safetensors   model tensor pieces written by rank 0 (one file per rank)
        optim_00000.safetensors   optimizer tensor pieces written by rank 0
        rng_00000.safetensors     rank 0's RNG states (python, numpy, torch CPU, CUDA)

A tensor is stored as *pieces*: hyper-rectangles of the global tensor, each with its
offsets, so any layout reads any slice it needs from whichever files hold it.

One concern per module:

    pieces.py        piece geometry: how a tensor a process holds is cut into global pieces
    format.py        safetensors files and metadata.json: writing, indexing, CheckpointReader
    folder.py        the folder protocol: staging, atomic publish, latest file, choosing, retention
    rng.py           RNG states
    saving.py        save_checkpoint (and its steps begin_save, write_rank_files, finalize_save)
    loading.py       load_checkpoint
    checkpointer.py  Checkpointer: a run's policy (what to load, when to save, what to remove)
"""

from megalite.checkpoint.checkpointer import Checkpointer, Resumed
from megalite.checkpoint.folder import (LATEST_FILE, STAGING_SUFFIX, checkpoint_dir, choose_checkpoint,
                                        complete_checkpoints, read_latest_iteration, remove_old_checkpoints,
                                        resolve_checkpoint)
from megalite.checkpoint.format import (FORMAT_VERSION, METADATA_FILE, CheckpointReader, check_model_config,
                                        read_metadata)
from megalite.checkpoint.loading import load_checkpoint
from megalite.checkpoint.pieces import (Piece, flat_range_pieces, model_pieces, optimizer_pieces,
                                        tensor_parallel_pieces)
from megalite.checkpoint.saving import (CheckpointSaveError, begin_save, finalize_save, save_checkpoint,
                                        write_rank_files)

__all__ = ["FORMAT_VERSION", "LATEST_FILE", "METADATA_FILE", "STAGING_SUFFIX", "CheckpointReader",
           "CheckpointSaveError", "Checkpointer", "Piece", "Resumed", "begin_save", "check_model_config",
           "checkpoint_dir", "choose_checkpoint", "complete_checkpoints", "finalize_save", "flat_range_pieces",
           "load_checkpoint", "model_pieces", "optimizer_pieces", "read_latest_iteration", "read_metadata",
           "remove_old_checkpoints", "resolve_checkpoint", "save_checkpoint", "tensor_parallel_pieces",
           "write_rank_files"]
