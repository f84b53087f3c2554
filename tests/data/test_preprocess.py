"""megalite.data.prep.preprocess: text inputs to .bin/.idx token files (tools/preprocess_data.py's core)."""

import json
import os

import pytest

from megalite.data.indexed_dataset import IndexedDataset
from megalite.data.prep.preprocess import preprocess
from megalite.data.tokenizer import SentencePieceTokenizer
from megalite.errors import UserError


def run(inputs, output_prefix, tokenizer: dict, **options):
    """preprocess() with the tokenizer arguments `tokenizer` and keyword `options`; returns its summary."""
    return preprocess(inputs, str(output_prefix), **tokenizer, **options)


@pytest.fixture
def sp(spm_model):
    """Arguments selecting the test SentencePiece model."""
    return dict(tokenizer_type="GPTSentencePieceTokenizer", tokenizer_model=spm_model)


def decoded(prefix, tokenizer, strip_eod=False):
    dataset = IndexedDataset(str(prefix))
    documents = []
    for i in range(len(dataset)):
        ids = dataset[i]
        if strip_eod:
            assert ids[-1] == tokenizer.eod
            ids = ids[:-1]
        documents.append(tokenizer.detokenize(ids))
    return documents


@pytest.mark.parametrize("append_eod", [False, True])
def test_jsonl_documents_decode_back_to_the_input(tmp_path, texts, spm_model, sp, write_jsonl, append_eod):
    corpus = write_jsonl(tmp_path / "corpus.jsonl", [{"text": text, "id": i} for i, text in enumerate(texts)])
    summary = run(corpus, tmp_path / "out", tokenizer=sp, append_eod=append_eod)
    tokenizer = SentencePieceTokenizer(spm_model)
    assert decoded(tmp_path / "out_text_document", tokenizer, strip_eod=append_eod) == texts
    dataset = IndexedDataset(str(tmp_path / "out_text_document"))
    assert dataset.dtype.name == "uint16"
    assert summary["documents"] == {"text": len(texts)}
    assert summary["tokens"] == {"text": dataset.num_tokens}
    expected_tokens = sum(len(tokenizer.tokenize(text)) + append_eod for text in texts)
    assert dataset.num_tokens == expected_tokens


def test_worker_count_does_not_change_a_byte(tmp_path, texts, sp, write_jsonl):
    corpus = write_jsonl(tmp_path / "corpus.jsonl", [{"text": text} for text in texts * 3])
    for workers in (1, 2):  # small chunks: many tasks, finishing out of order
        run(corpus, tmp_path / f"w{workers}", tokenizer=sp, workers=workers, chunk_bytes=700, append_eod=True)
    for suffix in (".bin", ".idx"):
        first = (tmp_path / f"w1_text_document{suffix}").read_bytes()
        assert first == (tmp_path / f"w2_text_document{suffix}").read_bytes()


def test_several_json_keys_write_one_pair_each(tmp_path, spm_model, sp, write_jsonl):
    records = [{"title": f"title {i}", "body": f"body\n {i}"} for i in range(5)]
    corpus = write_jsonl(tmp_path / "c.jsonl", records)
    summary = run(corpus, tmp_path / "out", tokenizer=sp, json_keys=["title", "body"])
    assert summary["documents"] == {"title": 5, "body": 5}
    tokenizer = SentencePieceTokenizer(spm_model)
    assert decoded(tmp_path / "out_body_document", tokenizer)[3] == "body\n 3"
    assert decoded(tmp_path / "out_title_document", tokenizer)[4] == "title 4"


def test_txt_files_are_one_document_each(tmp_path, texts, spm_model, sp):
    for i, text in enumerate(texts[:4]):
        (tmp_path / f"doc{i}.txt").write_text(text, encoding="utf-8")
    (tmp_path / "empty.txt").write_text("")
    summary = run(str(tmp_path / "*.txt"), tmp_path / "out", tokenizer=sp)
    assert decoded(tmp_path / "out_text_document", SentencePieceTokenizer(spm_model)) == texts[:4]
    assert summary["skipped_empty"] == 1


def test_datasets_save_to_disk_folder(tmp_path, texts, spm_model, sp):
    datasets = pytest.importorskip("datasets")
    splits = datasets.DatasetDict({
        "train": datasets.Dataset.from_dict({"text": texts[:5], "n": list(range(5))}),
        "validation": datasets.Dataset.from_dict({"text": texts[5:7], "n": [5, 6]}),
    })
    splits.save_to_disk(str(tmp_path / "ds"))
    with pytest.raises(UserError, match="has splits train, validation; choose one with --hf-split"):
        run(str(tmp_path / "ds"), tmp_path / "out", tokenizer=sp)
    run(str(tmp_path / "ds"), tmp_path / "out", tokenizer=sp, hf_split="validation")
    assert decoded(tmp_path / "out_text_document", SentencePieceTokenizer(spm_model)) == texts[5:7]
    with pytest.raises(UserError, match="no column 'body'.*--json-keys"):
        run(str(tmp_path / "ds"), tmp_path / "out2", tokenizer=sp, hf_split="train", json_keys=["body"])


BAD_LINES = [
    ('{"text": "unterminated}', "invalid JSON"),
    ('{"title": "no text key"}', 'no key "text"'),
    ('{"text": 42}', '"text" is a JSON number, not a string'),
    ('{"text": null}', '"text" is a JSON null, not a string'),
    ('["a", "list"]', "not a JSON object"),
    ('{"text": "lone \\ud800 surrogate"}', "unpaired"),
    (b'{"text": "latin-1 \xe9"}', "invalid UTF-8"),
]


def write_with_bad_line(path, bad_line, good_before=3, good_after=2):
    """A JSONL file whose line `good_before + 1` is `bad_line`; the rest are good."""
    good = [json.dumps({"text": f"good document {i}"}).encode() for i in range(good_before + good_after)]
    bad = bad_line if isinstance(bad_line, bytes) else bad_line.encode()
    path.write_bytes(b"\n".join(good[:good_before] + [bad] + good[good_before:]) + b"\n")
    return str(path)


@pytest.mark.parametrize("bad_line, reason", BAD_LINES)
@pytest.mark.parametrize("chunk_bytes", [1048576, 30])
def test_bad_line_stops_with_file_and_line_number(tmp_path, sp, bad_line, reason, chunk_bytes):
    corpus = write_with_bad_line(tmp_path / "bad.jsonl", bad_line)
    with pytest.raises(UserError) as error:
        run(corpus, tmp_path / "out", tokenizer=sp, chunk_bytes=chunk_bytes)
    message = str(error.value)
    assert message.startswith(f"{corpus}:4: ")
    assert reason in message
    assert "--skip-bad-lines" in message
    assert os.listdir(tmp_path) == ["bad.jsonl"]  # nothing half-written left behind


def test_skip_bad_lines_counts_them(tmp_path, sp):
    corpus = tmp_path / "bad.jsonl"
    lines = [line if isinstance(line, bytes) else line.encode() for line, _ in BAD_LINES]
    good = [json.dumps({"text": f"good {i}"}).encode() for i in range(3)]
    corpus.write_bytes(b"\n".join(good[:1] + lines + good[1:]))  # no newline after the last line
    summary = run(str(corpus), tmp_path / "out", tokenizer=sp, skip_bad_lines=True)
    assert summary["skipped_bad"] == len(BAD_LINES)
    assert summary["documents"] == {"text": 3}
    assert summary["bad_examples"][0].startswith(f"{corpus}:2: invalid JSON")


def test_empty_documents_are_skipped_and_counted(tmp_path, spm_model, sp, write_jsonl):
    corpus = write_jsonl(tmp_path / "c.jsonl", [{"text": "a"}, {"text": ""}, "", {"text": "b"}, {"text": ""}])
    summary = run(corpus, tmp_path / "out", tokenizer=sp)
    assert summary["skipped_empty"] == 2
    assert decoded(tmp_path / "out_text_document", SentencePieceTokenizer(spm_model)) == ["a", "b"]


def test_worker_errors_leave_no_output_files(tmp_path, sp, write_jsonl):
    corpus = write_jsonl(tmp_path / "c.jsonl", [{"text": f"line {i}"} for i in range(50)] + ['{"text": 1}'])
    with pytest.raises(UserError, match=r"c.jsonl:51: "):
        run(corpus, tmp_path / "out", tokenizer=sp, workers=2, chunk_bytes=64)
    assert os.listdir(tmp_path) == ["c.jsonl"]


def test_null_tokenizer_names_the_line_it_cannot_read(tmp_path, write_jsonl):
    corpus = write_jsonl(tmp_path / "ids.jsonl", [{"text": "1 2 3"}, {"text": "4 five"}])
    null = dict(tokenizer_type="NullTokenizer", vocab_size=70000)
    with pytest.raises(UserError, match=r"ids.jsonl:2: the tokenizer rejects"):
        run(corpus, tmp_path / "out", tokenizer=null)
    corpus = write_jsonl(tmp_path / "ids.jsonl", [{"text": "1 2 3"}, {"text": "69999"}])
    run(corpus, tmp_path / "out", tokenizer=null, append_eod=True)
    dataset = IndexedDataset(str(tmp_path / "out_text_document"))
    assert dataset.dtype.name == "int32"  # vocabulary 70001 does not fit uint16
    assert [dataset[i].tolist() for i in range(2)] == [[1, 2, 3, 70000], [69999, 70000]]


def test_missing_input_is_a_user_error(tmp_path, sp):
    with pytest.raises(UserError, match="no file, folder or glob match.*--hf-split"):
        run(str(tmp_path / "missing.jsonl"), tmp_path / "out", tokenizer=sp)
    with pytest.raises(UserError, match="matches no file"):
        run(str(tmp_path / "*.jsonl"), tmp_path / "out", tokenizer=sp)


def test_worker_and_chunk_counts_below_one_are_refused(tmp_path, sp):
    for options in (dict(workers=0), dict(chunk_bytes=0)):
        with pytest.raises(ValueError, match="must be at least 1"):
            run(str(tmp_path / "missing.jsonl"), tmp_path / "out", tokenizer=sp, **options)
