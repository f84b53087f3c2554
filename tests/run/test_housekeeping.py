"""Megatron's loop housekeeping with its meaning: --manual-gc collects at fixed iterations and around
evaluations with the automatic collector off, --empty-unused-memory-level empties the CUDA cache at Megatron's
two points, --profile writes a PyTorch profiler trace of exactly the chosen iterations."""

import contextlib
import gc
import json

import pytest
import torch

from megalite.arguments import parse_args
from megalite.errors import UserError
from megalite.run import housekeeping, training
from megalite.run.training import Trainer

SMALL = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "4", "--ffn-hidden-size", "64",
         "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "4", "--log-interval", "1",
         "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "99"]

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def trainer_of():
    """trainer_of(*flags) -> (an open Trainer of SMALL + flags, its log lines); each closed after the test."""
    with contextlib.ExitStack() as opened:
        def build(*flags) -> tuple[Trainer, list[str]]:
            lines = []
            return opened.enter_context(Trainer(parse_args([*SMALL, *flags]), log=lines.append)), lines
        yield build


def collections_of(trainer: Trainer, monkeypatch) -> list[tuple]:
    """Train; (iteration, generation, whether automatic collection was on) of each gc.collect() call."""
    calls = []
    collect = gc.collect

    def recording_collect(generation=2):
        calls.append((trainer.state.iteration, generation, gc.isenabled()))
        return collect(generation)

    monkeypatch.setattr(gc, "collect", recording_collect)
    trainer.train()
    monkeypatch.setattr(gc, "collect", collect)
    return calls


def test_manual_gc_collects_at_the_interval_and_around_evaluations(monkeypatch, trainer_of):
    trainer, _ = trainer_of("--train-iters", "5", "--eval-interval", "3", "--eval-iters", "1", "--manual-gc",
                            "--manual-gc-interval", "2")
    assert gc.isenabled()
    calls = collections_of(trainer, monkeypatch)
    # The start; iteration 2; a full collection before iteration 3's evaluation and a young one after it;
    # iteration 4; then the closing validation and test, each with its pair.
    assert calls == [(0, 2, False), (2, 2, False), (3, 2, False), (3, 0, False), (4, 2, False),
                     (5, 2, False), (5, 0, False), (5, 2, False), (5, 0, False)]
    assert gc.isenabled()  # restored after training


def test_manual_gc_interval_0_and_no_eval_collections(monkeypatch, trainer_of):
    trainer, _ = trainer_of("--train-iters", "4", "--eval-interval", "2", "--eval-iters", "1", "--manual-gc",
                            "--no-manual-gc-eval")
    assert collections_of(trainer, monkeypatch) == [(0, 2, False)]  # only the start
    assert gc.isenabled()


def test_manual_gc_keeps_a_disabled_collector_disabled(monkeypatch, trainer_of):
    trainer, _ = trainer_of("--train-iters", "1", "--eval-iters", "0", "--manual-gc")
    gc.disable()
    try:
        collections_of(trainer, monkeypatch)
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_without_manual_gc_the_collector_stays_on(monkeypatch, trainer_of):
    trainer, _ = trainer_of("--train-iters", "3", "--eval-interval", "2", "--eval-iters", "1")
    assert all(enabled for _, _, enabled in collections_of(trainer, monkeypatch))
    assert gc.isenabled()


@pytest.mark.parametrize("level", [0, 1, 2])
def test_empty_unused_memory_level_empties_the_cache_where_megatron_does(monkeypatch, level, trainer_of):
    """Level 1: after each forward-backward (training and evaluation); level 2: also after each optimizer step."""
    trainer, _ = trainer_of("--train-iters", "2", "--eval-interval", "2", "--eval-iters", "1",
                            "--empty-unused-memory-level", str(level))
    events = []
    forward_backward, step = training.forward_backward, trainer.optimizer.step

    def recording_forward_backward(model, micro_batches, optimizer=None, *args, **kwargs):
        events.append("forward-backward" if optimizer is not None else "evaluation")
        return forward_backward(model, micro_batches, optimizer, *args, **kwargs)

    def recording_step(*args, **kwargs):
        events.append("step")
        return step(*args, **kwargs)

    monkeypatch.setattr(training, "forward_backward", recording_forward_backward)
    monkeypatch.setattr(trainer.optimizer, "step", recording_step)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: events.append("empty"))
    trainer.train()
    train_step = [["forward-backward", "step"], ["forward-backward", "empty", "step"],
                  ["forward-backward", "empty", "step", "empty"]][level]
    evaluation = ["evaluation", "empty"] if level else ["evaluation"]
    assert events == train_step * 2 + evaluation * 2  # iteration 2's validation, then the closing test


def trace_steps(path) -> list[str]:
    """The ProfilerStep#N spans of a Chrome trace, in order."""
    events = json.load(open(path))["traceEvents"]
    names = [event["name"] for event in events if event.get("name", "").startswith("ProfilerStep#")]
    return sorted(set(names), key=lambda name: int(name.split("#")[1]))


def test_profile_traces_exactly_the_chosen_iterations(tmp_path, trainer_of):
    trainer, lines = trainer_of("--train-iters", "5", "--eval-iters", "0", "--save", str(tmp_path), "--profile",
                                "--profile-step-start", "1", "--profile-step-end", "3")
    path = tmp_path / "profile" / "rank-0.json"
    assert any(f"iterations 2-3 on all ranks goes to {tmp_path / 'profile' / 'rank-<rank>.json'}" in line
               for line in lines)
    trainer.train()
    assert trace_steps(path) == ["ProfilerStep#2", "ProfilerStep#3"]


def test_profile_of_a_run_that_ends_first_writes_what_it_had(tmp_path, monkeypatch, trainer_of):
    monkeypatch.chdir(tmp_path)  # no --save, no --tensorboard-dir: ./profile/
    trainer, _ = trainer_of("--train-iters", "2", "--eval-iters", "0", "--profile", "--profile-step-start", "0",
                            "--profile-step-end", "4", "--profile-ranks", "0")
    trainer.train()
    assert trace_steps(tmp_path / "profile" / "rank-0.json") == ["ProfilerStep#1", "ProfilerStep#2"]


def test_profile_skips_ranks_not_chosen_and_refuses_missing_ones(tmp_path, trainer_of):
    assert not housekeeping.StepProfiler(parse_args([*SMALL, "--profile", "--profile-ranks", "1"]).train, 0, 2,
                                         str(tmp_path), torch.device("cpu")).enabled
    with pytest.raises(UserError, match="--profile-ranks 1 names a rank the run does not have"):
        trainer_of("--profile", "--profile-ranks", "1")


def test_profile_folder_prefers_tensorboard_then_save():
    assert housekeeping.profile_folder("tb", "ckpt") == "tb/profile"
    assert housekeeping.profile_folder(None, "ckpt") == "ckpt/profile"
    assert housekeeping.profile_folder(None, None) == "./profile"


@pytest.mark.parametrize("flags, message", [
    (["--manual-gc-interval", "5"], "--manual-gc-interval only matters with --manual-gc"),
    (["--no-manual-gc-eval"], "--no-manual-gc-eval only matters with --manual-gc"),
    (["--manual-gc", "--manual-gc-interval", "-1"], "--manual-gc-interval must be 0"),
    (["--profile", "--profile-step-start", "6", "--profile-step-end", "6"], "must satisfy 0 <= start < end"),
    (["--profile-ranks", "0"], "--profile-ranks needs --profile"),
])
def test_housekeeping_flags_are_checked(flags, message):
    with pytest.raises(UserError, match=message):
        parse_args([*SMALL, *flags])


def test_empty_unused_memory_level_takes_megatrons_levels_only():
    with pytest.raises(UserError, match="invalid choice"):
        parse_args([*SMALL, "--empty-unused-memory-level", "3"])
