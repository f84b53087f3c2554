"""Tokenizers (SentencePiece, Hugging Face, Megatron's GPT-2 BPE and NullTokenizer) and SentencePiece
training. Each offers `vocab_size`, the special ids `bos`, `eos`, `eod`, `pad`, `unk` (None where absent),
`tokenize`, `tokenize_batch`, `tokenize_batch_flat` (the preprocessing fast path) and `detokenize`, and
pickles cheaply (reloading from its model path) for worker processes."""

import io
import os
import time
from typing import Iterable, Iterator

import numpy as np
import sentencepiece

from megalite.config.data import TOKENIZER_TYPES
from megalite.data.index_cache import atomic_write
from megalite.errors import UserError

# SentencePiece drops training sentences longer than this (bytes); we cut them to it instead.
MAX_SENTENCE_BYTES = 4192
SPECIAL_IDS = {"unk_id": 0, "bos_id": 1, "eos_id": 2, "pad_id": 3}


class Tokenizer:
    """The interface; subclasses set the attributes and implement `tokenize` and `detokenize`."""

    vocab_size: int
    bos: int | None = None
    eos: int | None = None
    eod: int | None = None  # appended after each document by --append-eod
    pad: int | None = None
    unk: int | None = None

    def tokenize(self, text: str) -> list[int]:
        raise NotImplementedError

    def detokenize(self, ids) -> str:
        raise NotImplementedError

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.tokenize(text) for text in texts]

    def tokenize_batch_flat(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """Token ids of all texts back to back, [total] int, and tokens per text, [len(texts)] int64."""
        batch = self.tokenize_batch(texts)
        lengths = np.fromiter(map(len, batch), dtype=np.int64, count=len(batch))
        tokens = np.fromiter((i for ids in batch for i in ids), dtype=np.int64, count=int(lengths.sum()))
        return tokens, lengths


class SentencePieceTokenizer(Tokenizer):
    """A SentencePiece model; eod is its eos id. add_bos: start every text with bos (Llama2Tokenizer).
    num_threads: threads of one batch encode; 1 suits preprocessing, which runs a process per core."""

    def __init__(self, model_path: str, add_bos: bool = False, num_threads: int = 1):
        self.model_path, self.add_bos, self.num_threads = model_path, add_bos, num_threads
        try:
            self._processor = sentencepiece.SentencePieceProcessor(model_file=model_path)
        except (OSError, RuntimeError) as err:
            raise UserError(f"--tokenizer-model {model_path} is not a SentencePiece model ({err})") from err
        self.vocab_size = self._processor.vocab_size()
        ids = (self._processor.bos_id(), self._processor.eos_id(), self._processor.pad_id(), self._processor.unk_id())
        self.bos, self.eos, self.pad, self.unk = (None if i < 0 else i for i in ids)  # -1: the model has none
        self.eod = self.eos

    def __reduce__(self):
        return SentencePieceTokenizer, (self.model_path, self.add_bos, self.num_threads)

    def tokenize(self, text: str) -> list[int]:
        return self._processor.encode(text, add_bos=self.add_bos)

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        return self._processor.encode(texts, add_bos=self.add_bos, num_threads=self.num_threads)

    def tokenize_batch_flat(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        if not texts:
            return np.zeros(0, np.int32), np.zeros(0, np.int64)
        # SentencePiece fills numpy buffers in C++: no Python int per token.
        arrays = self._processor.encode(texts, add_bos=self.add_bos, num_threads=self.num_threads, out_type="numpy")
        lengths = np.fromiter(map(len, arrays), dtype=np.int64, count=len(arrays))
        return np.concatenate(arrays), lengths

    def detokenize(self, ids) -> str:
        return self._processor.decode(np.asarray(ids, dtype=np.int64).tolist())


class NullTokenizer(Tokenizer):
    """Megatron's _NullTokenizer: the text is whitespace-separated integer ids in [0, V]. Given
    `vocab_size` V, eod is V and the reported vocab_size is V + 1."""

    def __init__(self, vocab_size: int):
        self.eod = self.eos = int(vocab_size)
        self.vocab_size = self.eod + 1

    def tokenize(self, text: str) -> list[int]:
        ids = [int(word) for word in text.split()]
        if ids and not 0 <= min(ids) <= max(ids) < self.vocab_size:
            raise ValueError(f"NullTokenizer ids must lie in [0, {self.vocab_size - 1}]")
        return ids

    def detokenize(self, ids) -> str:
        return " ".join(str(int(i)) for i in ids)


class HuggingFaceTokenizer(Tokenizer):
    """A `transformers` tokenizer from a local folder (or a hub name, which needs internet); eod is its eos id.
    Like Megatron's, `tokenize` adds the tokenizer's own special tokens (a Llama tokenizer starts with bos)."""

    def __init__(self, path: str):
        try:
            from transformers import AutoTokenizer
        except ImportError as err:
            raise UserError("--tokenizer-type HuggingFaceTokenizer needs transformers; pip install "
                            "transformers") from err
        self.path = path
        try:
            self._tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=os.path.isdir(path))
        except (OSError, ValueError) as err:
            reason = str(err).strip().splitlines()[0]
            raise UserError(f"could not load the Hugging Face tokenizer {path} ({reason}); pass a local tokenizer "
                            "folder as --tokenizer-model") from err
        self.vocab_size = len(self._tokenizer)
        tokenizer = self._tokenizer
        self.bos, self.eos, self.pad, self.unk = (tokenizer.bos_token_id, tokenizer.eos_token_id,
                                                  tokenizer.pad_token_id, tokenizer.unk_token_id)
        self.eod = self.eos

    def __reduce__(self):
        return HuggingFaceTokenizer, (self.path,)

    def tokenize(self, text: str) -> list[int]:
        return self._tokenizer(text)["input_ids"]

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        return self._tokenizer(texts)["input_ids"] if texts else []

    def detokenize(self, ids) -> str:
        return self._tokenizer.decode(np.asarray(ids, dtype=np.int64).tolist())


class GPT2BPETokenizer(HuggingFaceTokenizer):
    """Megatron's GPT2BPETokenizer: GPT-2's byte-level BPE from local `--vocab-file` (gpt2-vocab.json) and
    `--merge-file` (gpt2-merges.txt), through transformers; eod is `<|endoftext|>`, and no special token is
    added to a text (as in Megatron)."""

    def __init__(self, vocab_file: str | None, merge_file: str | None):
        files = {"--vocab-file": (vocab_file, "gpt2-vocab.json"), "--merge-file": (merge_file, "gpt2-merges.txt")}
        for flag, (path, name) in files.items():
            if path is None or not os.path.isfile(path):
                raise UserError(f"--tokenizer-type GPT2BPETokenizer needs {flag} (GPT-2's {name}), but "
                                f"{path or 'none'} is not a file; pass the local file")
        try:
            from tokenizers import Tokenizer, decoders, models, pre_tokenizers
            from transformers import PreTrainedTokenizerFast
        except ImportError as err:
            raise UserError("--tokenizer-type GPT2BPETokenizer needs transformers; pip install transformers") from err
        self.vocab_file, self.merge_file = vocab_file, merge_file
        try:
            bpe = Tokenizer(models.BPE.from_file(vocab_file, merge_file))
        except Exception as err:  # tokenizers raises a bare Exception for unreadable or inconsistent files
            raise UserError(f"--vocab-file {vocab_file} and --merge-file {merge_file} are not one GPT-2 BPE tokenizer "
                            f"({err}); pass the gpt2-vocab.json and gpt2-merges.txt of the same tokenizer") from None
        bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)  # GPT-2's byte-level split
        bpe.decoder = decoders.ByteLevel()
        self._tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>")
        self.vocab_size = len(self._tokenizer)
        self.eod = self.eos = self._tokenizer.convert_tokens_to_ids("<|endoftext|>")

    def __reduce__(self):
        return GPT2BPETokenizer, (self.vocab_file, self.merge_file)


def build_tokenizer(tokenizer_type: str, tokenizer_model: str | None = None, vocab_size: int | None = None,
                    vocab_file: str | None = None, merge_file: str | None = None) -> Tokenizer:
    """The tokenizer named by Megatron's `--tokenizer-type`, `--tokenizer-model`, `--vocab-size`,
    `--vocab-file` and `--merge-file`."""
    if tokenizer_type not in TOKENIZER_TYPES:
        raise UserError(f"--tokenizer-type {tokenizer_type} is unknown; use one of {', '.join(TOKENIZER_TYPES)}")
    if tokenizer_type == "GPT2BPETokenizer":
        return GPT2BPETokenizer(vocab_file, merge_file)
    if tokenizer_type == "NullTokenizer":
        if vocab_size is None or vocab_size < 1:
            raise UserError("--tokenizer-type NullTokenizer needs --vocab-size V (ids 0..V-1; V is the "
                            "end-of-document id)")
        return NullTokenizer(vocab_size)
    if tokenizer_model is None:
        raise UserError(f"--tokenizer-type {tokenizer_type} needs --tokenizer-model (its model file or folder)")
    if tokenizer_type == "HuggingFaceTokenizer":
        return HuggingFaceTokenizer(tokenizer_model)
    if not os.path.isfile(tokenizer_model):
        raise UserError(f"--tokenizer-model {tokenizer_model} does not exist; pass a SentencePiece .model file "
                        "(tools/train_tokenizer.py writes one)")
    return SentencePieceTokenizer(tokenizer_model, add_bos=tokenizer_type == "Llama2Tokenizer")


def train_sentencepiece(documents: Iterable[str], output_prefix: str, vocab_size: int = 8192,
                        model_type: str = "bpe", character_coverage: float = 0.9995, max_sentences: int = 0,
                        seed: int = 0, hard_vocab_limit: bool = True) -> dict:
    """Train a SentencePiece model on the lines of `documents`; write `P.model` and `P.vocab`; return {"model", "vocab",
    "vocab_size", "num_sentences", "seconds"}. Suited to code and prose alike: no normalisation, whitespace kept
    (indentation becomes pieces), digits split and byte fallback, so decode(encode(text)) == text for any text. ids: unk
    0, bos 1, eos 2, pad 3. max_sentences > 0 samples that many lines (seeded by `seed`); hard_vocab_limit=False lets a
    small corpus give a smaller vocabulary instead of an error. The same inputs give a byte-identical model."""
    start = time.perf_counter()
    num_sentences = 0

    def sentences() -> Iterator[str]:
        """The non-empty lines of `documents`, cut to MAX_SENTENCE_BYTES, counted as they are read."""
        nonlocal num_sentences
        for document in documents:
            for line in filter(None, document.split("\n")):
                if len(line) * 4 > MAX_SENTENCE_BYTES:  # a character is at most 4 bytes: shorter lines fit
                    # The longest prefix that fits; "ignore" drops a character cut in two.
                    line = line.encode("utf-8")[:MAX_SENTENCE_BYTES].decode("utf-8", errors="ignore")
                num_sentences += 1
                yield line

    model = io.BytesIO()
    sentencepiece.set_random_generator_seed(seed)
    try:
        sentencepiece.SentencePieceTrainer.train(
            sentence_iterator=sentences(), model_writer=model, model_type=model_type, vocab_size=vocab_size,
            hard_vocab_limit=hard_vocab_limit, character_coverage=character_coverage, input_sentence_size=max_sentences,
            shuffle_input_sentence=True, max_sentence_length=MAX_SENTENCE_BYTES, normalization_rule_name="identity",
            remove_extra_whitespaces=False, add_dummy_prefix=False, allow_whitespace_only_pieces=True,
            split_digits=True, byte_fallback=True, minloglevel=1, **SPECIAL_IDS,
            # The model records its trainer's thread count; a fixed 1 gives the same file on every machine (and BPE
            # training gains nothing from more on our corpora).
            num_threads=1)
    except RuntimeError as err:
        raise UserError(f"SentencePiece training failed ({str(err).strip()}); lower --vocab-size or give it "
                        "more text") from err
    model_path, vocab_path = f"{output_prefix}.model", f"{output_prefix}.vocab"
    os.makedirs(os.path.dirname(os.path.abspath(model_path)), exist_ok=True)
    atomic_write(model_path, lambda file: file.write(model.getvalue()))
    processor = sentencepiece.SentencePieceProcessor(model_proto=model.getvalue())
    # SentencePiece's .vocab format: one "piece<TAB>score" line per id.
    vocab = "".join(f"{processor.id_to_piece(i)}\t{processor.get_score(i):g}\n" for i in range(processor.vocab_size()))
    atomic_write(vocab_path, lambda file: file.write(vocab.encode("utf-8")))
    return {"model": model_path, "vocab": vocab_path, "vocab_size": processor.vocab_size(),
            "num_sentences": num_sentences, "seconds": time.perf_counter() - start}

