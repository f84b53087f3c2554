"""Loading a checkpoint into any layout: the pieces of the live model and of a fresh optimizer state
say what this process holds, and `CheckpointReader` fills each from whichever files cover it."""

import dataclasses
import os

import torch

from megalite.checkpoint.folder import resolve_checkpoint
from megalite.checkpoint.format import CheckpointReader, check_model_config, read_metadata
from megalite.checkpoint.pieces import Piece, model_pieces, optimizer_pieces
from megalite.checkpoint.rng import restore_rng_state
from megalite.config import ModelConfig
from megalite.errors import UserError
from megalite.parallel_state import ONE_PROCESS, ParallelState


def load_checkpoint(load: str, model: torch.nn.Module, optimizer=None, *, model_config: ModelConfig,
                    iteration: int | None = None, load_rng: bool = True, rank: int = 0,
                    parallel: ParallelState = ONE_PROCESS, finetune: bool = False, param_shards=None) -> dict:
    """Restore `model` (ZeRO-3: its `param_shards`; + `optimizer`, + this rank's RNG) from `<load>` at `iteration`
    (default: latest), bitwise but for casts to the destination's dtype; return the iteration, consumed samples,
    extra and path. `finetune`: the weights start a new run, which may change the context length and rope's
    frequencies."""
    path = resolve_checkpoint(load, iteration)
    metadata = read_metadata(path)
    check_model_config(metadata["model_config"], model_config, path, finetune)
    vocab = (metadata["model_config"]["vocab_size"], model_config.vocab_size)
    with CheckpointReader(path, metadata) as reader:
        _fill(reader, "model", model_pieces(model, parallel, param_shards), vocab)
        if optimizer is not None:
            if metadata.get("optimizer") is None:
                raise UserError(f"checkpoint {path} holds no optimizer state (it was saved without one); "
                                f"pass --no-load-optim to load the model only")
            # A fresh state_dict says what this rank holds (a pipeline stage: its layers; TP: its
            # shards; ZeRO: the flat ranges of its shard), so only those parts are read.
            own = optimizer.state_dict()
            fresh = {name: _empty_like(value) for name, value in own["tensors"].items()}
            _fill(reader, "optimizer", optimizer_pieces(fresh, model, parallel, own.get("flat_ranges")), vocab)
            optimizer.load_state_dict({"tensors": fresh, "meta": metadata["optimizer"]["meta"]})
    if load_rng:
        if rank >= metadata["ranks"]:
            raise UserError(f"{path} holds RNG states for {metadata['ranks']} rank(s) but not for rank {rank} "
                            f"(it was saved by a smaller layout); pass --no-load-rng to keep this run's seeds")
        name = f"rng_{rank:05d}.safetensors"
        restore_rng_state(os.path.join(path, name), (metadata.get("files") or {}).get(name))
    return {"iteration": metadata["iteration"], "consumed_samples": metadata["consumed_samples"],
            "consumed_valid_samples": metadata.get("consumed_valid_samples"), "extra": metadata["extra"],
            "path": path}


@torch.no_grad()
def _fill(reader: CheckpointReader, section: str, pieces: dict[str, list[Piece]], vocab: tuple[int, int]) -> None:
    """Copy every piece of `section` from the checkpoint into its tensor. Only the vocabulary padding may
    change shape (`vocab`: the saved and current `vocab_size`): new rows read as zero, extra ones drop."""
    for name, name_pieces in pieces.items():
        for piece in name_pieces:
            saved, now = reader.shape(section, name), tuple(piece.global_shape)
            padding = saved != now and saved[1:] == now[1:] and saved[:1] + now[:1] == vocab
            if saved != now and not padding:
                raise UserError(f"checkpoint {reader.path} holds {name!r} with shape {list(saved)} but this run "
                                f"has {list(now)}; pass the same model flags as the saved run")
            piece.tensor.copy_(reader.read(section, name, piece.offsets, piece.tensor.shape, pad_rows=padding))


def _empty_like(value):
    """An uninitialised tensor, or Piece, shaped and placed like `value`."""
    if isinstance(value, Piece):
        return dataclasses.replace(value, tensor=torch.empty_like(value.tensor))
    return torch.empty_like(value)
