"""Regenerate tests/data/golden/megatron_samples.json with Megatron-LM's own dataset code.

Development aid, not a dependency: run it in a scratch environment that has
`megatron-core` installed (`pip install --no-deps megatron-core` beside torch) and
megalite (`pip install --no-deps -e .`). It builds GPT datasets and blends with
Megatron's classes on small token files that `write_golden_token_files` makes
deterministically, and records an md5 of every split's samples in order;
tests/data/test_megatron_golden.py checks megalite's samples against those digests.

    python tools/dev/megatron_golden.py            # rewrites the golden file
"""

import hashlib
import json
import os
import tempfile

import numpy as np

GOLDEN_PATH = os.path.join(os.path.dirname(__file__), "..", "..", "tests", "data", "golden",
                           "megatron_samples.json")
# name, prefixes, weights, split, seq_length, seed, samples per split
CASES = [
    ("single", ["a"], None, "949,40,11", 32, 1234, [500, 20, 5]),
    ("many_epochs", ["a"], None, "90,10,0", 64, 7, [100, 10, 0]),
    ("separate_final_epoch", ["a"], None, "80,20", 16, 3, [2000, 300, 0]),
    ("weighted_blend", ["a", "b", "c"], [0.5, 0.3, 0.2], "90,5,5", 32, 1234, [400, 40, 40]),
    ("size_weighted_blend", ["a", "b"], None, "90,5,5", 32, 1234, [100, 20, 10]),
]
TOKEN_FILES = {"a": (300, 200, 0), "b": (500, 50, 1), "c": (40, 900, 2)}  # docs, max length, seed


def golden_documents(num_docs: int, max_length: int, seed: int) -> list[np.ndarray]:
    """Deterministic documents of random ids in [1, 1000) and lengths in [1, max_length)."""
    rng = np.random.RandomState(seed)
    return [rng.randint(1, 1000, size=rng.randint(1, max_length)) for _ in range(num_docs)]


def write_golden_token_files(folder: str, builder_cls) -> dict[str, str]:
    """Write the files of TOKEN_FILES with `builder_cls` (megalite's builder); name -> prefix."""
    prefixes = {}
    for name, spec in TOKEN_FILES.items():
        prefixes[name] = os.path.join(folder, name)
        with builder_cls(prefixes[name], np.uint16) as builder:
            for doc in golden_documents(*spec):
                builder.add_document(doc)
    return prefixes


def samples_digest(dataset, count: int) -> str:
    """md5 over the first `count` samples' input tokens, in order."""
    digest = hashlib.md5(usedforsecurity=False)
    for i in range(count):
        digest.update(np.asarray(dataset[i]["tokens"], dtype=np.int64).tobytes())
    return digest.hexdigest()


def main() -> None:
    import torch.distributed as dist
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    from megalite.data.indexed_dataset import IndexedDatasetBuilder

    class Tokenizer:  # the fields Megatron's GPTDataset reads
        eod, pad, unique_identifiers, vocab_size = 0, -1, {}, 1000

    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:29571", rank=0, world_size=1)
    folder = tempfile.mkdtemp()
    prefixes = write_golden_token_files(folder, IndexedDatasetBuilder)
    golden = {}
    for name, files, weights, split, seq_length, seed, sizes in CASES:
        config = GPTDatasetConfig(
            random_seed=seed, sequence_length=seq_length, split=split, tokenizer=Tokenizer(),
            blend=([prefixes[f] for f in files], weights), reset_position_ids=False,
            reset_attention_mask=False, eod_mask_loss=False,
            path_to_cache=os.path.join(folder, "cache"),
        )
        datasets = BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, config).build()
        golden[name] = [
            None if ds is None or size == 0 else samples_digest(ds, size)
            for ds, size in zip(datasets, sizes)
        ]
        print(name, golden[name])
    with open(GOLDEN_PATH, "w") as f:
        json.dump(golden, f, indent=1)
    print(f"wrote {os.path.normpath(GOLDEN_PATH)}")


if __name__ == "__main__":
    main()
