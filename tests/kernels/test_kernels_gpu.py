"""Every Triton kernel compiled on a CUDA GPU at real model shapes, forward and backward, against float64.

The other kernel tests check the same kernels at tiny shapes (through Triton's interpreter where
there is no GPU); these check the compiled code at the shapes training gives it: hidden 2048 and
4096, 8192 tokens, rotary with 32 query heads in 8 groups of head dim 128, vocabularies of 32000,
50257 (padded to 50304) and 128256 for the losses, in fp32 and bf16. Each output and each grad of
the Triton path must be within twice the PyTorch path's own error in the same dtype (relative L2
error against the float64 computation on the same inputs), or within twice a small floor where
both are at rounding level.

Marked gpu: skipped without CUDA. Peak GPU memory stays near 25 GB (the 128k-vocabulary fused
output layer's float64 reference).
"""

import pytest
import torch

from megalite import kernels
from megalite.kernels.cross_entropy import IGNORE_INDEX
from megalite.kernels.layernorm import TritonNorm, layer_norm_reference
from megalite.kernels.linear_cross_entropy import linear_cross_entropy
from megalite.kernels.rmsnorm import rms_norm_reference
from megalite.kernels.rotary import _Rotary, apply_rotary_reference
from megalite.kernels.swiglu import _SwiGLU, swiglu_reference
from megalite.model.rotary import RotaryEmbedding
from tests.helpers.cross_entropy import losses_and_grad as run_cross_entropy, reference_losses

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not kernels.triton_available(), reason="triton is not installed")]

DTYPES = [torch.float32, torch.bfloat16]
# Below these relative errors both paths are at rounding level (fp32: ~1e-7 per element; bf16: ~2e-3).
FLOOR = {torch.float32: 1e-6, torch.bfloat16: 4e-3}
TOKENS = 8192


@pytest.fixture
def cuda():
    """The GPU, its caching allocator emptied after the test (these tensors are gigabytes)."""
    yield torch.device("cuda")
    torch.cuda.empty_cache()


def generator(seed: int) -> torch.Generator:
    return torch.Generator(device="cuda").manual_seed(seed)


def randn(*shape, seed: int, scale: float = 1.0, shift: float = 0.0) -> torch.Tensor:
    """float64 normal values drawn on the GPU."""
    return torch.randn(*shape, generator=generator(seed), dtype=torch.float64, device="cuda") * scale + shift


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.double() - expected).norm() / expected.norm())


def check(names, expected, triton_path, torch_path, dtype) -> None:
    """Each Triton result within twice PyTorch's own error against float64 (or twice the floor)."""
    assert len(names) == len(expected) == len(triton_path) == len(torch_path)
    for name, reference, ours, theirs in zip(names, expected, triton_path, torch_path):
        assert ours.shape == reference.shape, name
        assert torch.isfinite(ours).all(), f"{name}: non-finite values"
        ours_error, torch_error = relative_error(ours, reference), relative_error(theirs, reference)
        assert ours_error <= 2 * max(torch_error, FLOOR[dtype]), \
            f"{name}: Triton's relative error {ours_error:.3e}, PyTorch's {torch_error:.3e} ({dtype})"


def leaves(tensors, dtype):
    return [t.detach().clone().to(dtype).requires_grad_() for t in tensors]


# -- RMSNorm and LayerNorm ------------------------------------------------------------------------------------


NORMS = {  # name -> (PyTorch reference, Triton Function, has bias)
    "rmsnorm": (rms_norm_reference, lambda x, weight, eps: TritonNorm.apply(x, weight, None, eps), False),
    "layernorm": (layer_norm_reference, TritonNorm.apply, True),
}


def run_norm(function, with_bias, x, weight, bias, grad, dtype):
    """(y, dx, dweight[, dbias]) of `function` on copies of the inputs in `dtype`."""
    inputs = leaves((x, weight, bias) if with_bias else (x, weight), dtype)
    y = function(*inputs, 1e-5)
    y.backward(grad.to(y.dtype))
    return [y.detach(), *(leaf.grad for leaf in inputs)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [2048, 4096])
@pytest.mark.parametrize("norm", list(NORMS))
def test_norms_at_model_shapes(norm, hidden, dtype, cuda):
    reference_function, triton_function, with_bias = NORMS[norm]
    x = randn(TOKENS, hidden, seed=hidden, scale=3.0, shift=1.0)
    weight = randn(hidden, seed=hidden + 1, scale=0.2, shift=1.0)  # near 1, as trained norm weights are
    bias = randn(hidden, seed=hidden + 2, scale=0.1)
    grad = randn(TOKENS, hidden, seed=hidden + 3)
    inputs = (x, weight, bias, grad)
    expected = run_norm(reference_function, with_bias, *inputs, torch.float64)
    torch_path = run_norm(reference_function, with_bias, *inputs, dtype)
    triton_path = run_norm(triton_function, with_bias, *inputs, dtype)
    assert triton_path[0].dtype == dtype and all(g.dtype == dtype for g in triton_path[1:])
    names = ("y", "dx", "dweight", "dbias")[:len(expected)]
    check(names, expected, triton_path, torch_path, dtype)


# -- rotary ---------------------------------------------------------------------------------------------------


def run_rotary(function, q, k, cos, sin, grads, dtype):
    """(q out, k out, dq, dk) of `function` on strided views of copies of q and k in `dtype`, as attention
    hands them over (split from the fused QKV projection's output)."""
    inputs = leaves((q, k), dtype)
    views = [torch.cat([leaf, leaf], dim=-1)[..., :leaf.shape[-1]] for leaf in inputs]
    outputs = function(*views, cos, sin)
    torch.autograd.backward(outputs, [g.to(o.dtype) for g, o in zip(grads, outputs)])
    return [*(o.detach() for o in outputs), *(leaf.grad for leaf in inputs)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("positions", ["offset", "per-sample"])
def test_rotary_at_model_shapes(positions, dtype, cuda):
    s, b, heads, groups, d = 4096, 2, 32, 8, 128  # 8192 tokens; LLaMA-3-8B's attention
    q = randn(s, b, heads, d, seed=1)
    k = randn(s, b, groups, d, seed=2)
    grads = (randn(s, b, heads, d, seed=3), randn(s, b, groups, d, seed=4))
    rotary = RotaryEmbedding(d, base=500000.0)
    if positions == "offset":
        cos, sin = (table[100:] for table in rotary(100 + s, device=cuda))  # [s, 1, 1, d]
    else:  # documents restarting at 0 (--reset-position-ids): [s, b, 1, d]
        position_ids = torch.stack([torch.arange(s, device=cuda) % 1000, torch.arange(s, device=cuda).flip(0)])
        cos, sin = rotary(s, position_ids)
    expected = run_rotary(apply_rotary_reference, q, k, cos.double(), sin.double(), grads, torch.float64)
    torch_path = run_rotary(apply_rotary_reference, q, k, cos, sin, grads, dtype)
    triton_path = run_rotary(_Rotary.apply, q, k, cos, sin, grads, dtype)
    check(("q", "k", "dq", "dk"), expected, triton_path, torch_path, dtype)


# -- SwiGLU ---------------------------------------------------------------------------------------------------


def run_swiglu(function, x, grad, dtype):
    (leaf,) = leaves((x,), dtype)
    y = function(leaf)
    y.backward(grad.to(y.dtype))
    return [y.detach(), leaf.grad]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ffn", [5632, 14336])  # the FFN widths of hidden 2048 and 4096 LLaMA-style models
def test_swiglu_at_model_shapes(ffn, dtype, cuda):
    x = randn(TOKENS, 2 * ffn, seed=ffn, scale=2.0)
    grad = randn(TOKENS, ffn, seed=ffn + 1)
    expected = run_swiglu(swiglu_reference, x, grad, torch.float64)
    torch_path = run_swiglu(swiglu_reference, x, grad, dtype)
    triton_path = run_swiglu(_SwiGLU.apply, x, grad, dtype)
    check(("y", "dx"), expected, triton_path, torch_path, dtype)


# -- vocab-parallel cross-entropy, one process ------------------------------------------------------------------


def labels_for(tokens: int, real_vocab: int, seed: int) -> torch.Tensor:
    labels = torch.randint(0, real_vocab, (tokens,), generator=generator(seed), device="cuda")
    labels[::97] = IGNORE_INDEX  # some ignored tokens
    return labels


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens, vocab, real_vocab, z_loss_weight", [
    (4096, 32000, 32000, 0.0),
    (4096, 50304, 50257, 1e-4),  # GPT-2's vocabulary and its padding
    (1024, 128256, 128256, 1e-4),  # LLaMA 3's: 0.5 GB of fp32 logits at 1024 tokens
])
def test_cross_entropy_at_model_shapes(tokens, vocab, real_vocab, z_loss_weight, dtype, cuda):
    logits = randn(tokens, vocab, seed=vocab, scale=3.0)
    logits[:, real_vocab:] = 40.0  # padding would dominate if it were not excluded
    labels = labels_for(tokens, real_vocab, seed=vocab + 1)
    grad = torch.rand(tokens, generator=generator(vocab + 2), dtype=torch.float64, device="cuda")
    expected = run_cross_entropy(logits, labels, grad, torch.float64, real_vocab, z_loss_weight, use_reference=True)
    torch_path = run_cross_entropy(logits, labels, grad, dtype, real_vocab, z_loss_weight, kernels="torch")
    triton_path = run_cross_entropy(logits, labels, grad, dtype, real_vocab, z_loss_weight, kernels="triton")
    check(("losses", "dlogits"), expected, triton_path, torch_path, dtype)
    ignored = labels == IGNORE_INDEX
    assert torch.all(triton_path[0][ignored] == 0) and torch.all(triton_path[1][ignored] == 0)
    assert torch.all(triton_path[1][:, real_vocab:] == 0)  # padding columns get no grad


# -- the fused output layer + cross-entropy ---------------------------------------------------------------------


def unfused(hidden, weight, labels, real_vocab, z_loss_weight):
    """The output layer in the leaves' dtype, the loss in float64 (PyTorch's own path)."""
    return reference_losses(hidden @ weight.t(), labels, real_vocab, z_loss_weight)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens, hidden_size, vocab, real_vocab, z_loss_weight", [
    (4096, 2048, 32000, 32000, 0.0),
    (2048, 4096, 128256, 128256, 1e-4),  # chunks of 261 tokens forward, 16384 vocabulary columns backward
])
def test_linear_cross_entropy_at_model_shapes(tokens, hidden_size, vocab, real_vocab, z_loss_weight, dtype, cuda):
    hidden = randn(tokens, hidden_size, seed=hidden_size)
    weight = randn(vocab, hidden_size, seed=vocab, scale=0.02)  # the init std: logits of std ~1
    labels = labels_for(tokens, real_vocab, seed=vocab + 1)
    grad = torch.rand(tokens, generator=generator(vocab + 2), dtype=torch.float64, device="cuda")

    def run(function, dtype, **kwargs):
        inputs = leaves((hidden, weight), dtype)
        losses = function(*inputs, labels, **kwargs)
        losses.backward(grad.to(losses.dtype))
        return [losses.detach(), *(leaf.grad for leaf in inputs)]

    expected = run(unfused, torch.float64, real_vocab=real_vocab, z_loss_weight=z_loss_weight)
    torch_path = run(unfused, dtype, real_vocab=real_vocab, z_loss_weight=z_loss_weight)
    fused = run(linear_cross_entropy, dtype, real_vocab_size=real_vocab, z_loss_weight=z_loss_weight, kernels="triton")
    assert fused[0].dtype == torch.float32 and fused[1].dtype == fused[2].dtype == dtype
    check(("losses", "dhidden", "dweight"), expected, fused, torch_path, dtype)
    ignored = labels == IGNORE_INDEX
    assert torch.all(fused[0][ignored] == 0) and torch.all(fused[1][ignored] == 0)
