"""tools/preprocess_data.py: Megatron's flags onto megalite.data.prep.preprocess, as a script."""

import subprocess
import sys
from pathlib import Path

import pytest

from megalite.data.prep.preprocess import preprocess
from megalite.errors import UserError
from tools.preprocess_data import get_args, main

SCRIPT = Path(__file__).resolve().parents[2] / "tools" / "preprocess_data.py"


@pytest.fixture
def sp(spm_model):
    """Flags selecting the test SentencePiece model."""
    return ["--tokenizer-type", "GPTSentencePieceTokenizer", "--tokenizer-model", spm_model]


def test_flags_reach_the_function(tmp_path, spm_model, sp, write_jsonl, capsys):
    records = [{"title": f"title {i}", "body": f"body\n {i}"} for i in range(20)] + ['{"title": 1}']
    corpus = write_jsonl(tmp_path / "c.jsonl", records)
    main(["--input", corpus, "--output-prefix", str(tmp_path / "cli"), *sp, "--json-keys", "title", "body",
          "--append-eod", "--skip-bad-lines", "--workers", "2", "--chunk-bytes", "64", "--log-interval", "0"])
    assert "skipped 0 empty documents and 1 bad lines" in capsys.readouterr().out
    preprocess([corpus], str(tmp_path / "function"), "GPTSentencePieceTokenizer", spm_model,
               json_keys=["title", "body"], append_eod=True, skip_bad_lines=True, log_interval=0)
    for key in ("title", "body"):
        for suffix in (".bin", ".idx"):
            cli = (tmp_path / f"cli_{key}_document{suffix}").read_bytes()
            assert cli == (tmp_path / f"function_{key}_document{suffix}").read_bytes()


@pytest.mark.parametrize("flag", ["--workers", "--chunk-bytes"])
def test_counts_below_one_name_the_flag(tmp_path, sp, flag):
    with pytest.raises(UserError, match=f"^{flag} 0 must be at least 1$"):
        get_args(["--input", "c.jsonl", "--output-prefix", str(tmp_path / "out"), *sp, flag, "0"])


def test_cli_prints_a_summary_and_fails_with_one_line(tmp_path, sp, write_jsonl):
    corpus = write_jsonl(tmp_path / "c.jsonl", [{"text": "hello"}, {"text": "world"}])
    command = [sys.executable, str(SCRIPT), "--input", corpus, "--output-prefix", str(tmp_path / "out"), *sp]
    done = subprocess.run(
        command + ["--workers", "2", "--append-eod"], capture_output=True, text=True, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    assert "2 documents" in done.stdout
    with open(corpus, "a") as file:
        file.write("not json\n")
    failed = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path)
    assert failed.returncode == 1
    assert failed.stderr.startswith(f"error: {corpus}:3: invalid JSON")
    assert failed.stderr.count("\n") == 1
