"""scripts/: every launch script parses and passes shellcheck; the CPU demo trains end to end;
each GPU script's exact flag set validates as a dry run of its layout (no GPU needed)."""

import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from megalite.data.prep.builtin_corpus import ensure_builtin_corpus

REPO_ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(str(path.relative_to(REPO_ROOT)) for path in (REPO_ROOT / "scripts").rglob("*")
                 if path.suffix in (".sh", ".sbatch"))
# What the scripts read must not leak in from the environment running the tests.
SCRIPT_VARIABLES = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "NNODES", "NODE_RANK",
                    "GPUS_PER_NODE", "NPROC", "TP", "PP", "DRY_RUN", "RDZV_ENDPOINT", "RDZV_ID", "MODEL_SCRIPT",
                    "DATA_PATH", "TOKENIZER_TYPE", "TOKENIZER_MODEL", "SAVE_DIR", "LOAD_DIR", "MICRO_BATCH_SIZE",
                    "GLOBAL_BATCH_SIZE", "TRAIN_ITERS", "SEQ_LENGTH", "RECOMPUTE", "EXIT_DURATION_MINS",
                    "CUDA_DEVICE_MAX_CONNECTIONS", "SLURM_JOB_NUM_NODES", "SLURM_GPUS_ON_NODE", "SLURM_SUBMIT_DIR")


def run_script(script: str, *args: str, timeout: float = 300, **env: str) -> subprocess.CompletedProcess:
    environment = {key: value for key, value in os.environ.items() if key not in SCRIPT_VARIABLES}
    environment.update(PYTHON=sys.executable, TORCHRUN=f"{sys.executable} -m torch.distributed.run")
    environment.update(env)
    return subprocess.run(["bash", script, *args], cwd=REPO_ROOT, env=environment, capture_output=True, text=True,
                          timeout=timeout)


def test_the_scripts_are_all_here():
    assert SCRIPTS == ["scripts/launch.sh", "scripts/pretrain_cpu_demo.sh", "scripts/pretrain_gpt2_124m.sh",
                       "scripts/pretrain_llama2_7b.sh", "scripts/pretrain_llama3_1b.sh",
                       "scripts/pretrain_multinode.sh", "scripts/slurm/pretrain.sbatch"]


@pytest.mark.parametrize("script", SCRIPTS)
def test_bash_parses_every_script(script):
    result = subprocess.run(["bash", "-n", script], cwd=REPO_ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck is not installed")
def test_shellcheck_finds_nothing():
    result = subprocess.run(["shellcheck", "--external-sources", *SCRIPTS], cwd=REPO_ROOT, capture_output=True,
                            text=True)
    assert result.returncode == 0, result.stdout + result.stderr


GPU_DRY_RUNS = {  # script: (environment, the layout line its dry run prints)
    "scripts/pretrain_gpt2_124m.sh": ({}, "gpt2-124m on 8 ranks = TP 1 x PP 1 x DP 8, distributed optimizer, bf16"),
    "scripts/pretrain_llama3_1b.sh": ({}, "llama3.2-1b on 8 ranks = TP 1 x PP 1 x DP 8, distributed optimizer"),
    "scripts/pretrain_llama2_7b.sh": ({}, "llama2-7b on 8 ranks = TP 2 x PP 1 x DP 4, sequence parallel"),
    "scripts/pretrain_multinode.sh": ({"NNODES": "8", "TP": "8", "PP": "2"},
                                      "llama2-7b on 64 ranks = TP 8 x PP 2 x DP 4, sequence parallel"),
    "scripts/slurm/pretrain.sbatch": ({}, "llama2-7b on 64 ranks = TP 2 x PP 1 x DP 32"),
}


@pytest.fixture(scope="module")
def gpu_dry_runs():
    """Every GPU script's dry run, started together (each is mostly Python and torch starting up)."""
    with ThreadPoolExecutor(len(GPU_DRY_RUNS)) as pool:
        futures = {script: pool.submit(run_script, script, "--log-interval", "7", DRY_RUN="1", **env)
                   for script, (env, _) in GPU_DRY_RUNS.items()}
        return {script: future.result() for script, future in futures.items()}


@pytest.mark.parametrize("script", sorted(GPU_DRY_RUNS))
def test_gpu_script_flags_validate_as_a_dry_run(script, gpu_dry_runs):
    result, layout = gpu_dry_runs[script], GPU_DRY_RUNS[script][1]
    assert result.returncode == 0, result.stdout + result.stderr
    command = next(line for line in result.stdout.splitlines() if line.startswith("command: "))
    assert "pretrain_gpt.py" in command and " --log-interval 7 " in command  # extra arguments pass through
    world = layout.split(" on ")[1].split()[0]
    assert command.endswith(f"--dry-run --world-size {world}")
    assert layout in result.stdout
    assert "largest total per rank" in result.stdout


def test_multinode_launch_commands():
    """What torchrun gets on one machine of several, and under the c10d rendezvous the SLURM job sets up."""
    result = run_script("scripts/pretrain_multinode.sh", NNODES="2", NODE_RANK="1", MASTER_ADDR="node0",
                        TORCHRUN="echo")
    assert result.returncode == 0, result.stderr
    command = next(line for line in result.stdout.splitlines() if line.startswith("command: "))
    assert command.startswith("command: echo --nnodes 2 --nproc_per_node 8 --node_rank 1 --master_addr node0 "
                              "--master_port 6000 ") and "--model llama2-7b" in command
    result = run_script("scripts/pretrain_llama3_1b.sh", NNODES="4", RDZV_ENDPOINT="head:29500", RDZV_ID="42",
                        GPUS_PER_NODE="4", TORCHRUN="echo", OMP_NUM_THREADS="3")
    assert "command: echo --nnodes 4 --nproc_per_node 4 --rdzv_backend c10d --rdzv_endpoint head:29500 " \
           "--rdzv_id 42 " in result.stdout
    assert "environment: OMP_NUM_THREADS=3 CUDA_DEVICE_MAX_CONNECTIONS=unset" in result.stdout  # TP 1


def test_multinode_script_names_what_is_missing():
    result = run_script("scripts/pretrain_multinode.sh", NNODES="2")
    assert result.returncode != 0 and "set NODE_RANK" in result.stderr


def test_cpu_demo_trains_end_to_end(tmp_path):
    """4 gloo processes, TP 2 x PP 2, on a small build of the built-in corpus (the full one takes 15 s), with
    the MoE model (the dense one is every other test's)."""
    data_prefix, tokenizer_model = ensure_builtin_corpus(str(tmp_path / "corpus"), max_files=20)
    save = tmp_path / "run"
    # 20 documents: the default split (969,30,1) would leave the test split empty.
    result = run_script("scripts/pretrain_cpu_demo.sh", "--seq-length", "32", "--split", "8,1,1", DATA_PATH=data_prefix,
                        TOKENIZER_MODEL=tokenizer_model, SAVE_DIR=str(save), TRAIN_ITERS="2", MICRO_BATCH_SIZE="1",
                        GLOBAL_BATCH_SIZE="2", LOG_INTERVAL="1", EVAL_ITERS="1", OMP_NUM_THREADS="1",
                        MODEL="tiny-moe")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout
    command = next(line for line in out.splitlines() if line.startswith("command: "))
    assert "--nproc_per_node 4 --standalone" in command and "--sequence-parallel" in command
    assert command.endswith("--seq-length 32 --split 8,1,1")
    assert "CUDA_DEVICE_MAX_CONNECTIONS=1" in out  # TP 2
    assert "trained iterations 1-2" in out and "test loss at iteration 2" in out
    assert "--model tiny-moe" in command and "tokens per expert" in out
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
