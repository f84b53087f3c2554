"""The default run's step time in this checkout beside another checkout of megalite, side by side.

    git worktree add /tmp/baseline <commit>          # the version to compare against
    python tools/bench/default_run.py --baseline /tmp/baseline [--iters 30] [--rounds 4] [-- extra flags]

Each round runs `pretrain_gpt.py` (the default run: the tiny model on the built-in corpus,
plus any extra flags) for --iters iterations in each checkout, one process after the other,
alternating which goes first, so that whatever else the machine does falls on both. A
process reads its own checkout's code (the script's folder comes first on its import path)
and builds or reuses the built-in corpus under its own data/build/. The step time of a
process is the median of its iterations after the first --skip (start-up, allocation,
compiled code); the figure to quote is the median over rounds of the same-round ratio
baseline / this checkout (above 1: this checkout is faster).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def step_ms(checkout: str, iters: int, skip: int, extra: list[str], folder: str) -> float:
    """Median iteration time (ms) of one default-run process of `checkout`, after `skip` iterations."""
    metrics = os.path.join(folder, "metrics.jsonl")
    command = [sys.executable, os.path.join(checkout, "pretrain_gpt.py"), "--train-iters", str(iters),
               "--log-interval", "1", "--eval-interval", str(iters), "--eval-iters", "1",
               "--save", os.path.join(folder, "ckpt"), "--metrics-file", metrics, *extra]
    result = subprocess.run(command, cwd=checkout, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"{checkout}: pretrain_gpt.py failed:\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}")
    with open(metrics) as file:
        records = [json.loads(line) for line in file if line.strip()]
    times = [record["iteration_time_ms"] for record in records
             if "split" not in record and record["iteration"] > skip]
    return statistics.median(times)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", required=True, help="the other checkout's root folder")
    parser.add_argument("--iters", type=int, default=30, help="iterations per process")
    parser.add_argument("--skip", type=int, default=3, help="first iterations left out of each median")
    parser.add_argument("--rounds", type=int, default=4, help="process pairs")
    parser.add_argument("extra", nargs="*", help="flags for both runs (after --)")
    args = parser.parse_args(argv)
    if not os.path.isfile(os.path.join(args.baseline, "pretrain_gpt.py")):
        parser.error(f"--baseline {args.baseline} holds no pretrain_gpt.py; pass a megalite checkout")
    if args.iters <= args.skip or args.rounds < 1:
        parser.error("--iters must exceed --skip, and --rounds must be at least 1")
    sides = {"baseline": os.path.abspath(args.baseline), "this": HERE}
    times = {side: [] for side in sides}
    for round_index in range(args.rounds):
        order = list(sides) if round_index % 2 == 0 else list(sides)[::-1]
        for side in order:
            with tempfile.TemporaryDirectory() as folder:
                times[side].append(step_ms(sides[side], args.iters, args.skip, args.extra, folder))
            print(f"round {round_index + 1} {side}: {times[side][-1]:.1f} ms per iteration", flush=True)
    ratios = [base / this for base, this in zip(times["baseline"], times["this"])]
    for side in sides:
        print(f"{side} ({sides[side]}): median {statistics.median(times[side]):.1f} ms per iteration, "
              f"rounds {' '.join(f'{t:.1f}' for t in times[side])}")
    print(f"baseline / this, same-round: median {statistics.median(ratios):.3f} "
          f"({' '.join(f'{r:.3f}' for r in ratios)}); above 1: this checkout is faster")
    return 0


if __name__ == "__main__":
    sys.exit(main())
