"""The chunked output layer + cross-entropy against the unfused float64 computation, and in the model.

The kernel comparisons run on `device` (tests/kernels/conftest.py: the GPU when there is one, else
the CPU with Triton's interpreter); the model is a CPU matter."""

import pytest
import torch
import torch.nn.functional as F

from megalite.arguments import parse_args
from megalite.config import ModelConfig
from megalite.errors import UserError
from megalite.kernels import cross_entropy as ce_module
from megalite.kernels.cross_entropy import IGNORE_INDEX
from megalite.kernels.linear_cross_entropy import _LinearCrossEntropy, chunk_size, linear_cross_entropy
from megalite.model.gpt import build_model
from tests.helpers.model import token_losses

FLOOR = {torch.float32: 1e-6, torch.bfloat16: 4e-3}


@pytest.fixture
def small_blocks(monkeypatch):
    """32-column blocks, so that tiny vocabularies still take several loop steps."""
    monkeypatch.setattr(ce_module, "BLOCK", 32)


def unfused(hidden, weight, labels, z_loss_weight, real_vocab):
    logits = (hidden @ weight[:real_vocab].t()).double()
    losses = F.cross_entropy(logits, labels, reduction="none", ignore_index=IGNORE_INDEX)
    return losses + z_loss_weight * logits.logsumexp(-1).square() * (labels != IGNORE_INDEX)


def run(function, hidden, weight, labels, grad, dtype, **kwargs):
    leaves = [t.detach().clone().to(dtype).requires_grad_() for t in (hidden, weight)]
    losses = function(*leaves, labels, **kwargs)
    losses.backward(grad.to(losses.dtype))
    return [losses.detach().double()] + [leaf.grad.double() for leaf in leaves]


def relative_error(actual, expected):
    return float((actual - expected).norm() / expected.norm())


@pytest.mark.parametrize("kernel_mode", ["torch", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_output_cross_entropy_matches_unfused_float64(kernel_mode, dtype, small_blocks, one_thread, device):
    generator = torch.Generator().manual_seed(3)
    rows, hidden_size, vocab, real_vocab, z_loss_weight = 10, 24, 80, 75, 1e-3
    hidden = torch.randn(rows, hidden_size, generator=generator, dtype=torch.float64)
    weight = torch.randn(vocab, hidden_size, generator=generator, dtype=torch.float64) * 0.3
    labels = torch.randint(0, real_vocab, (rows,), generator=generator)
    labels[4] = IGNORE_INDEX
    grad = torch.rand(rows, generator=generator, dtype=torch.float64)
    hidden, weight, labels, grad = (t.to(device) for t in (hidden, weight, labels, grad))
    expected = run(unfused, hidden, weight, labels, grad, torch.float64, z_loss_weight=z_loss_weight,
                   real_vocab=real_vocab)
    eager = run(unfused, hidden, weight, labels, grad, dtype, z_loss_weight=z_loss_weight, real_vocab=real_vocab)
    # 3 rows per forward chunk (the last one short); 30 vocabulary columns per backward chunk.
    fused = run(linear_cross_entropy, hidden, weight, labels, grad, dtype, real_vocab_size=real_vocab,
                z_loss_weight=z_loss_weight, chunk_elements=300, kernels=kernel_mode)
    for name, reference, ours, theirs in zip(("losses", "dhidden", "dweight"), expected, fused, eager):
        assert relative_error(ours, reference) <= 2 * max(relative_error(theirs, reference), FLOOR[dtype]), name
    assert fused[0][4] == 0 and torch.all(fused[1][4] == 0)  # the ignored token
    assert torch.all(fused[2][real_vocab:] == 0)  # padding rows of the weight


def test_fused_path_keeps_no_logits(one_thread, device):
    """Saved for backward: hidden, weight (not copies), labels and one fp32 lse per token."""
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(12, 8, generator=generator).to(device).requires_grad_()
    weight = torch.randn(50, 8, generator=generator).to(device).requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        _LinearCrossEntropy.apply(hidden, weight, torch.arange(12, device=device), 50, 0.0, IGNORE_INDEX, 200,
                                  "auto", None)
    assert sorted(t.numel() for t in saved) == sorted([12, 12, weight.numel(), hidden.numel()])
    assert {t.data_ptr() for t in saved} >= {hidden.data_ptr(), weight.data_ptr()}


def test_chunk_size_bounds():
    assert chunk_size(10, 128_000, 2 ** 25) == 10
    assert chunk_size(100_000, 128_000, 2 ** 25) == 262
    assert chunk_size(5, 10 ** 9, 2 ** 25) == 1


@pytest.mark.parametrize("untie", [False, True])
def test_model_with_fused_output_cross_entropy_matches_unfused(untie, one_thread):
    """Same losses and grads for every parameter, padding rows of the output weight included."""
    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=128,
                tokenizer_vocab_size=100, swiglu=True, normalization="RMSNorm", position_embedding_type="rope",
                untie_embeddings_and_output_weights=untie, hidden_dropout=0.0, attention_dropout=0.0,
                z_loss_weight=1e-3)
    tokens = torch.randint(0, 100, (3, 16), generator=torch.Generator().manual_seed(0))
    labels = torch.roll(tokens, -1, dims=1)
    loss_mask = torch.ones(3, 16)
    loss_mask[0, :5] = 0
    results = []
    for fused in (False, True):
        model = build_model(ModelConfig.of(**base, fused_output_cross_entropy=fused), seed=7)
        losses = token_losses(model, tokens, labels, loss_mask)
        (losses.sum() / loss_mask.sum()).backward()
        results.append((losses.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (reference, reference_grads), (fused_losses, fused_grads) = results
    torch.testing.assert_close(fused_losses, reference, rtol=1e-6, atol=1e-6)
    assert reference_grads.keys() == fused_grads.keys()
    for name, grad in reference_grads.items():
        torch.testing.assert_close(fused_grads[name], grad, rtol=1e-5, atol=1e-6, msg=name)
    output = "output_layer.weight" if untie else "embedding.word_embeddings.weight"
    if untie:
        assert torch.all(fused_grads[output][100:] == 0)


def test_fused_output_cross_entropy_is_refused_under_tensor_parallelism():
    with pytest.raises(UserError, match="--fused-output-cross-entropy works at --tensor-model-parallel-size 1"):
        parse_args(["--fused-output-cross-entropy", "--tensor-model-parallel-size", "2", "--model", "tiny"], world_size=2)


def test_negative_z_loss_weight_is_refused():
    with pytest.raises(UserError, match="--z-loss-weight must be 0 or more"):
        parse_args(["--z-loss-weight", "-1"])
