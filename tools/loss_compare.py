"""Compare the losses of two runs from their metrics files (e.g. a parallel layout vs one process).

    python tools/loss_compare.py runs/tp1/metrics.jsonl runs/tp2/metrics.jsonl --rtol 1e-5

Prints, per logged training iteration (and per evaluation), both losses and their
relative difference, then the largest one. Exits 1 when it exceeds --rtol, or when the
files do not log the same iterations; 0 otherwise.
"""

import argparse
import sys

from megalite.errors import UserError, run_main
from megalite.run.metrics import read_metrics_records


def read_losses(path: str) -> dict[tuple[str, int], float]:
    """{(split, iteration): lm_loss} of a metrics JSONL file; split "train", "valid" or "test"."""
    return {(record.get("split", "train"), record["iteration"]): record.get("lm_loss")
            for record in read_metrics_records(path)}


def read_grad_norms(path: str) -> dict[tuple[str, int], float]:
    """{("grad_norm", iteration): the step's grad norm} of a metrics file's training records: a grad scaled by a
    layout (say by EP or TP) shows here even where Adam's scale invariance hides it from the losses."""
    return {("grad_norm", record["iteration"]): record["grad_norm"] for record in read_metrics_records(path)
            if "split" not in record and record.get("grad_norm") is not None}


def relative_difference(a: float, b: float) -> float:
    return abs(a - b) / max(abs(a), abs(b), 1e-12)


def compare(reference: dict, other: dict) -> tuple[list[tuple], float]:
    """Rows (split, iteration, ref, other, rel diff) for the common records, and the largest diff."""
    if set(reference) != set(other):
        only = sorted(set(reference) ^ set(other))[:5]
        raise UserError(f"the two files log different iterations (e.g. {only}); run both with the same "
                        f"--train-iters, --log-interval and --eval-interval")
    rows = []
    for key in sorted(reference, key=lambda k: (k[1], k[0])):
        a, b = reference[key], other[key]
        diff = float("inf") if a is None or b is None else relative_difference(a, b)
        rows.append((*key, a, b, diff))
    return rows, max((row[-1] for row in rows), default=0.0)


def main(argv) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("reference")
    parser.add_argument("other")
    parser.add_argument("--rtol", type=float, default=1e-5, help="largest relative difference accepted")
    parser.add_argument("--quiet", action="store_true", help="print only the summary line")
    args = parser.parse_args(argv)
    rows, worst = compare(read_losses(args.reference), read_losses(args.other))
    if not rows:
        raise UserError(f"{args.reference} holds no losses; was the run logged with --metrics-file?")
    if not args.quiet:
        print(f"{'split':<6} {'iteration':>9} {'reference':>14} {'other':>14} {'rel diff':>10}")
        for split, iteration, a, b, diff in rows:
            print(f"{split:<6} {iteration:>9} {a!s:>14.14} {b!s:>14.14} {diff:>10.2e}")
    verdict = "within" if worst <= args.rtol else "ABOVE"
    print(f"largest relative difference {worst:.3e} over {len(rows)} records: {verdict} --rtol {args.rtol:g}")
    return 0 if worst <= args.rtol else 1


if __name__ == "__main__":
    sys.exit(run_main(main))
