"""A megalite checkpoint of any layout -> a Hugging Face folder that `transformers` loads offline. Each
megalite tensor is assembled from the checkpoint's pieces, converted and written straight into its
safetensors file, so memory stays near the largest tensor. Above the shard size, files are
`model-0000k-of-0000n.safetensors` with `model.safetensors.index.json`."""

import itertools
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
    generation_config.json, the weights and (unless skip_tokenizer) the tokenizer. dtype: default as
    stored. tokenizer_type / tokenizer_model: default the run's, as its checkpoint records them."""
    from transformers import GenerationConfig  # only conversion needs transformers

    max_bytes = parse_size(max_shard_size)
    start = time.perf_counter()
    path = resolve_checkpoint(load, iteration)
    metadata = read_metadata(path)
    config = load_model_config(metadata)
    architecture = hf_architecture(config)
    maps = tensor_maps(config)
    stored_tensors = metadata["tensors"]["model"]  # name -> its dtype, shape and pieces
    stored, expected = set(stored_tensors), {tensor_map.ours for tensor_map in maps}
    unknown, missing = stored - expected, expected - stored
    if unknown or missing:
        raise UserError(f"checkpoint {path} does not hold the tensors its model config implies (unexpected "
                        f"{sorted(unknown)[:3]}, missing {sorted(missing)[:3]}); it is damaged or not a GPTModel")
    os.makedirs(save, exist_ok=True)
    for name in os.listdir(save):  # an earlier export's weight files would mix with the new ones
        if name in (WEIGHTS_FILE, INDEX_FILE) or re.fullmatch(r"model-\d{5}-of-\d{5}\.safetensors", name):
            os.remove(os.path.join(save, name))

    tokenizer_line, ids = "none (--skip-tokenizer)", {"bos": None, "eos": None, "pad": None}
    if not skip_tokenizer:
        tokenizer_line, ids = _export_tokenizer(load, save, metadata, config, tokenizer_type, tokenizer_model)
    # Without dtype, the embedding's: what the run trained in.
    stored_dtype = getattr(torch, stored_tensors["embedding.word_embeddings.weight"]["dtype"])
    hf_config_for(config, dtype or stored_dtype, **ids).save_pretrained(save)
    GenerationConfig(bos_token_id=ids["bos"], eos_token_id=ids["eos"], pad_token_id=ids["pad"]).save_pretrained(save)

    # (hf name, dtype, shape) of every HF tensor, in map order.
    entries = [(name, dtype or getattr(torch, stored_tensors[m.ours]["dtype"]), shape) for m in maps
               for name, shape in zip(m.theirs, hf_shapes(m, tuple(stored_tensors[m.ours]["shape"]), config))]
    files = _write_weights(path, metadata, maps, config, entries, max_bytes, save)
    total = sum(tensor_nbytes(dtype, shape) for _, dtype, shape in entries)
    log(f"wrote {save}: {architecture}, {len(entries)} tensors, {total / 1e6:.1f} MB in {len(files)} "
        f"file(s), from {path} (iteration {metadata['iteration']}) in {time.perf_counter() - start:.1f} s")
    log(f"tokenizer: {tokenizer_line}")


def load_model_config(metadata: dict) -> ModelConfig:
    """The ModelConfig a checkpoint's metadata records (fields this version does not know are dropped)."""
    fields = ModelConfig.__dataclass_fields__
    return ModelConfig(**{key: value for key, value in metadata["model_config"].items() if key in fields})


def _write_weights(path: str, metadata: dict, maps: list[TensorMap], config: ModelConfig, entries: list,
                   max_bytes: int, save: str) -> list[str]:
    """Write `entries` [(hf name, dtype, shape)] into one file or shards of at most `max_bytes`; the file names."""
    shards = shard_plan(entries, max_bytes)
    names = [WEIGHTS_FILE] if len(shards) == 1 else \
        [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    with CheckpointReader(path, metadata) as reader:
        # One megalite tensor (assembled from its pieces) at a time, converted and written at once.
        parts = (named_part for tensor_map in maps for named_part in
                 zip(tensor_map.theirs, to_hf(tensor_map, reader.read("model", tensor_map.ours), config)))
        for file_name, shard in zip(names, shards):
            writer = StreamingSafetensorsWriter(os.path.join(save, file_name), shard)
            for (_, dtype, _), (name, part) in zip(shard, itertools.islice(parts, len(shard))):
                writer.write(name, part.to(dtype))
            writer.close()
    if len(shards) > 1:
        file_of = {entry[0]: name for name, shard in zip(names, shards) for entry in shard}
        total = sum(tensor_nbytes(dtype, shape) for _, dtype, shape in entries)
        with open(os.path.join(save, INDEX_FILE), "w") as file:
            json.dump({"metadata": {"total_size": total}, "weight_map": file_of}, file, indent=2)
            file.write("\n")
    return names


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
