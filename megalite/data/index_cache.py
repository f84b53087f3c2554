"""Build-once cache for dataset indices (`.npy` files keyed by a hash of their inputs): local rank 0
builds and publishes atomically, a `description.json` last; the others wait for it (docs/data.md)."""

import hashlib
import json
import os
import time

import numpy as np

from megalite.errors import UserError

WAIT_TIMEOUT_S = float(os.environ.get("MEGALITE_INDEX_CACHE_TIMEOUT", 3600))


def description_hash(description: dict) -> str:
    """Stable md5 of a JSON-able description of everything that affects the indices."""
    text = json.dumps(description, sort_keys=True)
    return hashlib.md5(text.encode("utf-8"), usedforsecurity=False).hexdigest()


def file_fingerprint(path: str) -> str:
    """Size and md5 of the first and last MiB: catches a file rebuilt in place without reading it whole."""
    size = os.path.getsize(path)
    digest = hashlib.md5(usedforsecurity=False)
    with open(path, "rb") as f:
        digest.update(f.read(1 << 20))
        if size > 2 << 20:
            f.seek(size - (1 << 20))
            digest.update(f.read())
    return f"{size}:{digest.hexdigest()}"


def is_builder_process() -> bool:
    """The node's first process builds; with no distributed run, this process does."""
    local_rank = os.environ.get("LOCAL_RANK")
    if local_rank is not None:
        return int(local_rank) == 0
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def load_or_build(cache_dir: str | None, name: str, description: dict, build):
    """The dict of arrays `build()` makes, from the cache in `cache_dir` when it holds them. cache_dir None
    builds in memory. name: readable part of the file names ("GPTDataset-train"). description: JSON-able
    inputs of `build`, whose hash keys the files."""
    if cache_dir is None:
        return build()
    base = os.path.join(cache_dir, f"{description_hash(description)}-{name}")
    marker = base + "-description.json"
    if not os.path.isfile(marker):
        if is_builder_process():
            start = time.perf_counter()
            arrays = build()
            try:
                os.makedirs(cache_dir, exist_ok=True)
                for key, array in arrays.items():
                    atomic_write(f"{base}-{key}.npy", lambda f, a=array: np.save(f, a, allow_pickle=False))
                record = {"description": description, "arrays": sorted(arrays)}
                atomic_write(marker, lambda f: f.write(json.dumps(record, indent=1).encode()))
            except OSError as err:
                raise UserError(f"cannot write the dataset index cache in {cache_dir} ({err.strerror}); point "
                                "--data-cache-path at a writable folder") from err
            print(f"built {name} indices in {time.perf_counter() - start:.2f} s -> {base}-*.npy")
            return arrays
        deadline = time.monotonic() + WAIT_TIMEOUT_S
        while not os.path.isfile(marker):
            if time.monotonic() > deadline:
                raise UserError(f"waited {WAIT_TIMEOUT_S:.0f} s for another process to build {marker}; check the "
                                "log of local rank 0 for its error, or raise MEGALITE_INDEX_CACHE_TIMEOUT if "
                                "building is just slow")
            time.sleep(0.2)
    keys = json.load(open(marker))["arrays"]
    return {key: np.load(f"{base}-{key}.npy", mmap_mode="r") for key in keys}


def atomic_write(path: str, write) -> None:
    """`write(file)` into a temporary file opened for binary writing, then renamed to `path`: a reader sees
    the old file or the whole new one."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            write(f)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
