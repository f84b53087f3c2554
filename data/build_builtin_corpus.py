"""Build the built-in corpus (the Python standard library, tokenized) and say what was built.

    python data/build_builtin_corpus.py [--build-dir data/build] [--max-files N] [--force]

`python pretrain_gpt.py` builds it on first use anyway; this only does it ahead of time.
"""

import argparse
from pathlib import Path

from megalite.data.prep.builtin_corpus import DEFAULT_BUILD_DIR, ensure_builtin_corpus, load_manifest
from megalite.errors import run_main


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--build-dir", default=DEFAULT_BUILD_DIR, help="relative to the repository root")
    parser.add_argument("--max-files", type=int, default=None, help="use only the first N files (by path)")
    parser.add_argument("--force", action="store_true", help="rebuild even if a complete build exists")
    parser.add_argument("--debug", action="store_true", help="show tracebacks of errors")
    args = parser.parse_args(argv)
    data_prefix, tokenizer_model = ensure_builtin_corpus(args.build_dir, args.max_files, args.force)
    manifest = load_manifest(Path(data_prefix).parent, args.max_files)
    print(f"data prefix:     {data_prefix}  (--data-path)")
    print(f"tokenizer model: {tokenizer_model}  (--tokenizer-model, vocab size {manifest['vocab_size']})")
    print(
        f"{manifest['num_documents']} documents, {manifest['num_tokens']} tokens, "
        f"from {manifest['num_files']} files of {manifest['stdlib']} "
        f"({manifest['num_skipped_not_utf8']} not UTF-8 and "
        f"{manifest['num_empty_files']} empty ones skipped); built in {manifest['build_seconds']} s"
    )


if __name__ == "__main__":
    run_main(main)
