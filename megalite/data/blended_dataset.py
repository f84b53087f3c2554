"""Weighted blends of several datasets, sample by sample, as Megatron's BlendedDataset: sample i comes
from the dataset d maximising `w_d * max(i, 1) - count_d` (the lowest d on ties)."""

import numpy as np
import torch

from megalite.data.index_cache import load_or_build
from megalite.errors import UserError

SURPLUS = 0.005  # each part is built 0.5% larger than its share, as Megatron does


def samples_per_dataset(weights: list[float], size: int, surplus: float = 0.0) -> list[int]:
    """Samples to build from each dataset of a blend of `size` samples (normalised weights)."""
    return [int(np.ceil(np.ceil(size * w) * (1 + surplus))) for w in weights]


def build_blending_indices(weights: list[float], size: int) -> dict[str, np.ndarray]:
    """Which dataset, and which of its samples, each blend sample is. Shapes: [size]."""
    weights = [float(w) for w in weights]
    counts = [0] * len(weights)
    chosen, sample_of_chosen = [0] * size, [0] * size
    for i in range(size):
        scale = float(max(i, 1))
        # max() keeps the first of equal errors: ties go to the lowest index.
        best = max(range(len(weights)), key=lambda d: weights[d] * scale - counts[d])
        chosen[i], sample_of_chosen[i] = best, counts[best]
        counts[best] += 1
    return {"dataset_index": np.array(chosen, dtype=np.int16),
            "dataset_sample_index": np.array(sample_of_chosen, dtype=np.int64)}


class BlendedDataset(torch.utils.data.Dataset):
    """`size` samples drawn from `datasets` in the proportions of `weights` (normalised)."""

    def __init__(self, datasets: list, names: list[str], weights: list[float], size: int,
                 cache_dir: str | None, split_name: str):
        self.datasets, self.weights = datasets, weights
        description = {"class": "BlendedDataset", "weights": self.weights, "size": size, "split": split_name,
                       "datasets": [getattr(d, "cache_key", repr(n)) for d, n in zip(datasets, names)]}
        indices = load_or_build(cache_dir, f"BlendedDataset-{split_name}", description,
                                lambda: build_blending_indices(self.weights, size))
        self.dataset_index = indices["dataset_index"]
        self.dataset_sample_index = indices["dataset_sample_index"]
        needed = np.bincount(np.asarray(self.dataset_index), minlength=len(datasets))
        for dataset, name, count in zip(datasets, names, needed):
            if count > len(dataset):
                raise UserError(f"the blend needs {count} samples from {name} but it provides only {len(dataset)}; "
                                "raise its split share in --split or lower its weight in --data-path")

    def __len__(self) -> int:
        return len(self.dataset_index)

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        dataset = self.datasets[int(self.dataset_index[idx])]
        return dataset[int(self.dataset_sample_index[idx])]
