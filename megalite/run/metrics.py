"""The metrics file: one JSON record per log line and per evaluation, in strict JSON (NaN and inf written as
null) so that jq and pandas read every line. `MetricsFile` writes one, `read_metrics_records` reads it back."""

import json
import math
import os
from pathlib import Path

from megalite.errors import UserError


def finite_or_none(value):
    """NaN and inf become None, so every metrics line is strict JSON (jq, pandas)."""
    return None if value is None or not math.isfinite(value) else float(value)


def read_metrics_records(path: str) -> list[dict]:
    """The records of a metrics JSONL file, in file order, each with an integer "iteration" (evaluations
    also have "split": "valid" or "test"). A missing file or a line that is no record is a UserError."""
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


class MetricsFile:
    """The metrics file of one run, open for appending; each record is flushed as it is written."""

    def __init__(self, path: str | os.PathLike, start_iteration: int = 0, start_evaluations=None):
        """Create `path` (and its folder) or open it. A run resumed from iteration K writes K+1... again, so the
        lines past `start_iteration` go first (one atomic rewrite, counted in `self.dropped`), as do its
        evaluations at K not in `start_evaluations` (the splits its checkpoint had logged; None keeps all) and
        a torn last line."""
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        kept, self.dropped = [], 0
        for line in self.path.read_text().splitlines() if self.path.exists() else []:
            try:
                record = json.loads(line)
                keep = record["iteration"] < start_iteration or (record["iteration"] == start_iteration and (
                    "split" not in record or start_evaluations is None or record["split"] in start_evaluations))
            except (ValueError, KeyError, TypeError):
                keep = False  # a line cut short by a crash
            if keep:
                kept.append(line + "\n")
            else:
                self.dropped += 1
        if self.dropped:
            temporary = self.path.with_name(self.path.name + ".tmp")
            temporary.write_text("".join(kept))
            os.replace(temporary, self.path)
        self._file = open(self.path, "a", encoding="utf-8")

    def write(self, record: dict) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()  # a crash loses at most the line being written

    def close(self) -> None:
        self._file.close()
