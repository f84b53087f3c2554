"""Megatron's indexed token format: a `.bin` of token ids and a `.idx` that locates them (docs/data.md has
the layout). As in Megatron's GPT dataset, every sequence is a document. The reader memory-maps both
files and returns views, never copies."""

import os
import struct

import numpy as np

from megalite.errors import UserError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
DTYPE_CODES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32,
               8: np.uint16}
_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequences, document bounds
_REBUILD = "rebuild it with tools/preprocess_data.py"
_CODE_OF_DTYPE = {np.dtype(dtype): code for code, dtype in DTYPE_CODES.items()}


def token_dtype_for_vocab(vocab_size: int) -> np.dtype:
    """uint16 when every id fits with room to spare (Megatron's rule), else int32."""
    return np.dtype(np.uint16 if vocab_size < 65500 else np.int32)


def exists(prefix: str) -> bool:
    """True when both files of the pair exist."""
    return os.path.isfile(prefix + ".bin") and os.path.isfile(prefix + ".idx")


class IndexedDataset:
    """Read-only, memory-mapped view of a `.bin/.idx` pair; `ds[i]` is sequence i, shape [length]. Opening
    validates the header and every size. `mmap=False` (--no-mmap-bin-files) reads each request from the
    .bin file instead, for file systems where mapping is slow or not allowed."""

    def __init__(self, path_prefix: str, mmap: bool = True):
        self.path_prefix, self.mmap = path_prefix, mmap
        idx_file, bin_file = path_prefix + ".idx", path_prefix + ".bin"
        for path in (idx_file, bin_file):
            if not os.path.isfile(path):
                raise UserError(f"token file {path} does not exist; check the prefix given to --data-path "
                                "(it names files without the .bin/.idx suffix)")
        self._read_index(idx_file)
        self._check_bin(bin_file)

    def _read_index(self, idx_file: str) -> None:
        size = os.path.getsize(idx_file)
        if size < _HEADER.size:
            raise UserError(f"{idx_file} is truncated: {size} bytes, shorter than the {_HEADER.size}-byte "
                            f"header; {_REBUILD}")
        with open(idx_file, "rb") as f:
            magic, version, code, num_sequences, num_doc_bounds = _HEADER.unpack(f.read(_HEADER.size))
        if magic != MAGIC:
            raise UserError(f"{idx_file} is not a Megatron index file (bad magic {magic!r}); pass the prefix "
                            "of a .bin/.idx pair written by tools/preprocess_data.py")
        if version != VERSION:
            raise UserError(f"{idx_file} has index version {version}, but only version {VERSION} is "
                            f"supported; {_REBUILD}")
        if code not in DTYPE_CODES:
            raise UserError(f"{idx_file} names unknown token dtype code {code} (valid: {sorted(DTYPE_CODES)}); "
                            "the file is corrupt, rebuild it")
        expected = _HEADER.size + num_sequences * (4 + 8) + num_doc_bounds * 8
        if size != expected:
            raise UserError(f"{idx_file} is {size} bytes but its header ({num_sequences} sequences, {num_doc_bounds} "
                            f"document bounds) needs {expected}; the file is truncated or corrupt, {_REBUILD}")
        self.dtype = np.dtype(DTYPE_CODES[code])
        self._index_map = np.memmap(idx_file, mode="r", dtype=np.uint8)
        offset = _HEADER.size
        self.sequence_lengths = np.frombuffer(self._index_map, np.int32, num_sequences, offset)
        offset += num_sequences * 4
        self.sequence_pointers = np.frombuffer(self._index_map, np.int64, num_sequences, offset)
        offset += num_sequences * 8
        self.document_indices = np.frombuffer(self._index_map, np.int64, num_doc_bounds, offset)

    def _check_bin(self, bin_file: str) -> None:
        size = os.path.getsize(bin_file)
        lengths, pointers, itemsize = self.sequence_lengths, self.sequence_pointers, self.dtype.itemsize
        expected = int(pointers[-1]) + int(lengths[-1]) * itemsize if len(lengths) else 0
        if size != expected:
            raise UserError(f"{bin_file} is {size} bytes but {self.path_prefix}.idx says {expected}; the "
                            f"pair does not match (truncated or mixed up), {_REBUILD}")
        if len(lengths) and (lengths.min() < 0 or pointers[0] != 0 or np.any(
                pointers[1:] != pointers[:-1] + lengths[:-1].astype(np.int64) * itemsize)):
            raise UserError(f"{self.path_prefix}.idx has sequence offsets that do not follow its lengths; "
                            f"the file is corrupt, {_REBUILD}")
        # An empty file cannot be memory-mapped; an empty array serves the same purpose.
        self._bin_map = np.memmap(bin_file, mode="r", dtype=self.dtype) if size and self.mmap \
            else np.empty(0, self.dtype)

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens `[offset, offset + length)` of sequence i, as a view (a fresh array without mmap). Shape: [length]."""
        start = int(self.sequence_pointers[i]) // self.dtype.itemsize + offset
        if length is None:
            length = int(self.sequence_lengths[i]) - offset
        if not self.mmap:
            with open(self.path_prefix + ".bin", "rb") as f:
                f.seek(start * self.dtype.itemsize)
                return np.fromfile(f, self.dtype, length)
        return self._bin_map[start : start + length]

    __getitem__ = get  # ds[i]: the whole sequence i

    @property
    def num_tokens(self) -> int:
        return int(self.sequence_lengths.sum(dtype=np.int64))

    @property
    def num_documents(self) -> int:
        return len(self.document_indices) - 1


class IndexedDatasetBuilder:
    """Writes a `.bin/.idx` pair as a context manager: tokens stream into `<prefix>.bin.tmp`; a clean exit
    writes the `.idx` and renames both into place, an exception removes the temporaries."""

    def __init__(self, path_prefix: str, dtype):
        self.path_prefix = path_prefix
        self.dtype = np.dtype(dtype)
        if self.dtype not in _CODE_OF_DTYPE:  # fail before creating any file
            raise ValueError(f"dtype {self.dtype} has no code in Megatron's .idx format")
        self._tmp_bin, self._tmp_idx = path_prefix + ".bin.tmp", path_prefix + ".idx.tmp"
        self._lengths: list[np.ndarray] = []
        self._document_ends: list[np.ndarray] = []  # sequence counts after each document
        self._num_sequences = 0
        self._bin = None

    def __enter__(self):
        os.makedirs(os.path.dirname(os.path.abspath(self.path_prefix)), exist_ok=True)
        self._bin = open(self._tmp_bin, "wb")
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.finalize()
            return
        self._bin.close()
        for path in (self._tmp_bin, self._tmp_idx):
            if os.path.exists(path):
                os.remove(path)

    def add_document(self, tokens) -> None:
        """Append one document made of one sequence. tokens: [n] ints."""
        tokens = np.asarray(tokens)
        self.add_documents(tokens, np.array([len(tokens)]))

    def add_documents(self, flat_tokens: np.ndarray, lengths: np.ndarray) -> None:
        """Append many one-sequence documents. flat_tokens: [sum(lengths)], lengths: [n]."""
        lengths = np.asarray(lengths, dtype=np.int64)
        if int(lengths.sum()) != len(flat_tokens):
            raise ValueError("lengths must sum to the number of tokens")
        self._write_tokens(flat_tokens)
        self._lengths.append(lengths.astype(np.int32))
        self._document_ends.append(self._num_sequences + np.arange(1, len(lengths) + 1))
        self._num_sequences += len(lengths)

    def add_index(self, other_prefix: str) -> None:
        """Append every sequence and document of another pair (what Megatron's merge does)."""
        other = IndexedDataset(other_prefix)
        if other.dtype != self.dtype:
            raise UserError(f"cannot merge {other_prefix} (tokens {other.dtype}) into a {self.dtype} dataset; "
                            "preprocess all inputs with the same tokenizer")
        self._lengths.append(np.array(other.sequence_lengths, dtype=np.int32))
        self._document_ends.append(self._num_sequences + np.asarray(other.document_indices[1:]))
        self._num_sequences += len(other)
        with open(other_prefix + ".bin", "rb") as src:
            while chunk := src.read(1 << 24):
                self._bin.write(chunk)

    def _write_tokens(self, tokens: np.ndarray) -> None:
        if self._bin is None:
            raise RuntimeError("use IndexedDatasetBuilder as a context manager")
        if tokens.size and self.dtype.kind in "iu":
            info = np.iinfo(self.dtype)
            if tokens.min() < info.min or tokens.max() > info.max:
                raise UserError(f"token ids from {int(tokens.min())} to {int(tokens.max())} do not fit the "
                                f"{self.dtype} token files of {self.path_prefix}; the tokenizer's vocabulary is "
                                "larger than the dtype allows, pass a larger dtype")
        self._bin.write(np.ascontiguousarray(tokens, dtype=self.dtype).tobytes())

    def finalize(self) -> None:
        """Write the `.idx`, then move both files into place (`.idx` last)."""
        self._bin.close()
        lengths = np.concatenate(self._lengths) if self._lengths else np.zeros(0, np.int32)
        pointers = np.zeros(len(lengths), dtype=np.int64)
        np.cumsum(lengths[:-1].astype(np.int64) * self.dtype.itemsize, out=pointers[1:])
        documents = np.concatenate([[0], *self._document_ends]).astype(np.int64)
        with open(self._tmp_idx, "wb") as f:
            f.write(_HEADER.pack(MAGIC, VERSION, _CODE_OF_DTYPE[self.dtype], len(lengths), len(documents)))
            f.write(lengths.astype("<i4").tobytes())
            f.write(pointers.astype("<i8").tobytes())
            f.write(documents.astype("<i8").tobytes())
        os.replace(self._tmp_bin, self.path_prefix + ".bin")
        os.replace(self._tmp_idx, self.path_prefix + ".idx")


def merge_datasets(input_prefixes: list[str], output_prefix: str) -> None:
    """Concatenate several pairs (same dtype) into one, in the given order."""
    if not input_prefixes:
        raise UserError("nothing to merge; pass at least one input prefix")
    with IndexedDatasetBuilder(output_prefix, IndexedDataset(input_prefixes[0]).dtype) as builder:
        for prefix in input_prefixes:
            builder.add_index(prefix)
