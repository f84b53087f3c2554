"""Train the same model under several parallel layouts and compare each loss curve with one process.

Layouts: TP, TP+SP, PP (1F1B and interleaved), DP (plain and with the distributed
optimizer, with and without --overlap-grad-reduce) and their mixes, up to 8 processes; for the MoE
models also EP (each dispatcher, folded over DP and TP, with PP and every sharding strategy).

    python tools/check_layouts.py                      # every layout below, every model
    python tools/check_layouts.py --layouts tp2 pp2-vp2 --models llama
    python tools/check_layouts.py --models moe --layouts ep2-alltoall ep4-allgather

Each layout runs `pretrain_gpt.py --mock-data` for --train-iters iterations (fp32,
dropout 0) as ranks on CPU (gloo, one thread per rank, forked by tools/fork_ranks.py
from one interpreter rather than started by torchrun) and writes a metrics file; the
single-process reference runs on the CPU too (no GPU visible), so the comparison is CPU
against CPU on any machine;
tools/loss_compare.py's comparison against the single-process run gives the largest
relative difference of the losses and grad norms per layout. Exits 1 when any exceeds its tolerance (1e-6 for
pipeline-only layouts, which change no arithmetic; 1e-5 with tensor parallelism).
"""

import argparse
import os
import subprocess
import sys
import tempfile

from tools.fork_ranks import cpu_world_environment
from tools.loss_compare import compare, read_grad_norms, read_losses

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

COMMON = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "255", "--num-layers", "4",
          "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32", "--micro-batch-size", "2",
          "--global-batch-size", "8", "--log-interval", "1", "--eval-interval", "5", "--eval-iters", "1",
          "--hidden-dropout", "0", "--attention-dropout", "0"]
MODELS = {
    # GQA, rope, RMSNorm, SwiGLU, untied output, no biases
    "llama": ["--group-query-attention", "--num-query-groups", "4", "--ffn-hidden-size", "128"],
    # LayerNorm, GELU, biases, learned positions, tied output
    "gpt": ["--model", "gpt2-124m", "--max-position-embeddings", "64"],
}
# The llama model with MoE layers 1 and 3 (under PP 2 each stage holds a dense and an MoE layer; under PP 2 x
# VP 2 pipeline rank 0 holds layers 0 and 2, no MoE layer): 4 experts, top-2, a gated shared expert, the aux
# and z losses, the grouped GEMM.
MOE = ["--num-experts", "4", "--moe-ffn-hidden-size", "64", "--moe-layer-freq", "[0,1,0,1]",
       "--moe-shared-expert-intermediate-size", "32", "--moe-shared-expert-gate", "--moe-aux-loss-coeff", "1e-2",
       "--moe-z-loss-coeff", "1e-3", "--moe-grouped-gemm"]
MODELS["moe"] = [*MODELS["llama"], *MOE]
# Documents inside a sequence: positions restart after each end-of-document token, which carries no loss.
MODELS["llama-docs"] = [*MODELS["llama"], "--reset-position-ids", "--eod-mask-loss"]
# Aux-loss-free balancing (sigmoid scores, the expert bias) and experts that drop tokens past a capacity.
MODELS["moe-bias"] = [*MODELS["moe"], "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
                      "--moe-router-bias-update-rate", "1e-2"]
MODELS["moe-capacity"] = [*MODELS["moe"], "--moe-expert-capacity-factor", "1.0"]
TP2, PP2 = ["--tensor-model-parallel-size", "2"], ["--pipeline-model-parallel-size", "2"]
V2 = ["--num-virtual-stages-per-pipeline-rank", "2"]
DISTOPT = "--use-distributed-optimizer"
OVERLAP = ["--overlap-grad-reduce", "--ddp-bucket-size", "3000"]  # small buckets: several per chunk
ZERO2 = ["--data-parallel-sharding-strategy", "optim_grads"]
ZERO3 = ["--data-parallel-sharding-strategy", "optim_grads_params"]
LAYOUTS = {  # name -> (processes, flags, tolerance): pipelining alone changes no arithmetic
    "tp2": (2, TP2, 1e-5),
    "tp4": (4, ["--tensor-model-parallel-size", "4"], 1e-5),
    "tp2-sp": (2, [*TP2, "--sequence-parallel"], 1e-5),
    "tp4-sp": (4, ["--tensor-model-parallel-size", "4", "--sequence-parallel"], 1e-5),
    "pp2": (2, PP2, 1e-6),
    "pp4": (4, ["--pipeline-model-parallel-size", "4"], 1e-6),
    "pp2-vp2": (2, [*PP2, *V2], 1e-6),
    "pp2-tp2-sp": (4, [*PP2, *TP2, "--sequence-parallel"], 1e-5),
    "pp2-vp2-tp2-sp": (4, [*PP2, *V2, *TP2, "--sequence-parallel"], 1e-5),
    "dp2": (2, [], 1e-5),
    "dp2-overlap": (2, [*OVERLAP], 1e-5),
    "dp4-distopt": (4, [DISTOPT], 1e-5),
    "dp2-tp2-sp-distopt-overlap": (4, [*TP2, "--sequence-parallel", DISTOPT, *OVERLAP], 1e-5),
    "tp2-pp2-dp2-sp-vp2-distopt-overlap": (8, [*TP2, *PP2, *V2, "--sequence-parallel", DISTOPT, *OVERLAP], 1e-5),
    "dp2-zero2": (2, [*ZERO2, *OVERLAP], 1e-5),
    "dp4-zero2": (4, ZERO2, 1e-5),
    "dp2-zero3": (2, ZERO3, 1e-5),
    "dp4-zero3": (4, ZERO3, 1e-5),
    "dp2-tp2-sp-zero2": (4, [*TP2, "--sequence-parallel", *ZERO2], 1e-5),
    "dp2-tp2-sp-zero3": (4, [*TP2, "--sequence-parallel", *ZERO3], 1e-5),
    "pp2-dp2-zero2": (4, [*PP2, *ZERO2], 1e-5),
    "pp2-dp2-zero3": (4, [*PP2, *ZERO3], 1e-5),
    "tp2-pp2-vp2-dp2-sp-zero2": (8, [*TP2, *PP2, *V2, "--sequence-parallel", *ZERO2], 1e-5),
    "tp2-pp2-vp2-dp2-sp-zero3": (8, [*TP2, *PP2, *V2, "--sequence-parallel", *ZERO3], 1e-5),
}
ETP1 = ["--expert-tensor-parallel-size", "1"]
EXPERT_LAYOUTS = {  # EP N folded over the DP x TP ranks: name -> (processes, flags), each with both dispatchers
    "ep2": (2, []),
    "ep4": (4, []),
    "ep2-tp2-sp-etp1": (2, [*TP2, "--sequence-parallel", *ETP1]),
    "ep2-tp2-sp-etp2": (4, [*TP2, "--sequence-parallel"]),
    "ep2-pp2-vp2": (4, [*PP2, *V2]),  # pipeline rank 0 holds no MoE layer
    **{f"ep2-dp4-{name}": (4, flags) for name, flags in (("no-shard", OVERLAP), ("distopt", [DISTOPT, *OVERLAP]),
                                                          ("zero2", ZERO2), ("zero3", ZERO3))},
    "ep4-tp2-pp2-vp2-etp1-distopt": (8, [*TP2, *PP2, *V2, "--sequence-parallel", *ETP1, DISTOPT]),
}
for _name, (_processes, _flags) in EXPERT_LAYOUTS.items():
    for _dispatcher in ("allgather", "alltoall"):
        LAYOUTS[f"{_name}-{_dispatcher}"] = (_processes, [*_flags, "--expert-model-parallel-size", _name[2],
                                                           "--moe-token-dispatcher-type", _dispatcher], 1e-5)


CP_LAYOUTS = {  # CP N over the dense grid's tp-cp-dp-pp: name -> (processes, flags), each with every comm type
    "cp2": (2, []),
    "cp4": (4, []),
    "cp2-tp2-sp": (4, [*TP2, "--sequence-parallel"]),
    "cp2-pp2-vp2": (4, [*PP2, *V2]),
    **{f"cp2-dp2-{name}": (4, flags) for name, flags in (("no-shard", OVERLAP), ("distopt", [DISTOPT, *OVERLAP]),
                                                          ("zero2", ZERO2), ("zero3", ZERO3))},
    "cp2-tp2-pp2-dp2-sp-distopt": (16, [*TP2, *PP2, "--sequence-parallel", DISTOPT]),
    "cp2-recompute": (2, ["--recompute-granularity", "full", "--recompute-method", "uniform",
                          "--recompute-num-layers", "1"]),
}
for _name, (_processes, _flags) in CP_LAYOUTS.items():
    for _comm in ("p2p", "all_gather", "a2a"):
        LAYOUTS[f"{_name}-{_comm}"] = (_processes, [*_flags, "--context-parallel-size", _name[2],
                                                     "--cp-comm-type", _comm], 1e-5)
# a2a+p2p at CP 4: heads all-to-all among pairs of adjacent CP ranks, the ring over the two pairs.
HIERARCHICAL = ["--context-parallel-size", "4", "--cp-comm-type", "a2a+p2p", "--hierarchical-context-parallel-sizes",
                "2", "2"]
LAYOUTS["cp4-a2a+p2p"] = (4, HIERARCHICAL, 1e-5)
LAYOUTS["cp4-tp2-sp-a2a+p2p"] = (8, [*TP2, "--sequence-parallel", *HIERARCHICAL], 1e-5)


CP_EXPERT_LAYOUTS = {  # EP folded over CP ranks too (the experts' grid spans DP x CP x TP): name -> (processes, flags)
    "cp2-ep2": (2, ["--expert-model-parallel-size", "2"]),
    "cp2-dp2-ep4-distopt": (4, ["--expert-model-parallel-size", "4", DISTOPT, *OVERLAP]),
    "cp2-tp2-sp-ep2-etp1": (4, [*TP2, "--sequence-parallel", *ETP1, "--expert-model-parallel-size", "2"]),
    "cp2-tp2-sp-ep2-etp2": (4, [*TP2, "--sequence-parallel", "--expert-model-parallel-size", "2"]),
}
for _name, (_processes, _flags) in CP_EXPERT_LAYOUTS.items():
    for _dispatcher in ("allgather", "alltoall"):
        LAYOUTS[f"{_name}-{_dispatcher}"] = (_processes, [*_flags, "--context-parallel-size", "2",
                                                           "--moe-token-dispatcher-type", _dispatcher], 1e-5)


def fits(model: str, layout: str) -> bool:
    """Whether `layout` applies to `model`: expert parallelism needs an MoE model."""
    return model.startswith("moe") or not any(part.startswith("ep") for part in layout.split("-"))


def run(processes: int, flags: list[str], metrics: str) -> str:
    """`pretrain_gpt.py flags --metrics-file metrics` as `processes` CPU ranks (one: a plain process,
    also on the CPU); its standard output, or SystemExit with the run's output tail if it fails."""
    # Ranks forked from one interpreter (tools/fork_ranks.py): torch is imported once per run, not once per rank.
    launcher = [os.path.join(REPO_ROOT, "tools", "fork_ranks.py"), "--nproc-per-node", str(processes), "--"]
    command = [sys.executable, *(launcher if processes > 1 else [os.path.join(REPO_ROOT, "pretrain_gpt.py")]),
               *flags, "--metrics-file", metrics]
    env = cpu_world_environment(OMP_NUM_THREADS="1")
    result = subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO_ROOT)
    if result.returncode != 0:
        raise SystemExit(f"failed: {' '.join(command)}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return result.stdout


def largest_difference(model: str, layout: str, train_iters: int, folder: str) -> float:
    """Largest relative difference of `layout`'s losses and grad norms against one process's, for `model` (runs
    both)."""
    flags = [*COMMON, *MODELS[model], "--train-iters", str(train_iters)]
    reference = os.path.join(folder, f"{model}-single.jsonl")
    if not os.path.exists(reference):
        run(1, flags, reference)
    processes, layout_flags, _ = LAYOUTS[layout]
    other = os.path.join(folder, f"{model}-{layout}.jsonl")
    run(processes, [*flags, *layout_flags], other)
    return max(compare(read(reference), read(other))[1] for read in (read_losses, read_grad_norms))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--train-iters", type=int, default=10)
    parser.add_argument("--rtol", type=float, help="largest relative difference accepted (default: 1e-6 for "
                        "pipeline-only layouts, 1e-5 with tensor parallelism)")
    args = parser.parse_args(argv)
    failed = []
    with tempfile.TemporaryDirectory() as folder:
        for model in args.models:
            for layout in [layout for layout in args.layouts if fits(model, layout)]:
                difference = largest_difference(model, layout, args.train_iters, folder)
                rtol = args.rtol if args.rtol is not None else LAYOUTS[layout][2]
                verdict = "ok" if difference <= rtol else "ABOVE"
                if difference > rtol:
                    failed.append(f"{model} {layout}")
                print(f"{model:<12} {layout:<40} largest relative difference (loss, grad norm) vs 1 process: "
                      f"{difference:.2e} (rtol {rtol:g}: {verdict})", flush=True)
    print(f"{'all layouts within tolerance' if not failed else 'ABOVE tolerance: ' + ', '.join(failed)}")
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
