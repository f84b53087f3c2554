"""megalite/cpu: the backend applied to a model from outside it, and the process setting."""

import os
import subprocess
import sys

import pytest
import torch

from megalite import cpu
from megalite.model.gpt import GPTModel
from megalite.model.options import apply_options
from tests.helpers.model import token_losses


def loss_and_grads(model, config, seed=3):
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, config.real_vocab_size, (2, config.seq_length), generator=generator)
    loss = token_losses(model, tokens, tokens.roll(-1, dims=1)).mean()
    loss.backward()
    return loss.detach(), {name: param.grad for name, param in model.named_parameters()}


@pytest.fixture
def blocked_calls(monkeypatch):
    """A list that gets one entry per call of the blocked attention."""
    calls, original = [], cpu.causal_attention
    monkeypatch.setattr(cpu, "causal_attention", lambda *args: calls.append(1) or original(*args))
    return calls


@pytest.mark.parametrize("recompute", [None, "selective", "full"])
def test_the_blocked_attention_trains_the_model_like_sdpa(llama_config, recompute, one_thread, blocked_calls):
    """cpu.apply (then the options, as the run applies them): the same loss and grads as the model's own
    SDPA, with each recomputation; the layers' core attention is the blocked one where it applies."""
    config = llama_config(seq_length=80)  # two query blocks, the last one short
    plain = apply_options(GPTModel(config, seed=4), recompute_granularity=recompute)
    blocked = apply_options(cpu.apply(GPTModel(config, seed=4)), recompute_granularity=recompute)
    assert list(blocked.state_dict()) == list(plain.state_dict())
    expected, expected_grads = loss_and_grads(plain, config)
    assert blocked_calls == []
    loss, grads = loss_and_grads(blocked, config)
    assert len(blocked_calls) >= config.num_layers
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected_grads[name], rtol=1e-4, atol=1e-6, msg=name)


def test_attention_dropout_keeps_the_layers_own_attention(llama_config, blocked_calls):
    config = llama_config(attention_dropout=0.1)
    model = cpu.apply(GPTModel(config, seed=4)).train()
    loss_and_grads(model, config)
    assert blocked_calls == []


KEPT_SCRIPT = """
import os
from megalite import cpu
took = cpu.set_up_process()
import torch
def resident_mb():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2 ** 20
block = torch.empty(16 << 20).fill_(1.0)  # 64 MB, every page touched
before = resident_mb()
del block
print(int(took), before - resident_mb())
"""


def _memory_returned_on_free(keep: str):
    """(whether set_up_process took, MB the process gave back when a touched 64 MB block was freed)."""
    env = dict(os.environ, MEGALITE_KEEP_FREED_MEMORY=keep, THP_MEM_ALLOC_ENABLE="0")
    out = subprocess.run([sys.executable, "-c", KEPT_SCRIPT], env=env, check=True, capture_output=True,
                         text=True).stdout.split()
    return bool(int(out[0])), float(out[1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt: Linux")
def test_freed_memory_stays_in_the_process_for_reuse():
    """Kept: a freed block stays resident (the next allocation reuses its pages, no faults).
    Opted out: glibc unmaps a block that large on free, and the next one is faulted in afresh."""
    took, kept_returned = _memory_returned_on_free("1")
    opted_out, default_returned = _memory_returned_on_free("0")
    assert took and not opted_out
    assert default_returned > 56
    assert kept_returned < 8
