"""parallelize(): the one place a built model becomes a parallel model; the Trainer's symmetric open and close."""

import ast
import os

import pytest
import torch

import megalite
from megalite.arguments import parse_args
from megalite.config import Sharding
from megalite.data_parallel.ddp import ParallelModel
from megalite.parallel_state import ONE_PROCESS
from megalite.pipeline_parallel.stages import build_model_chunks
from megalite.run import resilience, training
from megalite.run.parallelize import parallelize
from tests.helpers.runs import MOCK, SMALL

pytestmark = pytest.mark.usefixtures("one_thread")


def test_parallelize_applies_the_cpu_backend_recomputation_and_data_parallelism_in_one_call():
    run = parse_args([*SMALL, "--recompute-granularity", "full", "--recompute-method", "uniform",
                      "--recompute-num-layers", "1",
                      "--use-distributed-optimizer"])
    chunks = build_model_chunks(run.model, run.train.seed)
    plain = {name: param.detach().clone() for name, param in chunks.named_parameters()}
    model = parallelize(chunks, run, ONE_PROCESS)
    assert isinstance(model, ParallelModel) and model.model is chunks and model.sharding == Sharding.OPTIM
    chunk = chunks[0]
    assert "run_layers" in vars(chunk)  # full recomputation replaced the instance's layer loop
    assert all("core_attention" in vars(layer.self_attention) for layer in chunk.layers.values())  # CPU attention
    for name, param in chunks.named_parameters():  # moved into the buffer, values unchanged
        assert torch.equal(param.detach(), plain[name]), name


@pytest.mark.parametrize("flags,fused", [([], True), (["--no-gradient-accumulation-fusion"], False),
                                         (["--compile"], False)])
def test_gradient_accumulation_fusion_is_on_by_default_and_off_for_compiled_layers(flags, fused):
    """Megatron's default; a compiled layer's traced backward cannot run the grad buffer's hooks."""
    run = parse_args([*SMALL, *flags])
    chunks = build_model_chunks(run.model, run.train.seed)
    model = parallelize(chunks, run, ONE_PROCESS)
    assert model.fuse_weight_grads is fused
    assert all((param.add_to_main_grad is not None) is fused for param in chunks.parameters())


@pytest.mark.parametrize("sharding", list(Sharding))
def test_every_strategy_holds_the_parameters_in_the_one_buffer(sharding):
    """No strategy keeps a second layout: each parameter is a view of its bucket's values, which are views of
    one whole tensor (or, under ZeRO-3, each its own bucket's, gathered on demand, beside the stored shards)."""
    run = parse_args(SMALL)
    chunks = build_model_chunks(run.model, run.train.seed)
    model = ParallelModel(chunks, ONE_PROCESS, sharding=sharding)
    buffer = model.buffer
    for bucket in buffer.buckets:
        if sharding.params:
            model.param_shards.gather(model.param_shards.unit_of[id(bucket.params[0])])
            assert all(param.untyped_storage().data_ptr() == bucket.param.untyped_storage().data_ptr()
                       for param in bucket.params)
            model.param_shards.release_all()
        else:
            assert bucket.param.untyped_storage().data_ptr() == buffer.param_data.untyped_storage().data_ptr()
            assert all(param.untyped_storage().data_ptr() == buffer.param_data.untyped_storage().data_ptr()
                       for param in bucket.params)


def _calls(name: str) -> list[str]:
    """The megalite modules that call a function or class named `name`."""
    root = os.path.dirname(megalite.__file__)
    callers = []
    for folder, _, files in os.walk(root):
        for file in files:
            if file.endswith(".py"):
                path = os.path.join(folder, file)
                tree = ast.parse(open(path, encoding="utf-8").read())
                if any(isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) == name
                       for node in ast.walk(tree)):
                    callers.append(os.path.relpath(path, root))
    return callers


def test_only_parallelize_applies_the_options_and_builds_the_parallel_model():
    assert _calls("apply_options") == ["run/parallelize.py"]
    assert _calls("ParallelModel") == ["run/parallelize.py"]
    assert [path for path in _calls("apply") if path.startswith("run")] == ["run/parallelize.py"]  # cpu.apply


def test_a_trainer_that_fails_while_opening_closes_what_it_opened(monkeypatch):
    closed = []
    monkeypatch.setattr(training.TrainingLogger, "close", lambda self: closed.append("logger"))

    def failing_tracking(*args, **kwargs):
        raise RuntimeError("tracking failed to start")

    monkeypatch.setattr(training, "start_tracking", failing_tracking)
    with pytest.raises(RuntimeError, match="tracking failed"):
        with training.Trainer(parse_args([*SMALL, *MOCK]), log=lambda line: None):
            pass
    assert closed == ["logger"] and resilience._owner is None  # the signal handlers are restored too


def test_leaving_a_trainer_closes_it_in_reverse_order_with_the_error_that_ended_it(monkeypatch):
    events = []
    monkeypatch.setattr(training.TrainingLogger, "close", lambda self: events.append("logger"))
    monkeypatch.setattr(training.parallel_state, "destroy", lambda parallel: events.append("process groups"))
    with pytest.raises(KeyboardInterrupt):
        with training.Trainer(parse_args([*SMALL, *MOCK]), log=lambda line: None) as trainer:
            monkeypatch.setattr(trainer.tracker, "finish", lambda code, summary: events.append((code, summary)))
            raise KeyboardInterrupt
    assert events == [(130, {"exit_reason": "KeyboardInterrupt: ", "final_iteration": 0}), "logger",
                      "process groups"]
    assert resilience._owner is None
