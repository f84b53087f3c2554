"""The built-in default corpus: the running interpreter's standard library (one document per `.py` file), with a
SentencePiece tokenizer trained on it, tokenized into `data/build/stdlib-py<version>/`. Reused while its
`manifest.json`, written last, checks out; deterministic and safe when several processes ask at once."""

import fcntl
import json
import os
import platform
import shutil
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np

from megalite.data.prep.preprocess import preprocess
from megalite.data.prep.text_sources import iter_documents
from megalite.data.tokenizer import train_sentencepiece
from megalite.errors import UserError

REPO_ROOT = Path(__file__).resolve().parents[3]  # megalite/data/prep/ -> the repository
DEFAULT_BUILD_DIR = "data/build"
VOCAB_SIZE = 8192
MANIFEST_FORMAT = 1
EXCLUDED_DIRS = {"site-packages", "dist-packages", "__pycache__"}
DATA_NAME = "stdlib"  # preprocessing writes stdlib_text_document.bin/.idx
TOKENIZER_NAME = "tokenizer"  # training writes tokenizer.model/.vocab


def ensure_builtin_corpus(build_dir: str = DEFAULT_BUILD_DIR, max_files: int | None = None,
                          force: bool = False) -> tuple[str, str]:
    """Build the corpus if needed; return (data_prefix, tokenizer_model_path). build_dir: relative to the
    repository root, not the cwd. max_files: keep only the first N files (by path), for tests, built in its
    own folder. force: rebuild even if complete."""
    name = f"stdlib-py{platform.python_version()}" + (f"-first{max_files}" if max_files is not None else "")
    corpus_dir = REPO_ROOT / build_dir / name  # joining keeps an absolute build_dir as it is
    corpus_dir.parent.mkdir(parents=True, exist_ok=True)
    with open(corpus_dir.with_name(corpus_dir.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a second process waits here; closing the file unlocks
        if force or load_manifest(corpus_dir, max_files) is None:
            _build(corpus_dir, max_files)
    return str(corpus_dir / f"{DATA_NAME}_text_document"), str(corpus_dir / f"{TOKENIZER_NAME}.model")


def load_manifest(corpus_dir: Path, max_files: int | None = None) -> dict | None:
    """The manifest of a complete build for this interpreter and `max_files`; None otherwise."""
    try:
        manifest = json.loads((corpus_dir / "manifest.json").read_text())
    except (OSError, ValueError):
        return None
    # Another Python, or an edited installation (another file count), means a rebuild.
    identity = _identity(max_files, len(stdlib_files(max_files)[1]))
    if any(manifest.get(key) != value for key, value in identity.items()):
        return None
    bin_file = corpus_dir / f"{DATA_NAME}_text_document.bin"
    needed = [bin_file, bin_file.with_suffix(".idx"), corpus_dir / f"{TOKENIZER_NAME}.model"]
    if not all(path.is_file() for path in needed):
        return None
    if bin_file.stat().st_size != manifest["num_tokens"] * np.dtype(manifest["dtype"]).itemsize:
        return None
    return manifest


def _identity(max_files: int | None, num_files: int) -> dict:
    return {"format": MANIFEST_FORMAT, "python_version": platform.python_version(), "max_files": max_files,
            "num_files": num_files}


def stdlib_files(max_files: int | None = None) -> tuple[Path, list[str]]:
    """The standard library's root and its .py files (relative posix paths, sorted), without site-packages."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for folder, subfolders, names in os.walk(root):
        subfolders[:] = [name for name in subfolders if name not in EXCLUDED_DIRS]
        relative = Path(folder).relative_to(root)
        files.extend((relative / name).as_posix() for name in names if name.endswith(".py"))
    return root, sorted(files)[:max_files]  # max_files None: all


def write_corpus_jsonl(root: Path, files: list[str], path: Path) -> int:
    """Write one {"text", "path"} line per file; return how many were skipped as not UTF-8."""
    num_skipped = 0
    with open(path, "w", encoding="utf-8") as out:
        for name in files:
            try:
                text = (root / name).read_bytes().decode("utf-8")
            except UnicodeDecodeError:  # a few test fixtures are deliberately in other encodings
                num_skipped += 1
                continue
            out.write(json.dumps({"text": text, "path": name}, ensure_ascii=False) + "\n")
    return num_skipped


def _build(corpus_dir: Path, max_files: int | None) -> None:
    """Write corpus.jsonl, the tokenizer, the token files and last the manifest into a staging folder; swap it in."""
    start = time.perf_counter()
    root, files = stdlib_files(max_files)
    if not files:
        raise UserError(f"found no .py files under {root}; the built-in corpus needs the Python standard library")
    print(f"building the built-in corpus from {len(files)} files under {root}", file=sys.stderr)
    staging = corpus_dir.with_name(f"{corpus_dir.name}.staging")
    shutil.rmtree(staging, ignore_errors=True)  # what a killed build left behind
    staging.mkdir()
    try:
        jsonl = staging / "corpus.jsonl"
        num_skipped = write_corpus_jsonl(root, files, jsonl)
        # A small max_files corpus cannot fill VOCAB_SIZE pieces; it gets fewer instead of an error.
        tokenizer = train_sentencepiece(iter_documents([str(jsonl)]), str(staging / TOKENIZER_NAME),
                                        vocab_size=VOCAB_SIZE, hard_vocab_limit=False)
        workers = max(1, min(os.cpu_count() or 1, 8))  # the output is the same for any count
        summary = preprocess(str(jsonl), str(staging / DATA_NAME), "GPTSentencePieceTokenizer", tokenizer["model"],
                             json_keys=["text"], append_eod=True, workers=workers, log_interval=0)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    manifest = {**_identity(max_files, len(files)), "stdlib": str(root), "num_skipped_not_utf8": num_skipped,
                "num_empty_files": summary["skipped_empty"], "num_documents": summary["documents"]["text"],
                "num_tokens": summary["tokens"]["text"], "dtype": summary["dtype"],
                "vocab_size": tokenizer["vocab_size"], "build_seconds": round(time.perf_counter() - start, 1)}
    (staging / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    shutil.rmtree(corpus_dir, ignore_errors=True)
    staging.rename(corpus_dir)
