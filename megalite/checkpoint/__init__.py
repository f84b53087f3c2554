"""Layout-free, atomic, pickle-free checkpoints that resume a run exactly. A tensor is stored as
pieces, hyper-rectangles of the global tensor, so any layout reads the slices it needs; the format,
the save protocol and each module's part are described in docs/checkpoints.md."""

from megalite.checkpoint.checkpointer import Checkpointer
from megalite.checkpoint.folder import (LATEST_FILE, STAGING_SUFFIX, checkpoint_dir, choose_checkpoint,
                                        read_latest_iteration, resolve_checkpoint)
from megalite.checkpoint.format import FORMAT_VERSION, CheckpointReader, read_metadata
from megalite.checkpoint.loading import load_checkpoint
from megalite.checkpoint.pieces import Piece, flat_range_pieces, param_pieces, tensor_parallel_pieces
from megalite.checkpoint.saving import CheckpointSaveError, begin_save, finalize_save, save_checkpoint, write_rank_files
