"""megalite.data.worker_signals: the worker processes megalite starts (tokenizing pools, data-loader workers)
leave SIGINT and SIGTERM to their main process, and end when it stops them or is gone, also when the main
process holds the run's signal handler (pretrain_gpt.py installs it before the built-in corpus is built)."""

import os
import signal
import subprocess
import sys
import textwrap
import time

from tools.fault_campaign import child_pids

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def start_script(script: str, **popen) -> subprocess.Popen:
    """`script` run by Python in a session of its own, its output (stdout and stderr) in a pipe."""
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(script)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, cwd=REPO_ROOT, start_new_session=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, **popen)


def finish(process: subprocess.Popen, timeout: float) -> tuple[int | None, str]:
    """(exit code, output) of a started script; None when it was still running after `timeout` s: then it
    and its workers are killed, so that a hang fails the test instead of stalling the suite."""
    try:
        output, _ = process.communicate(timeout=timeout)
        return process.returncode, output
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        return None, process.communicate()[0]


def test_a_pool_started_under_the_runs_signal_handler_has_workers_that_die_when_it_is_terminated():
    """The workers must not inherit the run's handler, which only records a signal. Closing the chunk
    stream early terminates the pool while both workers are busy: they end then, not when their task is
    done, nor never (one that got its SIGTERM while waiting for the task queue waits there for good)."""
    code, output = finish(start_script("""
        import signal, time
        from megalite.data.prep.preprocess import encoded_chunks
        from megalite.run.resilience import hold_signals_until_exit

        def stop_signal_dispositions(chunk):  # SIG_DFL, SIG_IGN or a handler's name
            return tuple(getattr(handler, "name", getattr(handler, "__qualname__", None))
                         for handler in map(signal.getsignal, (signal.SIGTERM, signal.SIGINT)))

        def sleep_unless_first(chunk):
            if chunk:
                time.sleep(30)
            return chunk

        hold_signals_until_exit(True)
        print(*set(encoded_chunks(range(2), stop_signal_dispositions, workers=2)))
        chunks = encoded_chunks(range(3), sleep_unless_first, workers=2)
        next(chunks)
        start = time.monotonic()
        chunks.close()  # the pool's terminate(): SIGTERM to each worker, then join
        print(time.monotonic() - start)
    """), timeout=60)
    assert code == 0, output[-3000:]
    dispositions, seconds = output.splitlines()[:2]
    assert dispositions == "('SIG_DFL', 'SIG_IGN')" and float(seconds) < 10


def test_a_corpus_build_repeated_under_the_runs_signal_handler_never_hangs(tmp_path, write_jsonl):
    """The race of a pool's terminate() with a worker waiting for the task queue, as pretrain_gpt.py's
    built-in corpus build met it: each call's terminate is one chance to hang."""
    corpus = write_jsonl(tmp_path / "c.jsonl", [{"text": " ".join(map(str, range(i % 50)))} for i in range(400)])
    code, output = finish(start_script(f"""
        from megalite.data.prep.preprocess import preprocess
        from megalite.run.resilience import hold_signals_until_exit
        hold_signals_until_exit(True)
        for call in range(10):
            preprocess({corpus!r}, {str(tmp_path / "out")!r}, "NullTokenizer", vocab_size=64, workers=2,
                       log_interval=0, chunk_bytes=4096)
        print("built 10 times")
    """), timeout=120)
    assert code == 0 and "built 10 times" in output, output[-3000:]


def test_loader_workers_survive_a_signal_to_every_process_and_end_with_the_main_process():
    """SIGTERM and SIGINT to the workers from outside (as SLURM's scancel sends them to every process):
    the loader goes on. Then the main process exits with its iterator still alive (a reference cycle):
    the interpreter's exit terminates the workers and joins them, which must not wait forever."""
    process = start_script("""
        import sys
        from megalite.data import build_data_loader, build_gpt_datasets
        from megalite.data.loader import iterate
        dataset = build_gpt_datasets(None, "1,0,0", 16, 3, (200, 0, 0), mock_vocab_size=64, eod=64)[0]
        batches = iterate(build_data_loader(dataset, 0, 4, 2, num_workers=2))
        next(batches)
        print("workers started", flush=True)
        sys.stdin.readline()  # the test signals the workers meanwhile
        for _ in range(20):
            next(batches)
        cycle = [batches]
        cycle.append(cycle)
        print("read 20 batches after the signals", flush=True)
    """, stdin=subprocess.PIPE)
    assert process.stdout.readline() == "workers started\n"
    workers = child_pids(process.pid)
    assert len(workers) == 2
    for pid in workers:
        os.kill(pid, signal.SIGTERM)
        os.kill(pid, signal.SIGINT)
    time.sleep(0.5)  # time to die, for a worker that would
    process.stdin.write("go on\n")
    process.stdin.flush()
    code, output = finish(process, timeout=60)
    assert code == 0 and "read 20 batches after the signals" in output, output[-3000:]
