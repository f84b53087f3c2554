"""--kernels: the one dispatch point, the model's own mode, and the errors."""

import collections

import pytest
import torch

from megalite import kernels
from megalite.config import ModelConfig, TrainConfig
from megalite.errors import UserError
from megalite.kernels import cross_entropy, layernorm, rotary, swiglu
from megalite.model.gpt import build_model
from tests.helpers.model import token_losses


def test_triton_on_a_cpu_without_the_interpreter_is_refused_with_the_fix(monkeypatch):
    if torch.cuda.is_available() or not kernels.triton_available():
        pytest.skip("needs a CPU-only machine with triton installed")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(UserError, match="TRITON_INTERPRET=1"):
        kernels.check_kernels("triton")
    kernels.check_kernels("torch")
    kernels.check_kernels("auto")


def test_modes_pick_the_path():
    x = torch.zeros(2)
    assert not kernels.use_triton(x, "torch") and kernels.use_triton(x, "triton")
    assert kernels.use_triton(x, "auto") == (x.is_cuda and kernels.triton_available())


def test_an_unknown_mode_is_the_configs_to_refuse():
    with pytest.raises(UserError, match="--kernels fast is not one of auto, triton, torch"):
        TrainConfig.from_flags(kernels="fast")


@pytest.mark.skipif(not kernels.triton_available(), reason="triton is not installed")
def test_two_models_in_one_process_each_use_their_own_kernels(monkeypatch, one_thread, device):
    """The mode is the model's, fixed when it is built (a process-wide mode could not do this): a torch
    and a triton model, run in turn, each take their own path for every fused op, with the same losses."""
    calls = collections.Counter()

    def counted(name, function):
        def call(*args):
            calls[name] += 1
            return function(*args)
        return call

    for module, op in ((layernorm, "TritonNorm"), (rotary, "_Rotary"), (swiglu, "_SwiGLU")):
        monkeypatch.setattr(getattr(module, op), "apply", counted("triton", getattr(module, op).apply))
    monkeypatch.setattr(cross_entropy, "local_targets", counted("torch loss", cross_entropy.local_targets))
    config = ModelConfig.of(num_layers=1, hidden_size=32, num_attention_heads=4, seq_length=8, vocab_size=64,
                            swiglu=True, normalization="RMSNorm", position_embedding_type="rope",
                            hidden_dropout=0.0, attention_dropout=0.0)
    models = {mode: build_model(config, seed=1, device=device, kernels=mode) for mode in ("torch", "triton")}
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0)).to(device)
    losses = {}
    for mode in ("torch", "triton", "torch"):
        calls.clear()
        losses[mode] = token_losses(models[mode], tokens, tokens)
        # triton: 2 norms, rotary and SwiGLU in the layer, the final norm; torch: the loss's PyTorch row stats
        # (the only caller of local_targets in a forward)
        assert calls == ({"triton": 5} if mode == "triton" else {"torch loss": 1}), mode
    torch.testing.assert_close(losses["triton"], losses["torch"], rtol=1e-5, atol=1e-5)
