"""A megalite checkpoint of any layout -> a Hugging Face folder that `transformers` loads offline.

Export streams: each megalite tensor is assembled from the checkpoint's pieces, converted
(megalite/convert/maps.py) and written straight into its safetensors file, so memory stays
near the largest tensor whatever the model size. Files above the shard size are split into
`model-0000k-of-0000n.safetensors` with `model.safetensors.index.json`.
"""

import json
import os
import re
import time
from collections.abc import Callable

import torch

from megalite.checkpoint import CheckpointReader, read_metadata, resolve_checkpoint
from megalite.config import ModelConfig
from megalite.convert.configs import hf_architecture, hf_config_for
from megalite.convert.hf_files import (INDEX_FILE, WEIGHTS_FILE, StreamingSafetensorsWriter, parse_size, shard_plan,
                                       tensor_nbytes)
from megalite.convert.maps import TensorMap, hf_shapes, tensor_maps, to_hf
from megalite.convert.tokenizer import export_tokenizer
from megalite.errors import UserError


def export_checkpoint(load: str, save: str, iteration: int | None = None, dtype: torch.dtype | None = None,
                      max_shard_size: str = "5GB", tokenizer_type: str | None = None,
                      tokenizer_model: str | None = None, skip_tokenizer: bool = False,
                      log: Callable[[str], None] = print) -> None:
    """Write checkpoint `load` (the latest, or `iteration`) as HF folder `save`: config.json,
    generation_config.json, the weights and (unless skip_tokenizer) the tokenizer.

    dtype: the weights' dtype, default as stored. max_shard_size: e.g. "5GB", "500MB".
    tokenizer_type / tokenizer_model: default the run's, as its checkpoint records them.
    UserError when the model has no HF architecture or the checkpoint lacks its tensors.
    """
    max_bytes = parse_size(max_shard_size)
    start = time.perf_counter()
    path = resolve_checkpoint(load, iteration)
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
    os.makedirs(save, exist_ok=True)
    _remove_old_weights(save)

    tokenizer_line, ids = "none (--skip-tokenizer)", {"bos": None, "eos": None, "pad": None}
    if not skip_tokenizer:
        tokenizer_line, ids = _export_tokenizer(load, save, metadata, config, tokenizer_type, tokenizer_model)
    hf_config = hf_config_for(config, dtype or _stored_dtype(metadata), **ids)
    hf_config.save_pretrained(save)
    _save_generation_config(save, ids)

    entries = _plan(metadata, maps, config, dtype)
    files = _write_weights(path, metadata, maps, config, entries, max_bytes, save)
    total = sum(tensor_nbytes(dtype, shape) for _, dtype, shape in entries)
    log(f"wrote {save}: {architecture}, {len(entries)} tensors, {total / 1e6:.1f} MB in {len(files)} "
        f"file(s), from {path} (iteration {metadata['iteration']}) in {time.perf_counter() - start:.1f} s")
    log(f"tokenizer: {tokenizer_line}")


def load_model_config(metadata: dict) -> ModelConfig:
    """The ModelConfig a checkpoint's metadata records (fields this version does not know are dropped)."""
    fields = {field for field in ModelConfig.__dataclass_fields__}
    return ModelConfig(**{key: value for key, value in metadata["model_config"].items() if key in fields})


def _stored_dtype(metadata: dict) -> torch.dtype:
    """The dtype of the checkpoint's embedding: what the run trained in."""
    return getattr(torch, metadata["tensors"]["model"]["embedding.word_embeddings.weight"]["dtype"])


def _plan(metadata: dict, maps: list[TensorMap], config: ModelConfig, dtype: torch.dtype | None):
    """[(hf name, dtype, shape)] of every HF tensor, in the order `maps` produces them."""
    entries = []
    for tensor_map in maps:
        entry = metadata["tensors"]["model"][tensor_map.ours]
        out_dtype = dtype or getattr(torch, entry["dtype"])
        for name, shape in zip(tensor_map.theirs, hf_shapes(tensor_map, tuple(entry["shape"]), config)):
            entries.append((name, out_dtype, shape))
    return entries


def _write_weights(path: str, metadata: dict, maps: list[TensorMap], config: ModelConfig, entries: list,
                   max_bytes: int, save: str) -> list[str]:
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
        total = sum(tensor_nbytes(dtype, shape) for _, dtype, shape in entries)
        with open(os.path.join(save, INDEX_FILE), "w") as file:
            json.dump({"metadata": {"total_size": total}, "weight_map": file_of}, file, indent=2)
            file.write("\n")
    return names


def _remove_old_weights(save: str) -> None:
    """An earlier export's shards would mix with the new ones: remove our own file names only."""
    for name in os.listdir(save):
        if name in (WEIGHTS_FILE, INDEX_FILE) or re.fullmatch(r"model-\d{5}-of-\d{5}\.safetensors", name):
            os.remove(os.path.join(save, name))


def _export_tokenizer(load: str, save: str, metadata: dict, config: ModelConfig, tokenizer_type: str | None,
                      tokenizer_model: str | None) -> tuple[str, dict]:
    """The run's tokenizer (or the one given) into `save`: (a one-line description, special token ids)."""
    data = metadata.get("extra", {}).get("run", {}).get("data", {})
    tokenizer_type = tokenizer_type or data.get("tokenizer_type")
    tokenizer_model = tokenizer_model or data.get("tokenizer_model")
    if tokenizer_type is None:
        raise UserError(f"{load} does not record its tokenizer; pass --tokenizer-type and --tokenizer-model, "
                        f"or --skip-tokenizer to export the model only")
    if tokenizer_model is not None and tokenizer_type != "NullTokenizer" and not os.path.exists(tokenizer_model):
        raise UserError(f"the run's tokenizer {tokenizer_model} does not exist (moved?); pass --tokenizer-model "
                        f"PATH, or --skip-tokenizer to export the model only")
    return export_tokenizer(tokenizer_type, tokenizer_model, data.get("vocab_size"), save, config)


def _save_generation_config(save: str, ids: dict) -> None:
    from transformers import GenerationConfig

    GenerationConfig(bos_token_id=ids["bos"], eos_token_id=ids["eos"], pad_token_id=ids["pad"]).save_pretrained(save)
