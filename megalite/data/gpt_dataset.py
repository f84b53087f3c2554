"""GPT training samples from token files, in the order Megatron's GPTDataset gives them.

Three indices turn a token file into samples (docs/data.md explains them at length):

- document index: the split's document ids repeated for enough epochs, shuffled with
  `numpy.random.RandomState(seed)`; a short final epoch is shuffled on its own;
- sample index: row i = (position in the document index, token offset) where sample i
  starts; consecutive samples overlap by one token, so sample i covers the tokens
  `[i * seq_length, i * seq_length + seq_length + 1)` of the concatenated documents;
- shuffle index: a permutation of the samples (the short final epoch apart).

Megatron builds the sample index with a compiled helper; megalite derives it from a
cumulative sum and a binary search in numpy, which gives the same rows.
"""

from dataclasses import dataclass
import os
import re

import numpy as np
import torch

from megalite.data.index_cache import description_hash, load_or_build
from megalite.errors import UserError

SPLIT_NAMES = ("train", "valid", "test")
SEPARATE_FINAL_EPOCH_THRESHOLD = 0.80  # Megatron's: a final epoch under 80% is shuffled apart


@dataclass
class GPTDatasetConfig:
    """What shapes a GPT sample, besides the token file and the split."""

    seq_length: int
    seed: int
    eod: int | None = None  # end-of-document id; needed by the two flags below
    pad: int | None = None  # labels equal to it are masked, as Megatron does
    eod_mask_loss: bool = False
    reset_position_ids: bool = False
    cache_dir: str | None = None  # None: beside the data, in cache/


def parse_split(split: str) -> list[float]:
    """`"969,30,1"` -> normalised train/valid/test weights `[0.969, 0.03, 0.001]`."""
    parts = re.findall(r"[^,/\s]+", split)
    if not parts or len(parts) > 3 or not all(re.fullmatch(r"\d*\.?\d+", p) for p in parts):
        raise UserError(
            f"--split {split!r} is not up to three non-negative numbers such as 969,30,1"
        )
    weights = [float(p) for p in parts] + [0.0] * (3 - len(parts))
    if sum(weights) <= 0:
        raise UserError(f"--split {split!r} gives every split weight 0; give train a positive share")
    return [w / sum(weights) for w in weights]


def split_document_ranges(split: str, num_documents: int) -> list[tuple[int, int] | None]:
    """Contiguous document ranges `[begin, end)` for train, valid and test.

    Bounds are the cumulative weights times the document count, rounded (Python's
    round, as Megatron). A split of weight 0 is None.
    """
    bounds = np.concatenate([[0.0], np.cumsum(parse_split(split))])
    ranges = []
    for begin, end in zip(bounds[:-1], bounds[1:]):
        if end <= begin:
            ranges.append(None)
        else:
            ranges.append(
                (int(round(begin * float(num_documents))), int(round(end * float(num_documents))))
            )
    return ranges


def num_epochs_for(num_samples: int | None, tokens_per_epoch: int, seq_length: int) -> int:
    """Fewest epochs whose tokens cover `num_samples` samples of `seq_length + 1` tokens."""
    if num_samples is None:
        return 1
    needed = num_samples * seq_length + 1
    return max(1, -(-needed // tokens_per_epoch))


def needs_separate_final_epoch(
    num_samples: int | None, num_epochs: int, tokens_per_epoch: int, seq_length: int
) -> bool:
    """True when the last epoch contributes under 80% of an epoch's samples."""
    if num_epochs == 1:
        return False
    samples_before_final = ((num_epochs - 1) * tokens_per_epoch - 1) // seq_length
    samples_from_final = num_samples - samples_before_final
    samples_per_epoch = (tokens_per_epoch - 1) // seq_length
    return samples_from_final < int(SEPARATE_FINAL_EPOCH_THRESHOLD * samples_per_epoch)


def build_document_index(
    documents: np.ndarray, num_epochs: int, rng: np.random.RandomState, separate_final_epoch: bool
) -> np.ndarray:
    """Document ids tiled `num_epochs` times and shuffled. Shape: [num_epochs * len(documents)]."""
    if separate_final_epoch and num_epochs > 1:
        first = build_document_index(documents, num_epochs - 1, rng, False)
        last = build_document_index(documents, 1, rng, False)
        return np.concatenate([first, last])
    document_index = np.tile(documents.astype(np.int32), num_epochs)
    rng.shuffle(document_index)
    return document_index


def build_sample_index(
    sequence_lengths: np.ndarray, document_index: np.ndarray, seq_length: int, num_epochs: int,
    tokens_per_epoch: int,
) -> np.ndarray:
    """Start of every sample in the document index, plus one end row. Shape: [n + 1, 2].

    Row i = (position p in the document index, token offset in document_index[p]).
    Sample i starts at token i * seq_length of the concatenated documents; the last
    partial sample is dropped.
    """
    num_samples = (num_epochs * tokens_per_epoch - 1) // seq_length
    lengths = sequence_lengths[document_index].astype(np.int64)
    ends = np.cumsum(lengths)  # [len(document_index)]: token position just past each document
    starts = np.arange(num_samples + 1, dtype=np.int64) * seq_length
    positions = np.searchsorted(ends, starts, side="right")
    offsets = starts - (ends[positions] - lengths[positions])
    index_dtype = np.int32 if max(len(document_index), int(lengths.max(initial=0))) < 2**31 else np.int64
    sample_index = np.stack([positions, offsets], axis=1).astype(index_dtype)
    sample_index[0] = 0  # Megatron starts at (0, 0) even when the first document is empty
    return sample_index


def build_shuffle_index(num_samples: int, total_size: int, rng: np.random.RandomState) -> np.ndarray:
    """A permutation of [0, num_samples) followed by one of [num_samples, total_size)."""
    dtype = np.uint32 if total_size < np.iinfo(np.uint32).max - 1 else np.int64
    first = np.arange(num_samples, dtype=dtype)
    rng.shuffle(first)
    if num_samples == total_size:
        return first
    last = np.arange(num_samples, total_size, dtype=dtype)
    rng.shuffle(last)
    return np.concatenate([first, last])


def build_gpt_indices(
    sequence_lengths: np.ndarray, documents: np.ndarray, num_samples: int | None, seq_length: int,
    seed: int,
) -> dict[str, np.ndarray]:
    """The document, sample and shuffle indices of one split, Megatron's algorithm."""
    tokens_per_epoch = int(sequence_lengths[documents].sum(dtype=np.int64))
    if tokens_per_epoch <= seq_length:
        raise UserError(
            f"the split has {tokens_per_epoch} tokens, not enough for one sample of "
            f"--seq-length {seq_length} plus one; give it more data via --split or --data-path"
        )
    num_epochs = num_epochs_for(num_samples, tokens_per_epoch, seq_length)
    separate = needs_separate_final_epoch(num_samples, num_epochs, tokens_per_epoch, seq_length)
    rng = np.random.RandomState(seed)
    document_index = build_document_index(documents, num_epochs, rng, separate)
    sample_index = build_sample_index(
        sequence_lengths, document_index, seq_length, num_epochs, tokens_per_epoch
    )
    total = len(sample_index) - 1
    if separate:
        first_part = ((num_epochs - 1) * tokens_per_epoch - 1) // seq_length
        shuffle_index = build_shuffle_index(first_part, total, rng)
    else:
        shuffle_index = build_shuffle_index(total, total, rng)
    return {"document_index": document_index, "sample_index": sample_index, "shuffle_index": shuffle_index}


class GPTDataset(torch.utils.data.Dataset):
    """Samples of `seq_length` tokens from one split of a token dataset.

    indexed: an IndexedDataset or MockTokenDataset (sequence_lengths, get, path_prefix).
    documents: the split's document ids. num_samples: how many samples training needs
    (None: one epoch). Items are dicts of `tokens`, `labels`, `loss_mask`,
    `position_ids`, each of shape [seq_length].
    """

    def __init__(self, indexed, documents: np.ndarray, num_samples: int | None, split_name: str,
                 config: GPTDatasetConfig):
        self.indexed = indexed
        self.config = config
        self.split_name = split_name
        description = {
            "class": "GPTDataset",
            "path_prefix": os.path.abspath(indexed.path_prefix) if indexed.path_prefix else None,
            "index_file": indexed.fingerprint(),
            "split": split_name,
            "documents": [int(documents[0]), int(documents[-1]) + 1] if len(documents) else [0, 0],
            "num_samples": num_samples,
            "seq_length": config.seq_length,
            "seed": config.seed,
            "add_extra_token_to_sequence": True,
        }
        self.cache_key = description_hash(description)
        indices = load_or_build(
            self._cache_dir(), f"GPTDataset-{split_name}", description,
            lambda: build_gpt_indices(
                indexed.sequence_lengths, documents, num_samples, config.seq_length, config.seed
            ),
        )
        self.document_index = indices["document_index"]
        self.sample_index = indices["sample_index"]
        self.shuffle_index = indices["shuffle_index"]

    def _cache_dir(self) -> str | None:
        if self.indexed.path_prefix is None:  # synthetic data: cheap to rebuild, nothing to key on
            return None
        return cache_dir_for(self.indexed.path_prefix, self.config.cache_dir)

    def __len__(self) -> int:
        return len(self.sample_index) - 1

    def sample_tokens(self, idx: int) -> np.ndarray:
        """The `seq_length + 1` token ids of sample idx. Shape: [seq_length + 1]."""
        idx = int(self.shuffle_index[idx])
        begin_pos, begin_offset = (int(v) for v in self.sample_index[idx])
        end_pos, end_offset = (int(v) for v in self.sample_index[idx + 1])
        if begin_pos == end_pos:
            doc = int(self.document_index[begin_pos])
            return self.indexed.get(doc, begin_offset, end_offset - begin_offset + 1)
        parts = []
        for pos in range(begin_pos, end_pos + 1):
            doc = int(self.document_index[pos])
            offset = begin_offset if pos == begin_pos else 0
            length = end_offset + 1 if pos == end_pos else None
            parts.append(self.indexed.get(doc, offset, length))
        return np.concatenate(parts)

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        text = torch.from_numpy(self.sample_tokens(idx).astype(np.int64))
        tokens, labels = text[:-1].contiguous(), text[1:].contiguous()
        return {"tokens": tokens, "labels": labels, **ltor_masks(tokens, labels, self.config)}


def ltor_masks(tokens: torch.Tensor, labels: torch.Tensor, config: GPTDatasetConfig) -> dict:
    """Loss mask and position ids of one left-to-right sample. tokens, labels: [s].

    As in Megatron, `eod_mask_loss` masks the positions whose *input* is EOD (predicting
    across a document boundary), and `reset_position_ids` restarts positions after each
    EOD; labels equal to the pad id are masked.
    """
    loss_mask = torch.ones(tokens.shape, dtype=torch.float32)
    if config.eod_mask_loss:
        loss_mask[tokens == config.eod] = 0.0
    if config.pad is not None and config.pad >= 0:
        loss_mask[labels == config.pad] = 0.0
    position_ids = torch.arange(len(tokens), dtype=torch.int64)
    if config.reset_position_ids:
        starts_document = torch.zeros_like(tokens, dtype=torch.bool)
        starts_document[1:] = tokens[:-1] == config.eod
        # Subtract, at every position, where its document began (the latest start so far).
        segment_start = torch.cummax(torch.where(starts_document, position_ids, 0), 0).values
        position_ids = position_ids - segment_start
    return {"loss_mask": loss_mask, "position_ids": position_ids}


def cache_dir_for(path_prefix: str, cache_dir: str | None) -> str:
    """`--data-cache-path` when given, else a `cache/` folder beside the token files."""
    if cache_dir is not None:
        return cache_dir
    return os.path.join(os.path.dirname(os.path.abspath(path_prefix)), "cache")


def validate_config(config: GPTDatasetConfig) -> None:
    """Flags that need an EOD id must have one."""
    if (config.eod_mask_loss or config.reset_position_ids) and config.eod is None:
        raise UserError(
            "--eod-mask-loss and --reset-position-ids need an end-of-document token, but the "
            "tokenizer has none; use a tokenizer with an EOS/EOD id or drop those flags"
        )
