"""Small model configs built in a line, for tests on one CPU process."""

from megalite.config import ModelConfig


def llama_config(**overrides) -> ModelConfig:
    """A 4-layer LLaMA-style model small enough for fp32 CPU tests (GQA, rope, SwiGLU, untied)."""
    values = dict(num_layers=4, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                  ffn_hidden_size=96, seq_length=16, vocab_size=256, position_embedding_type="rope",
                  normalization="RMSNorm", swiglu=True, add_bias_linear=False,
                  untie_embeddings_and_output_weights=True, hidden_dropout=0.0, attention_dropout=0.0)
    values.update(overrides)
    return ModelConfig.of(**values).validate()


def gpt2_config(**overrides) -> ModelConfig:
    """A 2-layer GPT-2-style model: learned positions, LayerNorm, GELU, biases, tied."""
    values = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=16,
                  max_position_embeddings=32, vocab_size=256, openai_gelu=True,
                  hidden_dropout=0.0, attention_dropout=0.0)
    values.update(overrides)
    return ModelConfig.of(**values).validate()
