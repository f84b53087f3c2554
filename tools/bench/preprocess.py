"""Preprocessing throughput on the built-in corpus, against the bare tokenizer's limit.

    python tools/bench/preprocess.py [--build-dir data/build] [--max-files N] [--workers 1 2]

Runs megalite.data.prep.preprocess (no end-of-document tokens, so token counts match)
with each worker count, and SentencePiece's batch encode of the same texts on one
thread, which no worker can beat. "per worker / limit" is the share of that limit each
worker reaches; 0.8 or more means parsing, IPC and writing cost little.
"""

import argparse
import os
import tempfile
import time
from pathlib import Path

import numpy as np

from megalite.data.gpt_dataset import build_gpt_indices
from megalite.data.indexed_dataset import IndexedDataset
from megalite.data.prep.builtin_corpus import DEFAULT_BUILD_DIR, ensure_builtin_corpus
from megalite.data.prep.preprocess import preprocess
from megalite.data.prep.text_sources import iter_documents
from megalite.data.tokenizer import SentencePieceTokenizer
from megalite.errors import run_main


def tokenizer_limit(model_path: str, texts: list[str]) -> dict:
    """Tokens/s of one-thread batch encoding (as lists, and into numpy buffers); the faster is the limit."""
    tokenizer = SentencePieceTokenizer(model_path, num_threads=1)
    rates = {}
    for name, encode in (("lists", tokenizer.tokenize_batch), ("numpy", tokenizer.tokenize_batch_flat)):
        start = time.perf_counter()
        encoded = encode(texts)
        seconds = time.perf_counter() - start
        num_tokens = sum(map(len, encoded)) if name == "lists" else len(encoded[0])
        rates[name] = num_tokens / seconds
    return rates


def preprocess_rates(jsonl: str, model_path: str, workers: int, output_dir: str) -> dict:
    summary = preprocess(jsonl, os.path.join(output_dir, f"w{workers}"), "GPTSentencePieceTokenizer", model_path,
                         workers=workers, log_interval=0)
    seconds = summary["seconds"]
    return {
        "seconds": seconds,
        "tokens_per_s": summary["tokens"]["text"] / seconds,
        "docs_per_s": summary["documents"]["text"] / seconds,
        "mb_per_s": summary["input_bytes"] / seconds / 1e6,
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--build-dir", default=DEFAULT_BUILD_DIR)
    parser.add_argument("--max-files", type=int, default=None)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--debug", action="store_true")
    args = parser.parse_args(argv)

    data_prefix, model_path = ensure_builtin_corpus(args.build_dir, args.max_files)
    jsonl = str(Path(data_prefix).parent / "corpus.jsonl")
    texts = list(iter_documents([jsonl]))
    megabytes = os.path.getsize(jsonl) / 1e6
    print(f"built-in corpus: {len(texts)} documents, {megabytes:.1f} MB of JSONL, {os.cpu_count()} CPUs")

    limits = tokenizer_limit(model_path, texts)
    limit = max(limits.values())
    for name, rate in limits.items():
        print(f"bare tokenizer, 1 thread, {name:5s}: {rate / 1e6:.3f} M tokens/s")

    with tempfile.TemporaryDirectory() as output_dir:
        for workers in args.workers:
            rates = preprocess_rates(jsonl, model_path, workers, output_dir)
            per_worker = rates["tokens_per_s"] / workers / limit
            print(
                f"preprocess --workers {workers}: {rates['tokens_per_s'] / 1e6:.3f} M tokens/s, "
                f"{rates['docs_per_s']:.1f} docs/s, {rates['mb_per_s']:.2f} MB/s ({rates['seconds']:.1f} s); "
                f"per worker / limit = {per_worker:.2f}"
            )

    bench_gpt_index_build(data_prefix)


# --- GPT index build timing ---
INDEX_BENCH_TOKENS = 1_000_000_000
INDEX_BENCH_TARGET_S = 30.0


def bench_gpt_index_build(data_prefix: str) -> None:
    """Time the document/sample/shuffle indices for 1B tokens of synthetic document lengths.

    Lengths are log-normal around 800 tokens (a web-like spread, from 1 to 200k), drawn
    until they hold a billion tokens; one epoch of samples at two sequence lengths, plus
    the real corpus for reference.
    """
    rng = np.random.RandomState(0)
    lengths = np.clip(rng.lognormal(np.log(800), 1.0, size=INDEX_BENCH_TOKENS // 400), 1, 200_000)
    lengths = lengths.astype(np.int32)
    lengths = lengths[: int(np.searchsorted(np.cumsum(lengths, dtype=np.int64), INDEX_BENCH_TOKENS)) + 1]
    documents = np.arange(len(lengths), dtype=np.int32)
    tokens = int(lengths.sum(dtype=np.int64))
    for seq_length in (4096, 2048, 512):
        start = time.perf_counter()
        indices = build_gpt_indices(lengths, documents, (tokens - 1) // seq_length, seq_length, seed=1234)
        elapsed = time.perf_counter() - start
        print(f"GPT indices, {tokens / 1e9:.2f}B tokens in {len(lengths):,} documents, seq {seq_length}: "
              f"{elapsed:.2f} s for {len(indices['shuffle_index']):,} samples "
              f"(target < {INDEX_BENCH_TARGET_S:.0f} s: {'ok' if elapsed < INDEX_BENCH_TARGET_S else 'MISSED'})")
    corpus = IndexedDataset(data_prefix)
    start = time.perf_counter()
    build_gpt_indices(corpus.sequence_lengths, np.arange(len(corpus), dtype=np.int32),
                      (corpus.num_tokens - 1) // 256 * 3, 256, seed=1234)
    print(f"GPT indices, built-in corpus ({corpus.num_tokens:,} tokens), seq 256, 3 epochs: "
          f"{time.perf_counter() - start:.2f} s")


if __name__ == "__main__":
    run_main(main)
