"""The GPT / LLaMA model built from tensor-parallel layers, in Megatron's [s, b, h] layout."""
