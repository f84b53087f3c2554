"""megalite/run/tracking.py: wandb runs read back from their offline files, exit paths, no network, flags.

Every test points wandb at temporary folders and at a closed local port, so nothing
touches the network or the home folder.
"""

import glob
import importlib.util
import json
import math
import os
import signal
import struct
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from megalite.arguments import parse_args
from megalite.config.run import default_wandb_mode
from megalite.errors import UserError
from megalite.run.resilience import RunSignals, owned_signals
from megalite.run.tracking import Tracker, scalars_of, start_tracking
from megalite.run.training import pretrain

wandb = pytest.importorskip("wandb")
pytestmark = pytest.mark.usefixtures("one_thread")

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CLOSED_PORT_URL = "http://127.0.0.1:9"  # the discard port: nothing listens there
SMALL = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "99", "--num-layers", "2",
         "--hidden-size", "32", "--num-attention-heads", "4", "--ffn-hidden-size", "64", "--seq-length", "16",
         "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "3e-3", "--lr-warmup-iters", "2",
         "--eval-iters", "1"]


@pytest.fixture
def wandb_env(tmp_path, monkeypatch):
    """wandb's folders under tmp_path, no API key, and a server address where nothing answers."""
    for variable in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_ENTITY", "WANDB_PROJECT", "WANDB_RUN_ID",
                     "WANDB_INIT_TIMEOUT", "HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy"):
        monkeypatch.delenv(variable, raising=False)
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("NETRC", str(home / ".netrc"))
    monkeypatch.setenv("WANDB_BASE_URL", CLOSED_PORT_URL)
    for variable, folder in [("WANDB_DIR", "wandb_dir"), ("WANDB_CONFIG_DIR", "wandb_config"),
                             ("WANDB_CACHE_DIR", "wandb_cache"), ("WANDB_DATA_DIR", "wandb_data"),
                             ("WANDB_ARTIFACT_DIR", "wandb_artifacts")]:
        (tmp_path / folder).mkdir()
        monkeypatch.setenv(variable, str(tmp_path / folder))
    yield
    wandb.teardown()  # the next test starts wandb afresh with its own environment


# ----------------------------------------------------------------------------- reading a run back


def wandb_records(path: str):
    """The protobuf records of a .wandb file, with wandb's own message types.

    wandb 0.31 has no Python reader; the file is a LevelDB-style log: a 7-byte header
    (":W&B", magic, version), then 32 KiB blocks of chunks, each with a 7-byte header
    (crc32c, little-endian length, type: 1 full, 2 first, 3 middle, 4 last).
    """
    from wandb.proto import wandb_internal_pb2

    data = open(path, "rb").read()
    assert data[:4] == b":W&B"
    position, pending, block = 7, b"", 32768
    while position + 7 <= len(data):
        if block - position % block < 7:  # a block's tail too short for a header is padding
            position += block - position % block
            continue
        _, length, kind = struct.unpack("<IHB", data[position:position + 7])
        pending += data[position + 7:position + 7 + length]
        position += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def _key(item) -> str:
    return item.key or ".".join(item.nested_key)


def read_wandb_run(folder) -> SimpleNamespace:
    """The one offline run under `folder`: its config, history rows by step, summary and exit code."""
    [path] = glob.glob(os.path.join(str(folder), "**", "offline-run-*", "run-*.wandb"), recursive=True)
    run = SimpleNamespace(name=None, config={}, history={}, summary={}, exit_code=None)
    for record in wandb_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run.name = record.run.display_name
            run.config.update({_key(item): json.loads(item.value_json) for item in record.run.config.update})
        elif kind == "history":
            row = {_key(item): json.loads(item.value_json) for item in record.history.item}
            run.history[row["_step"]] = row
        elif kind == "summary":
            run.summary.update({_key(item): json.loads(item.value_json) for item in record.summary.update})
        elif kind == "exit" and run.exit_code is None:
            run.exit_code = record.exit.exit_code
    return run


def metrics(path) -> list[dict]:
    return [json.loads(line) for line in open(path)]


# ----------------------------------------------------------------------------- whole runs


def test_offline_run_holds_config_every_logged_iteration_and_the_final_loss(wandb_env, tmp_path):
    save = tmp_path / "run"
    trainer, state = pretrain(parse_args([*SMALL, "--train-iters", "6", "--log-interval", "2", "--eval-interval",
                                          "3", "--save", str(save), "--save-interval", "4",
                                          "--wandb-project", "megalite-tests", "--wandb-mode", "offline"]),
                              log=lambda line: None)
    records = metrics(save / "metrics.jsonl")
    training = [r for r in records if "split" not in r]
    run = read_wandb_run(save / "wandb")  # the default --wandb-save-dir
    assert run.exit_code == 0 and run.summary["exit_reason"] == "finished" and run.summary["final_iteration"] == 6
    assert run.name.startswith("tiny-tp1-pp1-dp1-")
    assert run.config["model"]["num_layers"] == 2 and run.config["train"]["train_iters"] == 6
    # One history row per logged iteration, with the metrics file's numbers.
    logged = {step: row for step, row in run.history.items() if "train/lm_loss" in row}
    assert sorted(logged) == [r["iteration"] for r in training] == [2, 4, 6]
    for record in training:
        row = logged[record["iteration"]]
        for key in ("lm_loss", "lr", "grad_norm", "loss_scale", "tokens_per_sec", "tflops_per_device", "mfu",
                    "mem_peak_bytes", "iteration_time_ms", "consumed_samples"):
            assert row[f"train/{key}"] == pytest.approx(record[key]), key
    # The summary holds the final loss; evaluations add loss and perplexity; checkpoints their iteration.
    assert run.summary["train/lm_loss"] == pytest.approx(training[-1]["lm_loss"])
    valid = [r for r in records if r.get("split") == "valid"]
    assert [r["iteration"] for r in valid] == [3, 6] and "valid/lm_loss" in run.history[3]
    assert run.summary["valid/lm_loss"] == pytest.approx(valid[-1]["lm_loss"])
    assert run.summary["valid/ppl"] == pytest.approx(math.exp(valid[-1]["lm_loss"]))
    assert "test/ppl" in run.history[6]
    assert run.history[4]["checkpoint/iteration"] == 4 and run.history[6]["checkpoint/iteration"] == 6
    assert sorted(run.history) == [2, 3, 4, 6]  # nothing else makes rows


def test_an_error_inside_training_still_finishes_the_run(wandb_env, tmp_path):
    with pytest.raises(UserError, match="diverged"):
        pretrain(parse_args([*SMALL, "--train-iters", "5", "--lr", "1e30", "--lr-warmup-iters", "0",
                             "--clip-grad", "0", "--log-interval", "1", "--wandb-project", "megalite-tests",
                             "--wandb-save-dir", str(tmp_path / "wandb")]), log=lambda line: None)
    run = read_wandb_run(tmp_path / "wandb")
    assert run.exit_code == 1 and run.summary["exit_reason"].startswith("UserError: ")


def test_sigterm_without_the_handler_finishes_the_run_and_exits_143(wandb_env, tmp_path):
    """In process: the second log line sends this process a SIGTERM, which must unwind the loop."""
    lines = []

    def log(line: str) -> None:
        lines.append(line)
        if sum(line.startswith(" iteration") for line in lines) == 2:  # iteration 1 went to wandb already
            handler = signal.getsignal(signal.SIGTERM)
            # Without the tracker's handler the signal would end pytest itself: fail instead.
            assert isinstance(getattr(handler, "__self__", None), RunSignals), handler
            os.kill(os.getpid(), signal.SIGTERM)

    with pytest.raises(SystemExit) as stopped:
        pretrain(parse_args([*SMALL, "--train-iters", "100000", "--log-interval", "1", "--eval-interval", "0",
                             "--wandb-project", "megalite-tests", "--wandb-save-dir", str(tmp_path / "wandb")]),
                 log=log)
    assert stopped.value.code == 143 and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # restored
    run = read_wandb_run(tmp_path / "wandb")
    assert run.exit_code == 143 and run.summary["exit_reason"] == "SystemExit: 143"
    assert 1 in run.history and run.summary["final_iteration"] == 2


def test_under_pipeline_parallelism_only_the_last_rank_writes(wandb_env, tmp_path):
    """PP=2 on two processes: one wandb run, holding the loss that only the last stage computes."""
    save = tmp_path / "pp2"
    command = [sys.executable, os.path.join(REPO_ROOT, "tools", "fork_ranks.py"), "--nproc-per-node", "2", "--",
               *SMALL, "--pipeline-model-parallel-size", "2",
               "--train-iters", "2", "--log-interval", "1", "--eval-interval", "0", "--eval-iters", "0",
               "--save", str(save), "--wandb-project", "megalite-tests"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert len(glob.glob(str(save / "wandb" / "wandb" / "offline-run-*"))) == 1
    run = read_wandb_run(save / "wandb")
    assert run.name.startswith("tiny-tp1-pp2-dp1-") and run.config["parallel"]["world_size"] == 2
    assert [run.history[step]["train/lm_loss"] for step in (1, 2)] == pytest.approx(
        [r["lm_loss"] for r in metrics(save / "metrics.jsonl")])


# ----------------------------------------------------------------------------- no network


class FakeLogger:
    def __init__(self):
        self.sinks = []

    def add_sink(self, sink):
        self.sinks.append(sink)


def start(mode: str, folder, warnings: list) -> Tracker:
    run = parse_args([*SMALL, "--wandb-project", "megalite-tests", "--wandb-mode", mode,
                      "--wandb-save-dir", str(folder)])
    return start_tracking(run, {"note": "test"}, FakeLogger(), True, warn=warnings.append)


def test_online_without_a_key_or_a_server_logs_offline_at_once(wandb_env, tmp_path, monkeypatch):
    warnings = []
    begin = time.perf_counter()
    tracker = start("online", tmp_path / "no-key", warnings)  # no key: wandb would prompt on a terminal
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    second = start("online", tmp_path / "no-server", warnings)  # a key, but nothing at WANDB_BASE_URL
    elapsed = time.perf_counter() - begin
    for each in (tracker, second):
        assert each.active and each._wandb.settings.mode == "offline"
        each.finish()
    assert len(warnings) == 2 and "no API key is configured" in warnings[0]
    assert "127.0.0.1:9 cannot be reached" in warnings[1] and "wandb sync" in warnings[1]
    assert elapsed < 20  # wandb alone would wait 2 x 5 s for the account, then 90 s for the run


def test_a_failing_wandb_start_falls_back_offline_then_off(wandb_env, tmp_path, monkeypatch):
    real_init, calls = wandb.init, []

    def init_failing_online(**kwargs):
        calls.append(kwargs["mode"])
        if kwargs["mode"] == "online":
            raise wandb.errors.CommError("Timed out while retrying\nmore detail")
        return real_init(**kwargs)

    monkeypatch.setenv("HTTPS_PROXY", "http://127.0.0.1:9")  # behind a proxy there is no probe
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    monkeypatch.setattr(wandb, "init", init_failing_online)
    warnings = []
    tracker = start("online", tmp_path / "fallback", warnings)
    assert calls == ["online", "offline"] and tracker._wandb.settings.mode == "offline"
    assert warnings == [f"wandb: online start failed: Timed out while retrying; logging offline into "
                        f"{tmp_path / 'fallback'} (upload later with `wandb sync`)"]
    tracker.finish()

    def init_failing(**kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(wandb, "init", init_failing)
    warnings.clear()
    tracker = start("offline", tmp_path / "off", warnings)
    assert not tracker.active
    assert warnings == ["wandb: offline start failed: disk full; training goes on without wandb"]


# ----------------------------------------------------------------------------- pieces


def test_default_mode_follows_the_api_key(wandb_env, tmp_path, monkeypatch):
    assert default_wandb_mode() == "offline"
    (tmp_path / "home" / ".netrc").write_text("machine 127.0.0.1\n  login user\n  password " + "p" * 40 + "\n")
    assert default_wandb_mode() == "online"  # a netrc entry for WANDB_BASE_URL's host
    monkeypatch.setenv("WANDB_BASE_URL", "https://api.wandb.ai")
    assert default_wandb_mode() == "offline"  # ...but not for another host
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    assert default_wandb_mode() == "online"
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert default_wandb_mode() == "disabled"


def test_scalars_are_namespaced_and_evaluations_get_perplexity():
    training = {"iteration": 4, "consumed_samples": 16, "lm_loss": 2.5, "lr": 1e-3, "grad_norm": None, "mfu": None}
    assert scalars_of(training) == {"train/consumed_samples": 16, "train/lm_loss": 2.5, "train/lr": 1e-3}
    assert scalars_of({"iteration": 4, "split": "valid", "lm_loss": 2.0}) == {
        "valid/lm_loss": 2.0, "valid/ppl": pytest.approx(math.exp(2.0))}
    assert scalars_of({"iteration": 4, "split": "test", "lm_loss": None}) == {}  # a NaN loss


def test_tensorboard_gets_the_same_scalars():
    class Writer:
        def __init__(self):
            self.scalars, self.closed = [], False

        def add_scalar(self, key, value, step):
            self.scalars.append((key, value, step))

        def close(self):
            self.closed = True

    writer = Writer()
    tracker = Tracker(tensorboard=writer)
    tracker.log_record({"iteration": 2, "lm_loss": 3.0, "lr": 0.1})
    tracker.log_record({"iteration": 2, "split": "valid", "lm_loss": 0.0})
    tracker.log_checkpoint(2)
    tracker.finish(0)
    tracker.finish(0)  # twice is harmless
    assert writer.scalars == [("train/lm_loss", 3.0, 2), ("train/lr", 0.1, 2), ("valid/lm_loss", 0.0, 2),
                              ("valid/ppl", 1.0, 2), ("checkpoint/iteration", 2, 2)]
    assert writer.closed and not tracker.active


def test_a_sigterm_during_a_wandb_call_waits_for_the_call_to_return():
    calls = []

    class Run:
        def log(self, scalars, step):
            os.kill(os.getpid(), signal.SIGTERM)
            calls.append(step)  # reached: the handler did not raise inside wandb's code

    tracker = Tracker(wandb_run=Run())
    with owned_signals(save_and_exit=False):  # no --exit-signal-handler: a SIGTERM ends the run at once
        with pytest.raises(SystemExit) as stopped:
            tracker.log_checkpoint(3)
    assert calls == [3] and stopped.value.code == 143


def test_tensorboard_events_hold_the_scalars(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    pretrain(parse_args([*SMALL, "--train-iters", "4", "--log-interval", "2", "--eval-interval", "2",
                         "--save", str(tmp_path), "--tensorboard-dir", str(tmp_path / "tb")]), log=lambda line: None)
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    records = metrics(tmp_path / "metrics.jsonl")
    losses = [(event.step, event.value) for event in events.Scalars("train/lm_loss")]
    assert losses == [(r["iteration"], pytest.approx(r["lm_loss"])) for r in records if "split" not in r]
    assert [event.step for event in events.Scalars("valid/ppl")] == [2, 4]
    assert [event.value for event in events.Scalars("checkpoint/iteration")] == [4]


def test_tracking_flags(wandb_env):
    run = parse_args([*SMALL, "--save", "ckpt/a", "--wandb-project", "p"])
    assert run.logging.wandb_save_dir == os.path.join("ckpt/a", "wandb") and run.logging.wandb_mode == "offline"
    assert parse_args([*SMALL, "--wandb-project", "p"]).logging.wandb_save_dir is None  # wandb's own default
    assert parse_args(SMALL).logging.wandb_project is None  # tracking is off by default
    with pytest.raises(UserError) as error:
        parse_args([*SMALL, "--wandb-mode", "offline"])
    assert str(error.value) == ("--wandb-mode needs --wandb-project NAME (wandb tracks a run only when a project "
                                "is given); add it or drop --wandb-mode")
    with pytest.raises(UserError, match="--wandb-project is empty"):
        parse_args([*SMALL, "--wandb-project", " "])


def test_tensorboard_dir_without_the_package_is_one_sentence(tmp_path):
    if importlib.util.find_spec("tensorboard") is not None:
        pytest.skip("tensorboard is installed")
    with pytest.raises(UserError) as error:
        parse_args([*SMALL, "--tensorboard-dir", str(tmp_path)])
    assert str(error.value) == ("--tensorboard-dir needs the tensorboard package, which is not installed; "
                                "pip install tensorboard (or drop --tensorboard-dir)")
