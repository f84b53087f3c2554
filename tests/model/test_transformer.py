"""Attention, MLP and layer: shapes, causality, grouped-query attention, recomputation."""

import math

import pytest
import torch

from megalite.model.gpt import GPTModel
from megalite.model.options import apply_options
from megalite.model.rotary import RotaryEmbedding
from megalite.model.transformer import MLP, Attention, TransformerLayer
from megalite.pipeline_parallel.stages import chunk_layers
from megalite.tensor_parallel.layers import initialize
from tests.helpers.model import logits as logits_of, token_losses


def test_layer_shapes(llama_config):
    config = llama_config()
    s, b, h = 16, 3, config.hidden_size
    layer = TransformerLayer(config)
    initialize(layer, seed=0, prefix="layers.0")
    x = torch.randn(s, b, h)
    assert layer.self_attention.linear_qkv.weight.shape == ((4 + 2 * 2) * 16, h)
    assert layer.mlp.linear_fc1.weight.shape == (2 * 96, h)
    assert layer(x, RotaryEmbedding(16)(s)).shape == (s, b, h)
    # Built alone, the layer starts exactly as layer 0 of the whole model.
    whole = GPTModel(config, seed=0).layers["0"].state_dict()
    assert all(torch.equal(value, whole[name]) for name, value in layer.state_dict().items())


@pytest.mark.parametrize("which", ["llama", "gpt2"])
def test_model_output_shapes(llama_config, gpt2_config, which):
    config = llama_config() if which == "llama" else gpt2_config()
    model = GPTModel(config, seed=0)
    tokens = torch.randint(0, config.vocab_size, (3, config.seq_length))
    assert model(tokens).shape == (config.seq_length, 3, config.hidden_size)
    assert logits_of(model, tokens).shape == (3, config.seq_length, config.vocab_size)
    losses = token_losses(model, tokens, tokens)
    assert losses.shape == tokens.shape and losses.dtype == torch.float32


@pytest.mark.parametrize("which", ["llama", "gpt2"])
def test_causality(llama_config, gpt2_config, which):
    config = llama_config() if which == "llama" else gpt2_config()
    model = GPTModel(config, seed=1).eval()
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, config.vocab_size, (2, config.seq_length), generator=generator)
    changed = tokens.clone()
    changed[:, 9] = (changed[:, 9] + 1) % config.vocab_size
    with torch.no_grad():
        before, after = logits_of(model, tokens), logits_of(model, changed)
    torch.testing.assert_close(before[:, :9], after[:, :9], atol=0, rtol=0)
    assert (before[:, 9:] - after[:, 9:]).abs().amax(dim=-1).min() > 0  # every later position sees it


def gqa_to_mha_qkv(weight: torch.Tensor, heads: int, groups: int, head_dim: int) -> torch.Tensor:
    """Grouped QKV rows -> the MHA rows where each query head gets its group's key and value."""
    per_group = heads // groups
    grouped = weight.view(groups, per_group + 2, head_dim, -1)
    rows = []
    for head in range(heads):
        group, index = divmod(head, per_group)
        rows += [grouped[group, index], grouped[group, per_group], grouped[group, per_group + 1]]
    return torch.cat(rows)


def attention_by_hand(x, qkv_weight, proj_weight, heads, groups, head_dim, rope):
    """Plain loops over heads: scores, causal mask, softmax, weighted values (float64)."""
    s, b, _ = x.shape
    per_group = heads // groups
    grouped = qkv_weight.double().view(groups, per_group + 2, head_dim, -1)
    cos, sin = (t.double() for t in rope(s))
    half = head_dim // 2

    def rotate(t):  # t [s, b, d]
        return t * cos[:, :, 0] + torch.cat([-t[..., half:], t[..., :half]], dim=-1) * sin[:, :, 0]

    mask = torch.ones(s, s, dtype=torch.bool).tril()
    outputs = []
    for head in range(heads):
        group, index = divmod(head, per_group)
        q = rotate(x.double() @ grouped[group, index].t())
        k = rotate(x.double() @ grouped[group, per_group].t())
        v = x.double() @ grouped[group, per_group + 1].t()
        scores = torch.einsum("sbd,tbd->bst", q, k) / math.sqrt(head_dim)
        probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
        outputs.append(torch.einsum("bst,tbd->sbd", probs, v))
    return torch.cat(outputs, dim=-1) @ proj_weight.double().t()


def test_grouped_query_attention_equals_mha_with_shared_heads_and_hand_computation(llama_config):
    gqa_config = llama_config(num_query_groups=2)
    mha_config = llama_config(num_query_groups=None)
    heads, groups, head_dim = 4, 2, 16
    gqa = Attention(gqa_config)
    mha = Attention(mha_config)  # weights copied from gqa below
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        gqa.linear_qkv.weight.copy_(torch.randn(gqa.linear_qkv.weight.shape, generator=generator) * 0.2)
        gqa.linear_proj.weight.copy_(torch.randn(gqa.linear_proj.weight.shape, generator=generator) * 0.2)
        mha.linear_qkv.weight.copy_(gqa_to_mha_qkv(gqa.linear_qkv.weight, heads, groups, head_dim))
        mha.linear_proj.weight.copy_(gqa.linear_proj.weight)
    rope = RotaryEmbedding(head_dim)
    x = torch.randn(10, 2, 64, generator=generator)
    with torch.no_grad():
        out = gqa(x, rope(10))
        torch.testing.assert_close(out, mha(x, rope(10)), atol=1e-6, rtol=1e-6)
        reference = attention_by_hand(x, gqa.linear_qkv.weight, gqa.linear_proj.weight,
                                      heads, groups, head_dim, rope)
    torch.testing.assert_close(out.double(), reference, atol=1e-5, rtol=1e-5)


def test_mlp_swiglu_is_silu_gate_times_up(llama_config):
    config = llama_config()
    mlp = MLP(config)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in mlp.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
    x = torch.randn(5, 2, 64, generator=generator)
    gate, up = mlp.linear_fc1.weight.split([96, 96])
    expected = (torch.nn.functional.silu(x @ gate.t()) * (x @ up.t())) @ mlp.linear_fc2.weight.t()
    torch.testing.assert_close(mlp(x), expected)


def recompute_options(config) -> dict:
    return dict(recompute_granularity=config.recompute_granularity, recompute_method=config.recompute_method,
                recompute_num_layers=config.recompute_num_layers)


def loss_and_grads(config, tokens):
    model = apply_options(GPTModel(config, seed=5), **recompute_options(config)).train()
    torch.manual_seed(123)  # the dropout masks
    losses = token_losses(model, tokens, tokens.roll(-1, dims=1))
    losses.mean().backward()
    return losses.detach(), {name: p.grad for name, p in model.named_parameters()}


RECOMPUTE_SETTINGS = [dict(recompute_granularity="selective"), dict(recompute_granularity="full")] + [
    dict(recompute_granularity="full", recompute_method=method, recompute_num_layers=count)
    for method, count in (("uniform", 1), ("uniform", 3), ("block", 1), ("block", 5))]


@pytest.mark.parametrize("which", ["llama", "gpt2"])
def test_recomputation_gives_identical_loss_and_grads(llama_config, gpt2_config, which):
    make = llama_config if which == "llama" else gpt2_config
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(4))
    # Dropout on, so the recomputed forward must replay the same random masks.
    reference = loss_and_grads(make(hidden_dropout=0.1, attention_dropout=0.1), tokens)
    for recompute in RECOMPUTE_SETTINGS:
        losses, grads = loss_and_grads(make(hidden_dropout=0.1, attention_dropout=0.1, **recompute), tokens)
        torch.testing.assert_close(losses, reference[0], atol=0, rtol=0)
        assert grads.keys() == reference[1].keys()
        for name, grad in grads.items():
            torch.testing.assert_close(grad, reference[1][name], atol=0, rtol=0, msg=name)


def test_dropout_is_active_in_training_and_off_in_eval(llama_config):
    config = llama_config(hidden_dropout=0.5, attention_dropout=0.5)
    model = GPTModel(config, seed=0)
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    model.train()
    assert not torch.equal(model(tokens), model(tokens))
    model.eval()
    assert torch.equal(model(tokens), model(tokens))


def recomputed_layers(chunk, hidden_states=None, tokens=None) -> list[int]:
    """The global ids of the layers `chunk` runs again in its backward, in the order it runs them."""
    calls = []
    for layer_id, layer in chunk.layers.items():
        layer.register_forward_pre_hook(lambda *_, layer_id=int(layer_id): calls.append(layer_id))
    output = chunk(tokens, hidden_states=hidden_states)
    forward_calls = len(calls)
    output.float().sum().backward()
    return calls[forward_calls:]


@pytest.mark.parametrize("method, count, expected", [
    (None, None, [3, 2, 1, 0]),  # --recompute-granularity full alone: each layer its own unit, as uniform 1
    ("uniform", 1, [3, 2, 1, 0]), ("uniform", 2, [2, 3, 0, 1]),
    ("uniform", 3, [3, 0, 1, 2]),  # a group of 3, then the last layer alone
    ("block", 2, [1, 0]), ("block", 9, [3, 2, 1, 0])])
def test_full_recomputation_rebuilds_the_units_megatron_cuts(llama_config, method, count, expected):
    """uniform: groups of `count` layers, each recomputed as one unit (its layers run again together, the last
    group's first); block: only the first `count` layers, one by one."""
    config = llama_config()
    model = apply_options(GPTModel(config, seed=5), recompute_granularity="full", recompute_method=method,
                          recompute_num_layers=count)
    assert recomputed_layers(model, tokens=torch.randint(0, 256, (2, 16))) == expected


@pytest.mark.parametrize("method, count, expected", [("block", 1, [[0], [4], [2], [6]]),
                                                     ("uniform", 2, [[0, 1], [4, 5], [2, 3], [6, 7]])])
def test_recompute_counts_layers_per_pipeline_chunk(llama_config, method, count, expected):
    """8 layers over PP 2 x VP 2: each rank's chunk holds two layers ([0, 1], [4, 5] on rank 0; [2, 3], [6, 7] on
    rank 1), and --recompute-num-layers counts within each chunk, as Megatron's: block 1 recomputes the first
    layer of every chunk, uniform 2 each chunk's two layers as one unit."""
    config = llama_config(num_layers=8)
    recomputed = []
    for pp_rank in range(2):
        for ids in chunk_layers(8, pp=2, pp_rank=pp_rank, vp=2):
            chunk = apply_options(GPTModel(config, seed=5, layer_ids=ids, pre_process=False, post_process=False),
                                  recompute_granularity="full", recompute_method=method, recompute_num_layers=count)
            recomputed.append(recomputed_layers(chunk, torch.randn(16, 2, 64, requires_grad=True)))
    assert recomputed == expected
