import pytest
import sentencepiece

from megalite.errors import UserError
from tools.train_tokenizer import main


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, make_texts, write_jsonl):
    path = tmp_path_factory.mktemp("corpus") / "corpus.jsonl"
    return write_jsonl(path, [{"text": text} for text in make_texts(150)])


def train(corpus, prefix, *flags):
    main(["--input", corpus, "--output-prefix", str(prefix), "--vocab-size", "350", *flags])
    return prefix.with_suffix(".model").read_bytes()


def test_training_twice_gives_byte_identical_models(corpus, tmp_path, capsys):
    first = train(corpus, tmp_path / "a" / "tok", "--max-sentences", "300", "--seed", "3")
    second = train(corpus, tmp_path / "b" / "tok", "--max-sentences", "300", "--seed", "3")
    assert first == second
    assert (tmp_path / "a" / "tok.vocab").read_text(encoding="utf-8").count("\n") == 350
    assert "wrote" in capsys.readouterr().out


def test_trained_model_round_trips_text_it_never_saw(corpus, tmp_path):
    model = sentencepiece.SentencePieceProcessor(model_proto=train(corpus, tmp_path / "tok"))
    text = "class Ünseen:\n\tdef m(self):\n        return '🦀'  \r\n\n  x = 0x1F\n"
    assert model.decode(model.encode(text)) == text
    assert [model.id_to_piece(i) for i in range(4)] == ["<unk>", "<s>", "</s>", "<pad>"]


def test_vocabulary_too_large_for_the_corpus_is_a_user_error(corpus, tmp_path):
    with pytest.raises(UserError, match="lower --vocab-size"):
        main(["--input", corpus, "--output-prefix", str(tmp_path / "tok"), "--vocab-size", "100000"])
    assert not (tmp_path / "tok.model").exists()
