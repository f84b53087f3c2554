"""A tiny model and its iterations' grads, for the optimizer tests in one process."""

import torch
from torch import nn

from megalite.config import ModelConfig
from megalite.model.gpt import build_model
from tests.helpers.model import token_losses

HYPER = dict(weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8)


def tiny_llama(seed: int = 0, dtype: torch.dtype = torch.float32) -> nn.Module:
    """2 layers, hidden 32, GQA, RMSNorm (1-D weights: no weight decay), untied."""
    config = ModelConfig.of(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                            ffn_hidden_size=48, seq_length=8, vocab_size=64, position_embedding_type="rope",
                            normalization="RMSNorm", swiglu=True, add_bias_linear=False,
                            untie_embeddings_and_output_weights=True, hidden_dropout=0.0,
                            attention_dropout=0.0).validate()
    return build_model(config, seed, dtype=dtype)


def backward_iteration(model, step: int, optimizer=None, num_microbatches: int = 2) -> None:
    """Backward of iteration `step`'s mean loss over its micro-batches (scaled by `optimizer`)."""
    for micro in range(num_microbatches):
        generator = torch.Generator().manual_seed(100 * step + micro)
        tokens = torch.randint(0, 64, (2, 8), generator=generator)
        loss = token_losses(model, tokens, tokens.roll(-1, dims=1)).mean() / num_microbatches
        (loss if optimizer is None else optimizer.scale_loss(loss)).backward()


def params_of(model) -> dict:
    return {name: param.detach().clone() for name, param in model.named_parameters()}
