"""Convert megalite checkpoints to Hugging Face model folders and back.

    # a checkpoint of any layout -> a folder transformers loads (LlamaForCausalLM or GPT2LMHeadModel)
    python tools/convert_checkpoint.py to-hf --load runs/default --save hf/tiny [--iteration N]
        [--dtype bf16|fp16|fp32] [--max-shard-size 5GB]

    # a local LLaMA / Mistral / GPT-2 folder -> a megalite checkpoint (iteration 0) to continue pretraining
    python tools/convert_checkpoint.py from-hf --load hf/TinyLlama --save ckpt/tinyllama \
        [--tensor-model-parallel-size 2] [--seq-length 2048]

to-hf streams: each megalite tensor is assembled from the checkpoint's pieces, converted
(megalite/hf.py) and written straight into its safetensors file, so memory stays near
the largest tensor whatever the model size. Files above --max-shard-size are split
into `model-0000k-of-0000n.safetensors` with `model.safetensors.index.json`.

from-hf reads `config.json` and the safetensors weights (one file or sharded), refuses
anything megalite would compute differently (naming the config field), writes
`<save>/iter_0000000/` and prints the pretrain_gpt.py flags to continue with
`--load <save> --finetune`. Checkpoints are layout-free, so the layout flags only check
that the model can be split that way (and pad the vocabulary for that TP size); any
other layout loads the checkpoint just as well.
"""

import argparse
import dataclasses
import json
import os
import re
import sys
import time

import torch

from megalite import checkpoint
from megalite.checkpoint import CheckpointReader, Piece, read_metadata, resolve_checkpoint
from megalite.config import ModelConfig
from megalite.data.tokenizer import TOKENIZER_TYPES
from megalite.errors import UserError, run_main
from megalite.hf import (GPT2, export_tokenizer, from_hf, hf_architecture, hf_config_for, hf_shapes,
                         model_fields_from_hf, pretrain_model_flags, tensor_maps, to_hf)
from megalite.model.gpt import build_model

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64"}
WEIGHTS_FILE, INDEX_FILE = "model.safetensors", "model.safetensors.index.json"
# HF tensors that are not weights: causal-mask buffers of old GPT-2 files, rotary tables of old LLaMA files.
IGNORED_HF_TENSORS = re.compile(r"(\.attn\.(bias|masked_bias)|\.rotary_emb\.inv_freq)$")


def parse_args(argv) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--debug", action="store_true", help="show tracebacks of user errors")
    commands = parser.add_subparsers(dest="command", required=True)

    export = commands.add_parser("to-hf", help="megalite checkpoint -> Hugging Face folder")
    export.add_argument("--load", required=True, metavar="DIR", help="checkpoint folder (a run's --save)")
    export.add_argument("--iteration", type=int, metavar="N", help="default: the latest checkpoint")
    export.add_argument("--save", required=True, metavar="DIR", help="the Hugging Face folder to write")
    export.add_argument("--dtype", choices=DTYPES, help="weight dtype; default: as stored in the checkpoint")
    export.add_argument("--max-shard-size", default="5GB", metavar="SIZE",
                        help="split weights into files of at most this size (e.g. 5GB, 500MB); default 5GB")
    export.add_argument("--tokenizer-type", choices=TOKENIZER_TYPES, help="default: the run's")
    export.add_argument("--tokenizer-model", metavar="PATH", help="default: the run's (give it when the file moved)")
    export.add_argument("--skip-tokenizer", action="store_true", help="write the model only")
    export.add_argument("--debug", action="store_true", help=argparse.SUPPRESS)

    load = commands.add_parser("from-hf", help="Hugging Face folder -> megalite checkpoint (iteration 0)")
    load.add_argument("--load", required=True, metavar="DIR",
                      help="local Hugging Face model folder (config.json + safetensors)")
    load.add_argument("--save", required=True, metavar="DIR", help="checkpoint folder to create")
    load.add_argument("--tensor-model-parallel-size", type=int, metavar="N", default=1,
                      help="checks that heads, groups and FFN split this way and pads the vocabulary for it; "
                           "the checkpoint still loads at any layout")
    load.add_argument("--pipeline-model-parallel-size", type=int, metavar="N", default=1,
                      help="checks that the layers split over this many stages")
    load.add_argument("--seq-length", type=int, metavar="N",
                      help="training sequence length to record; default max_position_embeddings, at most 4096")
    load.add_argument("--make-vocab-size-divisible-by", type=int, metavar="N", default=128,
                      help="vocabulary padding, as pretrain_gpt.py's flag of that name (default 128)")
    load.add_argument("--dtype", choices=DTYPES, help="weight dtype; default: as stored in the HF files")
    load.add_argument("--debug", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


# -- safetensors: written tensor by tensor, read lazily ---------------------------------------------


class StreamingSafetensorsWriter:
    """Writes one safetensors file whose tensors (names, dtypes, shapes) are known up front,
    one tensor at a time, so only the tensor being written is in memory.

    entries: [(name, dtype, shape)] in file order; `write` must follow that order.
    The file appears under its name only when `close` has checked that all were written.
    """

    def __init__(self, path: str, entries: list[tuple[str, torch.dtype, tuple[int, ...]]]):
        self.path, self.entries, self.position = path, entries, 0
        header, offset = {"__metadata__": {"format": "pt"}}, 0
        for name, dtype, shape in entries:
            size = _nbytes(dtype, shape)
            header[name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(shape),
                            "data_offsets": [offset, offset + size]}
            offset += size
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
        self.file = open(path + ".tmp", "wb")
        self.file.write(len(text).to_bytes(8, "little") + text)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        expected_name, dtype, shape = self.entries[self.position]
        if (name, tensor.dtype, tuple(tensor.shape)) != (expected_name, dtype, shape):
            raise AssertionError(f"wrote {name} {tensor.dtype} {list(tensor.shape)} where {expected_name} "
                                 f"{dtype} {list(shape)} was planned")
        self.file.write(tensor.contiguous().reshape(-1).view(torch.uint8).numpy())  # no copy: the buffer itself
        self.position += 1

    def close(self) -> None:
        if self.position != len(self.entries):
            raise AssertionError(f"{self.path}: {len(self.entries) - self.position} tensors never written")
        self.file.close()
        os.replace(self.path + ".tmp", self.path)


def _nbytes(dtype: torch.dtype, shape) -> int:
    count = 1
    for size in shape:
        count *= size
    return count * torch.empty((), dtype=dtype).element_size()


def parse_size(text: str) -> int:
    """'5GB', '200MB', '10KB', '1000' -> bytes (powers of 1000, or KiB/MiB/GiB); UserError otherwise."""
    units = {"KIB": 2 ** 10, "MIB": 2 ** 20, "GIB": 2 ** 30, "KB": 10 ** 3, "MB": 10 ** 6, "GB": 10 ** 9, "B": 1}
    cleaned = text.strip().upper().replace(" ", "")
    unit = next((unit for unit in units if cleaned.endswith(unit)), None)
    try:
        value = float(cleaned[:-len(unit)] if unit else cleaned) * units.get(unit, 1)
    except ValueError:
        value = 0.0
    if not 1 <= value < float("inf"):
        raise UserError(f"--max-shard-size {text!r} is not a size; use e.g. 5GB, 500MB or a byte count")
    return int(value)


def shard_plan(entries: list, max_bytes: int) -> list[list]:
    """Consecutive entries grouped into files of at most `max_bytes` (a larger tensor gets its own file)."""
    shards, current, size = [], [], 0
    for entry in entries:
        nbytes = _nbytes(entry[1], entry[2])
        if current and size + nbytes > max_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(entry)
        size += nbytes
    if current:
        shards.append(current)
    return shards


class HFWeights:
    """The tensors of a local HF folder's `model.safetensors` (or its shards), read one at a time."""

    def __init__(self, folder: str, prefix: str):
        index_path, single = os.path.join(folder, INDEX_FILE), os.path.join(folder, WEIGHTS_FILE)
        if os.path.isfile(index_path):
            with open(index_path) as file:
                files = json.load(file)["weight_map"]
        elif os.path.isfile(single):
            files = None
        else:
            pickled = [name for name in ("pytorch_model.bin", "pytorch_model.bin.index.json")
                       if os.path.exists(os.path.join(folder, name))]
            found = f" (it has {pickled[0]}, a pickle, which megalite does not load)" if pickled else ""
            raise UserError(f"{folder} holds no {WEIGHTS_FILE} or {INDEX_FILE}{found}; save the model with "
                            f"save_pretrained(..., safe_serialization=True) first")
        self._open = {}
        self.files = files or {}
        if files is None:
            handle = self._handle(single)
            self.files = {name: WEIGHTS_FILE for name in handle.keys()}
        self.folder, self.prefix = folder, prefix
        self.used: set[str] = set()

    def _handle(self, path: str):
        from safetensors import safe_open

        if path not in self._open:
            if not os.path.isfile(path):
                raise UserError(f"{path} is listed in {INDEX_FILE} but missing; download the whole model folder")
            self._open[path] = safe_open(path, framework="pt")
        return self._open[path]

    def resolve(self, name: str) -> str | None:
        """`name` as stored: HF names drop the base-model prefix when saved from the base model."""
        for candidate in (name, name.removeprefix(self.prefix)):
            if candidate in self.files:
                return candidate
        return None

    def get(self, name: str) -> torch.Tensor:
        stored = self.resolve(name)
        if stored is None:
            raise UserError(f"{self.folder} has no tensor {name!r} that its config.json implies; the weights "
                            f"do not match the config")
        self.used.add(stored)
        return self._handle(os.path.join(self.folder, self.files[stored])).get_tensor(stored)

    def unused(self) -> list[str]:
        return sorted(name for name in self.files if name not in self.used and not IGNORED_HF_TENSORS.search(name))


# -- to-hf ------------------------------------------------------------------------------------------


def load_model_config(metadata: dict) -> ModelConfig:
    fields = {field for field in ModelConfig.__dataclass_fields__}
    return ModelConfig(**{key: value for key, value in metadata["model_config"].items() if key in fields})


def to_hf_main(args) -> None:
    max_bytes = parse_size(args.max_shard_size)
    start = time.perf_counter()
    path = resolve_checkpoint(args.load, args.iteration)
    metadata = read_metadata(path)
    config = load_model_config(metadata)
    architecture = hf_architecture(config)
    maps = tensor_maps(config)
    stored = set(metadata["tensors"]["model"])
    unknown = stored - {tensor_map.ours for tensor_map in maps}
    missing = {tensor_map.ours for tensor_map in maps} - stored
    if unknown or missing:
        raise UserError(f"checkpoint {path} does not hold the tensors its model config implies (unexpected "
                        f"{sorted(unknown)[:3]}, missing {sorted(missing)[:3]}); it is damaged or not a GPTModel")
    os.makedirs(args.save, exist_ok=True)
    _remove_old_weights(args.save)

    tokenizer_line, ids = "none (--skip-tokenizer)", {"bos": None, "eos": None, "pad": None}
    if not args.skip_tokenizer:
        tokenizer_line, ids = _export_tokenizer(args, metadata, config)
    hf_config = hf_config_for(config, DTYPES[args.dtype] if args.dtype else _stored_dtype(metadata), **ids)
    hf_config.save_pretrained(args.save)
    _save_generation_config(args.save, ids)

    entries = _plan(metadata, maps, config, DTYPES.get(args.dtype))
    files = _write_weights(path, metadata, maps, config, entries, max_bytes, args.save)
    total = sum(_nbytes(dtype, shape) for _, dtype, shape in entries)
    print(f"wrote {args.save}: {architecture}, {len(entries)} tensors, {total / 1e6:.1f} MB in {len(files)} "
          f"file(s), from {path} (iteration {metadata['iteration']}) in {time.perf_counter() - start:.1f} s")
    print(f"tokenizer: {tokenizer_line}")


def _stored_dtype(metadata: dict) -> torch.dtype:
    """The dtype of the checkpoint's embedding: what the run trained in."""
    return getattr(torch, metadata["tensors"]["model"]["embedding.word_embeddings.weight"]["dtype"])


def _plan(metadata: dict, maps, config: ModelConfig, dtype: torch.dtype | None):
    """[(hf name, dtype, shape)] of every HF tensor, in the order `maps` produces them."""
    entries = []
    for tensor_map in maps:
        entry = metadata["tensors"]["model"][tensor_map.ours]
        out_dtype = dtype or getattr(torch, entry["dtype"])
        for name, shape in zip(tensor_map.theirs, hf_shapes(tensor_map, tuple(entry["shape"]), config)):
            entries.append((name, out_dtype, shape))
    return entries


def _write_weights(path: str, metadata: dict, maps, config, entries, max_bytes: int, save: str) -> list[str]:
    """Write `entries` (from _plan) into one file or shards of at most `max_bytes`; the file names."""
    shards = shard_plan(entries, max_bytes)
    names = [WEIGHTS_FILE] if len(shards) == 1 else \
        [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    file_of = {entry[0]: name for name, shard in zip(names, shards) for entry in shard}
    shard_index, writer, written = 0, None, 0
    with CheckpointReader(path, metadata) as reader:
        for tensor_map in maps:
            # One megalite tensor (assembled from its pieces) at a time, converted and written at once.
            tensor = reader.read("model", tensor_map.ours)
            for name, part in zip(tensor_map.theirs, to_hf(tensor_map, tensor, config)):
                if writer is None:
                    writer = StreamingSafetensorsWriter(os.path.join(save, names[shard_index]), shards[shard_index])
                writer.write(name, part.to(entries[written][1]))
                written += 1
                if writer.position == len(shards[shard_index]):
                    writer.close()
                    writer, shard_index = None, shard_index + 1
            del tensor
    if len(shards) > 1:
        total = sum(_nbytes(dtype, shape) for _, dtype, shape in entries)
        with open(os.path.join(save, INDEX_FILE), "w") as file:
            json.dump({"metadata": {"total_size": total}, "weight_map": file_of}, file, indent=2)
            file.write("\n")
    return names


def _remove_old_weights(save: str) -> None:
    """An earlier export's shards would mix with the new ones: remove our own file names only."""
    for name in os.listdir(save):
        if name in (WEIGHTS_FILE, INDEX_FILE) or re.fullmatch(r"model-\d{5}-of-\d{5}\.safetensors", name):
            os.remove(os.path.join(save, name))


def _export_tokenizer(args, metadata: dict, config: ModelConfig) -> tuple[str, dict]:
    data = metadata.get("extra", {}).get("run", {}).get("data", {})
    tokenizer_type = args.tokenizer_type or data.get("tokenizer_type")
    tokenizer_model = args.tokenizer_model or data.get("tokenizer_model")
    if tokenizer_type is None:
        raise UserError(f"{args.load} does not record its tokenizer; pass --tokenizer-type and --tokenizer-model, "
                        f"or --skip-tokenizer to export the model only")
    if tokenizer_model is not None and tokenizer_type != "NullTokenizer" and not os.path.exists(tokenizer_model):
        raise UserError(f"the run's tokenizer {tokenizer_model} does not exist (moved?); pass --tokenizer-model "
                        f"PATH, or --skip-tokenizer to export the model only")
    return export_tokenizer(tokenizer_type, tokenizer_model, data.get("vocab_size"), args.save, config)


def _save_generation_config(save: str, ids: dict) -> None:
    from transformers import GenerationConfig

    GenerationConfig(bos_token_id=ids["bos"], eos_token_id=ids["eos"], pad_token_id=ids["pad"]).save_pretrained(save)


# -- from-hf ----------------------------------------------------------------------------------------


def from_hf_main(args) -> None:
    start = time.perf_counter()
    config_path = os.path.join(args.load, "config.json")
    if not os.path.isfile(config_path):
        megalite = os.path.isfile(os.path.join(args.load, checkpoint.LATEST_FILE))
        raise UserError(f"{config_path} does not exist; --load takes a local Hugging Face model folder"
                        + (" (this is a megalite checkpoint: convert it with to-hf)" if megalite else ""))
    if os.path.isdir(args.save) and checkpoint.read_latest_iteration(args.save) is not None:
        raise UserError(f"--save {args.save} already holds a megalite checkpoint; choose a new folder")
    with open(config_path) as file:
        hf = json.load(file)
    imported = model_fields_from_hf(hf, args.seq_length)
    imported.fields["make_vocab_size_divisible_by"] = args.make_vocab_size_divisible_by
    flags, config = pretrain_model_flags(imported.fields, imported.vocab_size, args.tensor_model_parallel_size,
                                         args.pipeline_model_parallel_size)
    weights = HFWeights(args.load, "transformer." if imported.architecture == GPT2 else "model.")
    shapes = {name: tuple(tensor.shape) for name, tensor in build_model(config, 0, device="meta").state_dict().items()}
    tensors = {}
    for tensor_map in tensor_maps(config):
        hf_tensors = [weights.get(name) for name in tensor_map.theirs]
        expected = hf_shapes(tensor_map, shapes[tensor_map.ours], config)
        for name, tensor, shape in zip(tensor_map.theirs, hf_tensors, expected):
            if tuple(tensor.shape) != shape:
                raise UserError(f"{args.load}: {name} has shape {list(tensor.shape)} but config.json implies "
                                f"{list(shape)}; the weights do not match the config")
        tensor = from_hf(tensor_map, hf_tensors, config)
        tensors[tensor_map.ours] = tensor.to(DTYPES[args.dtype]) if args.dtype else tensor
    tied_head = [] if config.untie_embeddings_and_output_weights else ["lm_head.weight"]
    unused = [name for name in weights.unused() if name not in tied_head]
    if unused:
        raise UserError(f"{args.load} holds tensors megalite's {imported.architecture} mapping does not use "
                        f"({', '.join(unused[:3])}{', ...' if len(unused) > 3 else ''}); the model has parts "
                        f"megalite cannot represent")
    tokenizer = _hf_tokenizer_files(args.load)
    extra = {"model_name": f"from-hf:{os.path.basename(os.path.normpath(args.load))}", "model_flags": flags,
             "converted_from": {"path": os.path.abspath(args.load), "architecture": hf.get("architectures"),
                                "vocab_size": imported.vocab_size}}
    if tokenizer:
        # Where tools/generate.py and a later to-hf look for the run's tokenizer.
        extra["run"] = {"data": {"tokenizer_type": "HuggingFaceTokenizer",
                                 "tokenizer_model": os.path.abspath(args.load)}}
    saved = _save_megalite(args.save, tensors, config, extra)
    print(f"wrote {saved}: {imported.architecture} with {sum(t.numel() for t in tensors.values()) / 1e6:.2f}M "
          f"parameters (vocabulary {imported.vocab_size}, padded to {config.vocab_size}) in "
          f"{time.perf_counter() - start:.1f} s")
    _print_next_steps(args, flags, tokenizer, imported.vocab_size)


def _hf_tokenizer_files(folder: str) -> bool:
    return any(os.path.isfile(os.path.join(folder, name))
               for name in ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json"))


def _tokenizer_size_note(folder: str, vocab_size: int) -> str | None:
    """A warning when the folder's tokenizer has another vocabulary than the model (megalite needs them equal)."""
    try:
        from transformers import AutoTokenizer

        size = len(AutoTokenizer.from_pretrained(folder, local_files_only=True))
    except Exception:  # noqa: BLE001 - an unreadable tokenizer only costs the check
        return f"note: could not load the tokenizer of {folder}; training needs one with {vocab_size} tokens"
    if size == vocab_size:
        return None
    return (f"note: the tokenizer of {folder} has {size} tokens but the model's vocabulary is {vocab_size}; "
            f"megalite takes the vocabulary from the tokenizer, so --finetune needs one with {vocab_size} tokens")


def _save_megalite(save: str, tensors: dict, config: ModelConfig, extra: dict) -> str:
    """`<save>/iter_0000000/`: the model only (no optimizer), written as one piece per tensor."""
    staging = checkpoint.begin_save(save, 0)
    checkpoint.write_rank_files(staging, 0, {name: [Piece.full(tensor)] for name, tensor in tensors.items()})
    header = {"iteration": 0, "consumed_samples": 0, "consumed_valid_samples": 0,
              "model_config": dataclasses.asdict(config), "optimizer": None, "extra": extra}
    return checkpoint.finalize_save(save, 0, header)


def _print_next_steps(args, flags: list[str], tokenizer: bool, vocab_size: int) -> None:
    layout = []
    if args.tensor_model_parallel_size > 1:
        layout += ["--tensor-model-parallel-size", str(args.tensor_model_parallel_size)]
    if args.pipeline_model_parallel_size > 1:
        layout += ["--pipeline-model-parallel-size", str(args.pipeline_model_parallel_size)]
    tokenizer_flags = ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", args.load] if tokenizer \
        else ["--tokenizer-type", "...", "--tokenizer-model", "..."]
    note = _tokenizer_size_note(args.load, vocab_size) if tokenizer else None
    if note:
        print(note)
    print("continue pretraining with these model flags (the tokenizer must have "
          f"{vocab_size} tokens):")
    print("  " + " ".join(["pretrain_gpt.py", "--load", args.save, "--finetune", *flags, *layout, *tokenizer_flags,
                           "--data-path", "...", "--save", "..."]))


def main(argv) -> None:
    args = parse_args(argv)
    if args.command == "to-hf":
        to_hf_main(args)
    else:
        from_hf_main(args)


if __name__ == "__main__":
    sys.exit(run_main(main))
