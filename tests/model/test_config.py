"""ModelConfig validation, presets, vocabulary padding and the closed-form parameter count."""

import pytest
import torch

from megalite.config import MODEL_PRESETS, ModelConfig, model_config_from_preset, num_parameters
from megalite.config.model import pad_vocab_size
from megalite.errors import UserError
from megalite.model.gpt import build_model

# Published parameter counts (unpadded vocabulary).
PUBLISHED = {
    "gpt2-124m": 124_439_808,
    "gpt2-350m": 354_823_168,
    "llama2-7b": 6_738_415_616,
    "llama3-8b": 8_030_261_248,
    "llama3.2-1b": 1_235_814_400,
    "llama-1b": 1_100_048_384,  # TinyLlama-1.1B
    "qwen2.5-0.5b": 494_032_768,
    "qwen3-0.6b": 596_049_920,
    "mixtral-8x7b": 46_702_792_704,
    "qwen3-30b-a3b": 30_532_122_624,
    # 15_706_484_224 published with multi-head latent attention, whose 13_763_072 parameters a layer (q 2048 x 3072,
    # kv down 2048 x 576 and its norm 512, kv up 512 x 4096, out 2048 x 2048) the preset's standard attention
    # replaces by 4 x 2048 x 2048 = 16_777_216: 27 x 3_014_144 more.
    "deepseek-v2-lite": 15_706_484_224 + 27 * 3_014_144,
}
# Active parameters (a token's top-k routed experts, all else whole): Mixtral's published "12.9B", Qwen3's "3.3B"
# (Qwen's name, A3B, and model card), tiny-moe's near tiny's 7_096_576.
ACTIVE = {"mixtral-8x7b": 12_879_925_248, "qwen3-30b-a3b": 3_353_032_704, "tiny-moe": 7_056_640}


def meta_count(config: ModelConfig) -> int:
    return sum(p.numel() for p in build_model(config, seed=0, device="meta").parameters())


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_presets_have_published_parameter_counts(name):
    config = model_config_from_preset(name, make_vocab_size_divisible_by=1)
    assert config.vocab_size == MODEL_PRESETS[name]["vocab_size"]
    assert meta_count(config) == num_parameters(config) == PUBLISHED[name]


@pytest.mark.parametrize("name", sorted(ACTIVE))
def test_moe_presets_have_published_active_parameter_counts(name):
    config = model_config_from_preset(name, make_vocab_size_divisible_by=1)
    moe_layers = sum(config.is_moe_layer(i) for i in range(config.num_layers))
    expert = 3 * config.hidden_size * config.expert_ffn_hidden_size  # SwiGLU: gate, up, down
    assert num_parameters(config) - moe_layers * (config.num_experts - config.moe_router_topk) * expert == ACTIVE[name]
    assert num_parameters(config, active=True) == ACTIVE[name]  # what FLOPs and the dry run count


@pytest.mark.parametrize("name", sorted(MODEL_PRESETS))
def test_closed_form_count_matches_the_padded_meta_model(name):
    config = model_config_from_preset(name)
    assert config.vocab_size % 128 == 0 and config.vocab_size >= config.real_vocab_size
    assert meta_count(config) == num_parameters(config)


@pytest.mark.parametrize("overrides", [
    dict(position_embedding_type="learned_absolute", normalization="LayerNorm", add_bias_linear=True),
    dict(swiglu=False, untie_embeddings_and_output_weights=False, kv_channels=48),
    dict(num_query_groups=1, add_bias_linear=True),
    dict(add_qkv_bias=True, qk_layernorm=True, kv_channels=48),
    dict(qk_layernorm=True, normalization="LayerNorm", add_bias_linear=True, add_qkv_bias=True),
])
def test_closed_form_count_matches_variants(overrides):
    config = model_config_from_preset("tiny", **overrides)
    assert meta_count(config) == num_parameters(config)


def test_tiny_preset_is_a_few_million_parameters():
    config = model_config_from_preset("tiny")
    shape = (config.num_layers, config.hidden_size, config.ffn_hidden_size, config.query_groups)
    assert shape == (4, 256, 688, 2)
    assert 3e6 < num_parameters(config) < 10e6


def test_vocabulary_padding():
    assert pad_vocab_size(50257) == 50304
    assert pad_vocab_size(50257, 128, tensor_model_parallel_size=2) == 50432
    assert pad_vocab_size(8192, 128, 4) == 8192
    config = model_config_from_preset("gpt2-124m")
    assert (config.vocab_size, config.tokenizer_vocab_size, config.real_vocab_size) == (50304, 50257, 50257)
    config = model_config_from_preset("gpt2-124m", vocab_size=1000, tensor_model_parallel_size=2)
    assert (config.vocab_size, config.real_vocab_size) == (1024, 1000)


def test_derived_defaults_follow_megatron():
    config = ModelConfig.of(num_layers=2, hidden_size=96, num_attention_heads=4, seq_length=8, vocab_size=64)
    assert (config.ffn_hidden_size, config.max_position_embeddings, config.head_dim, config.query_groups) == (
        384, 8, 24, 4)
    swiglu = ModelConfig.of(num_layers=2, hidden_size=4096, num_attention_heads=32, seq_length=8,
                            vocab_size=64, swiglu=True)
    assert swiglu.ffn_hidden_size == 10880  # int(4 * 4096 * 2/3 / 64) * 64


def test_unknown_preset_names_the_flag():
    with pytest.raises(UserError, match=r"--model 'gpt5' is not a known preset.*tiny"):
        model_config_from_preset("gpt5")


BASE = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=16, vocab_size=128)


@pytest.mark.parametrize("overrides, message", [
    (dict(num_layers=0), r"--num-layers must be a positive integer"),
    (dict(hidden_size=66, num_attention_heads=4),
     r"--hidden-size 66 is not divisible by --num-attention-heads 4.*--kv-channels"),
    (dict(num_query_groups=3), r"--num-query-groups 3 does not divide --num-attention-heads 4"),
    (dict(position_embedding_type="alibi"), r"--position-embedding-type 'alibi' is unknown"),
    (dict(seq_length=64, max_position_embeddings=32), r"--seq-length 64 exceeds --max-position-embeddings 32"),
    (dict(position_embedding_type="rope", kv_channels=15), r"rotary embeddings need an even head size"),
    (dict(use_rope_scaling=True), r"--use-rope-scaling needs --position-embedding-type rope"),
    (dict(normalization="BatchNorm"), r"--normalization 'BatchNorm' is unknown"),
    (dict(norm_epsilon=0.0), r"--norm-epsilon must be positive"),
    (dict(hidden_dropout=1.0), r"--hidden-dropout must be in \[0, 1\)"),
    (dict(attention_dropout=-0.1), r"--attention-dropout must be in \[0, 1\)"),
    (dict(init_method_std=0.0), r"--init-method-std must be positive"),
    (dict(tokenizer_vocab_size=200),
     r"tokenizer's vocabulary \(200\) does not fit the model's padded vocabulary \(128\)"),
    (dict(recompute_granularity="some"), r"--recompute-granularity 'some' is unknown"),
    # Megatron's rules for --recompute-method and --recompute-num-layers
    (dict(recompute_granularity="full", recompute_method="random", recompute_num_layers=1),
     r"--recompute-method 'random' is unknown; use uniform or block"),
    (dict(recompute_method="uniform", recompute_num_layers=1),
     r"^--recompute-method needs --recompute-granularity full$"),
    (dict(recompute_granularity="selective", recompute_method="block", recompute_num_layers=1),
     r"^--recompute-method applies only to --recompute-granularity full .*; drop --recompute-method and "
     r"--recompute-num-layers, or use --recompute-granularity full$"),
    (dict(recompute_granularity="selective", recompute_num_layers=1),
     r"^--recompute-num-layers applies only to --recompute-granularity full"),
    (dict(recompute_granularity="full", recompute_method="block"),
     r"^--recompute-method block needs --recompute-num-layers N \(the layers recomputed per pipeline chunk\)$"),
    (dict(recompute_granularity="full", recompute_num_layers=2),
     r"^--recompute-num-layers needs --recompute-method uniform or block$"),
    (dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=0),
     r"^--recompute-num-layers must be a positive integer, got 0$"),
])
def test_each_validation_rule_names_the_flag(overrides, message):
    with pytest.raises(UserError, match=message):
        ModelConfig.of(**{**BASE, **overrides}).validate()


def test_rope_allows_sequences_longer_than_learned_positions_would():
    ModelConfig.of(**{**BASE, "seq_length": 64, "max_position_embeddings": 32,
                      "position_embedding_type": "rope"}).validate()


def test_kv_channels_lifts_the_divisibility_rule():
    config = ModelConfig.of(**{**BASE, "hidden_size": 66, "kv_channels": 16}).validate()
    assert config.head_dim == 16


def test_all_presets_validate_and_build_on_meta():
    for name in MODEL_PRESETS:
        model = build_model(model_config_from_preset(name), seed=0, device="meta")
        assert all(p.device == torch.device("meta") for p in model.parameters())


@pytest.mark.parametrize(
    "vocab_size, divisible_by, tp, padded",
    [
        (8192, 128, 1, 8192),
        (8193, 128, 1, 8320),
        (50257, 128, 2, 50432),
        (101, 128, 1, 128),
        (400, 1, 3, 402),
    ],
)
def test_padded_vocab_size(vocab_size, divisible_by, tp, padded):
    assert pad_vocab_size(vocab_size, divisible_by, tp) == padded
