"""End to end: pretrain_gpt.py trains, the loss falls, and bad input stops with one line."""

import os
import signal
import subprocess
import sys

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(*flags):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, os.path.join(REPO_ROOT, "pretrain_gpt.py"), *flags],
                          capture_output=True, text=True, env=env, timeout=300)


def test_mock_data_training_lowers_the_loss():
    result = run("--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "255",
                 "--seq-length", "32", "--micro-batch-size", "4", "--global-batch-size", "8",
                 "--train-iters", "30", "--lr", "3e-3", "--lr-warmup-iters", "5", "--eval-interval", "15",
                 "--eval-iters", "2", "--log-interval", "10")
    assert result.returncode == 0, result.stderr
    assert "validation loss at iteration 30" in result.stdout
    # Not the tiny preset: the start-up line says what changed.
    assert "\ncustom model (--model tiny with seq_length 32, vocabulary 256): 3,033,344 parameters, 4 layers" \
        in result.stdout
    line = next(l for l in result.stdout.splitlines() if l.startswith("trained iterations 1-30"))
    first, last = (float(x) for x in line.split("lm loss ")[1].split(" (")[0].split(" -> "))
    assert first == pytest.approx(5.55, abs=0.3)  # ln(256)
    assert last < first - 0.25  # 5.57 -> 5.18 at this seed: learning, not noise


def test_bad_batch_sizes_stop_with_one_line():
    result = run("--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "255",
                 "--micro-batch-size", "3", "--global-batch-size", "8")
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        "error: --global-batch-size 8 is not a multiple of --micro-batch-size 3 x data-parallel "
        "size 1 = 3; use a global batch size such as 6"]


def test_sigterm_with_exit_signal_handler_saves_and_exits_0(tmp_path):
    flags = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "255", "--seq-length", "32",
             "--micro-batch-size", "4", "--global-batch-size", "8", "--train-iters", "100000", "--log-interval", "1",
             "--eval-interval", "0", "--save", str(tmp_path), "--exit-signal-handler"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen([sys.executable, os.path.join(REPO_ROOT, "pretrain_gpt.py"), *flags],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    for line in process.stdout:
        if line.startswith(" iteration"):
            process.send_signal(signal.SIGTERM)
            break
    out, err = process.communicate(timeout=120)
    assert process.returncode == 0, err
    assert "exiting at iteration" in out and "SIGTERM" in out
    iteration = int(open(tmp_path / "latest_checkpointed_iteration.txt").read())
    assert 1 <= iteration < 100000 and (tmp_path / f"iter_{iteration:07d}").is_dir()


def test_list_models_and_help():
    result = run("--list-models")
    assert result.returncode == 0 and "llama3-8b" in result.stdout and "8.03B" in result.stdout
    result = run("--help")
    assert result.returncode == 0
    for flag in ["--tensor-model-parallel-size", "--lr-decay-style", "--exit-signal-handler", "--metrics-file"]:
        assert flag in result.stdout


def test_a_dry_run_plans():
    result = run("--dry-run", "--tensor-model-parallel-size", "2", "--lr-warmup-fraction", "0.05")
    assert result.returncode == 0, result.stderr
    assert "dry run: tiny on 2 ranks = TP 2 x PP 1 x DP 1" in result.stdout


def test_an_error_under_a_launcher_prints_once_and_every_rank_exits_non_zero():
    from tools.check_layouts import COMMON
    from tools.fork_ranks import cpu_world_environment

    command = [sys.executable, os.path.join(REPO_ROOT, "tools", "fork_ranks.py"), "--nproc-per-node", "2", "--",
               *COMMON, "--tensor-model-parallel-size", "3"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120,
                            env=cpu_world_environment(OMP_NUM_THREADS="1"))
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [  # rank 0's; rank 1 was stopped while it waited
        "error: --tensor-model-parallel-size 3 x --pipeline-model-parallel-size 1 = 3 does not divide the world "
        "size 2; launch a multiple of 3 processes"]


def test_an_error_of_one_rank_alone_is_printed_by_that_rank(monkeypatch, capsys):
    import megalite.errors
    from megalite.errors import UserError, run_main

    def fail(argv):
        raise UserError("only this rank saw it")

    monkeypatch.setenv("RANK", "3")
    monkeypatch.setattr(megalite.errors, "OTHER_RANKS_WAIT_S", 0.0)
    monkeypatch.setattr(megalite.errors.signal, "signal", lambda signum, handler: None)  # keep pytest's handlers
    with pytest.raises(SystemExit) as exit_info:
        run_main(fail, [])
    assert exit_info.value.code == 1
    assert capsys.readouterr().err == "rank 3: error: only this rank saw it\n"


@pytest.mark.parametrize("rank, lost, printed", [
    (1, {0}, "error: a peer died\n"),  # the lowest living rank speaks at once
    (2, {0}, None),  # rank 1 lives: it speaks; this one only if it outlives the wait
    (2, {0, 1}, "error: a peer died\n"),
    (0, {1}, "error: a peer died\n"),
])
def test_a_lost_peers_error_is_printed_at_once_by_the_lowest_living_rank(monkeypatch, capsys, rank, lost, printed):
    import megalite.errors
    from megalite.errors import PeerLostError, run_main

    def fail(argv):
        raise PeerLostError("a peer died", lost_ranks=lost)

    def waited(seconds):
        raise SystemExit("the launcher stopped it while it waited")

    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setattr(megalite.errors.time, "sleep", waited)
    monkeypatch.setattr(megalite.errors.signal, "signal", lambda signum, handler: None)  # keep pytest's handlers
    with pytest.raises(SystemExit) as exit_info:
        run_main(fail, [])
    assert capsys.readouterr().err == (printed or "")
    assert exit_info.value.code == (1 if printed else "the launcher stopped it while it waited")


def test_ctrl_c_without_save_is_one_line_and_the_start_up_says_nothing_is_kept():
    flags = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "255", "--seq-length", "32",
             "--micro-batch-size", "4", "--global-batch-size", "8", "--train-iters", "100000", "--log-interval", "1",
             "--eval-interval", "0"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen([sys.executable, os.path.join(REPO_ROOT, "pretrain_gpt.py"), *flags],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    head = []
    for line in process.stdout:
        head.append(line)
        if line.startswith(" iteration"):
            process.send_signal(signal.SIGINT)
            break
    out, err = process.communicate(timeout=120)
    assert process.returncode == 130
    assert "this run keeps no checkpoints (no --save DIR): its end or a Ctrl-C discards the model\n" in head
    assert err.strip().splitlines() == [
        "interrupted: this run keeps no checkpoints (no --save DIR); with --save DIR a Ctrl-C saves and exits"]


def test_the_closing_sample_is_tools_generate_with_its_defaults(tmp_path, capsys, monkeypatch):
    from megalite.arguments import parse_args
    from megalite.run.training import pretrain
    from tools.fork_ranks import _script
    from tools.generate import main as generate_main

    flags = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "50", "--num-layers", "2",
             "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16", "--micro-batch-size", "2",
             "--global-batch-size", "2", "--train-iters", "3", "--eval-interval", "0", "--save", str(tmp_path)]
    trainer, _ = pretrain(parse_args(flags), log=lambda line: None)
    entry = _script()
    monkeypatch.setattr(entry, "SAMPLE_PROMPT", "1 2 3")  # NullTokenizer text: ids
    entry.print_sample(trainer)
    closing = capsys.readouterr().out.splitlines()
    generate_main(["--load", str(tmp_path), "--prompt", "1 2 3"])
    assert closing[0] == "sample (temperature 0.8, top-k 40, top-p 0.95, seed 1234: tools/generate.py's defaults):"
    assert closing[1:] == capsys.readouterr().out.splitlines()
