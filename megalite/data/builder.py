"""`build_gpt_datasets`: train/valid/test datasets from `--data-path` style blends (docs/data.md):
every prefix cut by `--split`, or one blend of whole files per split (`--train-data-path` ...)."""

import difflib
import glob
import os

import numpy as np

from megalite.data.blended_dataset import SURPLUS, BlendedDataset, samples_per_dataset
from megalite.data.gpt_dataset import SPLIT_NAMES, GPTDataset, GPTDatasetConfig, cache_dir_for, split_document_ranges
from megalite.data.indexed_dataset import IndexedDataset, exists
from megalite.data.mock_dataset import MockTokenDataset
from megalite.errors import UserError


def parse_data_path(data_path: list[str] | str, flag: str = "--data-path") -> tuple[list[str], list[float] | None]:
    """`["0.3", "a", "0.7", "b"]` -> (["a", "b"], [0.3, 0.7]); plain prefixes -> weights None."""
    items = data_path.split() if isinstance(data_path, str) else list(data_path)
    if not items:
        raise UserError(f"{flag} is empty; pass one or more token file prefixes")
    numeric = [_is_number(item) for item in items]
    if len(items) == 1 or not any(numeric):
        return items, None
    if len(items) % 2 or not all(numeric[0::2]) or any(numeric[1::2]):
        raise UserError(f"{flag} mixes weights and prefixes ({' '.join(items)}); give either prefixes only or "
                        "weight-prefix pairs such as '0.7 data/a_text_document 0.3 data/b_text_document'")
    weights = [float(w) for w in items[0::2]]
    if any(w < 0 for w in weights) or sum(weights) <= 0:
        raise UserError(f"{flag} weights {weights} must be non-negative and not all zero")
    return items[1::2], weights


def _is_number(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False


def open_token_file(prefix: str, flag: str = "--data-path", mmap: bool = True) -> IndexedDataset:
    """Open a `.bin/.idx` pair (memory-mapped unless `mmap` is False); a missing prefix names near matches."""
    if exists(prefix):
        return IndexedDataset(prefix, mmap)
    for suffix in (".bin", ".idx"):
        if prefix.endswith(suffix) and exists(prefix[: -len(suffix)]):
            raise UserError(f"{flag} {prefix} names a file; pass the prefix without '{suffix}'")
    folder = os.path.dirname(prefix) or "."
    candidates = [p[: -len(".idx")] for p in glob.glob(os.path.join(folder, "*.idx"))]
    near = difflib.get_close_matches(prefix, candidates, n=3, cutoff=0.6)
    hint = (f"; did you mean {' or '.join(near)}?" if near
            else f"; no token files are in {folder}, make them with tools/preprocess_data.py")
    missing = [p for p in (prefix + ".bin", prefix + ".idx") if not os.path.isfile(p)]
    raise UserError(f"{flag} {prefix}: {' and '.join(missing)} not found{hint}")


def build_gpt_datasets(data_path, split: str = "969,30,1", seq_length: int = 1024, seed: int = 1234,
                       num_samples=(None, None, None), cache_dir: str | None = None, *, eod: int | None = None,
                       pad: int | None = None, eod_mask_loss: bool = False, reset_position_ids: bool = False,
                       train_data_path=None, valid_data_path=None, test_data_path=None,
                       mock_vocab_size: int | None = None, mmap_bin_files: bool = True):
    """Return (train, valid, test) datasets; a split with no data or no samples is None. data_path: a blend
    cut by `split`; or None with the per-split paths; or ignored when `mock_vocab_size` is set (synthetic
    documents, eod = `eod`). `mmap_bin_files` False reads the token files instead of mapping them
    (--no-mmap-bin-files). num_samples: samples each split must provide (None: one epoch). Items are dicts of
    `tokens`, `labels`, `loss_mask`, `position_ids`, each of shape [seq_length]."""
    if (eod_mask_loss or reset_position_ids) and eod is None:
        raise UserError("--eod-mask-loss and --reset-position-ids need an end-of-document token, but the tokenizer "
                        "has none; use a tokenizer with an EOS/EOD id or drop those flags")
    config = GPTDatasetConfig(seq_length, seed, eod, pad, eod_mask_loss, reset_position_ids, cache_dir)
    if mock_vocab_size is not None:
        mock = MockTokenDataset(mock_vocab_size, eod if eod is not None else mock_vocab_size, seq_length, seed)
        ranges = split_document_ranges(split, len(mock))
        return tuple(_gpt_split(mock, "mock data", ranges[i], num_samples[i], SPLIT_NAMES[i], config) for i in range(3))
    per_split = (train_data_path, valid_data_path, test_data_path)
    if any(per_split):
        if data_path:
            raise UserError("--data-path and --train-data-path/--valid-data-path/--test-data-path were both "
                            "given; use one or the other")
        flags = ("--train-data-path", "--valid-data-path", "--test-data-path")
        return tuple(_blend_split(path, flags[i], None, num_samples[i], i, config, mmap_bin_files) if path else None
                     for i, path in enumerate(per_split))
    if not data_path:
        raise UserError("no training data: pass --data-path (or --mock-data for synthetic tokens)")
    return tuple(_blend_split(data_path, "--data-path", split, num_samples[i], i, config, mmap_bin_files)
                 for i in range(3))


def _blend_split(data_path, flag, split, num_samples, split_index, config, mmap: bool = True):
    """Split number `split_index` of a blend (split None: whole files)."""
    if num_samples == 0:
        return None
    split_name = SPLIT_NAMES[split_index]
    prefixes, weights = parse_data_path(data_path, flag)
    files = [open_token_file(p, flag, mmap) for p in prefixes]
    ranges = [split_document_ranges(split, len(f))[split_index] if split else (0, len(f)) for f in files]
    if all(r is None for r in ranges):
        return None
    if len(files) == 1:
        return _gpt_split(files[0], prefixes[0], ranges[0], num_samples, split_name, config)
    if weights is not None:  # a file weighted 0 takes no part
        keep = [i for i, w in enumerate(weights) if w > 0]
        files, prefixes, ranges, weights = ([x[i] for i in keep] for x in (files, prefixes, ranges, weights))
    # Each range is set: split_document_ranges gives None to a split for every file alike, handled above.
    epoch_samples = [max(0, (int(f.sequence_lengths[begin:end].sum(dtype=np.int64)) - 1) // config.seq_length)
                     for f, (begin, end) in zip(files, ranges)]
    weights = weights or epoch_samples  # plain prefixes weigh what one epoch of each gives
    weights = [w / sum(weights) for w in weights]
    size = num_samples if num_samples is not None else sum(epoch_samples)
    parts = [_gpt_split(f, p, r, n, split_name, config)
             for f, p, r, n in zip(files, prefixes, ranges, samples_per_dataset(weights, size, SURPLUS))]
    return BlendedDataset(parts, prefixes, weights, sum(samples_per_dataset(weights, size)),
                          cache_dir_for(prefixes[0], config.cache_dir), split_name)


def _gpt_split(indexed, name, document_range, num_samples, split_name, config):
    if num_samples == 0 or document_range is None:
        return None
    begin, end = document_range
    if end <= begin:
        raise UserError(f"the {split_name} split of {name} gets no documents ({len(indexed)} in all); raise its "
                        f"share in --split, give it 0 to have no {split_name} split, or pass --eval-iters 0 "
                        f"(no validation or test samples)")
    return GPTDataset(indexed, np.arange(begin, end, dtype=np.int32), num_samples, split_name, config)
