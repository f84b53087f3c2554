"""RNG states in a checkpoint, one safetensors file per rank, so a resumed run draws the same
random numbers (dropout masks) as the run that saved it. Nothing is pickled: the python and
numpy states beside the keys are JSON in the file's header."""

import json
import random

import numpy as np
import torch
from megalite.checkpoint.format import open_safetensors, save_safetensors
from megalite.tensor_parallel.random import model_parallel_rng_tracker


def write_rng_state(path: str) -> None:
    """Write this process's python, numpy, torch CPU, CUDA and TP-region RNG states to `path`."""
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
    save_safetensors(tensors, path, meta)


def restore_rng_state(path: str, size: int | None = None) -> None:
    """Set this process's RNGs from a file of `write_rng_state` (of `size` bytes when known)."""
    with open_safetensors(path, size) as file:
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
