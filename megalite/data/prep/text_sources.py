"""Documents from the data tools' `--input`: JSONL files (Megatron's "loose json"), .txt files (one
document each), `datasets` folders or data files, or a hub dataset (with `--hf-split`). So that
preprocessing scales with worker processes, the parent only cuts the inputs into chunks, and `parse`,
run in the workers, turns a chunk into documents, naming the file and 1-based line of a bad one."""

import glob
import itertools
import json
import os
from dataclasses import dataclass, field
from typing import Iterator

from megalite.errors import UserError

# File suffix -> Source kind; a data file's suffix names its `datasets` builder.
FILE_KINDS = {".jsonl": "jsonl", ".json": "jsonl", ".txt": "txt", ".parquet": "data_file", ".csv": "data_file",
              ".arrow": "data_file"}
DATASET_FOLDER_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")

DEFAULT_CHUNK_BYTES = 1 << 20
MAX_BAD_EXAMPLES = 5  # where the first few skipped lines are; the rest are only counted


def add_input_args(parser) -> None:
    """The input flags shared by tools/preprocess_data.py and tools/train_tokenizer.py."""
    parser.add_argument("--input", nargs="+", required=True,
                        help="JSONL files or globs, .txt files, a datasets folder or data files, or a hub name")
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
    """What reading saw and skipped, summed over chunks with `add`."""

    num_bytes: int = 0  # input bytes (JSONL, .txt) or characters (datasets) read
    num_empty: int = 0  # (document, key) pairs skipped because the text was empty
    num_bad: int = 0  # lines or rows skipped as malformed (only with --skip-bad-lines)
    bad_examples: list[str] = field(default_factory=list)  # "where: why" for the first few

    def add(self, other: "ReadStats") -> None:
        self.num_bytes += other.num_bytes
        self.num_empty += other.num_empty
        self.num_bad += other.num_bad
        self.bad_examples.extend(other.bad_examples[:MAX_BAD_EXAMPLES - len(self.bad_examples)])

    def reject(self, where: str, reason: str, skip_bad_lines: bool) -> None:
        """Count a bad line in skip mode; otherwise stop with its location."""
        if not skip_bad_lines:
            raise UserError(f"{where}: {reason}; fix it or pass --skip-bad-lines to skip bad lines")
        self.num_bad += 1
        if len(self.bad_examples) < MAX_BAD_EXAMPLES:
            self.bad_examples.append(f"{where}: {reason}")


class ParsedChunk:
    """Documents of one chunk: key -> its non-empty texts in input order, and for each the index of its
    line (file, row) in the chunk, which the chunk's `location` names in errors. A bad line is skipped for
    every key, so all keys see the same lines."""

    def __init__(self, json_keys, num_bytes: int):
        self.texts: dict[str, list[str]] = {key: [] for key in json_keys}
        self.records: dict[str, list[int]] = {key: [] for key in json_keys}
        self.stats = ReadStats(num_bytes=num_bytes)

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
    """Whole lines of a JSONL file as raw bytes; `first_line` is the 1-based number of the first."""

    path: str
    first_line: int
    data: bytes

    def location(self, record: int) -> str:
        return f"{self.path}:{self.first_line + record}"

    def parse(self, json_keys, skip_bad_lines: bool) -> ParsedChunk:
        parsed = ParsedChunk(json_keys, len(self.data))
        for record, raw in enumerate(self.data.split(b"\n")):
            if not raw.strip():
                continue  # blank lines (a trailing one, say) hold no document
            try:
                parsed.add_record(record, _json_line_values(raw, json_keys))
            except _BadLine as bad:
                parsed.stats.reject(self.location(record), str(bad), skip_bad_lines)
        return parsed


class _BadLine(Exception):
    """A malformed input line; the message says what is wrong."""


_JSON_TYPE_NAMES = {dict: "object", list: "array", int: "number", float: "number", bool: "boolean", type(None): "null"}


def _json_line_values(raw: bytes, json_keys) -> list[str]:
    """The string under each key of one JSONL line; _BadLine if malformed."""
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
        if b"\\u" in raw:
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise _BadLine(f'"{key}" holds an unpaired \\u surrogate escape') from None
        values.append(value)
    return values


@dataclass
class TextFilesChunk:
    """Raw bytes of a few .txt files, each one document for the single key."""

    paths: list[str]
    contents: list[bytes]

    def location(self, record: int) -> str:
        return self.paths[record]

    def parse(self, json_keys, skip_bad_lines: bool) -> ParsedChunk:
        parsed = ParsedChunk(json_keys, sum(map(len, self.contents)))
        for record, content in enumerate(self.contents):
            try:
                parsed.add_record(record, [content.decode("utf-8")])
            except UnicodeDecodeError as err:
                line = content.count(b"\n", 0, err.start) + 1
                parsed.stats.reject(f"{self.paths[record]}:{line}", "invalid UTF-8", skip_bad_lines)
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
        parsed = ParsedChunk(json_keys, num_chars)
        for record, values in enumerate(zip(*(self.columns[key] for key in json_keys))):
            bad_key = next((key for key, v in zip(json_keys, values) if not isinstance(v, str)), None)
            if bad_key is None:
                parsed.add_record(record, list(values))
            else:
                parsed.stats.reject(self.location(record), f'"{bad_key}" is not a string', skip_bad_lines)
        return parsed


Chunk = JsonlChunk | TextFilesChunk | RowsChunk


def resolve_inputs(inputs: list[str], hf_split: str | None = None) -> list[Source]:
    """Turn `--input` values into sources, in order (glob matches sorted); UserError if one is unusable."""
    sources = []
    for name in inputs:
        if os.path.isdir(name):
            if not any(os.path.exists(os.path.join(name, marker)) for marker in DATASET_FOLDER_MARKERS):
                raise UserError(f"--input {name} is a folder but not a datasets save_to_disk folder; pass its "
                                f"files or a glob such as {os.path.join(name, '*.jsonl')}")
            sources.append(Source("dataset_folder", name))
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
            raise UserError(f"--input {name} is no file, folder or glob match; pass an existing path, or a "
                            "Hugging Face hub dataset name together with --hf-split")
    return sources


def _file_source(path: str) -> Source:
    kind = FILE_KINDS.get(os.path.splitext(path)[1].lower())
    if kind is None:
        raise UserError(f"--input {path} has an unknown file type; use one of {', '.join(FILE_KINDS)}")
    return Source(kind, path)


def iter_chunks(sources: list[Source], json_keys, hf_split: str | None = None,
                chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Iterator[Chunk]:
    """Cut the sources, in order, into chunks of about `chunk_bytes` each (lines are never split)."""
    if len(json_keys) > 1 and any(source.kind == "txt" for source in sources):
        raise UserError("a .txt --input holds one text per file; pass a single --json-keys with it")
    for kind, group in itertools.groupby(sources, key=lambda source: source.kind):
        if kind == "txt":  # consecutive .txt files share chunks
            yield from _txt_chunks([source.location for source in group], chunk_bytes)
        else:
            for source in group:
                yield from (_jsonl_chunks(source.location, chunk_bytes) if kind == "jsonl"
                            else _dataset_chunks(source, json_keys, hf_split, chunk_bytes))


def _jsonl_chunks(path: str, chunk_bytes: int) -> Iterator[JsonlChunk]:
    next_line = 1
    with open(path, "rb") as file:
        while lines := file.readlines(chunk_bytes):  # whole lines, until they pass chunk_bytes
            if next_line == 1:
                lines[0] = lines[0].removeprefix(b"\xef\xbb\xbf")  # a UTF-8 byte-order mark is no part of line 1
            yield JsonlChunk(path, next_line, b"".join(lines))
            next_line += len(lines)


def _txt_chunks(paths: list[str], chunk_bytes: int) -> Iterator[TextFilesChunk]:
    chunk, size = TextFilesChunk([], []), 0
    for path in paths:
        with open(path, "rb") as file:
            chunk.contents.append(file.read())
        chunk.paths.append(path)
        size += len(chunk.contents[-1])
        if size >= chunk_bytes:
            yield chunk
            chunk, size = TextFilesChunk([], []), 0
    if chunk.paths:
        yield chunk


def _dataset_chunks(source: Source, json_keys, hf_split, chunk_bytes) -> Iterator[RowsChunk]:
    dataset = load_dataset_source(source, hf_split)
    missing = [key for key in json_keys if key not in dataset.column_names]
    if missing:
        raise UserError(f"dataset {source.location} has no column {missing[0]!r} (its columns: "
                        f"{', '.join(dataset.column_names)}); choose columns with --json-keys")
    chunk, size = RowsChunk(source.location, 0, {key: [] for key in json_keys}), 0
    # Small batches from Arrow, merged until a chunk holds about chunk_bytes of text.
    for batch in dataset.select_columns(list(json_keys)).iter(batch_size=64):
        for key in json_keys:
            chunk.columns[key].extend(batch[key])
        size += sum(len(v) for v in batch[json_keys[0]] if isinstance(v, str))
        if size >= chunk_bytes:
            yield chunk
            chunk, size = RowsChunk(source.location, chunk.first_row + len(chunk.columns[json_keys[0]]),
                                    {key: [] for key in json_keys}), 0
    if chunk.columns[json_keys[0]]:
        yield chunk


def load_dataset_source(source: Source, hf_split: str | None):
    """The `datasets.Dataset` behind a dataset folder, data file or hub name (one split)."""
    try:
        import datasets
    except ImportError as err:
        raise UserError(f"--input {source.location} needs the datasets library; pip install datasets") from err
    if source.kind == "dataset_folder":
        dataset = datasets.load_from_disk(source.location)
        if not hasattr(dataset, "keys"):  # a single Dataset, not a DatasetDict
            return dataset
        splits = list(dataset.keys())
        if hf_split is None and len(splits) == 1:
            return dataset[splits[0]]
        if hf_split not in splits:
            raise UserError(f"dataset folder {source.location} has splits {', '.join(splits)}; choose one with "
                            "--hf-split")
        return dataset[hf_split]
    if source.kind == "data_file":
        builder = os.path.splitext(source.location)[1].lower()[1:]
        # A list of local data files is one "train" split; --hf-split may slice it ("train[:10%]").
        return datasets.load_dataset(builder, data_files=[source.location], split=hf_split or "train")
    try:
        return datasets.load_dataset(source.location, split=hf_split)
    except Exception as err:  # offline, unknown name, unknown split: all reported the same way
        reason = (str(err).strip().splitlines() or [""])[0]
        raise UserError(f"could not load hub dataset {source.location} split {hf_split} ({type(err).__name__}: "
                        f"{reason}); the hub needs internet access, or pass a local file or save_to_disk folder "
                        "as --input") from err


def iter_documents(inputs: list[str], json_keys=("text",), hf_split: str | None = None,
                   skip_bad_lines: bool = False, stats: ReadStats | None = None) -> Iterator[str]:
    """Every non-empty document of the inputs, in order, parsed in this process (with several keys, each
    chunk's documents key by key); skips are added to `stats`."""
    for chunk in iter_chunks(resolve_inputs(inputs, hf_split), json_keys, hf_split):
        parsed = chunk.parse(json_keys, skip_bad_lines)
        if stats is not None:
            stats.add(parsed.stats)
        for documents in parsed.texts.values():
            yield from documents
