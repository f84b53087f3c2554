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
offsets. The index in metadata.json lists, for every tensor name, its global shape,
dtype and pieces, so any layout reads any slice it needs from whichever files hold it
(`CheckpointReader.read`). Only safetensors, JSON and text are ever read: nothing is
unpickled, so a checkpoint cannot run code.

Atomicity: every rank writes its files into `iter_0000100.tmp-new/`; rank 0 then (after
a barrier) writes metadata.json, renames the folder into place and only then replaces
the latest file. A crash at any point leaves the latest file naming a complete
checkpoint; `*.tmp-*` leftovers are ignored by the loader and cleaned by the next save.
The steps are public (`begin_save`, `write_rank_files`, `finalize_save`) so a
distributed caller can pass `torch.distributed.barrier` as `barrier`.

A save that fails (disk full, permission denied, ...) raises `CheckpointSaveError`
naming the folder and the error, on every rank (the ranks agree through `failed_ranks`),
after rank 0 removed the partial folder: the previous checkpoint stays the latest.
metadata.json records every file's size, so a truncated or altered file is refused at
load, and `choose_checkpoint` skips incomplete folders. `remove_old_checkpoints` keeps
the newest N (`--keep-last-n-checkpoints`), deleting by rename first so that a killed
deletion never leaves a half-deleted `iter_*` folder.
"""

import dataclasses
import json
import os
import random
import shutil
from dataclasses import dataclass

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from megalite.config import ModelConfig
from megalite.errors import UserError
from megalite.tensor_parallel.layers import tensor_parallel_rank_size
from megalite.tensor_parallel.random import model_parallel_rng_tracker

FORMAT_VERSION = 1
LATEST_FILE = "latest_checkpointed_iteration.txt"
METADATA_FILE = "metadata.json"
STAGING_SUFFIX = ".tmp-new"  # a save in progress (or killed mid-way)
REPLACED_SUFFIX = ".tmp-old"  # the previous copy of an iteration being saved again
DELETING_SUFFIX = ".tmp-del"  # an old checkpoint being removed (--keep-last-n-checkpoints)
SECTIONS = ("model", "optimizer")  # the tensor index's parts; files model_*, optim_*


def _no_barrier() -> None:
    pass


class CheckpointSaveError(UserError):
    """A save failed (disk full, permission denied, ...): its partial folder is gone and the
    previous checkpoint is still the latest."""


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


def checkpoint_dir(save: str, iteration: int) -> str:
    """`<save>/iter_0000100`: Megatron's folder name, the iteration zero-padded to 7 digits."""
    return os.path.join(save, f"iter_{iteration:07d}")


def read_latest_iteration(load: str) -> int | None:
    """The iteration in `<load>/latest_checkpointed_iteration.txt`; None when there is no such file.

    Raises UserError when the file holds anything but a non-negative integer.
    """
    path = os.path.join(load, LATEST_FILE)
    if not os.path.isfile(path):
        return None
    with open(path, "rb") as file:
        raw = file.read(200)
    text = raw.decode("utf-8", errors="replace").strip()
    if not (text.isascii() and text.isdigit()):
        raise UserError(f"{path} should hold an iteration number but holds {text[:40]!r}; write the number of "
                        f"a complete iter_* folder into it, or delete it to start from scratch")
    return int(text)


# -- which pieces a process holds ------------------------------------------------------------


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
    """Every tensor of `model.state_dict()` (full global names) as pieces of views of the live tensors."""
    params = dict(model.named_parameters())
    return {name: tensor_parallel_pieces(tensor, params.get(name), tp_rank, tp_size)
            for name, tensor in model.state_dict().items()}


def optimizer_pieces(tensors: dict, model: torch.nn.Module | None = None, tp_rank: int = 0,
                     tp_size: int = 1) -> dict[str, list[Piece]]:
    """The tensors of an optimizer's `state_dict()` as pieces of global tensors.

    A value is the whole local tensor, or a `Piece` or a list of `Piece`s already placed
    in the global tensor (a distributed-optimizer range, `flat_range_pieces`). Tensors named `<param name>.<kind>` of a TP-sharded param of
    `model` are placed like the param (`tensor_parallel_pieces`).
    """
    params = dict(model.named_parameters()) if model is not None else {}
    return {name: [value] if isinstance(value, Piece) else list(value) if isinstance(value, list) else
            tensor_parallel_pieces(value, params.get(name.rsplit(".", 1)[0]), tp_rank, tp_size)
            for name, value in tensors.items()}


# -- saving ------------------------------------------------------------------------------------


def save_checkpoint(save: str, iteration: int, model: torch.nn.Module, optimizer=None, *,
                    consumed_samples: int, model_config: ModelConfig, consumed_valid_samples: int | None = None,
                    extra: dict | None = None, rank: int = 0, parallel=None, barrier=_no_barrier,
                    failed_ranks=None) -> str:
    """Save model (+ optimizer, + this rank's RNG) as `<save>/iter_XXXXXXX`; return that folder.

    Every rank calls this; each writes its own files, rank 0 finalizes. `extra` is any
    JSON-able dict (run args, LR schedule, ...) handed back by `load_checkpoint`.
    `barrier` synchronises the ranks (e.g. torch.distributed.barrier); one process needs none.
    `failed_ranks(ok)`, called by every rank after each step with whether the step worked
    here, returns the ranks where it failed (an all-reduce across ranks); without it the
    barrier stands in and each rank sees its own failure only. Any failure raises
    CheckpointSaveError on every rank once rank 0 has removed the partial folder.
    """
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

    step("create its folder", lambda: _create_staging(save, staging) if rank == 0 else None)
    tp_rank, tp_size = tensor_parallel_rank_size(parallel)
    # Data-parallel replicas hold the same model (and, without the distributed optimizer, the
    # same optimizer state): only DP rank 0 writes those; each DP rank writes its ZeRO shard.
    replica = getattr(parallel, "dp_rank", 0) > 0
    optim_pieces = optim_meta = None
    if optimizer is not None:
        optim_state = optimizer.state_dict()
        optim_meta = optim_state["meta"]
        optim_pieces = {} if replica and not getattr(optimizer, "distributed", False) else \
            optimizer_pieces(optim_state["tensors"], model, tp_rank, tp_size)
    model_part = {} if replica else model_pieces(model, tp_rank, tp_size)
    step("write its files", lambda: write_rank_files(staging, rank, model_part, optim_pieces))
    header = {"iteration": iteration, "consumed_samples": consumed_samples,
              "consumed_valid_samples": consumed_valid_samples,
              "model_config": dataclasses.asdict(model_config),
              "optimizer": None if optimizer is None else {"meta": optim_meta},
              "extra": extra or {}}
    step("publish it", lambda: finalize_save(save, iteration, header) if rank == 0 else None)
    return final


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
        _create_staging(save, staging)
    barrier()
    return staging


def _create_staging(save: str, staging: str) -> None:
    os.makedirs(save, exist_ok=True)
    _clean_leftovers(save)
    os.makedirs(staging)


def write_rank_files(staging: str, rank: int, model: dict[str, list[Piece]],
                     optimizer: dict[str, list[Piece]] | None = None) -> None:
    """Write this rank's model pieces, optimizer pieces and RNG states into `staging`, fsynced."""
    _write_pieces(os.path.join(staging, f"model_{rank:05d}.safetensors"), "model", model)
    if optimizer is not None:
        _write_pieces(os.path.join(staging, f"optim_{rank:05d}.safetensors"), "optimizer", optimizer)
    _write_rng_state(os.path.join(staging, f"rng_{rank:05d}.safetensors"))


def finalize_save(save: str, iteration: int, header: dict) -> str:
    """Rank 0, after every rank wrote: index the pieces, write metadata.json, publish atomically.

    `header` holds the JSON fields of metadata.json besides the version and the index.
    Order matters for crash safety: the folder is complete and renamed into place before
    the latest file names it.
    """
    final = checkpoint_dir(save, iteration)
    staging = final + STAGING_SUFFIX
    tensors = _index_pieces(staging)
    names = sorted(os.listdir(staging))
    ranks = sum(1 for name in names if name.startswith("rng_"))
    # Sizes let a loader refuse a truncated or altered file before reading it.
    files = {name: os.path.getsize(os.path.join(staging, name)) for name in names if name.endswith(".safetensors")}
    metadata = {"format": "megalite", "version": FORMAT_VERSION, **header, "ranks": ranks, "files": files,
                "tensors": tensors}
    with open(os.path.join(staging, METADATA_FILE), "w") as file:
        file.write(_metadata_text(metadata))
        file.flush()
        os.fsync(file.fileno())
    _fsync_dir(staging)
    _move_into_place(staging, final)
    _write_latest(save, iteration)
    return final


def _metadata_text(metadata: dict) -> str:
    """metadata.json's text: the fields indented, then one line per tensor of the index."""
    head = json.dumps({key: value for key, value in metadata.items() if key != "tensors"}, indent=1)
    sections = []
    for section, entries in metadata["tensors"].items():
        lines = ",\n".join(f"   {json.dumps(name)}: {json.dumps(entry)}" for name, entry in entries.items())
        sections.append(f"  {json.dumps(section)}: {{\n{lines}\n  }}")
    return head[:-2] + ',\n "tensors": {\n' + ",\n".join(sections) + "\n }\n}\n"


def _write_pieces(path: str, section: str, pieces: dict[str, list[Piece]]) -> None:
    """One safetensors file whose header says, per key, which piece of which tensor it holds."""
    tensors, described = {}, {}
    for name, name_pieces in pieces.items():
        for number, piece in enumerate(name_pieces):
            _check_piece(name, piece)
            key = name if number == 0 else f"{name}@{number}"  # '@' never occurs in a parameter name
            tensors[key] = piece.tensor.detach().to("cpu").contiguous()
            described[key] = {"name": name, "shape": list(piece.tensor.shape),
                              "global_shape": list(piece.global_shape), "offsets": list(piece.offsets),
                              "dtype": _dtype_name(piece.tensor.dtype)}
    save_file(tensors, path, metadata={"megalite": json.dumps({"section": section, "pieces": described})})
    _fsync_file(path)


def _check_piece(name: str, piece: Piece) -> None:
    shape = tuple(piece.tensor.shape)
    if len(shape) != len(piece.global_shape) or len(piece.offsets) != len(shape) or any(
            offset < 0 or offset + size > whole
            for offset, size, whole in zip(piece.offsets, shape, piece.global_shape)):
        raise ValueError(f"piece of {name!r} with shape {list(shape)} at offsets {list(piece.offsets)} "
                         f"does not fit its global shape {list(piece.global_shape)}")


def _index_pieces(staging: str) -> dict:
    """The tensor index of metadata.json, merged from the headers of every rank's files.

    `{section: {name: {"shape", "dtype", "pieces": [{"file", "key", "offsets", "shape"}]}}}`;
    identical pieces from several ranks (replicas) are listed once.
    """
    index = {section: {} for section in SECTIONS}
    for file_name in sorted(os.listdir(staging)):
        if not file_name.endswith(".safetensors") or file_name.startswith("rng_"):
            continue
        with safe_open(os.path.join(staging, file_name), framework="pt") as file:
            header = json.loads(file.metadata()["megalite"])
        for key, piece in header["pieces"].items():
            name = piece["name"]
            entry = index[header["section"]].setdefault(
                name, {"shape": piece["global_shape"], "dtype": piece["dtype"], "pieces": []})
            if (entry["shape"], entry["dtype"]) != (piece["global_shape"], piece["dtype"]):
                raise ValueError(f"ranks disagree on {name!r}: {entry['shape']} {entry['dtype']} vs "
                                 f"{piece['global_shape']} {piece['dtype']} in {file_name}")
            if any(known["offsets"] == piece["offsets"] and known["shape"] == piece["shape"]
                   for known in entry["pieces"]):
                continue
            entry["pieces"].append({"file": file_name, "key": key, "offsets": piece["offsets"],
                                    "shape": piece["shape"]})
    return index


def _clean_leftovers(save: str) -> None:
    """Remove `*.tmp-*` folders of killed saves, first restoring an iteration caught mid-replace."""
    for name in sorted(os.listdir(save)):
        path = os.path.join(save, name)
        if name.endswith(REPLACED_SUFFIX) and not os.path.exists(path[:-len(REPLACED_SUFFIX)]):
            # Killed between moving the old copy away and moving the new one in: the old
            # copy is the complete checkpoint the latest file names.
            os.rename(path, path[:-len(REPLACED_SUFFIX)])
        elif name.endswith((STAGING_SUFFIX, REPLACED_SUFFIX, DELETING_SUFFIX)) and os.path.isdir(path):
            shutil.rmtree(path)
        elif name == LATEST_FILE + ".tmp":
            os.remove(path)
    _fsync_dir(save)


def _move_into_place(staging: str, final: str) -> None:
    """Rename `staging` to `final`; an existing `final` (same iteration saved again) is replaced."""
    parent = os.path.dirname(final) or "."
    if not os.path.exists(final):
        os.rename(staging, final)
        _fsync_dir(parent)
        return
    replaced = final + REPLACED_SUFFIX
    os.rename(final, replaced)
    os.rename(staging, final)
    _fsync_dir(parent)
    shutil.rmtree(replaced)


def _write_latest(save: str, iteration: int) -> None:
    """Replace the latest file atomically: a reader sees the old number or the new one."""
    path = os.path.join(save, LATEST_FILE)
    temporary = path + ".tmp"
    try:
        with open(temporary, "w") as file:
            file.write(str(iteration))  # Megatron's content: the number, no newline
            file.flush()
            os.fsync(file.fileno())
    except OSError:
        if os.path.exists(temporary):
            os.remove(temporary)
        raise
    os.replace(temporary, path)
    _fsync_dir(save)


def _fsync_file(path: str) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _fsync_dir(path: str) -> None:
    """Make renames and new entries in `path` durable (a no-op where directories cannot be fsynced)."""
    try:
        _fsync_file(path)
    except OSError:
        pass


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# -- RNG states ------------------------------------------------------------------------------


def _write_rng_state(path: str) -> None:
    """This process's python, numpy, torch CPU and (when present) CUDA RNG states."""
    numpy_state = np.random.get_state()
    tensors = {"torch_cpu": torch.get_rng_state(),
               # MT19937 keys are uint32: int64 holds them exactly in a dtype every reader knows.
               "numpy_keys": torch.from_numpy(numpy_state[1].astype(np.int64))}
    if torch.cuda.is_available():
        for device, state in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"cuda_{device}"] = state
    for name, state in model_parallel_rng_tracker.get_states().items():
        tensors[f"tracker/{name}"] = state
    version, internal, gauss_next = random.getstate()
    meta = {"python": [version, list(internal), gauss_next],
            "numpy": {"name": numpy_state[0], "pos": int(numpy_state[2]), "has_gauss": int(numpy_state[3]),
                      "cached_gaussian": float(numpy_state[4])}}
    save_file(tensors, path, metadata={"megalite": json.dumps(meta)})
    _fsync_file(path)


def _restore_rng_state(path: str, size: int | None = None) -> None:
    """Set this process's RNGs from a file of `_write_rng_state` (of `size` bytes when known)."""
    with _open_safetensors(path, size) as file:
        meta = json.loads(file.metadata()["megalite"])
        tensors = {key: file.get_tensor(key) for key in file.keys()}
    version, internal, gauss_next = meta["python"]
    random.setstate((version, tuple(internal), gauss_next))
    numpy = meta["numpy"]
    np.random.set_state((numpy["name"], tensors["numpy_keys"].numpy().astype(np.uint32), numpy["pos"],
                         numpy["has_gauss"], numpy["cached_gaussian"]))
    torch.set_rng_state(tensors["torch_cpu"])
    tracked = {key.split("/", 1)[1]: value for key, value in tensors.items() if key.startswith("tracker/")}
    if tracked:
        model_parallel_rng_tracker.set_states(tracked)
    if torch.cuda.is_available():
        # A CPU checkpoint has no CUDA states and a CPU run cannot take them: each is skipped.
        for device in range(torch.cuda.device_count()):
            if f"cuda_{device}" in tensors:
                torch.cuda.set_rng_state(tensors[f"cuda_{device}"], device)


# -- loading -----------------------------------------------------------------------------------


def load_checkpoint(load: str, model: torch.nn.Module, optimizer=None, *, model_config: ModelConfig,
                    iteration: int | None = None, load_optim: bool = True, load_rng: bool = True,
                    rank: int = 0, parallel=None) -> dict:
    """Restore `model` (+ `optimizer`, + this rank's RNG) from `<load>` at `iteration` (default: latest).

    Tensors are cast to the destination's dtype; everything else is bitwise. Returns
    `{"iteration", "consumed_samples", "consumed_valid_samples", "extra", "path"}`.
    Raises UserError for a missing or corrupt checkpoint and for a different model config.
    """
    path = resolve_checkpoint(load, iteration)
    metadata = read_metadata(path)
    check_model_config(metadata["model_config"], model_config, path)
    tp_rank, tp_size = tensor_parallel_rank_size(parallel)
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
        _restore_rng_state(os.path.join(path, name), (metadata.get("files") or {}).get(name))
    return {"iteration": metadata["iteration"], "consumed_samples": metadata["consumed_samples"],
            "consumed_valid_samples": metadata.get("consumed_valid_samples"), "extra": metadata["extra"],
            "path": path}


def resolve_checkpoint(load: str, iteration: int | None = None) -> str:
    """The folder to load: `iteration`'s, else the latest file's. UserError when it does not exist."""
    if not os.path.isdir(load):
        raise UserError(f"--load directory {load} does not exist; check the path")
    if iteration is None:
        iteration = read_latest_iteration(load)
        if iteration is None:
            raise UserError(f"{load} has no {LATEST_FILE}, so it holds no complete checkpoint; "
                            f"check --load, or drop it to start from scratch")
    path = checkpoint_dir(load, iteration)
    if not os.path.isdir(path) and os.path.isdir(path + REPLACED_SUFFIX):
        return path + REPLACED_SUFFIX  # a save of the same iteration was killed mid-replace
    if not os.path.isdir(path):
        raise UserError(f"checkpoint folder {path} for iteration {iteration} does not exist; "
                        f"restore it, or fix {os.path.join(load, LATEST_FILE)}")
    return path


def _file_problem(path: str, metadata: dict) -> str | None:
    """What is wrong with the files of checkpoint `path` against its metadata.json, or None.

    Checks that every file the index or the RNG states need exists, with the size
    metadata.json recorded (checkpoints from before sizes were recorded: existence only).
    """
    sizes = metadata.get("files") or {}
    needed = {piece["file"] for section in metadata.get("tensors", {}).values()
              for entry in section.values() for piece in entry["pieces"]}
    needed |= {f"rng_{rank:05d}.safetensors" for rank in range(metadata.get("ranks", 0))}
    for name in sorted(needed | set(sizes)):
        file_path = os.path.join(path, name)
        if not os.path.isfile(file_path):
            return f"checkpoint file {file_path} is missing"
        if name in sizes and os.path.getsize(file_path) != sizes[name]:
            return f"checkpoint file {file_path} is {os.path.getsize(file_path)} bytes but {METADATA_FILE} " \
                   f"recorded {sizes[name]} (truncated or altered)"
    return None


def complete_checkpoints(load: str) -> list[tuple[int, str]]:
    """(iteration, folder) of every complete `iter_*` checkpoint in `load`, newest first.

    Complete: metadata.json reads as a megalite checkpoint and every file it needs is
    there with its recorded size. Staging and other `*.tmp-*` folders never count.
    """
    found = []
    for name in os.listdir(load) if os.path.isdir(load) else []:
        number = name[len("iter_"):]
        if not (name.startswith("iter_") and number.isascii() and number.isdigit()):
            continue
        path = os.path.join(load, name)
        try:
            if _file_problem(path, read_metadata(path)) is None:
                found.append((int(number), path))
        except (UserError, OSError, KeyError, TypeError):
            continue
    return sorted(found, reverse=True)


def choose_checkpoint(load: str) -> tuple[str | None, str | None]:
    """The checkpoint folder to resume from in `load`, and a note when it is not the latest file's.

    The latest file's iteration when that checkpoint is complete. Otherwise (no latest
    file, a garbled one, or one naming a missing or incomplete folder, e.g. after a
    crash or a manual deletion) the newest complete checkpoint at or below the named
    iteration, else the newest of all. (None, None) when `load` holds no checkpoint at all.
    """
    try:
        latest, garbled = read_latest_iteration(load), None
    except UserError as error:
        latest, garbled = None, str(error)
    if latest is not None:
        try:
            path = resolve_checkpoint(load, latest)
            problem = _file_problem(path, read_metadata(path))
        except UserError as error:
            problem = str(error)
        if problem is None:
            return path, None
    complete = complete_checkpoints(load)
    if not complete:
        if latest is not None or garbled:
            raise UserError(f"{load} holds no complete checkpoint: {garbled or problem}; restore a checkpoint "
                            f"folder, or delete {os.path.join(load, LATEST_FILE)} to start from scratch")
        return None, None
    older = [entry for entry in complete if latest is None or entry[0] <= latest]
    iteration, path = (older or complete)[0]
    why = garbled or (f"{LATEST_FILE} names iteration {latest}, which is incomplete ({problem})"
                      if latest is not None else f"{LATEST_FILE} is missing")
    return path, f"{why}; resuming from the newest complete checkpoint instead, iteration {iteration}"


def remove_old_checkpoints(save: str, keep_last: int, retain_interval: int | None = None,
                           keep: set[int] = frozenset()) -> list[str]:
    """Delete complete checkpoints beyond the newest `keep_last`; return the folders removed.

    Never removed: the latest file's iteration, multiples of `retain_interval`, and the
    iterations in `keep` (the one a run resumed from). Each folder is renamed to
    `*.tmp-del` before it is deleted, so a kill mid-way leaves no half-deleted `iter_*`.
    """
    try:
        latest = read_latest_iteration(save)
    except UserError:
        return []  # without a trustworthy latest file nothing is deleted
    removed = []
    for iteration, path in complete_checkpoints(save)[keep_last:]:
        if iteration == latest or iteration in keep or (retain_interval and iteration % retain_interval == 0):
            continue
        doomed = path + DELETING_SUFFIX
        os.rename(path, doomed)
        shutil.rmtree(doomed, ignore_errors=True)
        removed.append(path)
    if removed:
        _fsync_dir(save)
    return removed


def read_metadata(path: str) -> dict:
    """metadata.json of checkpoint folder `path`; UserError when missing, garbled or too new."""
    file_path = os.path.join(path, METADATA_FILE)
    try:
        with open(file_path) as file:
            metadata = json.load(file)
    except FileNotFoundError:
        raise UserError(f"{file_path} is missing, so {path} is not a complete megalite checkpoint; "
                        f"load another iteration or restore the folder") from None
    except (ValueError, UnicodeDecodeError) as error:
        raise UserError(f"{file_path} is not valid JSON ({error}); the checkpoint is corrupt, "
                        f"load another iteration or restore the folder") from None
    if not isinstance(metadata, dict) or metadata.get("format") != "megalite":
        raise UserError(f"{file_path} is not a megalite checkpoint's metadata; check --load")
    if metadata.get("version", 0) > FORMAT_VERSION:
        raise UserError(f"{file_path} has format version {metadata['version']}, newer than this megalite "
                        f"reads ({FORMAT_VERSION}); update megalite")
    return metadata


# Fields that do not change any weight or arithmetic: a resumed run may change them.
_FREE_FIELDS = {"recompute_granularity", "hidden_dropout", "attention_dropout", "z_loss_weight",
                "fused_output_cross_entropy"}


def check_model_config(saved: dict, current: ModelConfig, path: str) -> None:
    """UserError naming every field where the checkpoint's model config differs from `current`.

    `vocab_size` may differ when the tokenizer's vocabulary is the same: the padding
    depends on the TP size, and padding rows are zero (they load as zero or are dropped).
    """
    now = dataclasses.asdict(current)
    defaults = {field.name: field.default for field in dataclasses.fields(ModelConfig)}
    saved = {**{key: value for key, value in defaults.items() if key not in saved}, **saved}
    free = set(_FREE_FIELDS)
    if (saved.get("tokenizer_vocab_size") or saved["vocab_size"]) == current.real_vocab_size:
        free |= {"vocab_size", "tokenizer_vocab_size"}
    if saved.get("position_embedding_type") == now["position_embedding_type"] == "rope":
        free.add("max_position_embeddings")  # rotary positions have no table: a stated limit, no weights
    differences = [f"{key} (checkpoint {saved.get(key, '<absent>')!r}, now {now.get(key, '<absent>')!r})"
                   for key in sorted(set(saved) | set(now))
                   if key not in free and saved.get(key, "<absent>") != now.get(key, "<absent>")]
    if differences:
        raise UserError(f"checkpoint {path} was saved from a different model: {'; '.join(differences)}; "
                        f"pass the same model flags (or --model) as the saved run")


class CheckpointReader:
    """Reads any slice of any tensor of one checkpoint folder from the pieces that cover it.

    Files are opened once (header checked, nothing unpickled) and read lazily: a slice
    reads only the bytes of the pieces it overlaps.
    """

    def __init__(self, path: str, metadata: dict):
        self.path, self.metadata, self.index = path, metadata, metadata["tensors"]
        self._files = {}

    def __enter__(self) -> "CheckpointReader":
        return self

    def __exit__(self, *exc) -> None:
        for file in self._files.values():
            file.__exit__(None, None, None)
        self._files.clear()

    def names(self, section: str) -> list[str]:
        return list(self.index.get(section, {}))

    def shape(self, section: str, name: str) -> tuple[int, ...]:
        return tuple(self._entry(section, name)["shape"])

    def read(self, section: str, name: str, offsets=None, shape=None, pad_rows: bool = False) -> torch.Tensor:
        """`global[offsets : offsets + shape]` of tensor `name` in `section` ("model", "optimizer").

        Default: the whole tensor. Returned in the checkpoint's dtype. `pad_rows`: rows
        past the checkpoint's dim 0 read as zero (vocabulary padding). UserError when
        the stored pieces do not cover the region.
        """
        entry = self._entry(section, name)
        global_shape = entry["shape"]
        offsets = list(offsets) if offsets is not None else [0] * len(global_shape)
        shape = list(shape) if shape is not None else list(global_shape)
        limits = list(global_shape)
        if pad_rows and limits:
            limits[0] = max(limits[0], offsets[0] + shape[0])
        if len(offsets) != len(global_shape) or len(shape) != len(global_shape) or any(
                o < 0 or o + n > limit for o, n, limit in zip(offsets, shape, limits)):
            raise ValueError(f"region {offsets} + {shape} is outside {name!r} of shape {global_shape}")
        out = torch.zeros(shape, dtype=getattr(torch, entry["dtype"]))
        covered = torch.zeros(shape, dtype=torch.bool)
        if pad_rows and shape and offsets[0] + shape[0] > global_shape[0]:
            covered[max(global_shape[0] - offsets[0], 0):] = True
        for piece in entry["pieces"]:
            self._copy_overlap(piece, offsets, shape, out, covered)
        if not bool(covered.all()):
            raise UserError(f"checkpoint {self.path} lacks part of {section} tensor {name!r} (region offsets "
                            f"{offsets}, shape {shape}): a rank's file is missing from the index in "
                            f"{METADATA_FILE}; restore the folder or load another iteration")
        return out

    def _copy_overlap(self, piece: dict, offsets, shape, out: torch.Tensor, covered: torch.Tensor) -> None:
        """Copy the part of `piece` inside the region into `out`, reading only that part."""
        starts = [max(o, p) for o, p in zip(offsets, piece["offsets"])]
        stops = [min(o + n, p + m) for o, n, p, m in zip(offsets, shape, piece["offsets"], piece["shape"])]
        if any(start >= stop for start, stop in zip(starts, stops)):
            return
        source = tuple(slice(a - p, b - p) for a, b, p in zip(starts, stops, piece["offsets"]))
        target = tuple(slice(a - o, b - o) for a, b, o in zip(starts, stops, offsets))
        stored = self._file(piece["file"]).get_slice(piece["key"])
        if list(stored.get_shape()) != piece["shape"]:
            raise UserError(f"{os.path.join(self.path, piece['file'])} holds {piece['key']!r} with shape "
                            f"{stored.get_shape()}, but {METADATA_FILE} says {piece['shape']}; "
                            f"the checkpoint is corrupt, load another iteration")
        out[target] = stored[source]
        covered[target] = True

    def _entry(self, section: str, name: str) -> dict:
        entry = self.index.get(section, {}).get(name)
        if entry is None:
            raise UserError(f"checkpoint {self.path} holds no {section} tensor {name!r}; it was saved from a "
                            f"different model or optimizer, so pass the saved run's flags or load another "
                            f"checkpoint")
        return entry

    def _file(self, file_name: str):
        if file_name not in self._files:
            size = (self.metadata.get("files") or {}).get(file_name)
            self._files[file_name] = _open_safetensors(os.path.join(self.path, file_name), size).__enter__()
        return self._files[file_name]


def _open_safetensors(path: str, size: int | None = None):
    """`safe_open(path)`; UserError naming the file when it is missing, not valid safetensors, or
    not `size` bytes long (the size metadata.json recorded, when it did).

    safetensors parses a JSON header and checks it against the file size, so a pickle, a
    truncated file or random bytes are refused here without executing anything.
    """
    if not os.path.isfile(path):
        raise UserError(f"checkpoint file {path} is missing; the checkpoint is incomplete, "
                        f"restore it or load another iteration")
    try:
        opened = safe_open(path, framework="pt")
    except Exception as error:  # safetensors raises its own SafetensorError (and OSError)
        raise UserError(f"{path} is not a valid safetensors file ({error}); the checkpoint is corrupt "
                        f"or was not written by megalite, restore it or load another iteration") from None
    if size is not None and os.path.getsize(path) != size:
        raise UserError(f"checkpoint file {path} is {os.path.getsize(path)} bytes but {METADATA_FILE} recorded "
                        f"{size}; it was truncated or altered, restore it or load another iteration")
    return opened


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
    layers; TP: its shards; ZeRO: `Piece`s of its shard), so only those parts are read.
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

    fresh = {name: empty(value) for name, value in optimizer.state_dict()["tensors"].items()}
    pieces = optimizer_pieces(fresh, model, tp_rank, tp_size)
    with torch.no_grad():
        for name, name_pieces in pieces.items():
            for piece in name_pieces:
                piece.tensor.copy_(_read_piece(reader, "optimizer", name, piece, vocab))
    optimizer.load_state_dict({"tensors": fresh, "meta": state["meta"]})
