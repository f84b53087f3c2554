"""megalite/kernels/matmul.py: bf16/fp16 products in fp32 on CPUs without bf16/fp16 GEMM units."""

import pytest
import torch
import torch.nn.functional as F

from megalite.kernels import matmul
from megalite.kernels.matmul import fp32_products, linear, set_fp32_products

FLOOR = 4e-3  # bf16 rounding of the output alone is ~2e-3 relative


@pytest.fixture
def forced():
    """set_fp32_products for the test, detection restored after it."""
    yield set_fp32_products
    set_fp32_products(None)


def relative_error(actual, expected):
    return float((actual.detach().double() - expected).norm() / expected.norm())


def linear_grads(x, weight, bias, grad):
    """(y, dx, dW, db) of linear(x, W, b) for leaves copied from the float64 inputs, in x's dtype."""
    leaves = [t.detach().clone().requires_grad_() for t in (x, weight, bias)]
    if x.dtype == torch.float64:
        output = F.linear(*leaves)
    else:
        output = linear(*leaves)
    output.backward(grad.to(output.dtype))
    return [output.detach()] + [leaf.grad for leaf in leaves]


def test_detection_covers_only_reduced_precision_cpu_tensors(forced):
    assert not fp32_products(torch.ones(2))
    forced(None)
    expected = not matmul._CPU_HAS_GEMM[torch.bfloat16]
    assert fp32_products(torch.ones(2, dtype=torch.bfloat16)) == expected
    forced(True)
    assert fp32_products(torch.ones(2, dtype=torch.float16)) and not fp32_products(torch.ones(2))
    forced(False)
    assert not fp32_products(torch.ones(2, dtype=torch.bfloat16))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_linear_in_fp32_matches_float64_within_twice_native_error(dtype, forced, one_thread):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 48, generator=generator, dtype=torch.float64)
    weight = torch.randn(40, 48, generator=generator, dtype=torch.float64) / 7
    bias = torch.randn(40, generator=generator, dtype=torch.float64)
    grad = torch.randn(3, 5, 40, generator=generator, dtype=torch.float64)
    expected = linear_grads(x, weight, bias, grad)
    forced(False)
    native = linear_grads(x.to(dtype), weight.to(dtype), bias.to(dtype), grad)
    forced(True)
    ours = linear_grads(x.to(dtype), weight.to(dtype), bias.to(dtype), grad)
    for name, reference, theirs, mine in zip(("y", "dx", "dW", "db"), expected, native, ours):
        assert mine.dtype == dtype and mine.shape == reference.shape, name
        assert relative_error(mine, reference) <= 2 * max(relative_error(theirs, reference), FLOOR), name


def test_linear_in_fp32_saves_its_reduced_precision_inputs(forced, one_thread):
    """Activation memory of a bf16 model: the fp32 copies are made again in the backward, not kept."""
    forced(True)
    x = torch.randn(4, 16, dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(8, 16, dtype=torch.bfloat16, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        output = linear(x, weight)
    assert [t.dtype for t in saved] == [torch.bfloat16, torch.bfloat16]
    assert {t.data_ptr() for t in saved} == {x.data_ptr(), weight.data_ptr()}
    output.sum().backward()
    assert x.grad.dtype == weight.grad.dtype == torch.bfloat16


def test_linear_in_fp32_takes_non_contiguous_input_and_no_bias(forced, one_thread):
    forced(True)
    x = torch.randn(6, 4, 16, dtype=torch.bfloat16).transpose(0, 1).requires_grad_()
    weight = torch.randn(8, 16, dtype=torch.bfloat16, requires_grad=True)
    output = linear(x, weight)
    reference = F.linear(x.detach().float(), weight.detach().float()).to(torch.bfloat16)
    assert torch.equal(output, reference)
    output.float().square().sum().backward()
    assert x.grad.shape == x.shape and weight.grad.shape == weight.shape


def test_bf16_model_trains_alike_with_and_without_fp32_products(forced, one_thread):
    """The model's layers, attention and loss all take the path: same loss and grads as native bf16."""
    from megalite.config import model_config_from_preset
    from megalite.model.gpt import build_model

    config = model_config_from_preset("tiny", num_layers=2, hidden_size=64, ffn_hidden_size=96,
                                      num_attention_heads=4, num_query_groups=2, vocab_size=96, seq_length=12,
                                      make_vocab_size_divisible_by=1)
    tokens = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(2))
    results = []
    for value in (False, True):
        forced(value)
        model = build_model(config, seed=3, dtype=torch.bfloat16)
        loss = model(tokens, None, tokens.roll(-1, 1)).mean()
        loss.backward()
        results.append((float(loss), {n: p.grad.float() for n, p in model.named_parameters()}))
    assert results[0][0] == pytest.approx(results[1][0], rel=1e-2)
    for name, grad in results[0][1].items():
        assert relative_error(results[1][1][name], grad.double()) < 0.05, name


@pytest.mark.parametrize("dtype, products_in_fp32", [(torch.float32, False), (torch.bfloat16, True)])
def test_linear_into_out_is_tracked_like_the_plain_linear(dtype, products_in_fp32, forced, one_thread):
    """`out=`: the result lands in the given memory, is returned, and has the same values and grads."""
    forced(products_in_fp32)
    generator = torch.Generator().manual_seed(3)
    x, weight, bias, grad = (torch.randn(*shape, generator=generator).to(dtype)
                             for shape in ((3, 5, 16), (8, 16), (8,), (3, 5, 8)))
    results = []
    for out in (None, torch.empty(3, 5, 8, dtype=dtype)):
        leaves = [t.clone().requires_grad_() for t in (x, weight, bias)]
        output = linear(*leaves, out=out)
        assert out is None or output.data_ptr() == out.data_ptr()
        output.backward(grad)
        results.append([output.detach()] + [leaf.grad for leaf in leaves])
    # fp32: addmm against F.linear's own kernel choice; bf16: the same fp32 product, the same rounding.
    tolerance = 1e-6 if dtype == torch.float32 else 0.0
    for name, plain, into_out in zip(("y", "dx", "dW", "db"), *results):
        assert into_out.dtype == dtype, name
        torch.testing.assert_close(into_out, plain, rtol=tolerance, atol=tolerance, msg=name)
