"""Pipeline bubble of the real schedules in a discrete-event run, against the theory.

    python tools/bench/pipeline.py [--tolerance 0.05]

For P = 2, 4, 8 pipeline ranks, V = 1, 2, 4 model chunks per rank and m = P, 2P, 4P,
8P micro-batches, runs megalite.pipeline_parallel.simulation.simulate: every rank's
`schedule_steps` (the steps the real run executes) played against each other with
NCCL's matching rules, a whole-stage forward costing 1 and its backward 2 (a chunk
1/V of that). No tensors, no processes; a deadlock or a mismatched message fails it.

Columns, one row per case:
- P, V, m: pipeline ranks, chunks per rank, micro-batches per global batch;
- idle (sim): simulated idle over compute time, averaged over ranks;
- theory: Megatron's bubble fraction (P - 1) / (V * m);
- rel diff: |idle - theory| / theory;
- peak in flight per rank: the most micro-batch chunks a rank has forwarded but not
  yet backwarded (activations it holds), ranks 0, 1, ... separated by "/".

The script ends with the worst relative difference and exits 1 if it is above
--tolerance.
"""

import argparse
import sys

from megalite.pipeline_parallel.simulation import simulate, theoretical_idle_fraction

PIPELINE_SIZES = (2, 4, 8)
CHUNKS_PER_RANK = (1, 2, 4)
MICROBATCH_MULTIPLES = (1, 2, 4, 8)  # m = multiple x P
FORWARD_COST, BACKWARD_COST = 1.0, 2.0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tolerance", type=float, default=0.05,
                        help="largest relative difference between simulated and theoretical idle fraction")
    args = parser.parse_args(argv)

    print(f"forward cost {FORWARD_COST:g}, backward cost {BACKWARD_COST:g} per whole stage (1/V per chunk)")
    print(f"{'P':>2} {'V':>2} {'m':>3} {'idle (sim)':>10} {'theory':>8} {'rel diff':>9}  peak in flight per rank")
    worst, worst_case = 0.0, None
    for pp in PIPELINE_SIZES:
        for vp in CHUNKS_PER_RANK:
            for multiple in MICROBATCH_MULTIPLES:
                num_microbatches = multiple * pp
                result = simulate(pp, vp, num_microbatches, FORWARD_COST, BACKWARD_COST)
                theory = theoretical_idle_fraction(pp, vp, num_microbatches)
                difference = abs(result.idle_fraction - theory) / theory
                if worst_case is None or difference > worst:
                    worst, worst_case = difference, f"P={pp} V={vp} m={num_microbatches}"
                peaks = "/".join(str(peak) for peak in result.peak_in_flight)
                print(f"{pp:>2} {vp:>2} {num_microbatches:>3} {result.idle_fraction:>10.4f} {theory:>8.4f} "
                      f"{difference:>9.2%}  {peaks}")
    verdict = "within" if worst <= args.tolerance else "ABOVE"
    print(f"worst relative difference: {worst:.2%} ({worst_case}), {verdict} tolerance {args.tolerance:.0%}")
    return 0 if worst <= args.tolerance else 1


if __name__ == "__main__":
    sys.exit(main())
