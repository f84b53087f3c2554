"""Training on a CUDA GPU, in process: what only a GPU shows (skipped on CPU-only machines).

Exact resume with the fused AdamW kernel (its step count must live on the GPU), checkpoints
moving between a CPU run and a GPU run, llama-1b-shaped iterations with the Triton kernels,
and bf16 tracking fp32.
"""

import numpy as np
import pytest
import torch

from megalite.arguments import parse_args
from megalite.run.training import Trainer, pretrain

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("deterministic")]

MOCK = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "999"]
SMALL = ["--num-layers", "2", "--hidden-size", "128", "--num-attention-heads", "4", "--group-query-attention",
         "--num-query-groups", "2", "--ffn-hidden-size", "256", "--seq-length", "64", "--micro-batch-size", "2",
         "--global-batch-size", "8", "--lr", "3e-3", "--lr-warmup-iters", "2", "--eval-interval", "4",
         "--eval-iters", "1", "--log-interval", "1", *MOCK]
ON_CPU = ["--distributed-backend", "gloo"]  # a one-process run on the CPU although a GPU is present


def train(*flags):
    lines = []
    trainer, state = pretrain(parse_args(list(flags)), log=lines.append)
    return trainer, state, lines


def test_save_on_cuda_and_resume_on_cuda_is_bitwise_exact(tmp_path):
    common = [*SMALL, "--bf16", "--train-iters", "8", "--hidden-dropout", "0.1"]
    trainer, straight, _ = train(*common, "--save", str(tmp_path / "a"))
    assert trainer.device.type == "cuda"
    _, first, _ = train(*common, "--save", str(tmp_path / "b"), "--exit-interval", "4")
    _, second, lines = train(*common, "--save", str(tmp_path / "b"), "--load", str(tmp_path / "b"))
    assert any("loaded" in line and "iteration 4" in line for line in lines)
    assert first.losses + second.losses == straight.losses  # bitwise
    assert len(set(straight.losses)) == 8


@pytest.mark.parametrize("optimizer", [[], ["--use-distributed-optimizer"]])
def test_a_cpu_checkpoint_resumes_on_the_gpu_and_back(tmp_path, optimizer):
    """4 iterations on the CPU, 2 on the GPU from that checkpoint, 2 more on the CPU: the losses
    follow an uninterrupted CPU run (to fp32 rounding across devices)."""
    common = [*SMALL, "--fp32", "--train-iters", "8", *optimizer]
    _, straight, _ = train(*common, *ON_CPU)
    save = ["--save", str(tmp_path), "--load", str(tmp_path)]
    _, first, _ = train(*common, *ON_CPU, *save, "--exit-interval", "4")
    trainer, second, _ = train(*common, *save, "--exit-interval", "6")
    assert trainer.device.type == "cuda" and second.iteration == 6
    assert all(state["step"].device == main.device for main, state in trainer.optimizer.adam.state.items())
    _, third, _ = train(*common, *ON_CPU, *save)
    assert third.iteration == 8
    np.testing.assert_allclose(first.losses + second.losses + third.losses, straight.losses, rtol=1e-4)


def test_llama_1b_shaped_iterations_with_the_triton_kernels():
    """Two layers of llama-1b (hidden 2048, 32 heads / 4 groups, FFN 5632, vocab 32000) at seq 2048:
    the compiled kernels on real shapes train, starting from ln(vocab)."""
    _, state, _ = train("--model", "llama-1b", "--num-layers", "2", "--seq-length", "2048", "--micro-batch-size", "2",
                        "--global-batch-size", "4", "--train-iters", "4", "--lr", "1e-3", "--lr-warmup-iters", "0",
                        "--eval-interval", "0", "--kernels", "triton", "--bf16", "--mock-data", "--tokenizer-type",
                        "NullTokenizer", "--vocab-size", "31999")
    assert abs(state.losses[0] - np.log(32000)) < 0.5, state.losses
    assert all(np.isfinite(state.losses)) and state.losses[-1] < state.losses[0]


def test_bf16_tracks_fp32_on_the_gpu():
    common = [*SMALL, "--train-iters", "20", "--eval-interval", "0"]
    _, fp32, _ = train(*common, "--fp32")
    trainer, bf16, _ = train(*common)  # bf16 is the default on a GPU with bf16 units
    assert next(trainer.model.parameters()).dtype == torch.bfloat16
    assert fp32.losses[-1] < fp32.losses[0] - 0.25  # it learns (20 iterations: 6.92 -> 6.56 on an H200)
    np.testing.assert_allclose(bf16.losses, fp32.losses, rtol=0.02)


@pytest.mark.parametrize("strategy", ["optim", "optim_grads", "optim_grads_params"])
def test_each_sharding_strategy_on_one_gpu_tracks_no_shard(strategy):
    """A world of one runs the same sharded code path (the reduce-scatter a copy, the gathers too):
    bf16 on the GPU, the losses of no_shard within bf16 rounding."""
    common = [*SMALL, "--bf16", "--train-iters", "6"]
    _, reference, _ = train(*common)
    trainer, state, _ = train(*common, "--data-parallel-sharding-strategy", strategy)
    assert trainer.device.type == "cuda" and trainer.parallel_model.sharding.value == strategy
    np.testing.assert_allclose(state.losses, reference.losses, rtol=1e-2)


@pytest.mark.parametrize("precision", [["--bf16"], ["--fp16"]])
def test_a_step_makes_no_host_sync(monkeypatch, precision):
    """CUDA's own detector raises on any call that waits for the device inside a training step after the first
    (whose kernels' first launches may), log steps included: the loop reads the results outside the step.
    The CPU test (tests/run/test_training.py) cannot tell a host batch from a device read."""
    real_step = Trainer.train_step

    def train_step(self):
        torch.cuda.set_sync_debug_mode("error" if self.state.iteration else 0)
        try:
            return real_step(self)
        finally:
            torch.cuda.set_sync_debug_mode(0)

    monkeypatch.setattr(Trainer, "train_step", train_step)
    _, state, _ = train(*SMALL, *precision, "--train-iters", "6", "--log-interval", "3", "--eval-interval", "0")
    assert state.iteration == 6
