"""Train a SentencePiece tokenizer on the same inputs that tools/preprocess_data.py reads.

    python tools/train_tokenizer.py --input corpus.jsonl --output-prefix data/tok --vocab-size 8192

writes `data/tok.model` and `data/tok.vocab`. The model suits code and prose alike (no
normalisation, whitespace kept, digits split, byte fallback: every text round-trips) and
is deterministic: the same input and flags give a byte-identical `.model`.
"""

import argparse

from megalite.data.prep.text_sources import ReadStats, add_input_args, iter_documents
from megalite.data.tokenizer import train_sentencepiece
from megalite.errors import UserError, run_main


def get_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_input_args(parser)
    parser.add_argument("--output-prefix", required=True, help="writes {prefix}.model and {prefix}.vocab")
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--model-type", choices=("bpe", "unigram"), default="bpe")
    parser.add_argument("--character-coverage", type=float, default=0.9995,
                        help="share of characters that get their own piece; the rest fall back to bytes")
    parser.add_argument("--max-sentences", type=int, default=1_000_000,
                        help="train on a seeded random sample of at most this many lines (0: all)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the line sampling")
    parser.add_argument("--debug", action="store_true", help="show tracebacks of errors")
    args = parser.parse_args(argv)
    if args.max_sentences < 0:
        raise UserError(f"--max-sentences {args.max_sentences} must be 0 (all lines) or more")
    return args


def main(argv=None):
    args = get_args(argv)
    stats = ReadStats()
    documents = iter_documents(args.input, args.json_keys, args.hf_split, args.skip_bad_lines, stats)
    result = train_sentencepiece(
        documents,
        args.output_prefix,
        vocab_size=args.vocab_size,
        model_type=args.model_type,
        character_coverage=args.character_coverage,
        max_sentences=args.max_sentences,
        seed=args.seed,
    )
    sampled = min(result["num_sentences"], args.max_sentences or result["num_sentences"])
    print(f"wrote {result['model']} and {result['vocab']}: {args.model_type}, "
          f"vocab size {result['vocab_size']}")
    print(f"trained on {sampled} of {result['num_sentences']} lines in {result['seconds']:.1f} s")
    print(f"skipped {stats.num_empty} empty documents and {stats.num_bad} bad lines")


if __name__ == "__main__":
    run_main(main)
