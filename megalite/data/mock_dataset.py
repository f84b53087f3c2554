"""Deterministic synthetic documents for `--mock-data`: no files, same code path as real data. Each
document is an arithmetic pattern of ids drawn from `RandomState(seed)`, ending with the EOD id."""

import numpy as np


class MockTokenDataset:
    """Stands in for IndexedDataset: `sequence_lengths`, `get`, `path_prefix` (None)."""

    path_prefix = None

    def __init__(self, vocab_size: int, eod: int, seq_length: int, seed: int = 0, num_documents: int = 100_000):
        rng = np.random.RandomState(seed)
        self.vocab_size, self.eod = vocab_size, eod
        # Lengths around the sequence length, so samples span one to a few documents.
        self.sequence_lengths = rng.randint(2, 2 * seq_length + 2, size=num_documents).astype(np.int32)
        self._starts = rng.randint(0, vocab_size, size=num_documents)
        self._strides = rng.randint(1, 8, size=num_documents)

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens `[offset, offset + length)` of synthetic document i. Shape: [length]."""
        doc_length = int(self.sequence_lengths[i])
        if length is None:
            length = doc_length - offset
        positions = np.arange(offset, offset + length, dtype=np.int64)
        tokens = (self._starts[i] + self._strides[i] * positions) % self.vocab_size
        tokens[positions == doc_length - 1] = self.eod
        return tokens
