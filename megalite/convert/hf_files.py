"""Hugging Face model folders on disk: safetensors written tensor by tensor, and read lazily. A
safetensors file is an 8-byte header length, a JSON header (name -> dtype, shape, byte offsets) and the
raw tensor bytes; writing the header first lets each tensor be written as soon as it is converted, so
memory stays near the largest tensor."""

import json
import math
import os
import re

import torch

from megalite.errors import UserError

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64"}
WEIGHTS_FILE, INDEX_FILE = "model.safetensors", "model.safetensors.index.json"
# HF tensors that are not weights: causal-mask buffers of old GPT-2 files, rotary tables of old LLaMA files.
IGNORED_HF_TENSORS = re.compile(r"(\.attn\.(bias|masked_bias)|\.rotary_emb\.inv_freq)$")


class StreamingSafetensorsWriter:
    """Writes one safetensors file of the planned `entries` [(name, dtype, shape)], one tensor at a time
    in that order; the file appears under its name only when `close` has checked that all were written."""

    def __init__(self, path: str, entries: list[tuple[str, torch.dtype, tuple[int, ...]]]):
        self.path, self.entries, self.position = path, entries, 0
        header, offset = {"__metadata__": {"format": "pt"}}, 0
        for name, dtype, shape in entries:
            size = tensor_nbytes(dtype, shape)
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


def tensor_nbytes(dtype: torch.dtype, shape) -> int:
    return math.prod(shape) * dtype.itemsize


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
        nbytes = tensor_nbytes(entry[1], entry[2])
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
        self.folder, self.prefix = folder, prefix
        self.used: set[str] = set()
        self._open = {}
        index_path, single = os.path.join(folder, INDEX_FILE), os.path.join(folder, WEIGHTS_FILE)
        if os.path.isfile(index_path):
            with open(index_path) as file:
                self.files = json.load(file)["weight_map"]  # tensor name -> file name
        elif os.path.isfile(single):
            self.files = {name: WEIGHTS_FILE for name in self._handle(single).keys()}
        else:
            pickled = [name for name in ("pytorch_model.bin", "pytorch_model.bin.index.json")
                       if os.path.exists(os.path.join(folder, name))]
            found = f" (it has {pickled[0]}, a pickle, which megalite does not load)" if pickled else ""
            raise UserError(f"{folder} holds no {WEIGHTS_FILE} or {INDEX_FILE}{found}; save the model with "
                            f"save_pretrained(..., safe_serialization=True) first")

    def _handle(self, path: str):
        from safetensors import safe_open

        if path not in self._open:
            if not os.path.isfile(path):
                raise UserError(f"{path} is listed in {INDEX_FILE} but missing; download the whole model folder")
            self._open[path] = safe_open(path, framework="pt")
        return self._open[path]

    def get(self, name: str) -> torch.Tensor:
        """The stored tensor `name`, which lacks the base-model prefix when saved from the base model."""
        stored = next((n for n in (name, name.removeprefix(self.prefix)) if n in self.files), None)
        if stored is None:
            raise UserError(f"{self.folder} has no tensor {name!r} that its config.json implies; the weights "
                            f"do not match the config")
        self.used.add(stored)
        return self._handle(os.path.join(self.folder, self.files[stored])).get_tensor(stored)

    def unused(self) -> list[str]:
        """The stored weights no `get` has read, sorted (non-weight buffers left out)."""
        return sorted(name for name in self.files if name not in self.used and not IGNORED_HF_TENSORS.search(name))
