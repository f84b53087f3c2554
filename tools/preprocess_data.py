"""Tokenize text into Megatron's .bin/.idx token files.

    python tools/preprocess_data.py --input corpus.jsonl --output-prefix data/corpus \\
        --tokenizer-type GPTSentencePieceTokenizer --tokenizer-model tok.model \\
        --append-eod --workers 2

writes `data/corpus_text_document.bin/.idx`, one pair per `--json-keys` key, with the
flags and file names of Megatron's tools/preprocess_data.py. Inputs: JSONL files or
globs, .txt files, or a Hugging Face dataset (see megalite/data/prep/text_sources.py).

The work is megalite.data.prep.preprocess's `preprocess`, which this parses the flags for:
the output is byte-identical for any `--workers`, and a failed run leaves no output files.
"""

import argparse

from megalite.data.prep.preprocess import preprocess
from megalite.data.prep.text_sources import DEFAULT_CHUNK_BYTES, add_input_args
from megalite.data.tokenizer import TOKENIZER_TYPES
from megalite.errors import UserError, run_main


def get_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    group = parser.add_argument_group("input data")
    add_input_args(group)
    group = parser.add_argument_group("tokenizer")
    group.add_argument("--tokenizer-type", required=True, choices=TOKENIZER_TYPES, metavar="TYPE",
                       help=f"one of {', '.join(TOKENIZER_TYPES)}")
    group.add_argument("--tokenizer-model", default=None,
                       help="SentencePiece .model file or HF tokenizer folder")
    group.add_argument("--vocab-size", type=int, default=None, help="vocabulary size (NullTokenizer)")
    group.add_argument("--append-eod", action="store_true",
                       help="append the end-of-document token to each document")
    group = parser.add_argument_group("output data")
    group.add_argument("--output-prefix", required=True, help="writes {prefix}_{key}_document.bin/.idx")
    group = parser.add_argument_group("runtime")
    group.add_argument("--workers", type=int, default=1,
                       help="encoding processes (1: encode in this process)")
    group.add_argument("--log-interval", type=int, default=1000,
                       help="report progress every this many documents (0: never)")
    group.add_argument("--chunk-bytes", type=int, default=DEFAULT_CHUNK_BYTES,
                       help="input bytes per worker task: smaller balances load, larger cuts overhead")
    group.add_argument("--debug", action="store_true", help="show tracebacks of errors")
    args = parser.parse_args(argv)
    if args.workers < 1:
        raise UserError(f"--workers {args.workers} must be at least 1")
    if args.chunk_bytes < 1:
        raise UserError(f"--chunk-bytes {args.chunk_bytes} must be at least 1")
    return args


def preprocess_args(args: argparse.Namespace) -> dict:
    """`preprocess` on get_args' flags; returns its summary."""
    return preprocess(
        args.input, args.output_prefix, args.tokenizer_type, args.tokenizer_model, args.vocab_size,
        json_keys=args.json_keys, hf_split=args.hf_split, skip_bad_lines=args.skip_bad_lines,
        append_eod=args.append_eod, workers=args.workers, log_interval=args.log_interval,
        chunk_bytes=args.chunk_bytes,
    )


def format_summary(summary: dict) -> str:
    lines = []
    for key, prefix in summary["output_prefixes"].items():
        lines.append(
            f"wrote {prefix}.bin/.idx: {summary['documents'][key]} documents, "
            f"{summary['tokens'][key]} tokens ({summary['dtype']})"
        )
    lines.append(
        f"skipped {summary['skipped_empty']} empty documents and {summary['skipped_bad']} bad lines"
    )
    lines.extend(f"  skipped: {example}" for example in summary["bad_examples"])
    seconds = max(summary["seconds"], 1e-9)
    documents, tokens = sum(summary["documents"].values()), sum(summary["tokens"].values())
    lines.append(
        f"took {seconds:.1f} s ({documents / seconds:.1f} docs/s, {tokens / seconds / 1e6:.3f} M tokens/s, "
        f"{summary['input_bytes'] / seconds / 1e6:.2f} MB/s)"
    )
    return "\n".join(lines)


def main(argv=None):
    args = get_args(argv)
    print(format_summary(preprocess_args(args)))


if __name__ == "__main__":
    run_main(main)
