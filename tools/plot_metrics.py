"""Plot the training curves of one or several runs from their metrics files, overlaid.

    python tools/plot_metrics.py runs/lr1e-3 runs/lr3e-3 --out curves.png
    python tools/plot_metrics.py runs/a/metrics.jsonl runs/b/metrics.jsonl --labels baseline tp2 --out ab.png

Each RUN is a metrics file (one JSON object per line: what `--metrics-file`, by default
`<save>/metrics.jsonl`, holds) or a run folder containing metrics.jsonl. Four panels
against the iteration, one colour per run: lm loss (training as a line, validation as
dots on a dashed line, test as a cross), learning rate, throughput (tokens/s over all
devices) and gradient norm. matplotlib draws with its Agg backend: no display needed.
"""

import argparse
import os
import sys

from megalite.errors import UserError, run_main
from megalite.run.metrics import read_metrics_records

METRICS_FILE = "metrics.jsonl"
# (key of a training record, panel title); the loss panel also shows the evaluations.
PANELS = (("lm_loss", "lm loss"), ("lr", "learning rate"), ("tokens_per_sec", "throughput (tokens/s)"),
          ("grad_norm", "grad norm"))


def metrics_path(run: str) -> str:
    """The metrics file of RUN: the file itself, or metrics.jsonl inside a run folder."""
    path = os.path.join(run, METRICS_FILE) if os.path.isdir(run) else run
    if not os.path.isfile(path):
        raise UserError(f"{run} is neither a metrics file nor a run folder holding {METRICS_FILE}; pass a run's "
                        f"--save folder or its --metrics-file")
    return path


def read_metrics(path: str) -> dict[str, list[dict]]:
    """The records of a metrics file by split: "train" (lines without a split), "valid", "test"."""
    records = {"train": [], "valid": [], "test": []}
    for record in read_metrics_records(path):
        records.setdefault(record.get("split", "train"), []).append(record)
    if not records["train"]:
        raise UserError(f"{path} holds no training records; was the run stopped before its first log line "
                        f"(--log-interval)?")
    return records


def run_labels(runs: list[str], labels: list[str] | None) -> list[str]:
    """--labels, else each run's folder name (the file's name when it is not metrics.jsonl)."""
    if labels is not None:
        if len(labels) != len(runs):
            raise UserError(f"--labels gives {len(labels)} names for {len(runs)} runs; give one per run")
        return labels
    names = []
    for run in runs:
        path = os.path.abspath(metrics_path(run))
        folder, name = os.path.split(path)
        names.append(os.path.basename(folder) if name == METRICS_FILE else os.path.splitext(name)[0])
    if len(set(names)) < len(names):  # same folder names in different places: show the paths
        names = [os.path.relpath(metrics_path(run)) for run in runs]
    return names


def _points(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    pairs = [(record["iteration"], record[key]) for record in records if record.get(key) is not None]
    return [iteration for iteration, _ in pairs], [value for _, value in pairs]


def plot(runs: list[tuple[str, dict]], out: str, title: str | None = None, dpi: int = 100) -> None:
    """Draw (label, records by split) of every run into the PNG (or any matplotlib format) `out`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(2, 2, figsize=(12, 7.5), sharex=True)
    axes = axes.ravel()
    for index, (label, records) in enumerate(runs):
        color = f"C{index % 10}"
        for axis, (key, _) in zip(axes, PANELS):
            suffix = " train" if key == "lm_loss" else ""
            axis.plot(*_points(records["train"], key), color=color, linewidth=1.5, label=label + suffix)
        loss = axes[0]
        if records["valid"]:
            loss.plot(*_points(records["valid"], "lm_loss"), color=color, linestyle="--", marker="o",
                      markersize=4, linewidth=1, label=f"{label} valid")
        if records["test"]:
            loss.plot(*_points(records["test"], "lm_loss"), color=color, linestyle="none", marker="x",
                      markersize=8, label=f"{label} test")
    for axis, (key, name) in zip(axes, PANELS):
        axis.set_title(name)
        axis.grid(alpha=0.3)
        axis.legend(fontsize="small")
        if key == "lr":
            axis.ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))
    for axis in axes[2:]:
        axis.set_xlabel("iteration")
    if title:
        figure.suptitle(title)
    figure.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    figure.savefig(out, dpi=dpi)
    plt.close(figure)


def main(argv) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", metavar="RUN", help="metrics files or run folders holding metrics.jsonl")
    parser.add_argument("--out", required=True, help="the image to write, e.g. curves.png")
    parser.add_argument("--labels", nargs="+", help="legend names, one per run (default: the run folders' names)")
    parser.add_argument("--title", help="a title above the panels")
    parser.add_argument("--dpi", type=int, default=100, help="pixels per inch; the figure is 12 x 7.5 inches")
    parser.add_argument("--debug", action="store_true", help="show tracebacks of user errors")
    args = parser.parse_args(argv)
    labels = run_labels(args.runs, args.labels)
    runs = [(label, read_metrics(metrics_path(run))) for label, run in zip(labels, args.runs)]
    if args.dpi < 10:
        raise UserError(f"--dpi must be at least 10, got {args.dpi}")
    plot(runs, args.out, args.title, args.dpi)
    points = sum(len(records["train"]) for _, records in runs)
    print(f"wrote {args.out}: {len(runs)} run(s), {points} training points")


if __name__ == "__main__":
    sys.exit(run_main(main))
