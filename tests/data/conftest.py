"""Shared fixtures of the data tests: a small mixed corpus and a tiny SentencePiece model."""

import pytest

from megalite.data.tokenizer import train_sentencepiece
from tests.helpers import corpus


@pytest.fixture(scope="session")
def make_texts():
    """The generator of test documents: make_texts(count, seed=0) -> list[str]."""
    return corpus.make_texts


@pytest.fixture(scope="session")
def write_jsonl():
    """The JSONL writer: write_jsonl(path, records) -> path as str."""
    return corpus.write_jsonl


@pytest.fixture(scope="session")
def texts() -> list[str]:
    return corpus.make_texts(60)


@pytest.fixture(scope="session")
def spm_model(tmp_path_factory, texts) -> str:
    """Path of a 400-piece SentencePiece model trained on `texts` (and more of the same)."""
    prefix = tmp_path_factory.mktemp("tokenizer") / "tiny"
    return train_sentencepiece(texts + corpus.make_texts(200, seed=1), str(prefix), vocab_size=400)["model"]
