"""Tokenize text into Megatron's .bin/.idx token files: the core of tools/preprocess_data.py. Workers
parse and batch-encode chunks of raw lines (text_sources.py); results are taken in input order, so the
output is byte-identical for any number of workers."""

import functools
import multiprocessing
import os
import sys
import time
from collections import deque
from collections.abc import Sequence
from contextlib import ExitStack, closing
from dataclasses import dataclass
from typing import Iterator

import numpy as np

from megalite.data.indexed_dataset import IndexedDatasetBuilder, token_dtype_for_vocab
from megalite.data.prep.text_sources import DEFAULT_CHUNK_BYTES, ReadStats, iter_chunks, resolve_inputs
from megalite.data.tokenizer import build_tokenizer
from megalite.data.worker_signals import leave_stop_signals_to, workers_starting
from megalite.errors import UserError


@dataclass
class EncodedChunk:
    """One chunk's documents per key: token ids back to back and tokens per document (eod included)."""

    tokens: dict[str, np.ndarray]  # [sum(lengths)] int
    lengths: dict[str, np.ndarray]  # [num_documents] int64
    stats: ReadStats


def encode_chunk(chunk, tokenizer, json_keys: tuple[str, ...], skip_bad_lines: bool, append_eod: bool) -> EncodedChunk:
    """Parse and batch-encode one chunk; documents that yield no tokens count as empty."""
    parsed = chunk.parse(json_keys, skip_bad_lines)
    tokens, lengths = {}, {}
    for key, texts in parsed.texts.items():
        flat, counts = _tokenize(tokenizer, key, texts, chunk, parsed.records[key])
        empty = counts == 0  # e.g. whitespace under NullTokenizer; a zero-length document helps nobody
        parsed.stats.num_empty += int(empty.sum())
        counts = counts[~empty]
        if append_eod:
            flat = np.insert(flat, np.cumsum(counts), tokenizer.eod)
            counts = counts + 1
        tokens[key], lengths[key] = flat, counts
    return EncodedChunk(tokens, lengths, parsed.stats)


def _tokenize(tokenizer, key, texts, chunk, records):
    """tokenizer.tokenize_batch_flat(texts); if that fails, a UserError naming the line (`records`) to blame."""
    try:
        return tokenizer.tokenize_batch_flat(texts)
    except Exception:
        for text, record in zip(texts, records):  # slow, but only on the way to an error
            try:
                tokenizer.tokenize(text)
            except Exception as err:
                raise UserError(f'{chunk.location(record)}: the tokenizer rejects "{key}" ({err}); fix the line '
                                "or choose another --tokenizer-type") from err
        raise


_worker_encode = None  # encode_chunk with its tokenizer and options bound, set once per worker process


def _init_worker(encode, main_pid: int):
    global _worker_encode
    leave_stop_signals_to(main_pid)  # so that the pool's terminate() ends it, and nothing else does
    _worker_encode = encode


def _encode_in_worker(chunk) -> EncodedChunk:
    return _worker_encode(chunk)


def encoded_chunks(chunks, encode, workers: int) -> Iterator[EncodedChunk]:
    """`encode(chunk)` over `chunks`, in order; in this process or in a pool of `workers`, with at most
    2 x workers chunks in flight (the reader never runs far ahead of the encoders). `encode` (and its
    tokenizer) travels to each worker once, through the pool's initializer."""
    if workers == 1:
        yield from map(encode, chunks)
        return
    with workers_starting():
        pool = multiprocessing.Pool(workers, initializer=_init_worker, initargs=(encode, os.getpid()))
    with pool:
        in_flight = deque()
        for chunk in chunks:
            in_flight.append(pool.apply_async(_encode_in_worker, (chunk,)))
            if len(in_flight) >= 2 * workers:
                yield in_flight.popleft().get()
        while in_flight:
            yield in_flight.popleft().get()


def preprocess(inputs: str | Sequence[str], output_prefix: str, tokenizer_type: str, tokenizer_model: str | None = None,
               vocab_size: int | None = None, *, json_keys: Sequence[str] = ("text",), hf_split: str | None = None,
               skip_bad_lines: bool = False, append_eod: bool = False, workers: int = 1, log_interval: int = 1000,
               chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> dict:
    """Tokenize `inputs` (text_sources.resolve_inputs) into `{output_prefix}_{key}_document.bin/.idx` per key; bad input
    raises UserError and leaves no output files. The tokenizer flags are build_tokenizer's. skip_bad_lines: count
    malformed lines and go on. append_eod: end every document with the end-of-document token. workers: encoding
    processes (1: this one). log_interval: a progress line to stderr every this many documents (0: never). chunk_bytes:
    input bytes per worker task. Returns {"documents": {key: n}, "tokens": {key: n}, "skipped_empty", "skipped_bad",
    "bad_examples", "input_bytes", "seconds", "output_prefixes": {key: prefix}, "dtype"}."""
    if workers < 1 or chunk_bytes < 1:
        raise ValueError(f"workers ({workers}) and chunk_bytes ({chunk_bytes}) must be at least 1")
    tokenizer = build_tokenizer(tokenizer_type, tokenizer_model, vocab_size)
    if append_eod and tokenizer.eod is None:
        raise UserError(f"--append-eod needs an end-of-document token, and this {tokenizer_type} has none")
    json_keys = tuple(json_keys)
    sources = resolve_inputs([inputs] if isinstance(inputs, str) else list(inputs), hf_split)
    encode = functools.partial(encode_chunk, tokenizer=tokenizer, json_keys=json_keys,
                               skip_bad_lines=skip_bad_lines, append_eod=append_eod)
    dtype = token_dtype_for_vocab(tokenizer.vocab_size)
    prefixes = {key: f"{output_prefix}_{key}_document" for key in json_keys}
    documents, tokens, stats = dict.fromkeys(json_keys, 0), dict.fromkeys(json_keys, 0), ReadStats()
    start, intervals_logged = time.perf_counter(), 0
    with ExitStack() as stack:
        builders = {key: stack.enter_context(IndexedDatasetBuilder(p, dtype)) for key, p in prefixes.items()}
        chunks = iter_chunks(sources, json_keys, hf_split, chunk_bytes)
        # closing(): on an error, stop the worker pool now, not when the traceback is freed.
        for encoded in stack.enter_context(closing(encoded_chunks(chunks, encode, workers))):
            for key, builder in builders.items():
                builder.add_documents(encoded.tokens[key], encoded.lengths[key])
                documents[key] += len(encoded.lengths[key])
                tokens[key] += int(encoded.lengths[key].sum())
            stats.add(encoded.stats)
            done = sum(documents.values())
            if log_interval and done // log_interval > intervals_logged:  # one line for several intervals
                intervals_logged = done // log_interval
                seconds = max(time.perf_counter() - start, 1e-9)
                print(f"processed {done} documents ({done / seconds:.1f} docs/s, "
                      f"{sum(tokens.values()) / seconds / 1e6:.3f} M tokens/s, "
                      f"{stats.num_bytes / seconds / 1e6:.2f} MB/s)", file=sys.stderr, flush=True)
        for key, count in documents.items():
            if not count:
                raise UserError(f'the inputs hold no non-empty "{key}" document; check --input and --json-keys')
    return {"documents": documents, "tokens": tokens, "skipped_empty": stats.num_empty,
            "skipped_bad": stats.num_bad, "bad_examples": stats.bad_examples, "input_bytes": stats.num_bytes,
            "seconds": time.perf_counter() - start, "output_prefixes": prefixes, "dtype": dtype.name}
