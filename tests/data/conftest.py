"""Shared fixtures of the data tests: a small mixed corpus and a tiny SentencePiece model."""

import json
import random

import pytest

from megalite.data.tokenizer import train_sentencepiece

WORDS = "the model reads tokens from files and learns to predict what comes next".split()
UNICODE_WORDS = ["café", "naïve", "über", "日本語", "данные", "🙂", "λ"]


def _make_texts(count: int, seed: int = 0) -> list[str]:
    """`count` documents mixing prose, indented code, digits and non-ASCII text."""
    rng = random.Random(seed)
    texts = []
    for i in range(count):
        prose = " ".join(rng.choice(WORDS + UNICODE_WORDS) for _ in range(rng.randint(5, 30)))
        code = (
            f"def function_{i}(x, y={rng.randint(0, 99999)}):\n"
            f"    if x > {rng.randint(0, 9)}:\n"
            f"\t\treturn x * y  # {rng.choice(WORDS)}\n"
            f"    return None\n"
        )
        texts.append(prose + "\n\n" + code if i % 2 else code + "\n" + prose)
    return texts


def _write_jsonl(path, records) -> str:
    """Write records (dicts, or raw strings written as they are) one per line; return the path."""
    with open(path, "w", encoding="utf-8") as file:
        for record in records:
            file.write((record if isinstance(record, str) else json.dumps(record)) + "\n")
    return str(path)


@pytest.fixture(scope="session")
def make_texts():
    """The generator of test documents: make_texts(count, seed=0) -> list[str]."""
    return _make_texts


@pytest.fixture(scope="session")
def write_jsonl():
    """The JSONL writer: write_jsonl(path, records) -> path as str."""
    return _write_jsonl


@pytest.fixture(scope="session")
def texts() -> list[str]:
    return _make_texts(60)


@pytest.fixture(scope="session")
def spm_model(tmp_path_factory, texts) -> str:
    """Path of a 400-piece SentencePiece model trained on `texts` (and more of the same)."""
    prefix = tmp_path_factory.mktemp("tokenizer") / "tiny"
    return train_sentencepiece(texts + _make_texts(200, seed=1), str(prefix), vocab_size=400)["model"]
