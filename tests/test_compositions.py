"""The composition matrix (tools/check_compositions.py) at strength 2: every pair of feature values trained
together in some run, each run against its references with the invariants checked in every rank; the
covering-array generator (tools/covering_array.py) and the in-rank probe (tools/composition_probe.py)."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from megalite.arguments import parse_args
from megalite.pipeline_parallel.stages import chunk_layers
from tools import check_compositions as matrix
from tools.covering_array import coverable, covered_by, covering_array

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNS = matrix.matrix(2)
FACTORS = {feature.name: [value.name for value in feature.values] for feature in matrix.FEATURES}


# -- the covering array ----------------------------------------------------------------------------

TOY = {"a": [0, 1, 2], "b": [0, 1], "c": ["x", "y", "z"], "d": [0, 1], "e": [0, 1, 2]}
TOY_CONSTRAINTS = [(("a", "c"), lambda row: not (row.get("a") == 2 and row.get("c") == "z")),
                   (("b", "d", "e"), lambda row: not (row.get("b") == 1 and row.get("d") == 1 and row.get("e") == 2))]


@pytest.mark.parametrize("strength", [2, 3])
def test_covering_array_holds_every_allowed_tuple_in_allowed_rows(strength):
    rows = covering_array(TOY, strength, TOY_CONSTRAINTS)
    reachable, unreachable = coverable(TOY, strength, TOY_CONSTRAINTS)
    assert reachable <= set().union(*(covered_by(row, strength) for row in rows))
    assert all(predicate(row) for row in rows for _, predicate in TOY_CONSTRAINTS)
    assert frozenset({("a", 2), ("c", "z")}) in unreachable or strength == 3
    assert len(rows) < len(reachable)  # a covering array, not the list of tuples
    assert covering_array(TOY, strength, TOY_CONSTRAINTS) == rows  # seeded: the same rows every time


def test_the_matrix_holds_every_pair_of_values_in_allowed_runs_that_megalite_accepts():
    reachable, unreachable = coverable(FACTORS, 2, matrix.CONSTRAINTS)
    assert reachable <= set().union(*(covered_by(run, 2) for run in RUNS))
    assert all(matrix.allowed(run) for run in RUNS)
    # The constraints leave out only pairs that need more ranks than MAX_RANKS or break a rule of the table.
    assert frozenset({("sharding", "optim"), ("dp", "1")}) in unreachable
    for run in RUNS:  # each run's flags, and its references', are valid at their world sizes
        for values in (run, matrix.exact_reference(run), matrix.one_process_reference(run)):
            parse_args(matrix.flags(values), matrix.ranks_of(values))
    assert len(RUNS) <= 33  # each run is a multi-process training: keep the suite's share small


def test_references_keep_the_settings_and_drop_what_they_test():
    run = next(run for run in RUNS if run["overlap-param-gather"] == "on")
    exact, single = matrix.exact_reference(run), matrix.one_process_reference(run)
    assert exact["overlap-param-gather"] == "off" and exact["dp"] == run["dp"] and exact["sharding"] == run["sharding"]
    assert matrix.ranks_of(single) == 1 and single["precision"] == run["precision"] and single["model"] == run["model"]
    pipeline_only = {**single, "pp": "2"}
    assert matrix.tolerance(pipeline_only) == 0.0  # pipelining alone changes no arithmetic: bitwise
    assert matrix.tolerance({**single, "tp": "2+sp", "precision": "bf16"}) == matrix.LOW_PRECISION_RTOL
    # An MoE model's routing statistics: the token counts and the balancing loss (which counts them) within fp32
    # rounding only (bf16 params or grads reduced in bf16 may flip a top-k choice), the z-loss always.
    routing = {("tokens_per_expert_max", 1): 1.5, ("load_balancing_loss", 1): 1e-2, ("z_loss", 1): 2e-3}
    assert matrix.comparable_routing(routing, {**single, "precision": "fp32"}) == routing
    assert matrix.comparable_routing(routing, {**single, "precision": "bf16"}) == {("z_loss", 1): 2e-3}
    bf16_grads = {**single, "dp": "2", "grad-reduce-in-bf16": "on"}
    assert matrix.comparable_routing(routing, bf16_grads) == {("z_loss", 1): 2e-3}


def test_moe_meets_every_layout_and_a_pipeline_rank_without_moe_layers():
    moe = [run for run in RUNS if run["model"] == "moe"]
    for name in ("tp", "pp", "sharding", "recompute", "precision", "resume", "kernels"):
        assert {run[name] for run in moe} == set(FACTORS[name]), name
    # --moe-layer-freq [0,1,0,1] under PP 2 x VP 2: pipeline rank 0 holds layers 0 and 2, both dense.
    run = next(run for run in moe if run["pp"] == "2+vp2")
    config = parse_args(matrix.flags(run), matrix.ranks_of(run)).model
    assert [config.is_moe_layer(layer) for layer in range(4)] == [False, True, False, True]
    assert chunk_layers(4, 2, 0, 2) == [[0], [2]]


def test_context_parallelism_meets_every_model_layout_and_option_that_allows_it():
    for comm_type in ("2", "2+a2a"):
        cp = [run for run in RUNS if run["cp"] == comm_type]
        for name in ("model", "tp", "pp", "ep", "sharding", "recompute", "precision", "resume", "micro-batches"):
            assert {run[name] for run in cp} == set(FACTORS[name]), (comm_type, name)
        assert {run["size"] for run in cp} == {"base"}  # the tiny size's 2 tokens do not cut into 2 x CP chunks


def test_a_run_with_an_exact_option_costs_twice_for_its_reference():
    plain = {name: FACTORS[name][0] for name in FACTORS}
    assert matrix.cost({**plain, "recompute": "full"}) == 2 * matrix.cost(plain)
    assert matrix.cost({**plain, "kernels": "triton", "size": "tiny"}) == 10 * matrix.cost(plain)


# -- the probe -------------------------------------------------------------------------------------

SMALL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--ffn-hidden-size", "64",
         "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "4", "--log-interval", "1",
         "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "99", "--train-iters", "3",
         "--eval-iters", "0", "--untie-embeddings-and-output-weights"]


def probed(*flags, planned=None, break_step=None):
    """Train SMALL + `flags` on one process with the probe; its report. break_step(optimizer) runs after
    each step."""
    from megalite.run.training import Trainer
    from tools.composition_probe import Probe

    run = parse_args([*SMALL, *flags])
    with Trainer(run, log=lambda line: None) as trainer:
        if break_step is not None:
            step = trainer.optimizer.step

            def broken_step(*args, **kwargs):
                result = step(*args, **kwargs)
                break_step(trainer.optimizer)
                return result

            trainer.optimizer.step = broken_step
        plan = matrix.planned_bytes([*SMALL, *flags], 1)[0]
        probe = Probe(trainer, planned or plan)
        trainer.train()
    return probe.report()


@pytest.mark.usefixtures("one_thread")
def test_the_probe_passes_a_sound_run_and_names_a_lost_update_a_stale_weight_and_a_plan_overrun(monkeypatch):
    # As the matrix's ranks: the logger's peak FLOP/s (seconds of matmuls per run) is not what is tested.
    monkeypatch.setattr("megalite.run.logger.peak_flops", lambda device, dtype: (None, "not measured"))
    sound = probed()
    assert sound["violations"] == [] and sound["steps_checked"] == 3
    assert sound["peak_bytes"] <= sum(sound["planned_bytes"].values())

    frozen = {}

    def lose_the_output_layer_update(optimizer):  # the step's update of one weight undone, as item 1 did
        index = optimizer.names.index("output_layer.weight")
        frozen.setdefault(index, optimizer.main_params[index].detach().clone())
        optimizer.main_params[index].data.copy_(frozen[index])

    lost = probed(break_step=lose_the_output_layer_update)["violations"]
    assert lost and all("output_layer.weight: the step left its owned values unchanged" in line for line in lost)

    def stale_model_weight(optimizer):  # the bf16 model computes with other values than the fp32 step wrote
        optimizer.model_params[optimizer.names.index("output_layer.weight")].data.add_(1.0)

    stale = probed("--bf16", break_step=stale_model_weight)["violations"]
    assert stale and "output_layer.weight [0:" in stale[0] and "other than the optimizer's last step wrote" in stale[0]

    over = probed(planned={"params": 0, "grads": 0, "optimizer": 0, "working": 0})["violations"]
    assert [line.split(":")[1].split(" take")[0].strip() for line in over[:3]] == ["params", "grads", "optimizer"]
    assert "peaked at" in over[3]


# -- the matrix ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def outcomes(request, tmp_path_factory):
    """The selected runs of the strength-2 matrix, trained by one tools/check_compositions.py process (its
    ranks forked from it, torch imported once); their outcomes by run number, and the process's output."""
    selected = sorted({item.callspec.params["index"] for item in request.session.items
                       if item.originalname == "test_composition" and item.get_closest_marker("skip") is None})
    report = tmp_path_factory.mktemp("compositions") / "outcomes.json"
    command = [sys.executable, os.path.join(REPO_ROOT, "tools", "check_compositions.py"), "--json", str(report),
               "--runs", *map(str, selected)]
    result = subprocess.run(command, capture_output=True, text=True, cwd=REPO_ROOT, timeout=1800,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    by_index = {}
    if report.exists():
        by_index = {outcome["index"]: outcome for outcome in json.loads(report.read_text())}
    return by_index, result.stdout[-6000:] + result.stderr[-3000:]


def _case(index: int, run: dict):
    """Run `index` as a test case: a strict xfail while it is a known failure; with Triton's kernels, marked
    `interpreter` (skipped where that cannot run them) and skipped without Triton."""
    known = matrix.known_failure(run)
    marks = [pytest.mark.xfail(strict=True, reason=known)] if known else []
    if run["kernels"] == "triton":
        marks += [pytest.mark.interpreter,
                  pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton")]
    return pytest.param(index, marks=marks, id=f"{index}-{matrix.describe(run).replace(' ', ',')}")


@pytest.mark.slow
@pytest.mark.parametrize("index", [_case(index, run) for index, run in enumerate(RUNS)])
def test_composition(index, outcomes):
    by_index, output = outcomes
    assert index in by_index, f"run {index} has no outcome; tools/check_compositions.py printed:\n{output}"
    outcome = by_index[index]
    assert outcome["values"] == RUNS[index], "the tool's matrix is not this module's: the generator must be seeded"
    assert outcome["ok"], (f"run {index} ({matrix.describe(RUNS[index])}): {outcome['verdict']}; "
                           f"exact reference {outcome['bitwise']}, difference {outcome['difference']} against one "
                           f"process (rtol {outcome['rtol']}), error {outcome['error']}, invariants broken:\n"
                           + "\n".join(outcome["violations"]))
