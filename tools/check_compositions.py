"""The composition matrix: every pair of feature values trained together, each run against its references.

    python tools/check_compositions.py                  # strength 2: every pair of values in some run
    python tools/check_compositions.py --strength 3     # every triple (longer; outside the suite)
    python tools/check_compositions.py --list           # the runs, without training

FEATURES is the table: one row per feature, its values and the flags each adds to BASE (the tiny
model of tools/check_layouts.py, a few iterations). A covering array (tools/covering_array.py) picks
runs such that every `--strength` values of different features meet in at least one run that the
constraints allow (a value's `requires`, FORBIDDEN, at most MAX_RANKS processes).

Each feature is of one kind, which says what its reference is:
- SETTING defines the training (the model, the precision, the LR schedule...): every reference keeps it;
- EXACT is a pure speed or memory option: the run must equal, bitwise, the same run without it (the
  same layout, every EXACT feature at its first value);
- ROUNDING is a layout, or an option that may change rounding only: the run must match the same
  settings on one process (every non-SETTING feature at its first value) within the largest
  tolerance of its values (0, bitwise, for pipeline-only layouts; bf16 and fp16 widen it).
An MoE model's routing statistics (its balancing losses, tokens per expert), reduced over the ranks, are
compared as its losses are.
References are trained once and shared by every run that needs them. Every training, references
too, runs the invariants of tools/composition_probe.py inside each rank (updates not lost, the
model computing with the optimizer's values, model state within the dry run's plan).

Ranks are gloo CPU processes forked from this process, which imported torch once (as
tools/fork_ranks.py forks them); each training has a time limit. A combination known to fail
stays in the matrix as a KNOWN_FAILURES entry naming its issue: it is reported as such, and the
run exits 1 when a run fails that is not known to, or when a known failure passes (then drop its
entry). tests/test_compositions.py runs the strength-2 matrix in the suite.
"""

import argparse
import dataclasses
import gc
import json
import math
import multiprocessing
import os
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from megalite.run.metrics import read_metrics_records
from tools.check_layouts import COMMON, MODELS
from tools.covering_array import covering_array
from tools.fork_ranks import cpu_world_environment
from tools.loss_compare import compare, read_losses

SETTING, EXACT, ROUNDING = "setting", "exact", "rounding"
# Enough for each feature to act on a step after a step: the ramp's half then whole batch, a resume after 1 with 2
# to go, the overlapped gathers of a step's updated weights (docs/benchmarks.md has what a fourth would cost).
ITERATIONS = 3
BASE = [*COMMON, "--train-iters", str(ITERATIONS)]
MAX_RANKS = 4  # every pair of layout values fits in 4 ranks; 8 would cost the suite more than it adds
TIME_LIMIT_S = 300.0  # one training (both halves of a resumed one); a hang fails its run, not the matrix
FP32_RTOL = 1e-5  # fp32 rounding of a changed layout, as tools/check_layouts.py
LOW_PRECISION_RTOL = 5e-3  # bf16 / fp16 params: a changed layout rounds each activation to 8 / 11 bits


@dataclass(frozen=True)
class Value:
    """One value of a feature: the flags it adds (a list, or a function of the run's values), the
    processes it multiplies the world by, the largest relative loss difference it may cause against
    one process (ROUNDING; a precision's is the floor of any layout's there), the values of other
    features it works with (feature -> allowed value names), and how much slower it makes a rank
    (the matrix is chosen for the least processes x slowness in all)."""

    name: str
    flags: tuple[str, ...] | Callable[[dict], list[str]] = ()
    ranks: int = 1
    rtol: float = 0.0
    requires: dict[str, tuple[str, ...]] = field(default_factory=dict)
    slowness: float = 1.0

    def flags_for(self, values: dict) -> list[str]:
        return list(self.flags(values) if callable(self.flags) else self.flags)


@dataclass(frozen=True)
class Feature:
    """A row of the table: its values, the first one the default (what references use)."""

    name: str
    kind: str
    values: tuple[Value, ...]

    def value(self, name: str) -> Value:
        return next(value for value in self.values if value.name == name)


def global_batch(values: dict) -> int:
    """The run's global batch: COMMON's 8 samples, or the tiny size's 4."""
    return 4 if values["size"] == "tiny" else 8


def _micro_batches(values: dict) -> list[str]:
    """Several micro-batches per DP rank (4 at DP 1, 2 at DP 2: COMMON's micro-batch of 2 at the base size),
    or one: the micro-batch is the rank's whole part of the global batch."""
    per_rank = global_batch(values) // int(values["dp"])
    return ["--micro-batch-size", str(per_rank if values["micro-batches"] == "one" else global_batch(values) // 4)]


def _rampup(values: dict) -> list[str]:
    """Half the global batch for the first half of the iterations, then all of it."""
    batch = global_batch(values)
    return ["--rampup-batch-size", str(batch // 2), str(batch // 2), str(batch)]


DP2 = {"dp": ("2",)}
SEVERAL_BUCKETS = ("small", "per-parameter")
FEATURES = (
    # --ffn-hidden-size: the gpt2-124m preset's is 4 x 768, not 4 x COMMON's hidden size.
    Feature("model", SETTING, (Value("llama", tuple(MODELS["llama"])),  # untied output layer, RMSNorm, rope
                               Value("gpt", (*MODELS["gpt"], "--ffn-hidden-size", "256")),  # tied, LayerNorm
                               Value("moe", tuple(MODELS["moe"])))),
    # A CPU with AVX512-FP16 overflows every fp16 step at the default 2^32: start where fp16 trains.
    Feature("precision", SETTING, (Value("fp32"), Value("bf16", ("--bf16",), rtol=LOW_PRECISION_RTOL),
                                   Value("fp16", ("--fp16", "--initial-loss-scale", "4096"),
                                         rtol=LOW_PRECISION_RTOL))),
    # 2 tokens a sample and 4 samples a global batch: what Triton's interpreter can afford.
    Feature("size", SETTING, (Value("base"), Value("tiny", ("--seq-length", "2", "--global-batch-size", "4")))),
    Feature("tp", ROUNDING, (Value("1"), Value("2+sp", ("--tensor-model-parallel-size", "2", "--sequence-parallel"),
                                               ranks=2, rtol=FP32_RTOL))),
    Feature("pp", ROUNDING, (Value("1"), Value("2", ("--pipeline-model-parallel-size", "2"), ranks=2),
                             Value("2+vp2", ("--pipeline-model-parallel-size", "2",
                                             "--num-virtual-stages-per-pipeline-rank", "2"), ranks=2,
                                   requires={"micro-batches": ("several",)}))),
    Feature("dp", ROUNDING, (Value("1"), Value("2", ranks=2, rtol=FP32_RTOL))),
    # Context parallelism: the ring (p2p, the default) or Ulysses' all-to-all over heads (a2a); the sequence in
    # 2 x CP chunks, which the tiny size's 2 tokens are not. all_gather and a2a+p2p run in tools/check_layouts.py.
    Feature("cp", ROUNDING, (Value("1"), *(Value(name, ("--context-parallel-size", "2", "--cp-comm-type", comm),
                                                ranks=2, rtol=FP32_RTOL, requires={"size": ("base",)})
                                          for name, comm in (("2", "p2p"), ("2+a2a", "a2a"))))),
    # Expert parallelism folds over the DP x TP ranks: the experts split over TP (ETP = TP) and EP over DP with the
    # alltoall dispatcher, or whole experts (ETP 1) over DP or TP ranks with the allgather one (EP_FITS).
    Feature("ep", ROUNDING, (Value("1"), Value("2", ("--expert-model-parallel-size", "2", "--moe-token-dispatcher-type",
                                                     "alltoall"), rtol=FP32_RTOL, requires={"model": ("moe",), **DP2}),
                             Value("2+etp1", ("--expert-model-parallel-size", "2", "--expert-tensor-parallel-size",
                                              "1"), rtol=FP32_RTOL, requires={"model": ("moe",)}))),
    Feature("sharding", ROUNDING, (Value("no_shard"),) + tuple(
        Value(strategy, ("--data-parallel-sharding-strategy", strategy), rtol=FP32_RTOL, requires=DP2)
        for strategy in ("optim", "optim_grads", "optim_grads_params"))),
    # Small buckets hold one or two weights each, as in a real model (the output layer alone in the first);
    # a bucket size of 1 gives each parameter a bucket of its own. Not exact: the distributed optimizer's
    # grad norm sums its shard's pieces, whose cut moves with the buckets.
    Feature("buckets", ROUNDING, (Value("per-chunk"), Value("small", ("--ddp-bucket-size", "3000"), rtol=FP32_RTOL),
                                  Value("per-parameter", ("--ddp-bucket-size", "1"), rtol=FP32_RTOL))),
    # The overlaps with several buckets per chunk (a chunk's one bucket overlaps nothing).
    Feature("overlap-grad-reduce", EXACT, (Value("off"), Value("on", ("--overlap-grad-reduce",), requires={
        **DP2, "buckets": SEVERAL_BUCKETS}))),
    # ZeRO-3 always gathers ahead of use, so the flag changes nothing there.
    Feature("overlap-param-gather", EXACT, (Value("off"), Value("on", ("--overlap-param-gather",), requires={
        "sharding": ("optim", "optim_grads"), "buckets": SEVERAL_BUCKETS}))),
    Feature("grad-reduce-in-bf16", ROUNDING, (Value("off"), Value("on", ("--grad-reduce-in-bf16",), rtol=1e-3,
                                                                  requires=DP2))),
    # Megatron's gradient-accumulation fusion, on by default: the linear layers' backward GEMMs add their weight
    # grads into the fp32 buffer; off, autograd's grads are added by the buffer's hook (fp32: another rounding).
    Feature("grad-accum-fusion", ROUNDING, (Value("on"), Value("off", ("--no-gradient-accumulation-fusion",),
                                                               rtol=FP32_RTOL))),
    Feature("fused-output-ce", ROUNDING, (Value("off"), Value("on", ("--fused-output-cross-entropy",),
                                                              rtol=FP32_RTOL, requires={"tp": ("1",)}))),
    # Full recomputation in Megatron's units: each chunk's layers in groups of two, each group one checkpoint
    # (a chunk of one layer under VP 2: a group of one, as plain --recompute-granularity full).
    Feature("recompute", EXACT, (Value("none"), Value("selective", ("--recompute-granularity", "selective")),
                                 Value("full", ("--recompute-granularity", "full", "--recompute-method", "uniform",
                                                "--recompute-num-layers", "2")))),
    Feature("micro-batches", ROUNDING, (Value("several", _micro_batches), Value("one", _micro_batches,
                                                                                rtol=FP32_RTOL))),
    Feature("decoupled-lr", SETTING, (Value("off"), Value("on", ("--decoupled-lr", "3e-3")))),
    # Micro-batches of the ramp's sizes too: several of them.
    Feature("rampup", SETTING, (Value("off"), Value("on", _rampup, requires={"micro-batches": ("several",)}))),
    Feature("z-loss", SETTING, (Value("off"), Value("on", ("--z-loss-weight", "1e-3")))),
    # Triton's interpreter on CPU tensors: a tenth of a second per token of a 4-layer forward and backward.
    Feature("kernels", ROUNDING, (Value("torch"), Value("triton", ("--kernels", "triton"), rtol=FP32_RTOL,
                                                        requires={"size": ("tiny",)}, slowness=10.0))),
    Feature("num-workers", EXACT, (Value("0"), Value("1", ("--num-workers", "1")))),
    # Stop at half (--exit-interval, saving) and resume from the checkpoint (--load): the runner does it.
    Feature("resume", EXACT, (Value("no"), Value("half-way"))),
)
FEATURE = {feature.name: feature for feature in FEATURES}

# Combinations no run may hold, each with the reason.
FORBIDDEN = (
    # The ramp's first global batch at DP 2 is one micro-batch, which the interleaved schedule cannot run.
    ({"rampup": "on", "pp": "2+vp2", "dp": "2"}, "the ramp's first global batch is one micro-batch per DP rank"),
    # Megatron's aux_loss balances each micro-batch's tokens: another micro-batch size is another loss, and one
    # process with several micro-batches no reference (the z-loss and the tokens per expert would match).
    ({"model": "moe", "micro-batches": "one"}, "the balancing loss is a function of the micro-batch"),
)

# Runs expected to fail until an issue is fixed: (a predicate on the run's values, the issue). Each is an
# xfail(strict=True) in tests/test_compositions.py, so that the fix shows as an unexpected pass.
KNOWN_FAILURES: tuple[tuple[Callable[[dict], bool], str], ...] = ()


VALUE = {(feature.name, value.name): value for feature in FEATURES for value in feature.values}
RANKED = tuple(feature.name for feature in FEATURES if any(value.ranks > 1 for value in feature.values))


def ranks_of(values: dict) -> int:
    """The processes a (possibly partial) run needs: the product of its values' ranks."""
    return math.prod(VALUE[name, values[name]].ranks for name in RANKED if name in values)


def cost(values: dict) -> float:
    """A (possibly partial) run's relative cost: its processes times the slowness of its values, twice that with an
    exact option, whose reference (the same run without it) trains too, as slowly."""
    exact = any(FEATURE[name].kind == EXACT and value != FEATURE[name].values[0].name for name, value in values.items())
    return ranks_of(values) * math.prod(VALUE[item].slowness for item in values.items()) * (2 if exact else 1)


def _requirement(name: str, value: str, other: str, names: tuple[str, ...]):
    return lambda values: values.get(name) != value or values.get(other, names[0]) in names


def _not_all(combination: dict):
    return lambda values: not all(values.get(name) == value for name, value in combination.items())


# (the features read, a predicate on a possibly partial run: False once its assigned values break the rule).
CONSTRAINTS = [(RANKED, lambda values: ranks_of(values) <= MAX_RANKS)]
CONSTRAINTS += [((name, other), _requirement(name, value.name, other, names))
                for (name, _), value in VALUE.items() for other, names in value.requires.items()]
CONSTRAINTS += [(tuple(combination), _not_all(combination)) for combination, _ in FORBIDDEN]
# EP 2 with whole experts needs two DP, CP or TP ranks to fold over.
EP_FITS = (("ep", "dp", "cp", "tp"), lambda values: not (values.get("ep") == "2+etp1" and values.get("dp") == "1"
                                                         and values.get("cp", "1") == "1" and values.get("tp") == "1"))
CONSTRAINTS.append(EP_FITS)


def allowed(values: dict) -> bool:
    """Whether a (possibly partial) run breaks no constraint."""
    return all(predicate(values) for _, predicate in CONSTRAINTS)


def matrix(strength: int = 2) -> list[dict]:
    """The runs (feature -> value name) covering every `strength` values of different features, at a low
    total cost."""
    factors = {feature.name: [value.name for value in feature.values] for feature in FEATURES}
    return covering_array(factors, strength, CONSTRAINTS, cost=cost)


def defaults(values: dict, kinds: tuple[str, ...]) -> dict:
    """`values` with the features of `kinds` at their first (default) value."""
    return {name: FEATURE[name].values[0].name if FEATURE[name].kind in kinds else value
            for name, value in values.items()}


def exact_reference(values: dict) -> dict:
    """The same run without its speed and memory options: it must match bitwise."""
    return defaults(values, (EXACT,))


def one_process_reference(values: dict) -> dict:
    """The same settings on one process, with every option and layout at its default."""
    return defaults(values, (EXACT, ROUNDING))


def tolerance(values: dict) -> float:
    """The largest relative loss difference allowed against `one_process_reference(values)`: 0 when
    only pipeline layouts and exact options differ, else the largest of the values' tolerances and
    the precision's."""
    rounding = [FEATURE[name].value(value).rtol for name, value in values.items()
                if FEATURE[name].kind == ROUNDING and value != FEATURE[name].values[0].name]
    if not any(rounding):
        return 0.0
    settings = [FEATURE[name].value(value).rtol for name, value in values.items() if FEATURE[name].kind == SETTING]
    return max(rounding + settings)


def flags(values: dict) -> list[str]:
    """pretrain_gpt.py's flags for a run: BASE, then each value's."""
    return [*BASE, *(flag for feature in FEATURES for flag in feature.value(values[feature.name]).flags_for(values))]


def describe(values: dict) -> str:
    """The values that differ from the defaults, `feature=value` separated by spaces ("defaults" if none)."""
    changed = [f"{name}={value}" for name, value in values.items() if value != FEATURE[name].values[0].name]
    return " ".join(changed) or "defaults"


def known_failure(values: dict) -> str | None:
    return next((issue for predicate, issue in KNOWN_FAILURES if predicate(values)), None)


# -- training in forked ranks ------------------------------------------------------------------


@dataclass
class Training:
    """One training's outcome: its losses by (split, iteration), an MoE model's routing statistics by (name,
    iteration), each rank's probe report, and an error (exit code and log tail) if it failed."""

    losses: dict = field(default_factory=dict)
    routing: dict = field(default_factory=dict)
    reports: list[dict] = field(default_factory=list)
    error: str | None = None
    seconds: float = 0.0

    @property
    def violations(self) -> list[str]:
        return [f"rank {report['rank']}: {line}" for report in self.reports for line in report["violations"]]


def prepare_process() -> None:
    """Import what every rank needs once, here, before the ranks are forked: torch (on the CPU, one thread
    per rank), the training loop, the compiler modules AdamW imports when built (seconds per rank
    otherwise), Triton if installed; then frozen out of the garbage collector's reach. The logger's peak
    FLOP/s is not measured (a second of matmuls per run): the matrix checks losses, not MFU."""
    os.environ.update(cpu_world_environment(OMP_NUM_THREADS="1"))
    import importlib.util

    import torch
    import torch._dynamo  # noqa: F401 - imported by torch.optim.AdamW's constructor

    import megalite.run.logger
    import megalite.run.training  # noqa: F401

    if importlib.util.find_spec("triton") is not None:
        import triton  # noqa: F401 - its interpreter, for --kernels triton in the ranks
    torch.set_num_threads(1)
    megalite.run.logger.peak_flops = lambda device, dtype: (None, "not measured by the composition matrix")
    gc.freeze()  # what is imported now stays out of the ranks' collections (parallel_state.destroy collects)


def planned_bytes(argv: list[str], world_size: int) -> list[dict]:
    """Each rank's model-state plan (params, grads, optimizer, working bytes) from the dry run."""
    from megalite.arguments import parse_args
    from megalite.plan.dry_run import plan

    report = plan(parse_args(argv, world_size))
    return [{"params": cls.param_bytes, "grads": cls.grad_bytes, "optimizer": cls.optimizer_bytes,
             "working": cls.working_bytes} for cls in map(report.rank_class, range(world_size))]


def _rank_main(argv: list[str], folder: str, planned: list[dict]) -> None:
    """One forked rank: train with the probe, write its report (also when training fails)."""
    from megalite import cpu
    from megalite.arguments import parse_args
    from megalite.parallel_state import world_size_from_env
    from megalite.run.training import Trainer
    from tools.composition_probe import Probe

    rank = int(os.environ.get("RANK", "0"))
    log = os.open(os.path.join(folder, f"rank-{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
        os.dup2(log, stream.fileno())
    run = parse_args(argv, world_size_from_env())
    cpu.set_up_process()
    with Trainer(run) as trainer:
        probe = Probe(trainer, planned[rank])
        try:
            trainer.train()
        finally:
            with open(os.path.join(folder, f"report-{rank}-{os.getpid()}.json"), "w", encoding="utf-8") as file:
                json.dump({"rank": rank, **probe.report()}, file)


def _launcher(world_size: int, argv: list[str], folder: str, planned: list[dict]) -> None:
    """The forked launcher of one training: its own process group, so that a hang can be ended whole."""
    from tools.fork_ranks import launch

    os.setpgrp()
    sys.exit(launch(world_size, argv, main=lambda rank_argv: _rank_main(rank_argv, folder, planned)))


def _launch(world_size: int, argv: list[str], folder: str, planned: list[dict], deadline: float) -> str | None:
    """Train `argv` on `world_size` ranks; None, or what went wrong."""
    process = multiprocessing.get_context("fork").Process(target=_launcher, args=(world_size, argv, folder, planned))
    process.start()
    process.join(max(1.0, deadline - time.monotonic()))
    if process.exitcode is None:
        os.killpg(process.pid, signal.SIGKILL)  # the launcher and its ranks: the group it made
        process.join()
        return f"no end within {TIME_LIMIT_S:.0f} s (a hang?)"
    return None if process.exitcode == 0 else f"exit code {process.exitcode}"


def train(values: dict, folder: str) -> Training:
    """Train the run `values` (in two halves for resume=half-way) in `folder`; its Training."""
    os.makedirs(folder, exist_ok=True)
    world_size, argv = ranks_of(values), [*flags(values), "--metrics-file", os.path.join(folder, "metrics.jsonl")]
    planned = planned_bytes(argv, world_size)
    start = time.monotonic()
    deadline = start + TIME_LIMIT_S
    if values["resume"] == "half-way":
        checkpoint = os.path.join(folder, "checkpoint")
        halves = [[*argv, "--save", checkpoint, "--exit-interval", str(ITERATIONS // 2)], [*argv, "--load", checkpoint]]
    else:
        halves = [argv]
    result = Training()
    for half in halves:
        result.error = _launch(world_size, half, folder, planned, deadline)
        if result.error:
            break
    result.seconds = time.monotonic() - start
    for name in sorted(os.listdir(folder)):
        if name.startswith("report-"):
            with open(os.path.join(folder, name), encoding="utf-8") as file:
                result.reports.append(json.load(file))
    if result.error:
        logs = [os.path.join(folder, name) for name in sorted(os.listdir(folder)) if name.endswith(".log")]
        result.error += "".join(f"\n--- {os.path.basename(path)}:\n{_tail(path)}" for path in logs)
    elif os.path.exists(os.path.join(folder, "metrics.jsonl")):
        result.losses = read_losses(os.path.join(folder, "metrics.jsonl"))
        result.routing = read_routing(os.path.join(folder, "metrics.jsonl"))
    return result


# The routing statistics of an MoE model's training records, reduced over the job's ranks (model/moe.py's
# take_moe_statistics): like the losses, each run must log those of its references.
ROUTING = ("load_balancing_loss", "z_loss", "tokens_per_expert_min", "tokens_per_expert_max")


def read_routing(path: str) -> dict[tuple[str, int], float]:
    """{(name, iteration): value} of the ROUTING values in a metrics file's training records."""
    return {(name, record["iteration"]): record[name] for record in read_metrics_records(path)
            if "split" not in record for name in ROUTING if name in record}


def comparable_routing(routing: dict, values: dict) -> dict:
    """The routing statistics a run is compared by against one process: all of them within fp32 rounding; where
    the run rounds more (bf16 / fp16 params, grads reduced in bf16), which may flip a top-k choice near a tie (a
    token moves to another expert, and the loss stays within the tolerance), the z-loss only: the token counts
    and the balancing loss, which counts them, move by a step then. Exact references compare all."""
    if max(VALUE["precision", values["precision"]].rtol, tolerance(values)) <= FP32_RTOL:
        return routing
    return {key: value for key, value in routing.items() if key[0] == "z_loss"}


def _tail(path: str, lines: int = 15) -> str:
    with open(path, encoding="utf-8", errors="replace") as file:
        return "".join(file.readlines()[-lines:])


# -- the matrix ------------------------------------------------------------------------------------


@dataclass
class Outcome:
    """One run of the matrix checked against its references."""

    values: dict
    exact_reference: dict | None  # None: the run has no exact option on
    bitwise: bool | None  # equal to the exact reference (None: none, or a training failed)
    difference: float | None  # largest relative loss difference against one process
    rtol: float
    violations: list[str]
    error: str | None
    seconds: float
    known: str | None

    @property
    def ok(self) -> bool:
        return (self.error is None and self.bitwise is not False and self.difference is not None
                and self.difference <= self.rtol and not self.violations)

    @property
    def verdict(self) -> str:
        if self.known:
            return "known failure" if not self.ok else "PASSES (drop its KNOWN_FAILURES entry)"
        return "ok" if self.ok else "FAIL"

    @property
    def expected(self) -> bool:
        return self.ok != bool(self.known)


class Trainings:
    """Trainings by their values, each trained once (references are shared), under one folder."""

    def __init__(self, folder: str):
        self.folder, self.done = folder, {}

    def get(self, values: dict) -> Training:
        key = tuple(sorted(values.items()))
        if key not in self.done:
            self.done[key] = train(values, os.path.join(self.folder, f"training-{len(self.done)}"))
        return self.done[key]


def check(values: dict, trainings: Trainings) -> Outcome:
    """Train `values` and its references; compare."""
    run = trainings.get(values)
    exact = exact_reference(values)
    exact = None if exact == values else exact
    single = trainings.get(one_process_reference(values))
    used = [run, single] + ([trainings.get(exact)] if exact else [])
    error = next((f"{label}: {training.error}" for label, training in zip(("run", "one process", "exact reference"),
                                                                         used) if training.error), None)
    violations = [f"{label}: {line}" for label, training in zip(("run", "one process", "exact reference"), used)
                  for line in training.violations]
    bitwise = difference = None
    if error is None:
        if exact:
            bitwise = used[2].losses == run.losses and used[2].routing == run.routing
        difference = _difference(single.losses, run.losses)
        if single.routing or run.routing:
            difference = max(difference, _difference(*(comparable_routing(training.routing, values)
                                                        for training in (single, run))))
    return Outcome(values, exact, bitwise, difference, tolerance(values), violations, error,
                   sum(training.seconds for training in used), known_failure(values))


def _difference(reference: dict, losses: dict) -> float:
    """Largest relative difference of two runs' logged values, {key: value} (inf when the runs logged different
    records or a value is missing)."""
    if set(reference) != set(losses) or not losses:
        return math.inf
    return compare(reference, losses)[1]


def format_outcome(index: int, outcome: Outcome) -> str:
    bitwise = {None: "-", True: "equal", False: "DIFFERS"}[outcome.bitwise]
    difference = "-" if outcome.difference is None else f"{outcome.difference:.1e}"
    invariants = "ok" if not outcome.violations else f"{len(outcome.violations)} broken"
    return (f"{index:>3}  {ranks_of(outcome.values)}  {difference:>8} {outcome.rtol:>7.0e}  {bitwise:<8} "
            f"{invariants:<10} {outcome.seconds:>5.0f}  {outcome.verdict:<14} {describe(outcome.values)}"
            + (f"  [{outcome.known}]" if outcome.known else ""))


HEADER = (f"{'run':>3}  {'n':>1}  {'vs 1 proc':>8} {'rtol':>7}  {'exact':<8} {'invariants':<10} {'s':>5}  "
          f"{'verdict':<14} values (besides the defaults)")


def details(outcome: Outcome) -> str:
    lines = []
    if outcome.exact_reference is not None:
        lines.append(f"exact reference: {describe(outcome.exact_reference)}")
    lines.append(f"one-process reference: {describe(one_process_reference(outcome.values))}")
    if outcome.error:
        lines.append(outcome.error)
    lines += outcome.violations
    return "\n".join("      " + line for line in "\n".join(lines).splitlines())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strength", type=int, default=2, help="every this many values meet in a run (default 2)")
    parser.add_argument("--list", action="store_true", help="print the runs and their references, without training")
    parser.add_argument("--runs", type=int, nargs="+", help="train only these runs (their numbers in --list)")
    parser.add_argument("--json", help="also write every run's outcome to this file")
    args = parser.parse_args(argv)
    runs = matrix(args.strength)
    print(f"{len(runs)} runs cover every {args.strength}-tuple of values of {len(FEATURES)} features; "
          f"{sum(map(ranks_of, runs))} ranks in all")
    if args.list:
        for index, values in enumerate(runs):
            print(f"{index:>3}  {ranks_of(values)} ranks  {describe(values)}"
                  + (f"  [{known_failure(values)}]" if known_failure(values) else ""))
        return 0
    prepare_process()
    try:
        return _check(runs, args)
    finally:
        gc.unfreeze()  # objects frozen for the ranks' sake are collected at exit as usual


def _check(runs: list[dict], args) -> int:
    """Train and check `runs` (those numbered in args.runs, or all); print the table; the exit code."""
    outcomes = []
    print(HEADER, flush=True)
    with tempfile.TemporaryDirectory() as folder:
        trainings = Trainings(folder)
        for index, values in enumerate(runs):
            if args.runs is not None and index not in args.runs:
                continue
            outcome = check(values, trainings)
            outcomes.append((index, outcome))
            print(format_outcome(index, outcome), flush=True)
            if not outcome.ok:
                print(details(outcome), flush=True)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as file:
            json.dump([{"index": index, **dataclasses.asdict(outcome), "ok": outcome.ok, "verdict": outcome.verdict}
                       for index, outcome in outcomes], file, indent=1)
    unexpected = [index for index, outcome in outcomes if not outcome.expected]
    worst = max((outcome.difference for _, outcome in outcomes if outcome.ok and outcome.difference is not None),
                default=0.0)
    print(f"{len(outcomes)} runs, {len(trainings.done)} trainings; largest difference of a passing run "
          f"against one process: {worst:.1e}; "
          + ("every run as expected" if not unexpected else f"unexpected: runs {' '.join(map(str, unexpected))}"))
    return 0 if not unexpected else 1


if __name__ == "__main__":
    sys.exit(main())
