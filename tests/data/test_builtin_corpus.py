import json
import multiprocessing
import os
import re
from pathlib import Path

import pytest
import torch

from megalite.data.prep import builtin_corpus
from megalite.data.prep.builtin_corpus import ensure_builtin_corpus, stdlib_files
from megalite.data.indexed_dataset import IndexedDataset
from megalite.data.tokenizer import SentencePieceTokenizer

MAX_FILES = 12


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(build_dir, data_prefix, tokenizer_model) of a small built-in corpus."""
    build_dir = tmp_path_factory.mktemp("build")
    return (build_dir, *ensure_builtin_corpus(str(build_dir), max_files=MAX_FILES))


def test_builds_documents_that_decode_to_the_stdlib_files(built):
    build_dir, data_prefix, tokenizer_model = built
    manifest = json.loads((Path(data_prefix).parent / "manifest.json").read_text())
    dataset = IndexedDataset(data_prefix)
    tokenizer = SentencePieceTokenizer(tokenizer_model)
    assert manifest["num_files"] == MAX_FILES
    assert len(dataset) == manifest["num_documents"] > 0
    assert dataset.num_tokens == manifest["num_tokens"]
    root, files = stdlib_files(MAX_FILES)
    texts = [(root / name).read_text(encoding="utf-8") for name in files]
    non_empty = [text for text in texts if text]
    assert len(non_empty) == len(dataset)
    for i in (0, len(dataset) - 1):
        assert dataset[i][-1] == tokenizer.eod
        assert tokenizer.detokenize(dataset[i][:-1]) == non_empty[i]


def test_second_call_reuses_the_build(built, monkeypatch):
    build_dir, data_prefix, tokenizer_model = built
    mtimes = {name: os.stat(name).st_mtime_ns for name in (data_prefix + ".bin", tokenizer_model)}

    def fail(*args):
        raise AssertionError("rebuilt a complete corpus")

    monkeypatch.setattr(builtin_corpus, "_build", fail)
    assert ensure_builtin_corpus(str(build_dir), max_files=MAX_FILES) == (data_prefix, tokenizer_model)
    assert {name: os.stat(name).st_mtime_ns for name in mtimes} == mtimes


def test_incomplete_build_is_rebuilt_identically(built):
    """A missing manifest means an unfinished build; building again gives the same bytes."""
    build_dir, data_prefix, tokenizer_model = built
    corpus_dir = os.path.dirname(data_prefix)
    outputs = [data_prefix + ".bin", data_prefix + ".idx", tokenizer_model]
    before = [open(path, "rb").read() for path in outputs]
    os.remove(os.path.join(corpus_dir, "manifest.json"))
    assert ensure_builtin_corpus(str(build_dir), max_files=MAX_FILES) == (data_prefix, tokenizer_model)
    assert [open(path, "rb").read() for path in outputs] == before
    assert os.path.exists(os.path.join(corpus_dir, "manifest.json"))
    name = os.path.basename(corpus_dir)
    assert sorted(os.listdir(build_dir)) == [name, name + ".lock"]


def test_two_processes_building_at_once_both_get_the_corpus(tmp_path):
    context = multiprocessing.get_context("fork")
    processes = [
        context.Process(target=ensure_builtin_corpus, args=(str(tmp_path), 4)) for _ in range(2)
    ]
    for process in processes:
        process.start()
    for process in processes:
        process.join()
    assert [process.exitcode for process in processes] == [0, 0]
    data_prefix, _ = ensure_builtin_corpus(str(tmp_path), max_files=4)
    assert len(IndexedDataset(data_prefix)) > 0
    assert not [name for name in os.listdir(tmp_path) if name.endswith(".staging")]


def test_the_closing_sample_prompt_tokenizes_as_it_would_inside_longer_text(built):
    """"def " tokenized as ['def', '▁']: a lone '▁', which in this corpus comes before digits, so the default
    run's sample read `def 4000200000...`. The prompt's tokens must be those of the same text in the corpus."""
    from tools.fork_ranks import _script

    prompt = _script().SAMPLE_PROMPT
    tokenizer = SentencePieceTokenizer(built[2])
    tokens = tokenizer.tokenize(prompt)
    for continuation in ("self, x):", "argv=None):", " x"):
        assert tokenizer.tokenize(prompt + continuation)[:len(tokens)] == tokens, continuation


def test_the_closing_sample_of_a_model_trained_briefly_is_mostly_the_corpus_words(built, capsys):
    """A model barely trained on the corpus continues the prompt mostly in the corpus's own words (an
    untrained one: about 1 word in 5)."""
    from megalite.arguments import parse_args
    from megalite.run.training import pretrain
    from tools.fork_ranks import _script

    _, data_prefix, tokenizer_model = built
    flags = ["--data-path", data_prefix, "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model",
             tokenizer_model, "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length",
             "64", "--micro-batch-size", "8", "--global-batch-size", "8", "--train-iters", "100", "--lr", "3e-3",
             "--lr-warmup-iters", "5", "--eval-iters", "0", "--log-interval", "100"]
    with torch.random.fork_rng():
        trainer, _ = pretrain(parse_args(flags), log=lambda line: None)
    entry = _script()
    entry.print_sample(trainer)
    sample = capsys.readouterr().out.split("tools/generate.py's defaults):\n", 1)[1]
    assert sample.startswith(entry.SAMPLE_PROMPT)
    root, files = stdlib_files(MAX_FILES)
    corpus_words = set(re.findall(r"\w+", " ".join((root / name).read_text(encoding="utf-8") for name in files)))
    words = re.findall(r"\w+", sample[len(entry.SAMPLE_PROMPT):])
    assert len(words) >= 10 and sum(word in corpus_words for word in words) >= 0.6 * len(words), sample
