"""GPT sample indices: Megatron's algorithm, its splits, epochs, masks and cache."""

import json
import os

import numpy as np
import pytest
import torch

from megalite.data import build_gpt_datasets
from megalite.data.gpt_dataset import (
    GPTDatasetConfig, build_gpt_indices, build_sample_index, ltor_masks, needs_separate_final_epoch,
    split_document_ranges,
)
from megalite.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
from megalite.errors import UserError
from tools.dev.megatron_golden import CASES, GOLDEN_PATH, samples_digest, write_golden_token_files


def sample_index_by_walking(lengths, document_index, seq_length, num_epochs, tokens_per_epoch):
    """The sample index the slow way: Megatron's helper loop written out in Python."""
    num_samples = (num_epochs * tokens_per_epoch - 1) // seq_length
    rows, position, offset = [(0, 0)], 0, 0
    while len(rows) <= num_samples:
        remaining = seq_length + 1
        while remaining:
            doc_length = lengths[document_index[position]] - offset
            remaining -= doc_length
            if remaining <= 0:
                offset += remaining + doc_length - 1
                remaining = 0
            else:
                position, offset = position + 1, 0
        rows.append((position, offset))
    return np.array(rows)


@pytest.mark.parametrize("seed", range(5))
def test_vectorised_sample_index_equals_the_walk(seed):
    rng = np.random.RandomState(seed)
    lengths = rng.randint(0 if seed % 2 else 1, 40, size=50).astype(np.int32)
    lengths[0] = max(lengths[0], 1)
    document_index = np.tile(np.arange(50, dtype=np.int32), 3)
    rng.shuffle(document_index)
    tokens_per_epoch = int(lengths.sum())
    for seq_length in (2, 7, 16, 33):
        ours = build_sample_index(lengths, document_index, seq_length, 3, tokens_per_epoch)
        walk = sample_index_by_walking(lengths, document_index, seq_length, 3, tokens_per_epoch)
        np.testing.assert_array_equal(ours, walk)


def test_split_boundaries():
    assert split_document_ranges("969,30,1", 1000) == [(0, 969), (969, 999), (999, 1000)]
    assert split_document_ranges("98,2,0", 100) == [(0, 98), (98, 100), None]
    assert split_document_ranges("1", 10) == [(0, 10), None, None]
    # normalised, and rounded with Python's round: 1/3 * 10 = 3.33 -> 3, 2/3 * 10 -> 7
    assert split_document_ranges("1,1,1", 10) == [(0, 3), (3, 7), (7, 10)]
    assert split_document_ranges("0.8/0.2", 5) == [(0, 4), (4, 5), None]
    for bad in ("", "a,b", "1,2,3,4", "0,0,0", "-1,2"):
        with pytest.raises(UserError, match="--split"):
            split_document_ranges(bad, 10)


def test_separate_final_epoch_rule():
    # 101 tokens per epoch at seq 10: 10 samples per epoch
    assert not needs_separate_final_epoch(10, 1, 101, 10)
    assert needs_separate_final_epoch(17, 2, 101, 10)  # 7 from the last epoch < 8
    assert not needs_separate_final_epoch(18, 2, 101, 10)  # 8 is not below 80%
    lengths = np.full(20, 6, dtype=np.int32)  # 120 tokens per epoch, 11 samples at seq 10
    indices = build_gpt_indices(lengths, np.arange(20, dtype=np.int32), 13, 10, seed=3)
    shuffle = indices["shuffle_index"]
    first_part = (120 - 1) // 10
    assert sorted(shuffle[:first_part]) == list(range(first_part))  # shuffled apart
    assert sorted(shuffle[first_part:]) == list(range(first_part, len(shuffle)))
    # each epoch of the document index holds every document once
    document_index = indices["document_index"]
    assert sorted(document_index[:20]) == list(range(20)) and sorted(document_index[20:]) == list(range(20))


def test_samples_match_megatron_golden(tmp_path):
    """Digests recorded by tools/dev/megatron_golden.py from Megatron-LM's own classes."""
    golden = json.load(open(GOLDEN_PATH))
    prefixes = write_golden_token_files(str(tmp_path), IndexedDatasetBuilder)
    for name, files, weights, split, seq_length, seed, sizes in CASES:
        if weights is None:
            data_path = [prefixes[f] for f in files]
        else:
            data_path = [x for w, f in zip(weights, files) for x in (str(w), prefixes[f])]
        datasets = build_gpt_datasets(data_path, split, seq_length, seed, sizes, str(tmp_path / "c"))
        digests = [None if ds is None or n == 0 else samples_digest(ds, n) for ds, n in zip(datasets, sizes)]
        assert digests == golden[name], name


def _token_file(tmp_path, num_docs=60, seed=0):
    rng = np.random.RandomState(seed)
    prefix = str(tmp_path / "tok")
    with IndexedDatasetBuilder(prefix, np.uint16) as builder:
        for _ in range(num_docs):
            builder.add_document(np.append(rng.randint(1, 100, rng.randint(1, 30)), 0))
    return prefix


def test_items_shift_by_one_and_cover_the_stream(tmp_path):
    prefix = _token_file(tmp_path)
    train, _, _ = build_gpt_datasets(prefix, "1,0,0", 8, 1, (40, 0, 0), str(tmp_path / "c"))
    ds = IndexedDataset(prefix)
    stream = np.concatenate([ds[int(d)] for d in train.document_index])
    for i in range(len(train)):
        item = train[i]
        assert set(item) == {"tokens", "labels", "loss_mask", "position_ids"}
        assert all(v.shape == (8,) for v in item.values())
        start = int(train.shuffle_index[i]) * 8
        np.testing.assert_array_equal(item["tokens"], stream[start : start + 8])
        np.testing.assert_array_equal(item["labels"], stream[start + 1 : start + 9])


def test_index_determinism_and_cache_reuse(tmp_path, capsys):
    prefix = _token_file(tmp_path)
    cache = str(tmp_path / "cache")
    first = build_gpt_datasets(prefix, "90,10,0", 16, 5, (50, 5, 0), cache)
    assert "built GPTDataset-train" in capsys.readouterr().out
    files = sorted(os.listdir(cache))
    mtimes = [os.path.getmtime(os.path.join(cache, f)) for f in files]
    second = build_gpt_datasets(prefix, "90,10,0", 16, 5, (50, 5, 0), cache)
    assert "built" not in capsys.readouterr().out
    assert sorted(os.listdir(cache)) == files
    assert [os.path.getmtime(os.path.join(cache, f)) for f in files] == mtimes
    for a, b in zip(first[:2], second[:2]):
        for i in range(len(a)):
            assert torch.equal(a[i]["tokens"], b[i]["tokens"])
    # in-memory build (no cache) gives the same indices
    fresh = build_gpt_indices(IndexedDataset(prefix).sequence_lengths, np.arange(54, dtype=np.int32), 50, 16, 5)
    np.testing.assert_array_equal(fresh["shuffle_index"], first[0].shuffle_index)
    # another seed is another order, and another cache entry
    other = build_gpt_datasets(prefix, "90,10,0", 16, 6, (50, 5, 0), cache)
    assert not np.array_equal(other[0].shuffle_index, first[0].shuffle_index)


def test_default_cache_is_beside_the_data(tmp_path):
    prefix = _token_file(tmp_path)
    build_gpt_datasets(prefix, "1,0,0", 8, 1, (10, 0, 0))
    assert any(f.endswith("-description.json") for f in os.listdir(tmp_path / "cache"))


def test_rebuilt_token_file_invalidates_the_cache(tmp_path):
    prefix = _token_file(tmp_path, seed=0)
    a = build_gpt_datasets(prefix, "1,0,0", 8, 1, (10, 0, 0))[0]
    _token_file(tmp_path, seed=1)  # same name, new content
    b = build_gpt_datasets(prefix, "1,0,0", 8, 1, (10, 0, 0))[0]
    assert a.cache_key != b.cache_key
    fresh = build_gpt_indices(IndexedDataset(prefix).sequence_lengths, np.arange(60, dtype=np.int32), 10, 8, 1)
    np.testing.assert_array_equal(b.sample_index, fresh["sample_index"])


def test_waiting_rank_reads_what_the_builder_publishes(tmp_path, monkeypatch):
    prefix = _token_file(tmp_path)
    cache = str(tmp_path / "cache")
    built = build_gpt_datasets(prefix, "1,0,0", 8, 1, (10, 0, 0), cache)[0]
    monkeypatch.setenv("LOCAL_RANK", "1")  # a non-builder finds the finished cache
    waited = build_gpt_datasets(prefix, "1,0,0", 8, 1, (10, 0, 0), cache)[0]
    np.testing.assert_array_equal(built.sample_index, waited.sample_index)
    import megalite.data.index_cache as index_cache
    monkeypatch.setattr(index_cache, "WAIT_TIMEOUT_S", 0.3)
    with pytest.raises(UserError, match="waited 0 s for another process"):
        build_gpt_datasets(prefix, "1,0,0", 8, 2, (10, 0, 0), cache)


def test_eod_mask_loss_and_reset_position_ids():
    config = GPTDatasetConfig(seq_length=8, seed=0, eod=0, eod_mask_loss=True, reset_position_ids=True)
    tokens = torch.tensor([5, 6, 0, 7, 8, 9, 0, 4])
    labels = torch.tensor([6, 0, 7, 8, 9, 0, 4, 3])
    out = ltor_masks(tokens, labels, config)
    assert out["loss_mask"].tolist() == [1, 1, 0, 1, 1, 1, 0, 1]
    assert out["position_ids"].tolist() == [0, 1, 2, 0, 1, 2, 3, 0]
    plain = ltor_masks(tokens, labels, GPTDatasetConfig(seq_length=8, seed=0, eod=0, pad=3))
    assert plain["position_ids"].tolist() == list(range(8))
    assert plain["loss_mask"].tolist() == [1, 1, 1, 1, 1, 1, 1, 0]  # label == pad


def test_split_errors_are_clear(tmp_path):
    prefix = _token_file(tmp_path, num_docs=3)
    with pytest.raises(UserError, match="valid split of .* gets no documents"):
        build_gpt_datasets(prefix, "99,1,0", 8, 1, (10, 5, 0), str(tmp_path / "c"))
    with pytest.raises(UserError, match="not enough for one sample of --seq-length 4096"):
        build_gpt_datasets(prefix, "1,0,0", 4096, 1, (10, 0, 0), str(tmp_path / "c"))
    with pytest.raises(UserError, match="need an end-of-document token"):
        build_gpt_datasets(prefix, "1,0,0", 8, 1, (10, 0, 0), eod_mask_loss=True)


def test_mock_data_is_deterministic_and_in_vocab():
    a = build_gpt_datasets(None, "98,2,0", 32, 7, (64, 8, 0), mock_vocab_size=100, eod=100)
    b = build_gpt_datasets(None, "98,2,0", 32, 7, (64, 8, 0), mock_vocab_size=100, eod=100)
    assert a[2] is None
    for i in range(64):
        assert torch.equal(a[0][i]["tokens"], b[0][i]["tokens"])
        assert int(a[0][i]["tokens"].max()) <= 100
    assert len(a[1]) >= 8
