"""The MoE layer (megalite/model/moe.py): routing, capacity, the balancing losses and the expert bias against
hand computations; the grouped GEMM against the loop, bit for bit; the layer against Hugging Face's Mixtral,
Qwen2-MoE and Qwen3-MoE blocks on the same weights."""

import math

import pytest
import torch
import torch.nn.functional as F

from megalite.arguments import parse_args
from megalite.config import ModelConfig, describe_model
from megalite.errors import UserError
from megalite.model.gpt import build_model
from megalite.model.moe import (MoELayer, Router, apply_capacity, expert_capacity, sequence_aux_loss,
                                set_aux_loss_scale, switch_aux_loss, take_moe_statistics, topk_routing,
                                update_expert_bias)
from megalite.model.transformer import build_mlp

pytestmark = pytest.mark.usefixtures("one_thread")

LOGITS = torch.tensor([[2.0, 1.0, 0.0, -1.0],
                       [0.0, 3.0, 1.0, 2.5],
                       [1.0, 1.5, 4.0, 0.5]])


def moe_config(**overrides) -> ModelConfig:
    values = dict(num_layers=2, hidden_size=16, num_attention_heads=2, seq_length=8, vocab_size=64,
                  num_experts=4, ffn_hidden_size=32, moe_ffn_hidden_size=8, swiglu=True, add_bias_linear=False,
                  hidden_dropout=0.0, attention_dropout=0.0, position_embedding_type="rope", normalization="RMSNorm")
    return ModelConfig.of(**{**values, **overrides}).validate()


def test_softmax_routing_is_a_softmax_over_the_top_k():
    probs, routing_map = topk_routing(LOGITS, 2)
    assert routing_map.tolist() == [[True, True, False, False], [False, True, False, True],
                                    [False, True, True, False]]
    first = 1 / (1 + math.exp(-1.0))  # softmax over (2, 1)
    assert torch.allclose(probs[0], torch.tensor([first, 1 - first, 0, 0]))
    # The same as a full softmax, top-k, renormalised (Mixtral, Qwen3-MoE).
    full = torch.softmax(LOGITS, dim=-1) * routing_map
    torch.testing.assert_close(probs, full / full.sum(dim=-1, keepdim=True))


def test_pre_softmax_routing_keeps_the_full_softmax_probs():
    probs, routing_map = topk_routing(LOGITS, 2, pre_softmax=True, scaling_factor=2.0)
    torch.testing.assert_close(probs, 2.0 * torch.softmax(LOGITS, dim=-1) * routing_map)


def test_sigmoid_routing_picks_by_biased_scores_and_weights_by_unbiased_ones():
    bias = torch.tensor([0.0, 0.0, 0.0, 10.0])  # expert 3 always chosen
    probs, routing_map = topk_routing(LOGITS, 2, score_function="sigmoid", expert_bias=bias)
    assert routing_map.tolist() == [[True, False, False, True], [False, True, False, True],
                                    [False, False, True, True]]
    scores = torch.sigmoid(LOGITS) * routing_map
    torch.testing.assert_close(probs, scores / scores.sum(dim=-1, keepdim=True))
    single, _ = topk_routing(LOGITS, 1, score_function="sigmoid")  # k = 1: not normalised
    torch.testing.assert_close(single.max(dim=-1).values, torch.sigmoid(LOGITS).max(dim=-1).values)


def test_group_limited_routing_chooses_within_the_best_groups():
    # Groups {0, 1} and {2, 3}, scored by the sum of their top two; one group per token: token 0's sums are
    # 3 and -1, token 1's 3 and 3.5 (its best expert, 1, is in the losing group).
    probs, routing_map = topk_routing(LOGITS, 2, num_groups=2, group_topk=1)
    assert routing_map.tolist() == [[True, True, False, False], [False, False, True, True],
                                    [False, False, True, True]]
    torch.testing.assert_close(probs[1, 2:], torch.softmax(torch.tensor([1.0, 2.5]), dim=0))


@pytest.mark.parametrize("policy, pad, kept", [
    ("probs", False, [[True, False], [False, False], [False, True], [True, False]]),
    ("position", False, [[True, False], [True, False], [False, True], [False, False]]),
    ("position", True, [[True, True], [True, False], [False, True], [False, False]]),
])
def test_capacity_drops_by_probs_or_position_and_pads(policy, pad, kept):
    # Two experts, capacity 2; expert 0 is routed tokens 0, 1, 3 (probs .9, .2, .8), expert 1 only token 2.
    probs = torch.tensor([[0.9, 0.0], [0.2, 0.0], [0.0, 0.7], [0.8, 0.0]])
    routing_map = probs > 0
    assert expert_capacity(4, 2, 1, 1.0) == 2
    final_probs, final_map = apply_capacity(probs, routing_map, 2, policy, pad)
    assert final_map.tolist() == kept
    torch.testing.assert_close(final_probs, probs * final_map)
    if pad:
        assert final_map.sum(dim=0).tolist() == [2, 2]  # padded rows carry prob 0


def test_aux_loss_and_seq_aux_loss_by_hand():
    scores = torch.softmax(LOGITS, dim=-1)
    routing_map = topk_routing(LOGITS, 2)[1]
    t, experts, k = 3, 4, 2
    # Switch: E * sum_e (mean score of e) * (e's share of the t*k assignments).
    hand = experts * sum(scores[:, e].mean() * routing_map[:, e].sum() / (t * k) for e in range(experts))
    torch.testing.assert_close(switch_aux_loss(scores, routing_map.sum(dim=0), k), hand)
    # Per sequence (s = 3, b = 1 here: one sequence), the same value; two sequences of [s=2, b=2] averaged.
    torch.testing.assert_close(sequence_aux_loss(scores, routing_map, k, 3), hand)
    logits = torch.randn(4, 4, generator=torch.Generator().manual_seed(0))
    scores, routing_map = torch.softmax(logits, dim=-1), topk_routing(logits, 2)[1]
    per_sequence = [switch_aux_loss(scores[b::2], routing_map[b::2].sum(dim=0), 2) for b in range(2)]  # rows are [s, b]
    torch.testing.assert_close(sequence_aux_loss(scores, routing_map, 2, 2), sum(per_sequence) / 2)


@pytest.mark.parametrize("kind", ["aux_loss", "z_loss"])
def test_balancing_losses_reach_the_router_gradient_scaled_and_outside_the_loss(kind):
    coeff, scale = 0.5, 0.25
    flags = dict(moe_aux_loss_coeff=coeff) if kind == "aux_loss" else dict(moe_z_loss_coeff=coeff)
    router = Router(moe_config(**flags))
    router.init_weights(seed=1, prefix="router")
    set_aux_loss_scale(router, scale)
    tokens = torch.randn(6, 16, generator=torch.Generator().manual_seed(2))
    probs, _ = router(tokens, seq_length=6)
    (probs * 0).sum().backward()  # the scalar loss does not hold the balancing loss: only the injection acts
    logits = F.linear(tokens, router.weight)
    if kind == "aux_loss":
        scores = torch.softmax(logits, dim=-1)
        top_two = torch.zeros(6, 4, dtype=torch.bool).scatter(1, scores.topk(2, dim=-1).indices, True)
        hand = switch_aux_loss(scores, top_two.sum(dim=0), 2)
    else:
        hand = torch.logsumexp(logits, dim=-1).square().mean()
    expected = torch.autograd.grad(coeff * scale * hand, router.weight)[0]
    torch.testing.assert_close(router.weight.grad, expected)
    name = "load_balancing_loss" if kind == "aux_loss" else "z_loss"
    assert take_moe_statistics(router, router.config)[name] == pytest.approx(coeff * hand.item(), rel=1e-6)


def test_expert_bias_moves_towards_the_mean_load():
    router = Router(moe_config(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                               moe_router_bias_update_rate=0.01))
    router.to(torch.bfloat16)
    assert router.expert_bias.dtype == torch.float32
    router.tokens_per_expert.copy_(torch.tensor([3, 1, 2, 6]))  # mean 3
    update_expert_bias(router)
    torch.testing.assert_close(router.expert_bias, torch.tensor([0.0, 0.01, 0.01, -0.01]))
    assert router.tokens_per_expert.tolist() == [0, 0, 0, 0]
    # A training forward counts each token's top-k choices (2 per token).
    router.float().init_weights(seed=1, prefix="router")
    router(torch.randn(5, 16), seq_length=5)
    assert router.tokens_per_expert.sum() == 10


def _train_steps(config: ModelConfig, dtype: torch.dtype, steps: int = 3):
    """Losses and final grads of `steps` SGD steps of a tiny MoE model."""
    model = build_model(config, seed=3, dtype=dtype)
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(4))
    losses = []
    for _ in range(steps):
        model.zero_grad()
        loss = model.logits(model(tokens)).float().logsumexp(dim=-1).mean()
        loss.backward()
        losses.append(loss.item())
        with torch.no_grad():
            for param in model.parameters():
                param -= 0.1 * param.grad
        update_expert_bias(model)
    return losses, {name: param.grad.clone() for name, param in model.named_parameters()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_grouped_gemm_equals_the_expert_loop_bitwise(dtype):
    common = dict(moe_ffn_hidden_size=16, moe_aux_loss_coeff=0.01, moe_shared_expert_intermediate_size=8)
    loop = _train_steps(moe_config(**common), dtype)
    grouped = _train_steps(moe_config(moe_grouped_gemm=True, **common), dtype)
    assert loop[0] == grouped[0] and len(set(loop[0])) == 3
    for name, grad in loop[1].items():
        assert torch.equal(grad, grouped[1][name]), name


def test_grouped_gemm_refuses_fp64():
    layer = MoELayer(moe_config(moe_ffn_hidden_size=16, moe_grouped_gemm=True), 0.01).double()
    with pytest.raises(ValueError, match="fp64"):
        layer(torch.randn(4, 2, 16, dtype=torch.float64))


transformers = pytest.importorskip("transformers")


def _hf_block(kind: str):
    """(HF sparse MoE block in fp32 with random weights, the megalite config that routes as it does)."""
    common = dict(hidden_size=16, intermediate_size=32, num_attention_heads=2, num_key_value_heads=2,
                  num_hidden_layers=1, vocab_size=64)
    if kind == "mixtral":
        hf_config = transformers.MixtralConfig(num_local_experts=4, num_experts_per_tok=2, **common)
        block, ours = transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock(hf_config), {}
    elif kind == "qwen3":
        hf_config = transformers.Qwen3MoeConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8,
                                                norm_topk_prob=True, **common)
        block, ours = transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock(hf_config), {}
    else:
        hf_config = transformers.Qwen2MoeConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8,
                                                shared_expert_intermediate_size=24, norm_topk_prob=False, **common)
        block = transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock(hf_config)
        ours = dict(moe_router_pre_softmax=True, moe_shared_expert_intermediate_size=24, moe_shared_expert_gate=True)
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for param in block.parameters():
            param.copy_(0.3 * torch.randn(param.shape, generator=generator))
    ffn = block.experts.down_proj.shape[-1]
    return block.float(), moe_config(moe_ffn_hidden_size=ffn, **ours)


@pytest.mark.parametrize("kind", ["mixtral", "qwen2", "qwen3"])
def test_moe_layer_equals_hugging_face_blocks(kind):
    block, config = _hf_block(kind)
    ours = build_mlp(config, layer_id=0)
    assert isinstance(ours, MoELayer)
    with torch.no_grad():
        ours.router.weight.copy_(block.gate.weight)
        ours.experts.linear_fc1.weight.copy_(block.experts.gate_up_proj)  # [E, gate; up, h]
        ours.experts.linear_fc2.weight.copy_(block.experts.down_proj)
        if kind == "qwen2":
            shared = block.shared_expert
            ours.shared_experts.linear_fc1.weight.copy_(torch.cat([shared.gate_proj.weight, shared.up_proj.weight]))
            ours.shared_experts.linear_fc2.weight.copy_(shared.down_proj.weight)
            ours.shared_expert_gate.copy_(block.shared_expert_gate.weight)
    hidden = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(6))  # HF's [b, s, h]
    ours.eval()
    with torch.no_grad():
        expected = block(hidden)
        got = ours(hidden.transpose(0, 1)).transpose(0, 1)
    assert (got - expected).abs().max() <= 1e-6 * expected.abs().max()


@pytest.mark.parametrize("grouped", [False, True], ids=["loop", "grouped"])
def test_moe_layer_with_biases_and_gelu_is_the_prob_weighted_sum_of_its_experts(grouped):
    config = moe_config(swiglu=False, add_bias_linear=True, moe_ffn_hidden_size=16, moe_grouped_gemm=grouped)
    layer = MoELayer(config, 0.02)
    generator = torch.Generator().manual_seed(8)
    with torch.no_grad():
        for param in layer.parameters():
            param.copy_(0.5 * torch.randn(param.shape, generator=generator))
    hidden = torch.randn(4, 2, 16, generator=generator)
    tokens = hidden.reshape(8, 16)
    probs, routing_map = topk_routing(F.linear(tokens, layer.router.weight), 2)
    fc1, fc2 = layer.experts.linear_fc1, layer.experts.linear_fc2
    expected = torch.zeros_like(tokens)
    for t in range(8):
        for e in routing_map[t].nonzero().flatten().tolist():
            mlp = F.linear(F.gelu(F.linear(tokens[t], fc1.weight[e], fc1.bias[e])), fc2.weight[e], fc2.bias[e])
            expected[t] += probs[t, e] * mlp
    torch.testing.assert_close(layer(hidden).reshape(8, 16), expected)


def test_layers_follow_moe_layer_freq_and_parameters_are_counted():
    from megalite.config.model import num_parameters
    config = moe_config(num_layers=4, moe_layer_freq="([0]*1+[1]*3)", moe_shared_expert_intermediate_size=8,
                        moe_shared_expert_gate=True)
    model = build_model(config, seed=1)
    kinds = [type(layer.mlp).__name__ for layer in model.layers.values()]
    assert kinds == ["MLP", "MoELayer", "MoELayer", "MoELayer"]
    assert sum(p.numel() for p in model.parameters()) == num_parameters(config)
    assert model.layers["1"].mlp.experts.linear_fc1.weight.shape == (4, 16, 16)  # [E, gate; up, h]


@pytest.mark.parametrize("flags, world_size, words", [
    (["--moe-router-topk", "4"], 1, ["--moe-router-topk configures mixture-of-experts layers", "--num-experts"]),
    (["--num-experts", "4", "--moe-router-topk", "5"], 1, ["--moe-router-topk 5 exceeds --num-experts 4"]),
    (["--num-experts", "4", "--moe-router-topk", "1"], 1, ["--moe-router-pre-softmax"]),
    (["--num-experts", "4", "--moe-router-enable-expert-bias"], 1, ["needs --moe-router-score-function sigmoid"]),
    (["--num-experts", "6", "--moe-router-num-groups", "4", "--moe-router-group-topk", "1"], 1,
     ["--moe-router-num-groups 4 does not divide --num-experts 6"]),
    (["--num-experts", "4", "--moe-router-num-groups", "2"], 1, ["--moe-router-group-topk go together"]),
    (["--num-experts", "4", "--moe-layer-freq", "[1]*3"], 1, ["gives 3 layers but --num-layers is 4"]),
    (["--num-experts", "4", "--moe-layer-freq", "__import__('os')"], 1, ["--moe-layer-freq", "list of 0/1"]),
    (["--num-experts", "4", "--moe-pad-expert-input-to-capacity"], 1, ["needs --moe-expert-capacity-factor"]),
    (["--num-experts", "4", "--moe-shared-expert-gate"], 1, ["--moe-shared-expert-intermediate-size"]),
    (["--num-experts", "4", "--moe-router-load-balancing-type", "sinkhorn"], 1, ["sinkhorn"]),
    (["--num-experts", "4", "--tensor-model-parallel-size", "2"], 2, ["--num-experts with --tensor-model-parallel"
                                                                       "-size 2 needs --sequence-parallel"]),
    (["--num-experts", "4", "--moe-token-dispatcher-type", "flex"], 1, ["--moe-token-dispatcher-type", "flex",
                                                                         "allgather"]),
    (["--num-experts", "4", "--moe-router-fusion"], 1, ["--moe-router-fusion is a Megatron MoE option megalite "
                                                         "does not build"]),
    (["--num-experts", "4", "--moe-permute-fusion"], 1, ["--moe-permute-fusion is a Megatron MoE option megalite "
                                                          "does not build"]),
    (["--expert-model-parallel-size", "2"], 2, ["--expert-model-parallel-size 2", "add --num-experts"]),
    (["--num-experts", "6", "--expert-model-parallel-size", "4"], 4, ["--expert-model-parallel-size 4 does not "
                                                                        "divide --num-experts 6"]),
    (["--num-experts", "4", "--expert-model-parallel-size", "4"], 2, ["= 4 does not divide the 2 data-parallel"]),
    (["--num-experts", "4", "--tensor-model-parallel-size", "4", "--sequence-parallel",
      "--expert-tensor-parallel-size", "2"], 4, ["--expert-tensor-parallel-size 2 must be 1 or the --tensor-model"]),
], ids=["no-experts", "topk", "topk1-softmax", "bias-softmax", "groups-divide", "groups-pair", "freq-length",
        "freq-eval", "pad-capacity", "gate-shared", "sinkhorn", "tp", "flex", "unknown-moe", "permute-fusion",
        "ep-without-experts", "ep-divides-experts", "ep-fits-ranks", "etp-is-1-or-tp"])
def test_moe_flags_refuse_bad_combinations_in_one_sentence(flags, world_size, words):
    with pytest.raises(UserError) as err:
        parse_args(["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "99", *flags], world_size)
    message = str(err.value)
    assert "\n" not in message
    for word in words:
        assert word in message, message


def test_moe_flags_parse_with_megatron_s_names_and_defaults():
    run = parse_args(["--num-experts", "8", "--moe-layer-freq", "'([0]*1+[1]*3)'", "--moe-ffn-hidden-size", "64",
                      "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
                      "--moe-router-num-groups", "4", "--moe-router-group-topk", "2", "--moe-grouped-gemm",
                      "--moe-shared-expert-intermediate-size", "128", "--moe-shared-expert-gate",
                      "--moe-expert-capacity-factor", "1.5", "--moe-token-drop-policy", "position",
                      "--moe-router-load-balancing-type", "seq_aux_loss", "--moe-aux-loss-coeff", "1e-2",
                      "--moe-z-loss-coeff", "1e-3", "--expert-model-parallel-size", "1",
                      "--moe-router-dtype", "fp32", "--moe-token-dispatcher-type", "alltoall"])
    model = run.model
    assert [model.is_moe_layer(i) for i in range(4)] == [False, True, True, True]
    assert (model.num_experts, model.moe_router_topk, model.moe_router_bias_update_rate) == (8, 2, 1e-3)
    assert model.expert_ffn_hidden_size == 64 and model.moe_token_drop_policy == "position"
    assert "num_experts 8" in describe_model("tiny", model)
    assert parse_args(["--num-experts", "4"]).model.expert_ffn_hidden_size == 688  # --ffn-hidden-size's
