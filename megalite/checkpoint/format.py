"""The checkpoint format: safetensors files whose headers place each piece, metadata.json's index of
them, and `CheckpointReader`. Only safetensors and JSON are read, so a checkpoint cannot run code."""

import contextlib
import dataclasses
import json
import os

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from megalite.checkpoint.pieces import Piece, first_gap
from megalite.config import ModelConfig
from megalite.errors import UserError

FORMAT_VERSION = 1
METADATA_FILE = "metadata.json"
# The process's umask, read once at import, before any thread that writes files could see the brief 0 here.
_UMASK = os.umask(0o022)
os.umask(_UMASK)


def write_pieces(path: str, section: str, pieces: dict[str, list[Piece]]) -> dict:
    """One safetensors file of `section` ("model", "optimizer") whose header places each key's piece;
    return that description, `{"section", "pieces": {key: {"name", "shape", "global_shape", "offsets",
    "dtype"}}}`."""
    tensors, described = {}, {}
    for name, name_pieces in pieces.items():
        for number, piece in enumerate(name_pieces):
            key = name if number == 0 else f"{name}@{number}"  # '@' never occurs in a parameter name
            tensors[key] = piece.tensor.detach().to("cpu").contiguous()
            described[key] = {"name": name, "shape": list(piece.tensor.shape),
                              "global_shape": list(piece.global_shape), "offsets": list(piece.offsets),
                              "dtype": str(piece.tensor.dtype).removeprefix("torch.")}
    header = {"section": section, "pieces": described}
    save_safetensors(tensors, path, header)
    return header


def save_safetensors(tensors: dict[str, torch.Tensor], path: str, header: dict) -> None:
    """`tensors` as the safetensors file `path`, `header` as JSON in its metadata, with the permissions the
    process's umask gives every other file the run writes: safetensors' own `save_file` makes it owner-only
    (0600), which teammates on a shared cluster could not read or convert."""
    save_file(tensors, path, metadata={"megalite": json.dumps(header)})
    os.chmod(path, 0o666 & ~_UMASK)


def _fits(offsets, shape, limits) -> bool:
    """Whether the box at `offsets` of `shape` lies inside `[0, limits)` in every dimension."""
    return len(offsets) == len(shape) == len(limits) and all(
        0 <= offset and offset + size <= limit for offset, size, limit in zip(offsets, shape, limits))


def index_pieces(reports: list[dict]) -> dict:
    """metadata.json's tensor index, merged from what every rank reported it wrote (`write_rank_files`:
    each file's header description): `{section: {name: {"shape", "dtype", "pieces": [{"file", "key",
    "offsets", "shape"}]}}}`. Identical pieces from several ranks (replicas) are listed once."""
    index = {"model": {}, "optimizer": {}}
    for report in reports:
        for file_name, header in sorted(report["pieces"].items()):
            for key, piece in header["pieces"].items():
                name = piece["name"]
                entry = index[header["section"]].setdefault(
                    name, {"shape": piece["global_shape"], "dtype": piece["dtype"], "pieces": []})
                place = {"offsets": piece["offsets"], "shape": piece["shape"]}
                if not any(known["offsets"] == place["offsets"] and known["shape"] == place["shape"]
                           for known in entry["pieces"]):
                    entry["pieces"].append({"file": file_name, "key": key, **place})
    return index


def missing_parts(index: dict, holds: dict[str, set[str]]) -> list[str]:
    """What the index lacks, one phrase each: a tensor some rank `holds` (`{section: names}`) that no piece
    stores, or the first region of a tensor that no piece covers."""
    missing = [f"all of {section} tensor {name!r}"
               for section, names in holds.items() for name in sorted(names) if name not in index[section]]
    for section, entries in index.items():
        for name, entry in entries.items():
            gap = first_gap(entry["shape"], [(piece["offsets"], piece["shape"]) for piece in entry["pieces"]])
            if gap is not None:
                missing.append(f"part of {section} tensor {name!r} of shape {entry['shape']} (offsets {gap[0]}, "
                               f"shape {gap[1]})")
    return missing


def metadata_text(metadata: dict) -> str:
    """metadata.json's text: the fields indented, then one line per tensor of the index."""
    head = json.dumps({key: value for key, value in metadata.items() if key != "tensors"}, indent=1)
    sections = []
    for section, entries in metadata["tensors"].items():
        lines = ",\n".join(f"   {json.dumps(name)}: {json.dumps(entry)}" for name, entry in entries.items())
        sections.append(f"  {json.dumps(section)}: {{\n{lines}\n  }}")
    return head[:-2] + ',\n "tensors": {\n' + ",\n".join(sections) + "\n }\n}\n"


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


def file_problem(path: str, metadata: dict) -> str | None:
    """What is wrong with the files of checkpoint `path`, or None: every file the index or the RNG
    states need must exist, with the size metadata.json recorded (when it recorded sizes)."""
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


# Fields that change no weight and no arithmetic: a resumed run may change them.
_FREE_FIELDS = {"recompute_granularity", "recompute_method", "recompute_num_layers", "hidden_dropout",
                "attention_dropout", "z_loss_weight", "fused_output_cross_entropy", "moe_grouped_gemm",
                "moe_token_dispatcher_type", "moe_aux_loss_coeff", "moe_z_loss_coeff", "moe_router_bias_update_rate"}
# A field a checkpoint's config predates had its default then.
_DEFAULTS = {field.name: field.default for field in dataclasses.fields(ModelConfig)
             if field.default is not dataclasses.MISSING}
# The context length and rope's frequencies change no weight's shape, only the arithmetic: a new run from the
# weights (--finetune, continued pretraining at a longer context) may change them, a resume may not.
_CONTEXT_FIELDS = ("seq_length", "rotary_base", "use_rope_scaling", "rope_scaling_factor")


def context_changes(saved: dict, current: ModelConfig) -> str:
    """The _CONTEXT_FIELDS that `current` changes from the checkpoint's model config `saved`, as
    "seq_length 128 -> 256, rotary_base 10000.0 -> 500000.0" ("" when none does)."""
    return ", ".join(f"{key} {saved[key]} -> {getattr(current, key)}" for key in _CONTEXT_FIELDS
                     if key in saved and saved[key] != getattr(current, key))


def check_model_config(saved: dict, current: ModelConfig, path: str, finetune: bool = False) -> None:
    """UserError naming every field where the checkpoint's model config differs from `current`. The padded
    `vocab_size` depends on TP, so it may differ when the tokenizer's vocabulary is the same; a rotary
    model's stated context (`max_position_embeddings`) may always differ, and with `finetune` (a new run
    from the weights) the _CONTEXT_FIELDS too."""
    now = dataclasses.asdict(current)
    free = set(_FREE_FIELDS) | (set(_CONTEXT_FIELDS) if finetune else set())
    if (saved["tokenizer_vocab_size"] or saved["vocab_size"]) == current.real_vocab_size:
        free |= {"vocab_size", "tokenizer_vocab_size"}
    if saved["position_embedding_type"] == now["position_embedding_type"] == "rope":
        free.add("max_position_embeddings")  # rotary positions have no table: a stated limit, no weights
    saved = {**{key: value for key, value in _DEFAULTS.items() if key in now}, **saved}
    differing = [key for key in sorted(set(saved) | set(now))
                 if key not in free and saved.get(key, "<absent>") != now.get(key, "<absent>")]
    if not differing:
        return
    differences = "; ".join(f"{key} (checkpoint {saved.get(key, '<absent>')!r}, now {now.get(key, '<absent>')!r})"
                            for key in differing)
    if set(differing) <= set(_CONTEXT_FIELDS):
        flags = " ".join("--" + key.replace("_", "-") for key in differing)
        raise UserError(f"checkpoint {path} was saved with other settings of {flags}: {differences}; a resume "
                        f"continues the saved run as it was, so pass its values, or add --finetune to start a new "
                        f"run from its weights (continued pretraining, docs/training.md)")
    if "max_position_embeddings" in differing and now["position_embedding_type"] == "learned_absolute":
        differences += (" (learned position embeddings hold one row per position, so --max-position-embeddings "
                        "must stay the checkpoint's; a longer --seq-length needs a table saved that long)")
    raise UserError(f"checkpoint {path} was saved from a different model: {differences}; "
                    f"pass the same model flags (or --model) as the saved run")


class CheckpointReader(contextlib.ExitStack):
    """Reads any slice of any tensor of one checkpoint folder from the pieces that cover it. Each file
    is opened once and read lazily, only the bytes a slice needs; leaving the `with` closes them."""

    def __init__(self, path: str, metadata: dict):
        super().__init__()
        self.path, self.metadata, self.index = path, metadata, metadata["tensors"]
        self._files = {}

    def shape(self, section: str, name: str) -> tuple[int, ...]:
        return tuple(self._entry(section, name)["shape"])

    def read(self, section: str, name: str, offsets=None, shape=None, pad_rows: bool = False) -> torch.Tensor:
        """`global[offsets : offsets + shape]` (default: all) of tensor `name` of `section`, in the
        checkpoint's dtype. `pad_rows`: rows past the saved dim 0 read as zero (vocabulary padding).
        UserError when the stored pieces do not cover the region."""
        entry = self._entry(section, name)
        global_shape = entry["shape"]
        offsets = list(offsets) if offsets is not None else [0] * len(global_shape)
        shape = list(shape) if shape is not None else list(global_shape)
        limits = list(global_shape)
        if pad_rows and limits:
            limits[0] = max(limits[0], offsets[0] + shape[0])
        if not _fits(offsets, shape, limits):
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
            self._files[file_name] = self.enter_context(open_safetensors(os.path.join(self.path, file_name), size))
        return self._files[file_name]


def open_safetensors(path: str, size: int | None = None):
    """`safe_open(path)`; UserError naming the file when it is missing, not safetensors, or not
    `size` bytes long. safetensors checks its JSON header against the file size, so a pickle, a
    truncated file or random bytes are refused without executing anything."""
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
