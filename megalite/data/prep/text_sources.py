"""Documents from the inputs the data tools accept: JSONL files, .txt files, HF datasets.

Reading is split in two so that preprocessing scales with worker processes. The parent
only cuts its inputs into `Chunk`s -- raw bytes of whole JSONL lines, the bytes of a
few .txt files, or rows of a dataset -- and `Chunk.parse`, run in the workers, turns a
chunk into documents, checking every line and naming its file and 1-based line number
when one is bad. The parent never parses JSON.

Inputs (`--input`, one or more):
  - `.jsonl` / `.json` files or globs: one JSON object per line (Megatron's "loose json");
  - `.txt` files or globs: each file is one document;
  - a `datasets` `save_to_disk` folder, or `.parquet` / `.csv` / `.arrow` data files,
    read with the `datasets` library;
  - any other name is a Hugging Face hub dataset, which needs `--hf-split` (and internet).
"""

import glob
import json
import os
from dataclasses import dataclass, field
from typing import Iterator

from megalite.errors import UserError

JSONL_SUFFIXES = (".jsonl", ".json")
TEXT_SUFFIXES = (".txt",)
DATA_FILE_BUILDERS = {".parquet": "parquet", ".csv": "csv", ".arrow": "arrow"}
DATASET_FOLDER_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")

DEFAULT_CHUNK_BYTES = 1 << 20
MAX_BAD_EXAMPLES = 5  # where the first few skipped lines are; the rest are only counted
SKIP_HINT = "fix it or pass --skip-bad-lines to skip bad lines"


def add_input_args(parser) -> None:
    """The input flags shared by tools/preprocess_data.py and tools/train_tokenizer.py."""
    parser.add_argument("--input", nargs="+", required=True,
                        help="JSONL files or globs, .txt files, a datasets folder or data files, "
                        "or a hub name")
    parser.add_argument("--json-keys", nargs="+", default=["text"],
                        help="keys (columns) to read; preprocessing writes one .bin/.idx per key")
    parser.add_argument("--hf-split", default=None, help="split of a Hugging Face dataset input")
    parser.add_argument("--skip-bad-lines", action="store_true",
                        help="skip (and count) malformed lines instead of stopping at the first")


@dataclass(frozen=True)
class Source:
    """One resolved input. kind: "jsonl", "txt", "dataset_folder", "data_file" or "hub"."""

    kind: str
    location: str


@dataclass
class ReadStats:
    """What reading skipped, summed over chunks with `add`.

    num_bytes: input bytes (JSONL, .txt) or characters (datasets) read.
    num_empty: (document, key) pairs skipped because the text was empty.
    num_bad: lines or rows skipped as malformed (only with --skip-bad-lines).
    bad_examples: "where: why" for the first few of those.
    """

    num_bytes: int = 0
    num_empty: int = 0
    num_bad: int = 0
    bad_examples: list[str] = field(default_factory=list)

    def add(self, other: "ReadStats") -> None:
        self.num_bytes += other.num_bytes
        self.num_empty += other.num_empty
        self.num_bad += other.num_bad
        room = MAX_BAD_EXAMPLES - len(self.bad_examples)
        self.bad_examples.extend(other.bad_examples[:room])

    def reject(self, where: str, reason: str, skip_bad_lines: bool) -> None:
        """Count a bad line in skip mode; otherwise stop with its location."""
        if not skip_bad_lines:
            raise UserError(f"{where}: {reason}; {SKIP_HINT}")
        self.num_bad += 1
        if len(self.bad_examples) < MAX_BAD_EXAMPLES:
            self.bad_examples.append(f"{where}: {reason}")


@dataclass
class ParsedChunk:
    """Documents of one chunk, plus what was skipped.

    texts: key -> its non-empty texts, in input order.
    records: key -> for each of those texts, the index of its line (file, row) in the chunk,
        which the chunk's `location` turns into "file:line" for error messages.
    A bad line is skipped for every key, so all keys see the same lines.
    """

    texts: dict[str, list[str]]
    records: dict[str, list[int]]
    stats: ReadStats

    @classmethod
    def empty(cls, json_keys, num_bytes: int) -> "ParsedChunk":
        texts = {key: [] for key in json_keys}
        return cls(texts, {key: [] for key in json_keys}, ReadStats(num_bytes=num_bytes))

    def add_record(self, record: int, values: list[str]) -> None:
        """Add the texts of the chunk's `record`-th line, one per key in `texts`' order."""
        for key, text in zip(self.texts, values):
            if text:
                self.texts[key].append(text)
                self.records[key].append(record)
            else:
                self.stats.num_empty += 1


@dataclass
class JsonlChunk:
    """Whole lines of a JSONL file, as raw bytes; `first_line` is the 1-based number of the first.

    Blank lines are not documents and are passed over silently.
    """

    path: str
    first_line: int
    data: bytes

    def location(self, record: int) -> str:
        return f"{self.path}:{self.first_line + record}"

    def parse(self, json_keys, skip_bad_lines: bool) -> ParsedChunk:
        parsed = ParsedChunk.empty(json_keys, len(self.data))
        lines = self.data.split(b"\n")
        if lines[-1] == b"":  # the chunk ends with a newline
            lines.pop()
        for record, raw in enumerate(lines):
            try:
                values = _json_line_values(raw, json_keys)
            except _BadLine as bad:
                parsed.stats.reject(self.location(record), str(bad), skip_bad_lines)
                continue
            if values is not None:
                parsed.add_record(record, values)
        return parsed


class _BadLine(Exception):
    """A malformed input line; the message says what is wrong with it."""


def _json_line_values(raw: bytes, json_keys) -> list[str] | None:
    """The string under each key of one JSONL line; None for a blank line; _BadLine if malformed."""
    if not raw.strip():
        return None  # blank lines (a trailing one, say) hold no document
    try:
        record = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as err:
        raise _BadLine(f"invalid UTF-8 at byte {err.start + 1} of the line") from None
    except json.JSONDecodeError as err:
        raise _BadLine(f"invalid JSON ({err.msg} at column {err.colno})") from None
    if not isinstance(record, dict):
        raise _BadLine("the line is not a JSON object")
    values = []
    for key in json_keys:
        if key not in record:
            raise _BadLine(f'no key "{key}" (choose keys with --json-keys)')
        value = record[key]
        if not isinstance(value, str):
            raise _BadLine(f'"{key}" is a JSON {_JSON_TYPE_NAMES[type(value)]}, not a string')
        # JSON escapes can spell lone surrogates ("\ud800"), which no UTF-8 tokenizer accepts.
        if b"\\u" in raw and not _is_encodable(value):
            raise _BadLine(f'"{key}" holds an unpaired \\u surrogate escape')
        values.append(value)
    return values


_JSON_TYPE_NAMES = {
    dict: "object", list: "array", int: "number", float: "number", bool: "boolean", type(None): "null"
}


def _is_encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


@dataclass
class TextFilesChunk:
    """Raw bytes of a few .txt files, each one document for the single key."""

    paths: list[str]
    contents: list[bytes]

    def location(self, record: int) -> str:
        return self.paths[record]

    def parse(self, json_keys, skip_bad_lines: bool) -> ParsedChunk:
        parsed = ParsedChunk.empty(json_keys, sum(map(len, self.contents)))
        for record, content in enumerate(self.contents):
            try:
                text = content.decode("utf-8")
            except UnicodeDecodeError as err:
                line = content.count(b"\n", 0, err.start) + 1
                parsed.stats.reject(f"{self.paths[record]}:{line}", "invalid UTF-8", skip_bad_lines)
                continue
            parsed.add_record(record, [text])
        return parsed


@dataclass
class RowsChunk:
    """Rows of a `datasets` dataset: key -> column values; `first_row` is the 0-based row index."""

    name: str
    first_row: int
    columns: dict[str, list]

    def location(self, record: int) -> str:
        return f"{self.name} row {self.first_row + record}"

    def parse(self, json_keys, skip_bad_lines: bool) -> ParsedChunk:
        num_chars = sum(len(v) for values in self.columns.values() for v in values if isinstance(v, str))
        parsed = ParsedChunk.empty(json_keys, num_chars)
        for record, values in enumerate(zip(*(self.columns[key] for key in json_keys))):
            bad_key = next((key for key, v in zip(json_keys, values) if not isinstance(v, str)), None)
            if bad_key is not None:
                parsed.stats.reject(self.location(record), f'"{bad_key}" is not a string', skip_bad_lines)
                continue
            parsed.add_record(record, list(values))
        return parsed


Chunk = JsonlChunk | TextFilesChunk | RowsChunk


def resolve_inputs(inputs: list[str], hf_split: str | None = None) -> list[Source]:
    """Turn `--input` values into sources, in order (glob matches sorted); UserError if one is unusable."""
    sources = []
    for name in inputs:
        if os.path.isdir(name):
            sources.append(_folder_source(name))
        elif os.path.isfile(name):
            sources.append(_file_source(name))
        elif glob.has_magic(name):
            matches = sorted(p for p in glob.glob(name, recursive=True) if os.path.isfile(p))
            if not matches:
                raise UserError(f"--input {name} matches no file; check the pattern")
            sources.extend(_file_source(path) for path in matches)
        elif hf_split is not None:
            sources.append(Source("hub", name))
        else:
            raise UserError(
                f"--input {name} is no file, folder or glob match; pass an existing path, "
                "or a Hugging Face hub dataset name together with --hf-split"
            )
    return sources


def _folder_source(path: str) -> Source:
    if any(os.path.exists(os.path.join(path, marker)) for marker in DATASET_FOLDER_MARKERS):
        return Source("dataset_folder", path)
    raise UserError(
        f"--input {path} is a folder but not a datasets save_to_disk folder; "
        f"pass its files or a glob such as {os.path.join(path, '*.jsonl')}"
    )


def _file_source(path: str) -> Source:
    suffix = os.path.splitext(path)[1].lower()
    if suffix in JSONL_SUFFIXES:
        return Source("jsonl", path)
    if suffix in TEXT_SUFFIXES:
        return Source("txt", path)
    if suffix in DATA_FILE_BUILDERS:
        return Source("data_file", path)
    known = ", ".join(JSONL_SUFFIXES + TEXT_SUFFIXES + tuple(DATA_FILE_BUILDERS))
    raise UserError(f"--input {path} has an unknown file type; use one of {known}")


def iter_chunks(
    sources: list[Source], json_keys, hf_split: str | None = None, chunk_bytes: int = DEFAULT_CHUNK_BYTES
) -> Iterator[Chunk]:
    """Cut the sources, in order, into chunks of about `chunk_bytes` each (lines are never split)."""
    if len(json_keys) > 1 and any(source.kind == "txt" for source in sources):
        raise UserError("a .txt --input holds one text per file; pass a single --json-keys with it")
    pending_txt = []
    for source in sources:
        if source.kind == "txt":
            pending_txt.append(source.location)
            continue
        yield from _txt_chunks(pending_txt, chunk_bytes)
        pending_txt = []
        if source.kind == "jsonl":
            yield from _jsonl_chunks(source.location, chunk_bytes)
        else:
            yield from _dataset_chunks(source, json_keys, hf_split, chunk_bytes)
    yield from _txt_chunks(pending_txt, chunk_bytes)


def _jsonl_chunks(path: str, chunk_bytes: int) -> Iterator[JsonlChunk]:
    next_line = 1
    carry = b""  # the start of a line that the previous read cut
    with open(path, "rb") as file:
        while block := file.read(chunk_bytes):
            if next_line == 1 and not carry and block.startswith(b"\xef\xbb\xbf"):
                block = block[3:]  # a UTF-8 byte-order mark is not part of the first line
            block = carry + block
            end = block.rfind(b"\n") + 1
            if end == 0:  # one line longer than a chunk: keep reading
                carry = block
                continue
            data, carry = block[:end], block[end:]
            yield JsonlChunk(path, next_line, data)
            next_line += data.count(b"\n")
    if carry:
        yield JsonlChunk(path, next_line, carry)


def _txt_chunks(paths: list[str], chunk_bytes: int) -> Iterator[TextFilesChunk]:
    chunk = TextFilesChunk([], [])
    size = 0
    for path in paths:
        with open(path, "rb") as file:
            content = file.read()
        chunk.paths.append(path)
        chunk.contents.append(content)
        size += len(content)
        if size >= chunk_bytes:
            yield chunk
            chunk, size = TextFilesChunk([], []), 0
    if chunk.paths:
        yield chunk


def _dataset_chunks(source: Source, json_keys, hf_split, chunk_bytes) -> Iterator[RowsChunk]:
    dataset = load_dataset_source(source, hf_split)
    missing = [key for key in json_keys if key not in dataset.column_names]
    if missing:
        raise UserError(
            f"dataset {source.location} has no column {missing[0]!r} (its columns: "
            f"{', '.join(dataset.column_names)}); choose columns with --json-keys"
        )
    columns = {key: [] for key in json_keys}
    first_row = 0
    size = 0
    # Small batches from Arrow, merged until a chunk holds about chunk_bytes of text.
    for batch in dataset.select_columns(list(json_keys)).iter(batch_size=64):
        for key in json_keys:
            columns[key].extend(batch[key])
        size += sum(len(v) for v in batch[json_keys[0]] if isinstance(v, str))
        if size >= chunk_bytes:
            yield RowsChunk(source.location, first_row, columns)
            first_row += len(columns[json_keys[0]])
            columns = {key: [] for key in json_keys}
            size = 0
    if columns[json_keys[0]]:
        yield RowsChunk(source.location, first_row, columns)


def load_dataset_source(source: Source, hf_split: str | None):
    """The `datasets.Dataset` behind a dataset folder, data file or hub name (one split)."""
    try:
        import datasets
    except ImportError as err:
        raise UserError(
            f"--input {source.location} needs the datasets library; pip install datasets"
        ) from err
    if source.kind == "dataset_folder":
        return _pick_split(datasets.load_from_disk(source.location), source.location, hf_split)
    if source.kind == "data_file":
        builder = DATA_FILE_BUILDERS[os.path.splitext(source.location)[1].lower()]
        # A list of local data files is one "train" split; --hf-split may slice it ("train[:10%]").
        return datasets.load_dataset(builder, data_files=[source.location], split=hf_split or "train")
    try:
        return datasets.load_dataset(source.location, split=hf_split)
    except Exception as err:  # offline, unknown name, unknown split: all reported the same way
        reason = (str(err).strip().splitlines() or [""])[0]
        raise UserError(
            f"could not load hub dataset {source.location} split {hf_split} "
            f"({type(err).__name__}: {reason}); "
            "the hub needs internet access, or pass a local file or save_to_disk folder as --input"
        ) from err


def _pick_split(dataset, location, hf_split):
    if not hasattr(dataset, "keys"):  # a single Dataset, not a DatasetDict
        return dataset
    splits = list(dataset.keys())
    if hf_split is None and len(splits) == 1:
        return dataset[splits[0]]
    if hf_split not in splits:
        raise UserError(
            f"dataset folder {location} has splits {', '.join(splits)}; choose one with --hf-split"
        )
    return dataset[hf_split]


def iter_documents(
    inputs: list[str],
    json_keys=("text",),
    hf_split: str | None = None,
    skip_bad_lines: bool = False,
    stats: ReadStats | None = None,
) -> Iterator[str]:
    """Every non-empty document of the inputs, in order, parsed in this process.

    With several keys, each chunk yields its documents key by key. Skips are added to `stats`.
    """
    sources = resolve_inputs(inputs, hf_split)
    for chunk in iter_chunks(sources, json_keys, hf_split):
        parsed = chunk.parse(json_keys, skip_bad_lines)
        if stats is not None:
            stats.add(parsed.stats)
        for documents in parsed.texts.values():
            yield from documents
