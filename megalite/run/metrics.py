"""The metrics file: one JSON object per line, as ARCHITECTURE.md's "Metrics file" says.

Training records have the keys TRAINING_KEYS, evaluation records EVALUATION_KEYS. Values
are strict JSON (NaN and inf are written as null), so jq and pandas read every line.
`MetricsFile` writes one for a run (trimming what a resumed run writes again);
`read_metrics_records` reads one back (tools/plot_metrics.py, tools/loss_compare.py).
"""

import json
import math
import os
from pathlib import Path

from megalite.errors import UserError

TRAINING_KEYS = ("iteration", "consumed_samples", "lm_loss", "lr", "grad_norm", "loss_scale",
                 "tokens_per_sec", "tflops_per_device", "mfu", "iteration_time_ms", "mem_peak_bytes")
EVALUATION_KEYS = ("iteration", "split", "lm_loss")


def finite_or_none(value):
    """NaN and inf become None, so every metrics line is strict JSON (jq, pandas)."""
    if value is None:
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def read_metrics_records(path: str) -> list[dict]:
    """The records of a metrics JSONL file (one per log line or evaluation), in file order.

    Each has an integer "iteration"; evaluations also have "split" ("valid" or "test").
    A missing file or a line that is not such a record is a UserError naming it.
    """
    records = []
    try:
        with open(path, encoding="utf-8") as file:
            for number, line in enumerate(file, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                    record["iteration"] = int(record["iteration"])
                except (ValueError, KeyError, TypeError) as error:
                    raise UserError(f"{path} line {number} is not a metrics record ({error}); pass the "
                                    f"metrics.jsonl a megalite run wrote") from None
                records.append(record)
    except FileNotFoundError:
        raise UserError(f"{path} does not exist; pass the metrics file of a run (<save>/metrics.jsonl "
                        f"or --metrics-file)") from None
    return records


def trim_metrics_file(path: Path, start_iteration: int) -> int:
    """Drop lines after `start_iteration` (and a torn last line); return how many were dropped.

    A run resumed from the checkpoint of iteration K writes iterations K+1... again, so
    the lines an earlier attempt wrote past K would otherwise appear twice. The file is
    rewritten atomically, and only when something has to go.
    """
    if not path.exists():
        return 0
    kept, dropped = [], 0
    for line in path.read_text().splitlines():
        try:
            keep = json.loads(line)["iteration"] <= start_iteration
        except (ValueError, KeyError, TypeError):
            keep = False  # a line cut short by a crash
        if keep:
            kept.append(line + "\n")
        else:
            dropped += 1
    if dropped:
        temporary = path.with_name(path.name + ".tmp")
        temporary.write_text("".join(kept))
        os.replace(temporary, path)
    return dropped


class MetricsFile:
    """The metrics file of one run, open for appending; each record is flushed as it is written."""

    def __init__(self, path: str | os.PathLike, start_iteration: int = 0):
        """Create `path` (and its folder) or open it, first dropping the lines past `start_iteration`
        that a resumed run writes again; `self.dropped` says how many went."""
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.dropped = trim_metrics_file(self.path, start_iteration)
        self._file = open(self.path, "a", encoding="utf-8")

    def write(self, record: dict) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()  # a crash loses at most the line being written

    def close(self) -> None:
        self._file.close()
