"""The folder protocol: atomic saves that a crash at any step leaves loadable, and clear errors for a
missing or garbled latest file, folder or metadata."""

import os

import pytest

from megalite.checkpoint import load_checkpoint, read_latest_iteration
from megalite.errors import UserError
from megalite.model.gpt import build_model
from tests.helpers.checkpoint import assert_same_tensors, save, small_config


class SimulatedCrash(BaseException):
    """Stands for a kill: no except clause of the save catches it, so nothing is cleaned up.
    (A save that fails with an OSError cleans up: tests/run/test_resilience.py.)"""


def failing_on_call(real, failing_call: int):
    """A stand-in for `real` that crashes on call number `failing_call` (1-based)."""
    calls = []

    def wrapper(*args):
        calls.append(args)
        if len(calls) == failing_call:
            raise SimulatedCrash("simulated crash")
        return real(*args)
    return wrapper


def test_crash_before_the_rename_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    config = small_config()
    first, second = build_model(config, seed=1), build_model(config, seed=2)
    save(tmp_path, 100, first)
    monkeypatch.setattr(os, "rename", failing_on_call(os.rename, 1))
    with pytest.raises(SimulatedCrash, match="simulated crash"):
        save(tmp_path, 200, second)
    monkeypatch.undo()
    assert read_latest_iteration(str(tmp_path)) == 100
    assert (tmp_path / "iter_0000200.tmp-new").is_dir()  # the killed save's leftover ...
    fresh = build_model(config, seed=3)
    assert load_checkpoint(str(tmp_path), fresh, model_config=config)["iteration"] == 100  # ... is ignored
    assert_same_tensors(first.state_dict(), fresh.state_dict())

    save(tmp_path, 200, second)  # a re-save works and cleans up
    assert sorted(os.listdir(tmp_path)) == ["iter_0000100", "iter_0000200", "latest_checkpointed_iteration.txt"]
    assert load_checkpoint(str(tmp_path), fresh, model_config=config)["iteration"] == 200
    assert_same_tensors(second.state_dict(), fresh.state_dict())


def test_crash_before_the_latest_file_is_replaced_keeps_it_old(tmp_path, monkeypatch):
    model = build_model(small_config(), seed=1)
    save(tmp_path, 100, model)
    monkeypatch.setattr(os, "replace", failing_on_call(os.replace, 1))
    with pytest.raises(SimulatedCrash, match="simulated crash"):
        save(tmp_path, 200, model)
    monkeypatch.undo()
    assert read_latest_iteration(str(tmp_path)) == 100
    assert load_checkpoint(str(tmp_path), model, model_config=small_config())["iteration"] == 100


def test_crash_while_replacing_the_same_iteration_keeps_a_complete_copy(tmp_path, monkeypatch):
    config = small_config()
    first, second = build_model(config, seed=1), build_model(config, seed=2)
    save(tmp_path, 100, first)
    # Rename 1 moves the old copy away, rename 2 (moving the new one in) dies.
    monkeypatch.setattr(os, "rename", failing_on_call(os.rename, 2))
    with pytest.raises(SimulatedCrash, match="simulated crash"):
        save(tmp_path, 100, second)
    monkeypatch.undo()
    assert not (tmp_path / "iter_0000100").exists() and read_latest_iteration(str(tmp_path)) == 100
    fresh = build_model(config, seed=3)
    load_checkpoint(str(tmp_path), fresh, model_config=config)  # the old copy still loads
    assert_same_tensors(first.state_dict(), fresh.state_dict())

    save(tmp_path, 100, second)  # restores the old copy, then replaces it properly
    assert sorted(os.listdir(tmp_path)) == ["iter_0000100", "latest_checkpointed_iteration.txt"]
    load_checkpoint(str(tmp_path), fresh, model_config=config)
    assert_same_tensors(second.state_dict(), fresh.state_dict())


def test_garbled_latest_file_names_the_file_and_its_content(tmp_path):
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("iter_100\n")
    with pytest.raises(UserError, match=r"latest_checkpointed_iteration.txt should hold an iteration number "
                                        r"but holds 'iter_100'"):
        read_latest_iteration(str(tmp_path))


@pytest.mark.parametrize("case, message", [
    ("no load dir", r"--load directory .*missing does not exist"),
    ("no latest file", r"has no latest_checkpointed_iteration.txt"),
    ("no folder", r"checkpoint folder .*iter_0000007 for iteration 7 does not exist"),
    ("no metadata", r"metadata.json is missing"),
    ("garbled metadata", r"metadata.json is not valid JSON"),
    ("newer format", r"format version 99, newer than"),
])
def test_missing_or_garbled_checkpoints_are_user_errors(tmp_path, case, message):
    config = small_config()
    model = build_model(config, seed=1)
    save(tmp_path, 7, model)
    load, metadata = tmp_path, tmp_path / "iter_0000007" / "metadata.json"
    if case == "no load dir":
        load = tmp_path / "missing"
    elif case == "no latest file":
        os.remove(tmp_path / "latest_checkpointed_iteration.txt")
    elif case == "no folder":
        os.rename(tmp_path / "iter_0000007", tmp_path / "elsewhere")
    elif case == "no metadata":
        os.remove(metadata)
    elif case == "garbled metadata":
        metadata.write_text(metadata.read_text()[:100])
    else:
        metadata.write_text(metadata.read_text().replace('"version": 1', '"version": 99'))
    with pytest.raises(UserError, match=message):
        load_checkpoint(str(load), model, model_config=config)
