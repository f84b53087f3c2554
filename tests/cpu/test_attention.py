"""megalite/cpu/attention.py: causal attention in query blocks on a CPU, against PyTorch's SDPA."""

import pytest
import torch
import torch.nn.functional as F

from megalite.cpu import attention
from megalite.cpu.attention import BLOCK, MAX_SEQ_LENGTH, causal_attention, use_blocked_attention


def sdpa(q, k, v):
    """PyTorch's SDPA on `[s, b, n, d]` tensors, as the model's own core attention calls it."""
    q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])
    return out.permute(2, 0, 1, 3)


def reference(q, k, v):
    """SDPA in float64 on `[s, b, n, d]` tensors."""
    q, k, v = (t.detach().double().permute(1, 2, 0, 3) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])
    return out.permute(2, 0, 1, 3)


def inputs(s, b, heads, groups, d, dtype=torch.float32, seed=0):
    """q `[s, b, heads, d]`, k, v `[s, b, groups, d]` as the model makes them: views of one fused projection."""
    generator = torch.Generator().manual_seed(seed)
    per_group = heads // groups
    qkv = torch.randn(s, b, groups, (per_group + 2) * d, generator=generator).to(dtype).requires_grad_()
    q, k, v = qkv.split([per_group * d, d, d], dim=-1)
    return qkv, q.reshape(s, b, heads, d), k, v


def grads_of(function, q, k, v, grad):
    """(output, dq, dk, dv) of function(q, k, v) on leaves copied from q, k, v."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    output = function(*leaves)
    output.backward(grad.to(output.dtype))
    return [output.detach()] + [leaf.grad for leaf in leaves]


def relative_error(actual, expected):
    return float((actual.double() - expected).norm() / expected.norm())


# Sequences of one block, of blocks with a short last one, and of several full blocks;
# multi-head, grouped-query and multi-query attention.
@pytest.mark.parametrize("s, b, heads, groups, d", [
    (BLOCK, 2, 4, 4, 16), (BLOCK + 9, 2, 6, 3, 16), (3 * BLOCK, 1, 4, 1, 8), (5, 3, 2, 2, 8)])
def test_values_and_grads_match_float64_sdpa(s, b, heads, groups, d, one_thread):
    _, q, k, v = inputs(s, b, heads, groups, d)
    grad = torch.randn(s, b, heads, d, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    expected = reference(*leaves).requires_grad_(False)
    out64 = F.scaled_dot_product_attention(*(t.permute(1, 2, 0, 3) for t in leaves), is_causal=True,
                                           enable_gqa=groups != heads).permute(2, 0, 1, 3)
    out64.backward(grad)
    actual = grads_of(causal_attention, q, k, v, grad)
    assert relative_error(actual[0], expected) < 1e-5
    for got, leaf in zip(actual[1:], leaves):
        assert got.shape == leaf.shape
        assert relative_error(got, leaf.grad) < 1e-5


def test_grads_reach_the_fused_projection_like_sdpa(one_thread):
    qkv, q, k, v = inputs(2 * BLOCK + 3, 2, 4, 2, 16)
    grad = torch.randn(q.shape, generator=torch.Generator().manual_seed(2))
    results = []
    for function in (causal_attention, sdpa):
        qkv.grad = None
        output = function(q, k, v)
        output.backward(grad)
        results.append((output.detach(), qkv.grad.clone()))
    (blocked_out, blocked_grad), (sdpa_out, sdpa_grad) = results
    torch.testing.assert_close(blocked_out, sdpa_out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(blocked_grad, sdpa_grad, rtol=1e-5, atol=1e-6)


def test_without_grad_it_keeps_no_probabilities_and_gives_the_same_output(one_thread):
    _, q, k, v = inputs(BLOCK + 1, 2, 4, 2, 8)
    with torch.no_grad():
        out, probs = torch.ops.megalite.causal_attention_forward(q, k, v, False)
        quiet = causal_attention(q, k, v)
    assert probs == []
    assert torch.equal(out, quiet)
    assert torch.equal(quiet, causal_attention(q, k, v).detach())


def test_the_custom_ops_pass_torch_library_checks(one_thread):
    _, q, k, v = inputs(BLOCK + 5, 2, 4, 2, 8)
    q, k, v = (t.detach() for t in (q, k, v))  # the ops have no autograd: _CausalAttention is theirs
    torch.library.opcheck(torch.ops.megalite.causal_attention_forward.default, (q, k, v, True))
    out, probs = torch.ops.megalite.causal_attention_forward(q, k, v, True)
    grad = torch.randn_like(out)
    torch.library.opcheck(torch.ops.megalite.causal_attention_backward.default, (grad, q, k, v, out, probs))


def test_compiled_in_one_graph_with_the_same_values_and_grads(one_thread):
    qkv, q, k, v = inputs(BLOCK + 7, 2, 4, 2, 8)
    grad = torch.randn(q.shape, generator=torch.Generator().manual_seed(3))

    def layer(qkv):
        q, k, v = qkv.split([2 * 8, 8, 8], dim=-1)
        return causal_attention(q.reshape(*q.shape[:2], 4, 8), k, v) * 2

    results = []
    for function in (layer, torch.compile(layer, fullgraph=True)):  # fullgraph: no break at the ops
        qkv.grad = None
        output = function(qkv)
        output.backward(grad)
        results.append((output.detach(), qkv.grad.clone()))
    torch.testing.assert_close(results[1], results[0], rtol=1e-5, atol=1e-6)


def test_which_path_runs():
    q = torch.zeros(MAX_SEQ_LENGTH, 1, 2, 8)
    assert use_blocked_attention(q, 0.0)
    assert not use_blocked_attention(q, 0.1)  # attention dropout: SDPA
    assert not use_blocked_attention(torch.zeros(MAX_SEQ_LENGTH + 1, 1, 2, 8), 0.0)  # long: flash is as fast
    assert not use_blocked_attention(q.bfloat16(), 0.0)  # only fp32
    assert not use_blocked_attention(q.to("meta"), 0.0)


def test_the_probabilities_sum_to_one_per_row_and_vanish_above_the_diagonal(one_thread):
    s, b, heads, groups = BLOCK + 2, 1, 2, 1
    _, q, k, v = inputs(s, b, heads, groups, 8)
    _, probs = torch.ops.megalite.causal_attention_forward(q.detach(), k.detach(), v.detach(), True)
    assert len(probs) == len(attention._blocks(s))
    for (first, end), p in zip(attention._blocks(s), probs):
        p = p.view(b * groups, heads // groups, end - first, end)
        torch.testing.assert_close(p.sum(-1), torch.ones(p.shape[:-1]))
        query_position = torch.arange(first, end)[:, None]
        assert torch.all(p[..., torch.arange(end)[None, :] > query_position] == 0)
