"""megalite <-> Hugging Face `transformers`: configurations (and, with the conversion issue, weights)."""

from megalite.config import ModelConfig


def llama_config_to_hf(config: ModelConfig, attn_implementation: str = "sdpa", **extra):
    """The `transformers.LlamaConfig` of a LLaMA-shaped megalite config (real vocabulary, no padding).

    Llama 3.1 rope scaling maps to HF's "llama3" rope type with megalite's fixed low/high
    frequency factors (1, 4) and original context (8192). `extra` goes to LlamaConfig.
    """
    import transformers  # only conversion, tests and benchmarks need it

    rope_scaling = None
    if config.use_rope_scaling:
        rope_scaling = {"rope_type": "llama3", "factor": config.rope_scaling_factor, "low_freq_factor": 1.0,
                        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    hf_config = transformers.LlamaConfig(
        vocab_size=config.real_vocab_size, hidden_size=config.hidden_size,
        intermediate_size=config.ffn_hidden_size, num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_attention_heads, num_key_value_heads=config.query_groups,
        head_dim=config.head_dim, max_position_embeddings=config.max_position_embeddings,
        rms_norm_eps=config.norm_epsilon, rope_theta=config.rotary_base, rope_scaling=rope_scaling,
        tie_word_embeddings=not config.untie_embeddings_and_output_weights, attention_bias=False,
        mlp_bias=False, attention_dropout=0.0, **extra)
    hf_config._attn_implementation = attn_implementation
    return hf_config
