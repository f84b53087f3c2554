"""Named architectures: `--model NAME` -> ModelConfig field values with the published numbers
(`vocab_size` is the tokenizer's, padded by `model_config_from_preset`)."""

from megalite.config.model import MOE, ModelConfig, with_tokenizer_vocab
from megalite.config.options import option_fields
from megalite.errors import UserError


def _gpt2(num_layers: int, hidden_size: int, num_attention_heads: int) -> dict:
    """GPT-2: learned positions, LayerNorm, GELU (tanh form, HF's `gelu_new`), biases, tied."""
    return dict(num_layers=num_layers, hidden_size=hidden_size, num_attention_heads=num_attention_heads,
                ffn_hidden_size=4 * hidden_size, seq_length=1024, max_position_embeddings=1024,
                vocab_size=50257, position_embedding_type="learned_absolute", normalization="LayerNorm",
                norm_epsilon=1e-5, openai_gelu=True, add_bias_linear=True,
                untie_embeddings_and_output_weights=False, hidden_dropout=0.1, attention_dropout=0.1)


def _llama(num_layers: int, hidden_size: int, ffn_hidden_size: int, num_attention_heads: int,
           num_query_groups: int | None, vocab_size: int, seq_length: int, rotary_base: float,
           tied: bool = False, max_position_embeddings: int | None = None, norm_epsilon: float = 1e-5,
           **extra) -> dict:
    """LLaMA: rope, RMSNorm, SwiGLU, no biases, no dropout (Qwen2 adds QKV biases, Qwen3 q/k norms)."""
    return dict(num_layers=num_layers, hidden_size=hidden_size, ffn_hidden_size=ffn_hidden_size,
                num_attention_heads=num_attention_heads, num_query_groups=num_query_groups,
                vocab_size=vocab_size, seq_length=seq_length,
                max_position_embeddings=max_position_embeddings or seq_length,
                position_embedding_type="rope", rotary_base=rotary_base, normalization="RMSNorm",
                norm_epsilon=norm_epsilon, swiglu=True, add_bias_linear=False,
                untie_embeddings_and_output_weights=not tied, hidden_dropout=0.0,
                attention_dropout=0.0, **extra)


def _moe(experts: int, topk: int, aux_loss_coeff: float, expert_ffn: int | None = None,
         shared: int | None = None) -> dict:
    """The MoE fields: `experts` routed experts of hidden size `expert_ffn` (default the dense ffn size), `topk`
    per token, shared experts of total size `shared`, the aux loss (aux_loss) coefficient."""
    return dict(num_experts=experts, moe_router_topk=topk, moe_ffn_hidden_size=expert_ffn,
                moe_shared_expert_intermediate_size=shared, moe_aux_loss_coeff=aux_loss_coeff)


MODEL_PRESETS: dict[str, dict] = {
    # The default CPU model: LLaMA-shaped, about 7.1M parameters with an 8192-token vocabulary.
    "tiny": _llama(num_layers=4, hidden_size=256, ffn_hidden_size=688, num_attention_heads=4,
                   num_query_groups=2, vocab_size=8192, seq_length=256, rotary_base=10000.0),
    "gpt2-124m": _gpt2(num_layers=12, hidden_size=768, num_attention_heads=12),
    "gpt2-350m": _gpt2(num_layers=24, hidden_size=1024, num_attention_heads=16),
    "llama2-7b": _llama(num_layers=32, hidden_size=4096, ffn_hidden_size=11008, num_attention_heads=32,
                        num_query_groups=None, vocab_size=32000, seq_length=4096, rotary_base=10000.0),
    "llama3-8b": _llama(num_layers=32, hidden_size=4096, ffn_hidden_size=14336, num_attention_heads=32,
                        num_query_groups=8, vocab_size=128256, seq_length=8192, rotary_base=500000.0),
    "llama3.2-1b": _llama(num_layers=16, hidden_size=2048, ffn_hidden_size=8192, num_attention_heads=32,
                          num_query_groups=8, vocab_size=128256, seq_length=8192, rotary_base=500000.0,
                          tied=True, max_position_embeddings=131072, use_rope_scaling=True,
                          rope_scaling_factor=32.0),
    # TinyLlama-1.1B's shape: the ~1B LLaMA-2-style model (32000-token vocabulary).
    "llama-1b": _llama(num_layers=22, hidden_size=2048, ffn_hidden_size=5632, num_attention_heads=32,
                       num_query_groups=4, vocab_size=32000, seq_length=2048, rotary_base=10000.0),
    "qwen2.5-0.5b": _llama(num_layers=24, hidden_size=896, ffn_hidden_size=4864, num_attention_heads=14,
                           num_query_groups=2, vocab_size=151936, seq_length=4096, rotary_base=1000000.0,
                           tied=True, max_position_embeddings=32768, norm_epsilon=1e-6, add_qkv_bias=True),
    "qwen3-0.6b": _llama(num_layers=28, hidden_size=1024, ffn_hidden_size=3072, num_attention_heads=16,
                         num_query_groups=8, vocab_size=151936, seq_length=4096, rotary_base=1000000.0,
                         tied=True, max_position_embeddings=40960, norm_epsilon=1e-6, kv_channels=128,
                         qk_layernorm=True),
    # Mixture-of-experts models: MoE layers with softmax top-k routing (Megatron's default) unless noted, the aux
    # loss coefficient each was published with.
    # The CPU MoE model: tiny's attention, 8 experts of which 2 per token plus one shared expert (sigmoid-gated, so
    # it exports as Qwen2MoeForCausalLM): 7.06M parameters active (2 x 224 + 224 ~ tiny's 688), 11.2M in all.
    "tiny-moe": _llama(num_layers=4, hidden_size=256, ffn_hidden_size=688, num_attention_heads=4,
                       num_query_groups=2, vocab_size=8192, seq_length=256, rotary_base=10000.0,
                       **_moe(experts=8, topk=2, expert_ffn=224, shared=224, aux_loss_coeff=1e-2),
                       moe_shared_expert_gate=True),
    "mixtral-8x7b": _llama(num_layers=32, hidden_size=4096, ffn_hidden_size=14336, num_attention_heads=32,
                           num_query_groups=8, vocab_size=32000, seq_length=4096, rotary_base=1000000.0,
                           max_position_embeddings=32768, **_moe(experts=8, topk=2, aux_loss_coeff=1e-2)),
    # HF's norm_topk_prob True: the default softmax routing; the dense ffn size is unused (every layer is MoE).
    "qwen3-30b-a3b": _llama(num_layers=48, hidden_size=2048, ffn_hidden_size=6144, num_attention_heads=32,
                            num_query_groups=4, vocab_size=151936, seq_length=4096, rotary_base=1000000.0,
                            max_position_embeddings=40960, norm_epsilon=1e-6, kv_channels=128, qk_layernorm=True,
                            **_moe(experts=128, topk=8, expert_ffn=768, aux_loss_coeff=1e-3)),
    # DeepSeek-V2-Lite's MoE part (layer 0 dense, 64 routed experts of which 6, two shared ones as one of 2816,
    # not renormalised: --moe-router-pre-softmax; the sequence-level aux loss) with standard multi-head attention
    # of 16 x 128 channels in place of its multi-head latent attention (MLA), which megalite does not build, and a
    # 4096-token context without YaRN: 15.79B parameters (MLA's are 3M a layer fewer: 15.71B published).
    "deepseek-v2-lite": _llama(num_layers=27, hidden_size=2048, ffn_hidden_size=10944, num_attention_heads=16,
                               num_query_groups=None, vocab_size=102400, seq_length=4096, rotary_base=10000.0,
                               norm_epsilon=1e-6, moe_layer_freq="([0]*1+[1]*26)", moe_router_pre_softmax=True,
                               moe_router_load_balancing_type="seq_aux_loss",
                               **_moe(experts=64, topk=6, expert_ffn=1408, shared=2816, aux_loss_coeff=1e-3)),
    # Not here: OLMoE-1B-7B, whose q/k norms span all heads (megalite's --qk-layernorm is per head, as Qwen3's).
}


def model_config_from_preset(name: str, tensor_model_parallel_size: int = 1, **overrides) -> ModelConfig:
    """The validated ModelConfig of preset `name` with `overrides` applied, its `vocab_size` (the
    tokenizer's, from the preset or the overrides) padded per `make_vocab_size_divisible_by` x TP."""
    if name not in MODEL_PRESETS:
        raise UserError(f"--model {name!r} is not a known preset; use one of "
                        f"{', '.join(MODEL_PRESETS)} (see --list-models)")
    values = {**MODEL_PRESETS[name], **overrides}
    # Validated once the vocabulary is padded, which needs a sound --make-vocab-size-divisible-by.
    unpadded = ModelConfig.of(**values)
    if not isinstance(unpadded.make_vocab_size_divisible_by, int) or unpadded.make_vocab_size_divisible_by < 1:
        unpadded.validate()  # names --make-vocab-size-divisible-by
    return with_tokenizer_vocab(unpadded, values["vocab_size"], tensor_model_parallel_size)


def describe_model(name: str, model: ModelConfig) -> str:
    """How a run names its model: "model tiny" when it is preset `name`, else "custom model (--model tiny
    with num_layers 2, ...)", naming each network-size field set otherwise and "vocabulary N" for a tokenizer
    of another size. How it is trained (dropout, initialisation, recomputation: the options of other --help
    groups than network size and moe) does not change it."""
    preset = MODEL_PRESETS[name]
    reference = ModelConfig.of(**preset)
    changes = [f"{field.name} {getattr(model, field.name)}" for field, spec in option_fields(ModelConfig)
               if spec.group in (None, MOE) and getattr(model, field.name) != getattr(reference, field.name)]
    if model.real_vocab_size != preset["vocab_size"]:
        changes.append(f"vocabulary {model.real_vocab_size}")
    return f"custom model (--model {name} with {', '.join(changes)})" if changes else f"model {name}"
