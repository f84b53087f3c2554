"""Run N ranks of pretrain_gpt.py on this machine, forked from one process that imported torch once.

    python tools/fork_ranks.py --nproc-per-node 4 -- --mock-data --tokenizer-type NullTokenizer ...

torchrun starts a fresh interpreter per rank (and one for itself), and each pays for importing
torch and megalite: 2.5-3 s of CPU apiece on a 2-core machine, so an 8-rank run there spends
~12 s in imports before its first step. This launcher imports pretrain_gpt.py once, then forks
the ranks with the variables torchrun would set (RANK, LOCAL_RANK, WORLD_SIZE,
LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT on a free local port). When a rank fails, the
others are stopped, as torchrun does, and the launcher exits with that rank's code. A
SIGTERM or SIGINT to the launcher goes on to every rank, and the ranks get SIGTERM when
the launcher dies (Linux), so no rank outlives it.

It is a CPU launcher, for the CPU layout checks (tools/check_layouts.py) and the test suite:
one node, no restarts, no elastic membership. Its ranks see no GPU, whatever the machine has:
before torch is imported it sets CUDA_VISIBLE_DEVICES="" (so every rank takes gloo and the CPU,
as on a machine without one; forking a process that has used CUDA would be unsafe anyway) and,
unless already set, TRITON_INTERPRET=1 (the only way Triton kernels run on CPU tensors, for
`--kernels triton`). `cpu_world_environment()` gives the same variables to other launchers'
children. Launch real runs, and GPU runs, with torchrun (scripts/).
"""

import argparse
import ctypes
import importlib.util
import multiprocessing
import multiprocessing.connection
import os
import random
import signal
import socket
import sys

from megalite.errors import run_main

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

STOP_GRACE_S = 10.0  # a failed run's other ranks get this long to exit on SIGTERM before SIGKILL
PR_SET_PDEATHSIG = 1  # prctl option (linux/prctl.h): a signal for this process when its parent dies


def cpu_world_environment(base=None, **extra: str) -> dict[str, str]:
    """`base` (default: os.environ) as a CPU world's environment, plus `extra`: no GPU visible
    (CUDA_VISIBLE_DEVICES=""), so torch picks gloo and the CPU even on a GPU machine, and Triton in
    its CPU interpreter (TRITON_INTERPRET=1, unless `base` sets it). For the children of a launcher
    that must train on the CPU whatever the machine has."""
    environment = dict(os.environ if base is None else base)
    environment["CUDA_VISIBLE_DEVICES"] = ""
    environment.setdefault("TRITON_INTERPRET", "1")
    environment.update(extra)
    return environment


def free_port() -> int:
    """A TCP port on localhost that nothing listens on now (the rendezvous binds it moments later), drawn below
    the kernel's ephemeral range: a port from that range can be taken in the meantime by any outgoing connection,
    such as another world's gloo pairs (EADDRINUSE at the rendezvous)."""
    low = _ephemeral_low()
    candidates = random.Random().sample(range(max(1024, low - 12_000), low), 64) if low > 2048 else []
    for port in [*candidates, 0]:  # 0: the kernel's choice, when no range or no candidate is free
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            return probe.getsockname()[1]
    raise OSError("no free TCP port on localhost")


def _ephemeral_low() -> int:
    """The lowest port of the kernel's ephemeral range (Linux), else 0."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as file:
            return int(file.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def rank_environment(rank: int, world_size: int, port: int) -> dict[str, str]:
    """The variables torchrun sets for `rank` of a one-node world whose rendezvous is localhost:`port`."""
    return {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size), "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port)}


def _rank_main(main, launcher_pid: int, rank: int, world_size: int, port: int, argv: list[str]) -> None:
    """One forked rank: torchrun's environment, then `main` (pretrain_gpt.py's; its exit code is ours)."""
    _stop_with_launcher(launcher_pid)
    os.environ.update(rank_environment(rank, world_size, port))
    sys.exit(run_main(main, argv))


def _stop_with_launcher(launcher_pid: int) -> None:
    """Ask the kernel for a SIGTERM when the launcher dies, even by SIGKILL (Linux; elsewhere nothing)."""
    prctl = getattr(ctypes.CDLL(None), "prctl", None)
    if prctl is None:
        return
    prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != launcher_pid:  # it died before the request: nobody would send the signal
        os.kill(os.getpid(), signal.SIGTERM)


def _script(path: str = os.path.join(REPO_ROOT, "pretrain_gpt.py")):
    """The module of a script (imported once per process; pretrain_gpt.py by default): a file outside the
    installed packages, so it is loaded from its path."""
    name = os.path.splitext(os.path.basename(path))[0]
    module = sys.modules.get(name)
    if module is None:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        import torch._dynamo  # noqa: F401 - torch.optim's constructor imports it: seconds per rank otherwise
    return module


def launch(world_size: int, argv: list[str], main=None) -> int:
    """Fork `world_size` ranks of pretrain_gpt.py with `argv` on the CPU; 0, or the first failed rank's exit code.
    main: each rank's entry point instead of pretrain_gpt.py's, called with `argv` (a harness that trains
    in-process, as tools/check_compositions.py)."""
    os.environ.update(cpu_world_environment())  # before torch initialises CUDA: the ranks see no GPU
    entry = main or _script().main  # torch and megalite, imported once here, before the fork

    port = free_port()
    context = multiprocessing.get_context("fork")
    ranks = [context.Process(target=_rank_main, args=(entry, os.getpid(), rank, world_size, port, argv),
                             name=f"rank{rank}") for rank in range(world_size)]
    for process in ranks:
        process.start()
    _forward_signals(ranks)
    return _wait(ranks)


def _forward_signals(ranks: list) -> None:
    """SIGTERM and SIGINT to the launcher go on to every live rank; the launcher keeps waiting for them."""
    def forward(signum, frame):
        for process in ranks:
            if process.exitcode is None:
                os.kill(process.pid, signum)

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, forward)


def _wait(ranks: list) -> int:
    """Wait for every rank; at the first non-zero exit, stop the others and return its code."""
    running = list(ranks)
    while running:
        multiprocessing.connection.wait([process.sentinel for process in running])
        for process in [p for p in running if p.exitcode is not None]:
            running.remove(process)
            if process.exitcode != 0:
                _stop(running)
                # A rank killed by signal N reads -N; report it as a shell would (128 + N).
                return process.exitcode if process.exitcode > 0 else 128 - process.exitcode
    return 0


def _stop(processes: list) -> None:
    for process in processes:
        process.terminate()
    for process in processes:
        process.join(STOP_GRACE_S)
        if process.is_alive():
            process.kill()
            process.join()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc-per-node", "--nproc_per_node", type=int, required=True,
                        help="how many ranks to fork (the world size)")
    parser.add_argument("--script", help="fork this script's ranks (its main(argv)) instead of pretrain_gpt.py's: a "
                                             "bench's workers (tools/bench/memory.py's run_ranks)")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="pretrain_gpt.py's flags (or the script's), after --")
    args = parser.parse_args(argv)
    if args.nproc_per_node < 1:
        parser.error(f"--nproc-per-node must be at least 1, got {args.nproc_per_node}")
    flags = args.args[1:] if args.args[:1] == ["--"] else args.args
    return launch(args.nproc_per_node, flags, main=_script(os.path.abspath(args.script)).main if args.script else None)


if __name__ == "__main__":
    sys.exit(main())
