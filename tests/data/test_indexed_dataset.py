"""Megatron's .bin/.idx format: round trips, a hand-built golden file, and corrupt files."""

import os
import struct

import numpy as np
import pytest

from megalite.data.indexed_dataset import (
    DTYPE_CODES, IndexedDataset, IndexedDatasetBuilder, merge_datasets, token_dtype_for_vocab,
)
from megalite.errors import UserError

DOCS = [[5, 6, 7], [1], [9, 8, 7, 6, 5], [2, 3]]


def write(prefix, docs=DOCS, dtype=np.uint16):
    with IndexedDatasetBuilder(prefix, dtype) as builder:
        for doc in docs:
            builder.add_document(doc)
    return prefix


@pytest.mark.parametrize("code", sorted(DTYPE_CODES))
def test_round_trip_every_dtype(tmp_path, code):
    dtype = np.dtype(DTYPE_CODES[code])
    prefix = write(str(tmp_path / "d"), dtype=dtype)
    ds = IndexedDataset(prefix)
    assert ds.dtype == dtype and len(ds) == len(DOCS) and ds.num_documents == len(DOCS)
    for i, doc in enumerate(DOCS):
        assert ds[i].dtype == dtype
        np.testing.assert_array_equal(ds[i], np.array(doc, dtype=dtype))
    np.testing.assert_array_equal(ds.get(2, offset=1, length=3), [8, 7, 6])
    assert ds.num_tokens == sum(map(len, DOCS))


def test_reads_are_views_not_copies(tmp_path):
    ds = IndexedDataset(write(str(tmp_path / "d")))
    assert isinstance(ds.get(2).base, np.ndarray) or ds.get(2).base is not None
    assert not ds.get(2).flags.owndata


def test_golden_idx_bytes_built_by_hand(tmp_path):
    prefix = write(str(tmp_path / "d"))
    lengths = [len(d) for d in DOCS]
    pointers = np.concatenate([[0], np.cumsum(lengths)[:-1] * 2])
    expected = b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", 8)
    expected += struct.pack("<Q", 4) + struct.pack("<Q", 5)
    expected += b"".join(struct.pack("<i", n) for n in lengths)
    expected += b"".join(struct.pack("<q", int(p)) for p in pointers)
    expected += b"".join(struct.pack("<q", d) for d in [0, 1, 2, 3, 4])
    assert open(prefix + ".idx", "rb").read() == expected
    tokens = [t for doc in DOCS for t in doc]
    assert open(prefix + ".bin", "rb").read() == struct.pack(f"<{len(tokens)}H", *tokens)


def write_by_hand(prefix, sequences, document_indices) -> str:
    """An int32 .bin/.idx pair (dtype code 4) in Megatron's layout, where a document may hold several sequences
    (as Megatron's --split-sentences writes): document_indices [0, ..., len(sequences)]."""
    lengths = [len(sequence) for sequence in sequences]
    pointers = np.concatenate([[0], np.cumsum(lengths)[:-1] * 4])
    with open(prefix + ".idx", "wb") as file:
        file.write(b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, 4, len(sequences), len(document_indices)))
        file.write(b"".join(struct.pack("<i", n) for n in lengths))
        file.write(b"".join(struct.pack("<q", int(p)) for p in pointers))
        file.write(b"".join(struct.pack("<q", d) for d in document_indices))
    tokens = [token for sequence in sequences for token in sequence]
    with open(prefix + ".bin", "wb") as file:
        file.write(struct.pack(f"<{len(tokens)}i", *tokens))
    return prefix


def test_multi_sequence_documents(tmp_path):
    ds = IndexedDataset(write_by_hand(str(tmp_path / "d"), [[1, 2], [3], [4]], [0, 2, 3]))
    assert len(ds) == 3 and ds.num_documents == 2
    np.testing.assert_array_equal(ds.document_indices, [0, 2, 3])


def test_token_dtype_rule():
    assert token_dtype_for_vocab(32000) == np.uint16
    assert token_dtype_for_vocab(65499) == np.uint16
    assert token_dtype_for_vocab(65500) == np.int32
    assert token_dtype_for_vocab(128256) == np.int32


def test_ids_too_large_for_dtype_fail_and_leave_nothing(tmp_path):
    prefix = str(tmp_path / "d")
    with pytest.raises(UserError, match="do not fit the uint16"):
        with IndexedDatasetBuilder(prefix, np.uint16) as builder:
            builder.add_document([1, 70000])
    assert os.listdir(tmp_path) == []


def test_failed_build_leaves_no_files(tmp_path):
    prefix = str(tmp_path / "d")
    with pytest.raises(RuntimeError):
        with IndexedDatasetBuilder(prefix, np.uint16) as builder:
            builder.add_document([1, 2])
            raise RuntimeError("worker died")
    assert os.listdir(tmp_path) == []


def test_merge(tmp_path):
    a = write(str(tmp_path / "a"), DOCS[:2])
    b = write(str(tmp_path / "b"), DOCS[2:])
    merge_datasets([a, b], str(tmp_path / "ab"))
    whole = write(str(tmp_path / "whole"))
    for suffix in (".bin", ".idx"):
        assert open(str(tmp_path / "ab") + suffix, "rb").read() == open(whole + suffix, "rb").read()


def _corrupt(prefix, offset, data):
    with open(prefix + ".idx", "r+b") as f:
        f.seek(offset)
        f.write(data)


@pytest.mark.parametrize("damage, message", [
    (lambda p: _corrupt(p, 0, b"XXXXXXX"), "bad magic"),
    (lambda p: _corrupt(p, 9, struct.pack("<Q", 2)), "index version 2"),
    (lambda p: _corrupt(p, 17, b"\x09"), "unknown token dtype code 9"),
    (lambda p: os.truncate(p + ".idx", 20), "truncated"),
    (lambda p: os.truncate(p + ".idx", 60), "is 60 bytes but its header"),
    (lambda p: os.truncate(p + ".bin", 6), r"d.bin is 6 bytes but .* says 22"),
    (lambda p: open(p + ".bin", "ab").write(b"\x00\x00"), "does not match"),
    (lambda p: _corrupt(p, 34 + 16 + 8, struct.pack("<q", 4)), "offsets that do not follow"),
    (lambda p: os.remove(p + ".bin"), "d.bin does not exist"),
])
def test_corrupt_files_name_file_and_problem(tmp_path, damage, message):
    prefix = write(str(tmp_path / "d"))
    damage(prefix)
    with pytest.raises(UserError, match=message):
        IndexedDataset(prefix)
