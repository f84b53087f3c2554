"""Run a function in a gloo world of N CPU processes, one thread each, and collect the results.

    from tests.helpers.distributed import run_world

    def body(rank, world_size, scale):          # runs in every process, after init_process_group
        x = torch.full((2,), float(rank)) * scale
        torch.distributed.all_reduce(x)
        return x                                # must pickle; comes back in rank order

    results = run_world(4, body, 2.0)           # [tensor, tensor, tensor, tensor]

A failure on any rank fails the caller with that rank's traceback; a hang fails after
`timeout` seconds instead of stalling the suite. `body` must be a module-level function
(it is pickled into the rank's process).

The ranks are forked from multiprocessing's fork server, which imports torch and megalite
once for the whole session: a `spawn` process per rank paid ~3 s of imports apiece, 4-8
ranks sharing 2 cores. The server is a fresh interpreter, so no rank inherits the test
process's threads or state.

The world is a CPU world on any machine: the fork server starts with a CPU world's
environment (tools/fork_ranks.py's `cpu_world_environment`: no GPU visible, Triton in its
interpreter), so a body's default device is the CPU and `--kernels triton` runs there as on
a machine without a GPU, while the test process itself keeps the GPU.
"""

import io
import os
import tempfile
import time
import traceback
from multiprocessing import forkserver

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tools.fork_ranks import cpu_world_environment


def _worker(rank: int, world_size: int, init_file: str, body, args, results) -> None:
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size))
    try:
        if os.environ.get("CUDA_VISIBLE_DEVICES") != "":
            raise RuntimeError("this rank of a CPU world may see a GPU: the session's fork server was started "
                               "before run_world, without its CPU world's environment")
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
        try:
            # By value: a queued tensor otherwise shares its storage through a file descriptor this process
            # must still serve when the parent reads it, and a rank that has exited cannot.
            payload = io.BytesIO()
            torch.save(body(rank, world_size, *args), payload)
            results.put((rank, "ok", payload.getvalue()))
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        results.put((rank, "error", traceback.format_exc()))


# Imported by the fork server before its first fork; a rank then imports only its test module (torch._dynamo:
# torch.optim's constructor imports it, seconds per rank otherwise).
PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "megalite.run.training", "tests.helpers.distributed"]


def _start_fork_server() -> None:
    """Start the session's fork server (if not running) with a CPU world's environment.

    The server inherits this process's environment when it starts, and the ranks inherit the
    server's; the variables are set only while it starts, so the test process is unchanged.
    """
    overrides = {name: value for name, value in cpu_world_environment().items() if os.environ.get(name) != value}
    before = {name: os.environ.get(name) for name in overrides}
    os.environ.update(overrides)
    try:
        forkserver.ensure_running()
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def run_world(world_size: int, body, *args, timeout: float = 240.0) -> list:
    """`body(rank, world_size, *args)` on each of `world_size` gloo ranks on the CPU; its results by rank."""
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    _start_fork_server()
    results = context.SimpleQueue()
    with tempfile.TemporaryDirectory() as folder:
        init_file = os.path.join(folder, "init")
        processes = [context.Process(target=_worker, args=(rank, world_size, init_file, body, args, results),
                                     daemon=True) for rank in range(world_size)]
        for process in processes:
            process.start()
        try:
            outputs = _collect(results, processes, timeout)
        finally:
            for process in processes:
                process.join(timeout=5)
                if process.is_alive():
                    process.kill()
    return [outputs[rank] for rank in range(world_size)]


def _collect(results, processes, timeout: float) -> dict:
    """Results by rank; AssertionError on the first failure, a dead rank, or the timeout."""
    outputs = {}
    start = time.monotonic()
    while len(outputs) < len(processes):
        if not results.empty():
            rank, status, value = results.get()
            if status == "error":
                raise AssertionError(f"rank {rank} failed:\n{value}")
            outputs[rank] = torch.load(io.BytesIO(value), weights_only=False)
            continue
        dead = [rank for rank, p in enumerate(processes) if p.exitcode not in (None, 0) and rank not in outputs]
        if dead and results.empty():
            time.sleep(0.5)  # its error report may still be in flight
            if results.empty():
                raise AssertionError(f"ranks {dead} died with exit codes "
                                     f"{[processes[r].exitcode for r in dead]} and no report")
        if time.monotonic() - start > timeout:
            missing = sorted(set(range(len(processes))) - set(outputs))
            raise AssertionError(f"ranks {missing} gave no result within {timeout:.0f} s: a hang")
        time.sleep(0.01)
    return outputs
