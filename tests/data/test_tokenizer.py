import pickle

import numpy as np
import pytest

from megalite.data.tokenizer import (
    HuggingFaceTokenizer,
    NullTokenizer,
    SentencePieceTokenizer,
    build_tokenizer,
)
from megalite.errors import UserError

TRICKY_TEXTS = [
    "def f(x):\n    return x  # indented\n\n\n\tclass A:\n\t\tpass\n",
    "   leading spaces and trailing ones   ",
    "a\r\nwindows line ends\r\n",
    "emoji 🎉🙂, CJK 中文字, accents éàü, symbols ∑∫ and a rare one: 𓀀",
    "digits 1234567890 and 3.14159",
    "\n\n\n",
    " ",
    "",
]


@pytest.mark.parametrize("text", TRICKY_TEXTS)
def test_sentencepiece_round_trip_keeps_every_byte(spm_model, text):
    tokenizer = SentencePieceTokenizer(spm_model)
    assert tokenizer.detokenize(tokenizer.tokenize(text)) == text


def test_sentencepiece_special_ids_and_batches(spm_model, texts):
    tokenizer = build_tokenizer("GPTSentencePieceTokenizer", spm_model)
    assert (tokenizer.unk, tokenizer.bos, tokenizer.eos, tokenizer.pad) == (0, 1, 2, 3)
    assert tokenizer.eod == tokenizer.eos
    assert tokenizer.vocab_size == 400
    batch = tokenizer.tokenize_batch(texts)
    assert batch == [tokenizer.tokenize(text) for text in texts]
    flat, lengths = tokenizer.tokenize_batch_flat(texts)
    assert lengths.tolist() == [len(ids) for ids in batch]
    assert flat.tolist() == [i for ids in batch for i in ids]
    assert max(flat) < tokenizer.vocab_size


def test_sentencepiece_splits_digits(spm_model):
    tokenizer = SentencePieceTokenizer(spm_model)
    assert len(tokenizer.tokenize("9876543210")) == 10


def test_llama2_type_starts_with_bos_and_others_do_not(spm_model):
    assert build_tokenizer("Llama2Tokenizer", spm_model).tokenize("x y")[0] == 1
    for name in ("SentencePieceTokenizer", "GPTSentencePieceTokenizer"):
        assert build_tokenizer(name, spm_model).tokenize("x y")[0] != 1


def test_sentencepiece_tokenizer_pickles(spm_model, texts):
    tokenizer = SentencePieceTokenizer(spm_model, add_bos=True)
    copy = pickle.loads(pickle.dumps(tokenizer))
    assert copy.tokenize_batch(texts) == tokenizer.tokenize_batch(texts)


def test_null_tokenizer_follows_megatron():
    tokenizer = build_tokenizer("NullTokenizer", vocab_size=100)
    assert isinstance(tokenizer, NullTokenizer)
    assert tokenizer.eod == 100
    assert tokenizer.vocab_size == 101
    assert tokenizer.tokenize("5 7  99\n100") == [5, 7, 99, 100]
    assert tokenizer.detokenize(np.array([5, 7, 99])) == "5 7 99"
    assert tokenizer.tokenize_batch_flat(["1 2", "3"])[1].tolist() == [2, 1]
    with pytest.raises(ValueError):
        tokenizer.tokenize("5 101")
    with pytest.raises(ValueError):
        tokenizer.tokenize("five")


@pytest.fixture(scope="module")
def hf_tokenizer_dir(tmp_path_factory, texts):
    """A local Hugging Face tokenizer folder, made with the `tokenizers` library."""
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    model = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
    model.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    model.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
    )
    model.train_from_iterator(texts, trainer)
    wrapped = transformers.PreTrainedTokenizerFast(
        tokenizer_object=model, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    folder = tmp_path_factory.mktemp("hf_tokenizer")
    wrapped.save_pretrained(folder)
    return str(folder)


def test_hugging_face_tokenizer_from_local_folder(hf_tokenizer_dir, texts):
    tokenizer = build_tokenizer("HuggingFaceTokenizer", hf_tokenizer_dir)
    assert isinstance(tokenizer, HuggingFaceTokenizer)
    assert tokenizer.eod == tokenizer.eos == 2
    assert tokenizer.bos == 1
    assert tokenizer.vocab_size == 300
    ids = tokenizer.tokenize(texts[0])
    assert tokenizer.detokenize(ids) == texts[0]
    flat, lengths = pickle.loads(pickle.dumps(tokenizer)).tokenize_batch_flat(texts[:3])
    assert lengths[0] == len(ids)
    assert flat[: len(ids)].tolist() == ids


def test_hugging_face_tokenizer_missing_folder_is_a_user_error(tmp_path):
    pytest.importorskip("transformers")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(UserError, match="--tokenizer-model"):
        build_tokenizer("HuggingFaceTokenizer", str(empty))



def test_build_tokenizer_errors_name_the_flag(tmp_path):
    with pytest.raises(UserError, match="unknown; use one of .*GPTSentencePieceTokenizer.*NullTokenizer"):
        build_tokenizer("TikTokenizer", "x")
    with pytest.raises(UserError, match="needs --vocab-size"):
        build_tokenizer("NullTokenizer")
    with pytest.raises(UserError, match="needs --tokenizer-model"):
        build_tokenizer("GPTSentencePieceTokenizer")
    with pytest.raises(UserError, match=r"--tokenizer-model .*missing.model does not exist"):
        build_tokenizer("GPTSentencePieceTokenizer", str(tmp_path / "missing.model"))
    not_a_model = tmp_path / "text.model"
    not_a_model.write_text("hello")
    with pytest.raises(UserError, match="is not a SentencePiece model"):
        build_tokenizer("Llama2Tokenizer", str(not_a_model))


@pytest.mark.parametrize("vocab, problem", [('{"a": 0, "b": 1, "<|endoftext|>": 2}', "Token .ab. out of vocabulary"),
                                            ("not json", "Error while reading BPE files")])
def test_gpt2_bpe_files_that_do_not_fit_together_are_one_sentence_naming_both(tmp_path, vocab, problem):
    pytest.importorskip("transformers")
    vocab_file, merge_file = tmp_path / "vocab.json", tmp_path / "merges.txt"
    vocab_file.write_text(vocab)
    merge_file.write_text("#version: 0.2\na b\n")  # merges a + b into "ab", which the vocabulary lacks
    with pytest.raises(UserError, match=rf"^--vocab-file {vocab_file} and --merge-file {merge_file} are not one "
                                        rf"GPT-2 BPE tokenizer \(.*{problem}.*\); pass the gpt2-vocab.json and "
                                        rf"gpt2-merges.txt of the same tokenizer$"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=str(vocab_file), merge_file=str(merge_file))
