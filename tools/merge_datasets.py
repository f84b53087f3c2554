"""Concatenate several .bin/.idx pairs (same token dtype) into one, in the given order.

    python tools/merge_datasets.py --input data/a_text_document data/b_text_document \
        --output-prefix data/ab_text_document
"""

import argparse

from megalite.data.builder import open_token_file
from megalite.data.indexed_dataset import IndexedDataset, merge_datasets
from megalite.errors import run_main


def main(argv) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input", nargs="+", required=True, help="prefixes to merge, in order")
    parser.add_argument("--output-prefix", required=True, help="writes OUTPUT_PREFIX.bin/.idx")
    parser.add_argument("--debug", action="store_true", help="show tracebacks of user errors")
    args = parser.parse_args(argv)
    for prefix in args.input:
        open_token_file(prefix, "--input")  # names near matches for a mistyped prefix
    merge_datasets(args.input, args.output_prefix)
    merged = IndexedDataset(args.output_prefix)
    print(f"wrote {args.output_prefix}.bin/.idx: {merged.num_documents:,} documents, "
          f"{merged.num_tokens:,} tokens ({merged.dtype})")


if __name__ == "__main__":
    run_main(main)
