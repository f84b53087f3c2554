"""DataConfig: where tokens come from (`--data-path` blends, per-split paths, `--mock-data`, or
the built-in corpus when none is given: megalite/run/data.py's `final_run_config` points a copy at it)."""

from dataclasses import dataclass

from megalite.config.options import derived, option
from megalite.errors import UserError

SENTENCEPIECE_TYPES = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer")
TOKENIZER_TYPES = SENTENCEPIECE_TYPES + ("HuggingFaceTokenizer", "GPT2BPETokenizer", "NullTokenizer")


@dataclass(frozen=True)
class DataConfig:
    data_path: list[str] | None = option(None, "token file prefixes, optionally weighted",
                                         default_text="the built-in corpus")
    split: str = option("969,30,1", "train,valid,test weights of --data-path's documents")
    train_data_path: list[str] | None = option(None, "token file prefixes of the training split")
    valid_data_path: list[str] | None = option(None, "token file prefixes of the validation split")
    test_data_path: list[str] | None = option(None, "token file prefixes of the test split")
    data_cache_path: str | None = option(None, "where the sample indices are cached", default_text="beside the data")
    mock_data: bool = option(False, "deterministic synthetic tokens, no files")
    tokenizer_type: str | None = option(None, "the tokenizer", choices=TOKENIZER_TYPES,
                                        default_text="the built-in corpus's")
    tokenizer_model: str | None = option(None, "the tokenizer's model file or folder")
    vocab_file: str | None = option(None, "GPT2BPETokenizer: GPT-2's vocabulary file (gpt2-vocab.json)")
    merge_file: str | None = option(None, "GPT2BPETokenizer: GPT-2's merges file (gpt2-merges.txt)")
    vocab_size: int | None = option(None, "NullTokenizer: its vocabulary (+1 for EOD); any other tokenizer: the "
                                          "vocabulary the model is built for, at least the tokenizer's",
                                    default_text="the tokenizer's")
    eod_mask_loss: bool = option(False, "no loss on end-of-document tokens")
    reset_position_ids: bool = option(False, "positions restart after each end-of-document token")
    num_workers: int = option(0, "data loader worker processes")
    mmap_bin_files: bool = option(True, "memory-map the .bin token files; off: read each sample from the file",
                                  off_flag="--no-mmap-bin-files")
    builtin_corpus: bool = derived(False, "no data flag given: the default run's corpus, built under data/build/")

    def validate(self) -> "DataConfig":
        """Raise a UserError naming the flag for the first problem found; return self."""
        per_split = self.train_data_path or self.valid_data_path or self.test_data_path
        if self.mock_data and (self.data_path or per_split):
            raise UserError("--mock-data and --data-path/--train-data-path both given; pick one")
        if self.data_path and per_split:
            raise UserError("--data-path and --train/valid/test-data-path both given; use --data-path "
                            "with --split, or the per-split paths")
        if self.builtin_corpus and (self.tokenizer_type or self.tokenizer_model or self.vocab_file or self.merge_file):
            raise UserError("--tokenizer-type/--tokenizer-model given without --data-path; the built-in "
                            "corpus has its own tokenizer, so pass --data-path too (or drop them)")
        if not self.builtin_corpus and self.tokenizer_type is None:
            raise UserError("--tokenizer-type is required with --data-path or --mock-data "
                            "(e.g. --tokenizer-type NullTokenizer --vocab-size 1000 with --mock-data)")
        if self.vocab_size is not None and self.vocab_size < 1:
            raise UserError(f"--vocab-size must be at least 1, got {self.vocab_size}")
        if (self.vocab_file or self.merge_file) and self.tokenizer_type != "GPT2BPETokenizer":
            raise UserError("--vocab-file/--merge-file are GPT-2's BPE files; add --tokenizer-type "
                            "GPT2BPETokenizer (or drop them)")
        if self.num_workers < 0:
            raise UserError(f"--num-workers must be 0 or more, got {self.num_workers}")
        return self
