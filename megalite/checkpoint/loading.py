"""Loading a checkpoint into any layout: each process reads the parts of every tensor it holds.

The live model's and a fresh optimizer state's pieces (megalite/checkpoint/pieces.py)
say what this process holds in global coordinates; `CheckpointReader` fills each from
whichever files cover it. Tensors are cast to the destination's dtype; everything else
is bitwise, so a resumed run continues exactly.
"""

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
                    iteration: int | None = None, load_optim: bool = True, load_rng: bool = True,
                    rank: int = 0, parallel: ParallelState = ONE_PROCESS) -> dict:
    """Restore `model` (+ `optimizer`, + this rank's RNG) from `<load>` at `iteration` (default: latest).

    Tensors are cast to the destination's dtype; everything else is bitwise. Returns
    `{"iteration", "consumed_samples", "consumed_valid_samples", "extra", "path"}`.
    Raises UserError for a missing or corrupt checkpoint and for a different model config.
    """
    path = resolve_checkpoint(load, iteration)
    metadata = read_metadata(path)
    check_model_config(metadata["model_config"], model_config, path)
    tp_rank, tp_size = parallel.tp_rank, parallel.tp_size
    pieces = model_pieces(model, tp_rank, tp_size)
    vocab = (metadata["model_config"]["vocab_size"], model_config.vocab_size)
    with CheckpointReader(path, metadata) as reader:
        _load_model(reader, pieces, vocab)
        if optimizer is not None and load_optim:
            _load_optimizer(reader, optimizer, vocab, model, tp_rank, tp_size)
    if load_rng:
        if rank >= metadata["ranks"]:
            raise UserError(f"{path} holds RNG states for {metadata['ranks']} rank(s) but not for rank {rank} "
                            f"(it was saved by a smaller layout); pass --no-load-rng to keep this run's seeds")
        name = f"rng_{rank:05d}.safetensors"
        restore_rng_state(os.path.join(path, name), (metadata.get("files") or {}).get(name))
    return {"iteration": metadata["iteration"], "consumed_samples": metadata["consumed_samples"],
            "consumed_valid_samples": metadata.get("consumed_valid_samples"), "extra": metadata["extra"],
            "path": path}


def _read_piece(reader: CheckpointReader, section: str, name: str, piece: Piece, vocab: tuple[int, int]):
    """The part of `name` that `piece` stands for, in the checkpoint's dtype.

    Only the vocabulary padding may differ in shape (`vocab`: the saved and the current
    `vocab_size`, see check_model_config): rows past the saved ones read as zero, saved
    rows past ours (zero padding) are dropped. Any other shape change is a UserError.
    """
    saved, now = reader.shape(section, name), tuple(piece.global_shape)
    padding = saved != now and saved[1:] == now[1:] and saved[:1] + now[:1] == vocab
    if saved != now and not padding:
        raise UserError(f"checkpoint {reader.path} holds {name!r} with shape {list(saved)} but this run has "
                        f"{list(now)}; pass the same model flags as the saved run")
    return reader.read(section, name, piece.offsets, piece.tensor.shape, pad_rows=padding)


def _load_model(reader: CheckpointReader, pieces: dict[str, list[Piece]], vocab: tuple[int, int]) -> None:
    """Copy every piece of the model from the checkpoint into the live tensors, cast to their dtype."""
    with torch.no_grad():
        for name, name_pieces in pieces.items():
            for piece in name_pieces:
                piece.tensor.copy_(_read_piece(reader, "model", name, piece, vocab))


def _load_optimizer(reader: CheckpointReader, optimizer, vocab: tuple[int, int], model=None,
                    tp_rank: int = 0, tp_size: int = 1) -> None:
    """Hand the optimizer the tensors its own `state_dict()` names, shaped and typed like them.

    A fresh optimizer's state_dict says what this rank holds (a pipeline stage: its
    layers; TP: its shards; ZeRO: the flat ranges of its shard), so only those parts are read.
    """
    state = reader.metadata.get("optimizer")
    if state is None:
        raise UserError(f"checkpoint {reader.path} holds no optimizer state (it was saved without one); "
                        f"pass --no-load-optim to load the model only")
    def empty(value):
        if isinstance(value, list):
            return [empty(piece) for piece in value]
        if isinstance(value, Piece):
            return dataclasses.replace(value, tensor=torch.empty_like(value.tensor))
        return torch.empty_like(value)

    own = optimizer.state_dict()
    fresh = {name: empty(value) for name, value in own["tensors"].items()}
    pieces = optimizer_pieces(fresh, model, tp_rank, tp_size, own.get("flat_ranges"))
    with torch.no_grad():
        for name, name_pieces in pieces.items():
            for piece in name_pieces:
                piece.tensor.copy_(_read_piece(reader, "optimizer", name, piece, vocab))
    optimizer.load_state_dict({"tensors": fresh, "meta": state["meta"]})
