"""GPT training samples from token files, in the order Megatron's GPTDataset gives them, through the
document, sample and shuffle indices that docs/data.md explains."""

from dataclasses import dataclass
import os
import re

import numpy as np
import torch

from megalite.data.index_cache import description_hash, file_fingerprint, load_or_build
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


def split_document_ranges(split: str, num_documents: int) -> list[tuple[int, int] | None]:
    """Contiguous document ranges `[begin, end)` for train, valid and test from `--split` ("969,30,1"): the
    cumulative normalised weights times the document count, rounded as Megatron does; None for weight 0."""
    parts = re.findall(r"[^,/\s]+", split)
    if not parts or len(parts) > 3 or not all(re.fullmatch(r"\d*\.?\d+", p) for p in parts):
        raise UserError(f"--split {split!r} is not up to three non-negative numbers such as 969,30,1")
    weights = [float(p) for p in parts] + [0.0] * (3 - len(parts))
    if sum(weights) <= 0:
        raise UserError(f"--split {split!r} gives every split weight 0; give train a positive share")
    bounds = np.concatenate([[0.0], np.cumsum([w / sum(weights) for w in weights])])
    return [(int(round(begin * float(num_documents))), int(round(end * float(num_documents))))
            if end > begin else None for begin, end in zip(bounds[:-1], bounds[1:])]


def needs_separate_final_epoch(num_samples: int | None, num_epochs: int, tokens_per_epoch: int,
                               seq_length: int) -> bool:
    """True when the last epoch contributes under 80% of an epoch's samples."""
    if num_epochs == 1:
        return False
    samples_from_final = num_samples - ((num_epochs - 1) * tokens_per_epoch - 1) // seq_length
    samples_per_epoch = (tokens_per_epoch - 1) // seq_length
    return samples_from_final < int(SEPARATE_FINAL_EPOCH_THRESHOLD * samples_per_epoch)


def build_sample_index(sequence_lengths: np.ndarray, document_index: np.ndarray, seq_length: int, num_epochs: int,
                       tokens_per_epoch: int) -> np.ndarray:
    """Start of every sample, plus one end row, as [n + 1, 2] rows (position p in the document index, token
    offset in document_index[p]); the last partial sample is dropped."""
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


def build_gpt_indices(sequence_lengths: np.ndarray, documents: np.ndarray, num_samples: int | None, seq_length: int,
                      seed: int) -> dict[str, np.ndarray]:
    """The document, sample and shuffle indices of one split (num_samples None: one epoch)."""
    tokens_per_epoch = int(sequence_lengths[documents].sum(dtype=np.int64))
    if tokens_per_epoch <= seq_length:
        raise UserError(f"the split has {tokens_per_epoch} tokens, not enough for one sample of --seq-length "
                        f"{seq_length} plus one; give it more data via --split or --data-path")
    num_epochs = 1
    if num_samples is not None:  # the fewest epochs whose tokens cover the samples (ceil division)
        num_epochs = max(1, -(-(num_samples * seq_length + 1) // tokens_per_epoch))
    separate = needs_separate_final_epoch(num_samples, num_epochs, tokens_per_epoch, seq_length)
    rng = np.random.RandomState(seed)
    # One RNG shuffles, in order: documents (all epochs, or all but the last, then the last), then samples (likewise).
    epochs = [num_epochs - 1, 1] if separate else [num_epochs]
    documents = documents.astype(np.int32)
    document_index = np.concatenate([rng.permutation(np.tile(documents, n)) for n in epochs])
    sample_index = build_sample_index(sequence_lengths, document_index, seq_length, num_epochs, tokens_per_epoch)
    total = len(sample_index) - 1
    first = ((num_epochs - 1) * tokens_per_epoch - 1) // seq_length if separate else total
    dtype = np.uint32 if total < np.iinfo(np.uint32).max - 1 else np.int64
    shuffle_index = np.concatenate([rng.permutation(np.arange(first, dtype=dtype)),
                                    rng.permutation(np.arange(first, total, dtype=dtype))])
    return {"document_index": document_index, "sample_index": sample_index, "shuffle_index": shuffle_index}


class GPTDataset(torch.utils.data.Dataset):
    """Samples of `seq_length` tokens from the split `documents` (document ids) of `indexed`, an
    IndexedDataset or MockTokenDataset; `num_samples` None: one epoch. Items are dicts of `tokens`,
    `labels`, `loss_mask`, `position_ids`, each of shape [seq_length]."""

    def __init__(self, indexed, documents: np.ndarray, num_samples: int | None, split_name: str,
                 config: GPTDatasetConfig):
        self.indexed, self.config = indexed, config
        path = indexed.path_prefix  # None for synthetic data: cheap to rebuild, with nothing to key a cache on
        description = {
            "class": "GPTDataset", "path_prefix": os.path.abspath(path) if path else None,
            "index_file": file_fingerprint(path + ".idx") if path else None, "split": split_name,
            "documents": [int(documents[0]), int(documents[-1]) + 1] if len(documents) else [0, 0],
            "num_samples": num_samples, "seq_length": config.seq_length, "seed": config.seed,
            "add_extra_token_to_sequence": True,
        }
        self.cache_key = description_hash(description)
        cache_dir = cache_dir_for(path, config.cache_dir) if path else None
        indices = load_or_build(cache_dir, f"GPTDataset-{split_name}", description, lambda: build_gpt_indices(
            indexed.sequence_lengths, documents, num_samples, config.seq_length, config.seed))
        self.document_index = indices["document_index"]
        self.sample_index = indices["sample_index"]
        self.shuffle_index = indices["shuffle_index"]

    def __len__(self) -> int:
        return len(self.sample_index) - 1

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        idx = int(self.shuffle_index[idx])
        begin_pos, begin_offset = (int(v) for v in self.sample_index[idx])
        end_pos, end_offset = (int(v) for v in self.sample_index[idx + 1])
        parts = []  # the seq_length + 1 tokens of the sample, document by document
        for pos in range(begin_pos, end_pos + 1):
            doc = int(self.document_index[pos])
            start = begin_offset if pos == begin_pos else 0
            stop = end_offset + 1 if pos == end_pos else int(self.indexed.sequence_lengths[doc])
            parts.append(self.indexed.get(doc, start, stop - start))
        text = torch.from_numpy(np.concatenate(parts).astype(np.int64))
        tokens, labels = text[:-1].contiguous(), text[1:].contiguous()
        return {"tokens": tokens, "labels": labels, **ltor_masks(tokens, labels, self.config)}


def ltor_masks(tokens: torch.Tensor, labels: torch.Tensor, config: GPTDatasetConfig) -> dict:
    """Loss mask and position ids of one left-to-right sample (tokens, labels: [s]). As in Megatron,
    `eod_mask_loss` masks the positions whose *input* is EOD, `reset_position_ids` restarts positions
    after each EOD, and labels equal to the pad id are masked."""
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
    return cache_dir if cache_dir is not None else os.path.join(os.path.dirname(os.path.abspath(path_prefix)), "cache")
