"""Save a checkpoint in one parallel layout, resume it in others, and compare with one process.

    python tools/check_resharding.py       # TP2 x PP2(V2) x DP2 + SP + distributed optimizer -> 3 layouts

The source layout trains `--mock-data` (fp32, dropout 0) for --stop-at iterations and
saves; each target layout copies that folder, resumes it with `--load` and trains to
--train-iters. Every logged loss (training and evaluation) of each resumed run is
compared with the uninterrupted single-process run, as tools/check_layouts.py does for
whole runs. Exits 1 when any relative difference exceeds --rtol.
"""

import argparse
import os
import shutil
import sys
import tempfile

from tools.check_layouts import COMMON, LAYOUTS, MODELS, run
from tools.loss_compare import compare, read_losses

SOURCE = (8, LAYOUTS["tp2-pp2-dp2-sp-vp2-distopt-overlap"][1])
TARGETS = {  # name -> (processes, flags): the three targets, none with the distributed optimizer
    "tp1-pp1-dp1": (1, []),
    "tp4-dp2": (8, ["--tensor-model-parallel-size", "4"]),
    "pp4-dp2": (8, ["--pipeline-model-parallel-size", "4"]),
}


def train(folder: str, processes: int, flags: list[str], load: bool = False) -> dict:
    metrics = os.path.join(folder, "metrics.jsonl")
    run(processes, [*flags, "--save", folder, *(["--load", folder] if load else [])], metrics)
    return read_losses(metrics)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train-iters", type=int, default=8)
    parser.add_argument("--stop-at", type=int, default=3, help="the iteration the source layout saves at")
    parser.add_argument("--targets", nargs="+", default=list(TARGETS), choices=list(TARGETS))
    parser.add_argument("--rtol", type=float, default=1e-5)
    args = parser.parse_args(argv)
    flags = [*COMMON, *MODELS["llama"], "--train-iters", str(args.train_iters), "--eval-interval",
             str(args.stop_at)]
    worst = 0.0
    with tempfile.TemporaryDirectory() as folder:
        reference = train(os.path.join(folder, "single"), 1, flags)
        source = os.path.join(folder, "source")
        processes, source_flags = SOURCE
        train(source, processes, [*flags, *source_flags, "--exit-interval", str(args.stop_at)])
        for name in args.targets:
            target = os.path.join(folder, name)
            shutil.copytree(source, target)
            processes, target_flags = TARGETS[name]
            losses = train(target, processes, [*flags, *target_flags], load=True)
            rows, difference = compare({key: reference[key] for key in losses}, losses)
            resumed = sum(1 for split, iteration, *_ in rows if split == "train" and iteration > args.stop_at)
            worst = max(worst, difference)
            print(f"saved at {args.stop_at} by {' '.join(source_flags)}\n  resumed as {name:<12} "
                  f"{resumed} more iterations; largest relative loss difference vs 1 process: {difference:.2e}",
                  flush=True)
    verdict = "within" if worst <= args.rtol else "ABOVE"
    print(f"all resumed layouts {verdict} --rtol {args.rtol:g} (worst {worst:.2e})")
    return 0 if worst <= args.rtol else 1


if __name__ == "__main__":
    sys.exit(main())
