"""Faults as real runs: preemption, kills (also mid-save), dead and hung ranks, torchrun restarts,
NaNs, fp16 overflow, loss spikes, failed saves and bad input. Each test checks the message and
that nothing valid was lost. The 2-rank launch helpers and the kill-and-resume campaign live in
tools/fault_campaign.py (20 random trials by hand; two chosen ones here).
"""

import concurrent.futures
import errno
import json
import os
import random
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np
import pytest
import torch

from megalite.checkpoint import saving
from megalite.arguments import parse_args
from megalite.checkpoint import CheckpointSaveError, choose_checkpoint, read_latest_iteration
from megalite.data.indexed_dataset import IndexedDatasetBuilder
from megalite.errors import UserError
from megalite.run.resilience import (LossSpikeDetector, PeerWatch, SkippedSteps, divergence_message,
                                     owned_signals)
from megalite.run.training import Trainer, pretrain
from tools import fault_campaign as campaign
from tools.fork_ranks import cpu_world_environment

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PRETRAIN = os.path.join(REPO_ROOT, "pretrain_gpt.py")
ONE_THREAD = {**os.environ, "OMP_NUM_THREADS": "1"}
CPU_WORLD = cpu_world_environment(OMP_NUM_THREADS="1")  # runs that stay on the CPU (gloo) on any machine
MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
         "--micro-batch-size", "4", "--global-batch-size", "4", "--eval-interval", "0", "--eval-iters", "1",
         "--log-interval", "1"]
TINY = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "255", *MODEL]


def run_pretrain(*flags, preexec_fn=None, launcher=(), env=ONE_THREAD) -> subprocess.CompletedProcess:
    return subprocess.run([*launcher, sys.executable, PRETRAIN, *map(str, flags)], capture_output=True, text=True,
                          env=env, cwd=REPO_ROOT, timeout=300, preexec_fn=preexec_fn)


# Root writes into read-only folders; without these two capabilities it cannot (util-linux's setpriv).
AS_IF_NOT_ROOT = ["setpriv", "--bounding-set=-dac_override,-dac_read_search"] if os.geteuid() == 0 else []


def _why_writes_cannot_be_denied() -> str | None:
    """None when a process started as the read-only test starts its run (through AS_IF_NOT_ROOT) is
    refused a folder inside a 0o555 folder; else why not. Tried, not inferred from the user id: a
    root without CAP_DAC_OVERRIDE, a setpriv that cannot drop it, or a file system that ignores
    permission bits all decide it."""
    folder = tempfile.mkdtemp(prefix="megalite-read-only-")
    os.chmod(folder, 0o555)
    try:
        probe = subprocess.run([*AS_IF_NOT_ROOT, sys.executable, "-c", "import os, sys; os.mkdir(sys.argv[1])",
                                os.path.join(folder, "probe")], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as error:
        return f"running as root, and `{' '.join(AS_IF_NOT_ROOT)}` could not be started ({error})"
    finally:
        os.chmod(folder, 0o755)
        shutil.rmtree(folder, ignore_errors=True)
    if probe.returncode != 0 and "PermissionError" in probe.stderr:
        return None
    if probe.returncode == 0:
        how = f"even through `{' '.join(AS_IF_NOT_ROOT)}`" if AS_IF_NOT_ROOT else f"as uid {os.geteuid()}"
        return f"this machine lets a process create a folder inside a read-only folder {how}"
    last = (probe.stderr.strip().splitlines() or ["no output"])[-1]
    return f"the probe run {'through setpriv ' if AS_IF_NOT_ROOT else ''}failed otherwise: {last}"


WRITES_NOT_DENIED = _why_writes_cannot_be_denied()
CAN_BE_DENIED = WRITES_NOT_DENIED is None


def error_line(result: subprocess.CompletedProcess) -> str:
    """The run's one-sentence error: it must be the only thing on stderr, with no traceback."""
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1 and len(lines) == 1 and lines[0].startswith("error: "), result.stderr[-3000:]
    return lines[0]


def token_file(prefix, documents, dtype=np.uint16) -> str:
    with IndexedDatasetBuilder(str(prefix), dtype) as builder:
        for document in documents:
            builder.add_document(document)
    return str(prefix)


# -- two ranks: preemption, kills mid-save, dead and hung ranks, restarts ---------------------------


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The losses of the uninterrupted 2-rank run every interrupted one must reproduce bitwise."""
    return campaign.reference_run(str(tmp_path_factory.mktemp("reference")))


def test_sigterm_on_one_rank_saves_on_both_and_the_run_resumes_bitwise(reference, tmp_path):
    """A preemption seen by rank 0 only: both ranks save the same checkpoint and exit 0, the latest
    checkpoint is complete, and the same command again (--load defaults to --save) finishes the run
    with every loss bitwise equal to the uninterrupted run's (one trial of tools/fault_campaign.py)."""
    result = campaign.run_trial(1, "sigterm", str(tmp_path), reference, random.Random(0), ranks=[0])
    assert result.ok and result.resumed_from > 0, result.line()


def test_torchrun_restarts_after_a_rank_is_killed_mid_save_and_the_run_resumes_by_itself(reference, tmp_path):
    save, log_path = tmp_path / "run", tmp_path / "torchrun.log"
    with open(log_path, "w") as log:
        launcher = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                     "--nproc_per_node", "2", "--max-restarts", "1", PRETRAIN, *campaign.FLAGS,
                                     "--save", str(save)],
                                    stdout=log, stderr=subprocess.STDOUT, env=CPU_WORLD, cwd=REPO_ROOT)
    try:
        assert campaign.wait_for(lambda: campaign.staging_folder(str(save), 4), [launcher])
        os.kill(campaign.worker_pids(launcher.pid)[1], signal.SIGKILL)  # while iter_000000X.tmp-new is written
        assert launcher.wait(timeout=300) == 0, open(log_path).read()[-3000:]
    finally:
        if launcher.poll() is None:
            launcher.kill()
    output = open(log_path).read()
    # Rank 0 names its dead peer, unless torchrun's agent saw the death first and stopped rank 0
    # (SIGTERM) before it could: a race on a loaded machine; the agent then reports local rank 1.
    assert ("error: rank 0 stopped during iteration" in output and "rank 1 died" in output) or \
        "local_rank: 1" in output
    assert "(--load defaults to --save, which holds it)" in output
    assert campaign.read_losses(str(save)) == reference
    assert not [name for name in os.listdir(save) if ".tmp" in name]


def test_a_suspended_rank_makes_the_other_stop_within_the_distributed_timeout(tmp_path):
    flags = list(campaign.FLAGS)
    # 6 s: long enough that a loaded machine's start-up (ranks reaching their first collectives apart) never
    # times out, short enough for the test
    flags[flags.index("--distributed-timeout-minutes") + 1] = "0.1"
    save = str(tmp_path / "run")
    processes = campaign.start_world(save, flags=flags)
    try:
        assert campaign.wait_for(lambda: campaign.logged_iterations(save) >= 2, processes, poll=0.01)
        processes[1].send_signal(signal.SIGSTOP)
        stopped = time.monotonic()
        assert processes[0].wait(timeout=120) == 1
        waited = time.monotonic() - stopped
    finally:
        for process in processes:
            process.kill()
            process.wait()
    errors = [line for line in campaign.rank_log(save, 0).splitlines() if line.startswith("error: ")]
    assert errors and "rank 1 is suspended" in errors[0] and "Timed out" in errors[0], errors
    assert 5.5 < waited < 60
    assert choose_checkpoint(save)[1] is None  # what was saved is still complete


# -- one process, as real runs: bad input, divergence, a save that cannot write ----------------------

# Runs every case in one process (pretrain_gpt.main through run_main, as `python pretrain_gpt.py`
# does; an exception that escapes prints its traceback and exits 1, as Python would), so that a dozen
# cases cost one start-up: {case: argv} on stdin, {case: [exit code, stderr]} on stdout.
DRIVER = """
import contextlib, io, json, sys, traceback
import pretrain_gpt
from megalite.errors import run_main
results = {}
for case, argv in json.load(sys.stdin).items():
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = run_main(pretrain_gpt.main, argv) or 0
        except SystemExit as stop:
            code = stop.code
        except BaseException:  # a crash, not a clean error: the test shows its traceback
            traceback.print_exc()
            code = 1
    results[case] = [code, err.getvalue()]
print(json.dumps(results))
"""


class _WritesMarker:
    """Unpickling this creates `marker`: what a malicious checkpoint would do."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return open, (self.marker, "w")


def bad_input_cases(folder) -> dict[str, list[str]]:
    """Write the files of every bad-input case into `folder`; {case: flags}."""
    rng = np.random.default_rng(0)
    documents = [rng.integers(0, 99, 40).tolist() + [99] for _ in range(50)]
    good = token_file(folder / "corpus_text_document", documents)
    for damage in ("truncated", "corrupt"):
        for suffix in (".bin", ".idx"):
            shutil.copy(good + suffix, folder / f"{damage}_text_document{suffix}")
    with open(folder / "truncated_text_document.bin", "r+b") as file:
        file.truncate(os.path.getsize(good + ".bin") - 10)
    with open(folder / "corrupt_text_document.idx", "r+b") as file:
        file.write(b"NOTANIDX!")
    small_dtype = token_file(folder / "bytes_text_document", documents, np.uint8)
    wide_ids = token_file(folder / "wide_text_document", [[500, 1, 2] * 20 + [99] for _ in range(50)])

    checkpoint = folder / "ckpt"
    pretrain(parse_args([*TINY, "--train-iters", "1", "--save", str(checkpoint)]), log=lambda line: None)
    for copy in ("tampered", "pickled"):
        shutil.copytree(checkpoint, folder / copy)
    model_file = os.path.join("iter_0000001", "model_00000.safetensors")
    # A valid safetensors file in place of another: only the size metadata.json recorded tells.
    shutil.copy(folder / "tampered" / "iter_0000001" / "rng_00000.safetensors", folder / "tampered" / model_file)
    # A pickle whose loading would write a marker, padded to the recorded size.
    size = os.path.getsize(folder / "pickled" / model_file)
    torch.save({"weights": _WritesMarker(str(folder / "marker"))}, folder / "pickled" / model_file)
    with open(folder / "pickled" / model_file, "ab") as file:
        file.write(b"\0" * (size - os.path.getsize(folder / "pickled" / model_file)))

    data = ["--split", "100,0,0", "--tokenizer-type", "NullTokenizer", "--vocab-size", "99", *MODEL,
            "--train-iters", "2"]
    return {
        "mistyped prefix": ["--data-path", str(folder / "corpus_text_documnt"), *data],
        "truncated .bin": ["--data-path", str(folder / "truncated_text_document"), *data],
        "corrupt .idx": ["--data-path", str(folder / "corrupt_text_document"), *data],
        "vocabulary beyond the token dtype": ["--data-path", small_dtype, *data[:5], "1000", *data[6:]],
        "token ids beyond the vocabulary": ["--data-path", wide_ids, *data],
        "checkpoint of another model": [*TINY, "--train-iters", "2", "--num-layers", "3", "--load", str(checkpoint)],
        "tampered checkpoint": [*TINY, "--train-iters", "2", "--load", str(folder / "tampered")],
        "pickled checkpoint": [*TINY, "--train-iters", "2", "--load", str(folder / "pickled")],
        "impossible batch": [*TINY, "--global-batch-size", "6"],
        "impossible layout": [*TINY, "--tensor-model-parallel-size", "2"],
        "sequence above the position limit": [*TINY, "--position-embedding-type", "learned_absolute",
                                              "--max-position-embeddings", "16"],
    }


@pytest.fixture(scope="module")
def one_process_runs(tmp_path_factory):
    """Every single-process run of this file, started together, two at a time: the bad-input cases,
    one of them with --debug, and a run that diverges (one driver process), and two runs that resume a
    checkpoint and cannot write the next one: under a file-size limit (RLIMIT_FSIZE: writes past
    64 KiB fail with EFBIG, as on a full disk), and into a read-only folder. Returns their results
    by name, and the folder. The two that cannot write run on the CPU on any machine (CPU_WORLD):
    what they test is the save, and on a GPU the file-size limit and the dropped capabilities
    would also reach the kernel compilers' caches."""
    folder = tmp_path_factory.mktemp("one-process")
    torch.set_num_threads(1)
    cases = bad_input_cases(folder)
    no_space, read_only = folder / "no-space", folder / "read-only"
    for save in (no_space, read_only):
        pretrain(parse_args([*TINY, "--train-iters", "4", "--exit-interval", "2", "--save", str(save)]),
                 log=lambda line: None)

    def limit_file_size():
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, 64 * 1024))

    cases["--debug"] = [*cases["mistyped prefix"], "--debug"]
    cases["diverging"] = [*TINY, "--train-iters", "20", "--lr", "1e30", "--lr-warmup-iters", "0", "--clip-grad", "0",
                          "--save", str(folder / "nan"), "--save-interval", "1"]
    runs = {
        "driver": lambda: subprocess.run([sys.executable, "-c", DRIVER], input=json.dumps(cases),
                                         capture_output=True, text=True, env=ONE_THREAD, cwd=REPO_ROOT, timeout=300),
        "no space": lambda: run_pretrain(*TINY, "--train-iters", "4", "--save", no_space,
                                         preexec_fn=limit_file_size, env=CPU_WORLD),
    }
    if CAN_BE_DENIED:
        runs["read-only"] = lambda: run_pretrain(*TINY, "--train-iters", "4", "--save", read_only,
                                                 launcher=AS_IF_NOT_ROOT, env=CPU_WORLD)
    os.chmod(read_only, 0o555)
    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            futures = {name: pool.submit(run) for name, run in runs.items()}
            results = {name: future.result() for name, future in futures.items()}
    finally:
        os.chmod(read_only, 0o755)
    assert results["driver"].returncode == 0, results["driver"].stderr[-3000:]
    for case, (code, stderr) in json.loads(results["driver"].stdout).items():
        results[case] = subprocess.CompletedProcess(cases[case], code, "", stderr)
    return results, folder


BAD_INPUT = {  # case -> words its one sentence must hold
    "mistyped prefix": ["corpus_text_documnt", "not found; did you mean", "corpus_text_document"],
    "truncated .bin": ["truncated_text_document.bin is", "bytes but", "rebuild it"],
    "corrupt .idx": ["corrupt_text_document.idx is not a Megatron index file"],
    "vocabulary beyond the token dtype": ["bytes_text_document stores token ids as uint8 (at most 255)",
                                          "the tokenizer has 1001 ids"],
    "token ids beyond the vocabulary": ["holds token id 500, outside the tokenizer's 100 ids",
                                        "tokenized with another tokenizer"],
    "checkpoint of another model": ["different model: num_layers (checkpoint 2, now 3)"],
    "tampered checkpoint": ["model_00000.safetensors is", "bytes but metadata.json recorded", "truncated or altered"],
    "pickled checkpoint": ["model_00000.safetensors is not a valid safetensors file"],
    "impossible batch": ["--global-batch-size 6 is not a multiple of --micro-batch-size 4"],
    "impossible layout": ["--tensor-model-parallel-size 2", "does not divide the world size 1"],
    "sequence above the position limit": ["--seq-length 32 exceeds --max-position-embeddings 16"],
}


@pytest.mark.parametrize("case", list(BAD_INPUT))
def test_bad_input_stops_with_one_sentence(one_process_runs, case):
    line = error_line(one_process_runs[0][case])
    for words in BAD_INPUT[case]:
        assert words in line, line


def test_nothing_in_a_pickled_checkpoint_runs_and_debug_shows_the_traceback(one_process_runs):
    results, folder = one_process_runs
    assert not (folder / "marker").exists()
    debug = results["--debug"]
    assert debug.returncode == 1 and "Traceback (most recent call last)" in debug.stderr
    assert "did you mean" in debug.stderr


def test_nan_stops_the_run_naming_the_iteration_and_the_last_good_checkpoint(one_process_runs):
    results, folder = one_process_runs
    line = error_line(results["diverging"])
    assert "at iteration 2, so the run diverged" in line and "likely causes" in line
    assert f"the last good checkpoint is {folder / 'nan' / 'iter_0000001'}" in line
    assert read_latest_iteration(str(folder / "nan")) == 1 and not (folder / "nan" / "iter_0000002").exists()


def test_a_save_that_cannot_write_stops_and_keeps_the_previous_checkpoint(one_process_runs):
    results, folder = one_process_runs
    save = folder / "no-space"
    line = error_line(results["no space"])
    assert line.startswith(f"error: saving checkpoint {save / 'iter_0000004'} failed: could not write its files (")
    assert "File too large" in line and "removed the partial folder" in line
    assert "latest_checkpointed_iteration.txt still names iteration 2" in line
    assert sorted(os.listdir(save)) == ["iter_0000002", "latest_checkpointed_iteration.txt", "metrics.jsonl"]
    assert choose_checkpoint(str(save)) == (str(save / "iter_0000002"), None)


@pytest.mark.skipif(not CAN_BE_DENIED, reason=f"a save into a read-only folder cannot fail here: {WRITES_NOT_DENIED}")
def test_a_read_only_save_folder_stops_with_the_permission_error(one_process_runs):
    results, folder = one_process_runs
    save = folder / "read-only"
    line = error_line(results["read-only"])
    assert line.startswith(f"error: saving checkpoint {save / 'iter_0000004'} failed: could not create its folder (")
    assert "Permission denied" in line and "still names iteration 2" in line
    assert choose_checkpoint(str(save)) == (str(save / "iter_0000002"), None)


# -- in process: numerics, injected write failures, choosing and pruning checkpoints ----------------

SMALL = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "99", "--num-layers", "1",
         "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16", "--micro-batch-size", "2",
         "--global-batch-size", "2", "--eval-interval", "0", "--eval-iters", "1", "--log-interval", "1"]


def test_fp16_overflow_at_the_minimum_loss_scale_stops_after_ten_skipped_steps(monkeypatch, one_thread):
    # The CPU peak for MFU is measured with fp16 matmuls, seconds each on a CPU: not what is tested.
    monkeypatch.setattr("megalite.run.logger.peak_flops", lambda device, dtype: (None, "not measured"))
    lines = []
    with pytest.raises(UserError, match="10 iterations in a row up to iteration 10 had inf/nan gradients and were "
                                        r"skipped at the minimum loss scale \(--min-loss-scale 1\)"):
        pretrain(parse_args([*SMALL, "--train-iters", "50", "--fp16", "--init-method-std", "1000",
                             "--initial-loss-scale", "1"]), log=lines.append)
    assert sum("number of skipped iterations:   1 |" in line for line in lines) == 10


def test_loss_spikes_are_logged(tmp_path, one_thread):
    """An easy repeated pattern, with every 20th document random: once the pattern is learned,
    a batch that holds a random document is a spike."""
    rng = np.random.default_rng(0)
    prefix = token_file(tmp_path / "mix_text_document",
                        [(rng.integers(0, 64, 64).tolist() if i % 20 == 7 else list(range(32)) * 2) + [64]
                         for i in range(400)])
    lines = []
    pretrain(parse_args(["--data-path", prefix, "--split", "100,0,0", "--tokenizer-type", "NullTokenizer",
                         "--vocab-size", "64", *MODEL, "--lr", "1e-2", "--lr-warmup-iters", "0",
                         "--lr-decay-style", "constant", "--train-iters", "40"]), log=lines.append)
    spikes = [line for line in lines if line.startswith("warning: loss spike at iteration")]
    assert spikes and "x the median of the previous" in spikes[0]


def test_loss_spike_detector_compares_with_the_median_of_recent_losses():
    detector = LossSpikeDetector(1.5, window=4)
    assert [detector.check(i, loss) for i, loss in enumerate([2.0, 2.1, 1.9])] == [None, None, None]
    assert "loss spike at iteration 3: lm loss 3.5000 is 1.75x the median" in detector.check(3, 3.5)
    assert detector.check(4, 2.9) is None  # one spike does not raise the bar: median 2.1
    assert LossSpikeDetector(0).check(1, 1e9) is None


def test_the_first_exit_signal_is_recorded_repeated_sigterms_too_and_a_second_sigint_raises():
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    with owned_signals(save_and_exit=True) as signals:
        os.kill(os.getpid(), signal.SIGTERM)
        assert signals.received == signal.SIGTERM
        os.kill(os.getpid(), signal.SIGTERM)  # a scheduler's and torchrun's: still one request
        os.kill(os.getpid(), signal.SIGINT)
        assert signals.received == signal.SIGTERM
        with owned_signals(save_and_exit=True) as inner:  # a nested run reuses the owner
            assert inner is signals
        with pytest.raises(KeyboardInterrupt):  # Ctrl-C twice: a person wants out now
            os.kill(os.getpid(), signal.SIGINT)
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before


# What gloo raises on the survivor when its peer's process is gone.
PEER_GONE = RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer "
                         "[127.0.0.1]:2271")


@pytest.mark.parametrize("phase, failing_at, reported", [
    ("train_step", 2, 3),  # the step of iteration 3 runs while the counter still says 2
    ("evaluate_split", 2, 2),  # iteration 2's evaluation
    ("save", 2, 2),  # iteration 2's save
])
def test_a_lost_peer_is_reported_in_the_iteration_it_was_lost_in(tmp_path, monkeypatch, one_thread, phase,
                                                                 failing_at, reported):
    real = getattr(Trainer, phase)

    def losing_the_peer(self, *args):
        if self.state.iteration == failing_at:
            raise PEER_GONE
        return real(self, *args)
    monkeypatch.setattr(Trainer, phase, losing_the_peer)
    monkeypatch.setattr(PeerWatch, "peer_states", lambda self, wait: {1: "died"})
    flags = [*SMALL, "--train-iters", "4", "--eval-interval", "2", "--save-interval", "2", "--save", str(tmp_path)]
    with pytest.raises(UserError, match=f"^rank 0 stopped during iteration {reported}: rank 1 died"):
        pretrain(parse_args(flags), log=lambda line: None)


def stop_messages(last_checkpoint: str | None, monkeypatch) -> list[str]:
    """The sentences a divergence, unrecoverable skipped steps and a dead peer stop a run with."""
    skipped = SkippedSteps()
    with pytest.raises(UserError) as too_many_skipped:
        for iteration in range(1, 11):
            skipped.check(False, None, 1.0, iteration, last_checkpoint)
    monkeypatch.setattr(PeerWatch, "peer_states", lambda self, wait: {1: "died"})
    peers = PeerWatch(type("OneRank", (), {"rank": 0, "world_size": 1}))
    return [divergence_message("the lm loss is nan", 3, last_checkpoint), str(too_many_skipped.value),
            str(peers.failure(PEER_GONE, 3, last_checkpoint))]


def test_stop_messages_resume_from_a_checkpoint_only_when_one_was_saved(monkeypatch):
    for message in stop_messages(None, monkeypatch):
        assert "no checkpoint was saved" in message and "resume" not in message and "start" in message, message
    for message in stop_messages("ckpt/iter_0000002", monkeypatch):
        assert "checkpoint is ckpt/iter_0000002" in message and "resume from" in message, message


def failing(real, error: OSError, calls_before: int = 0):
    """`real`, except that call number `calls_before + 1` raises `error`."""
    calls = []

    def wrapper(*args, **kwargs):
        calls.append(args)
        if len(calls) == calls_before + 1:
            raise error
        return real(*args, **kwargs)
    return wrapper


@pytest.mark.parametrize("target, calls_per_save, error, step", [
    ("write_pieces", 2, OSError(errno.ENOSPC, "No space left on device"), "could not write its files"),
    ("create_staging", 1, PermissionError(errno.EACCES, "Permission denied"), "could not create its folder"),
    ("write_latest", 1, OSError(errno.ENOSPC, "No space left on device"), "could not publish it"),
])
def test_injected_write_failures_remove_the_partial_folder(tmp_path, monkeypatch, one_thread, target,
                                                          calls_per_save, error, step):
    """The failure hits the second save of the run (iteration 4); the first stays the latest."""
    flags = [*SMALL, "--train-iters", "4", "--save-interval", "2", "--save", str(tmp_path)]
    monkeypatch.setattr(saving, target, failing(getattr(saving, target), error, calls_per_save))
    with pytest.raises(CheckpointSaveError) as failure:
        pretrain(parse_args(flags), log=lambda line: None)
    message = str(failure.value)
    assert message.startswith(f"saving checkpoint {tmp_path / 'iter_0000004'} failed: {step} (")
    assert error.strerror in message and "still names iteration 2" in message
    assert sorted(os.listdir(tmp_path)) == ["iter_0000002", "latest_checkpointed_iteration.txt", "metrics.jsonl"]
    assert choose_checkpoint(str(tmp_path)) == (str(tmp_path / "iter_0000002"), None)


def test_load_picks_the_newest_complete_checkpoint_and_says_which(tmp_path, one_thread):
    flags = [*SMALL, "--train-iters", "6", "--save-interval", "2", "--save", str(tmp_path)]
    pretrain(parse_args([*flags, "--exit-interval", "4"]), log=lambda line: None)
    shutil.rmtree(tmp_path / "iter_0000004")  # the latest file now names a folder that is gone
    lines = []
    _, state = pretrain(parse_args(flags), log=lines.append)
    assert any("names iteration 4, which is incomplete" in line and "iteration 2" in line for line in lines)
    assert any(line.startswith(f"loaded checkpoint {tmp_path / 'iter_0000002'} at iteration 2") for line in lines)
    assert state.iteration == 6


def test_keep_last_n_checkpoints_never_deletes_the_one_resumed_from(tmp_path, one_thread):
    flags = [*SMALL, "--train-iters", "12", "--save-interval", "1", "--save", str(tmp_path)]
    pretrain(parse_args([*flags, "--exit-interval", "3"]), log=lambda line: None)
    pretrain(parse_args([*flags, "--keep-last-n-checkpoints", "2", "--save-retain-interval", "5"]),
             log=lambda line: None)
    kept = sorted(name for name in os.listdir(tmp_path) if name.startswith("iter_"))
    # the newest two, the multiples of 5, and iteration 3, which the second run resumed from
    assert kept == ["iter_0000003", "iter_0000005", "iter_0000010", "iter_0000011", "iter_0000012"]
