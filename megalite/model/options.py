"""Options applied to a built model from outside it (as torchtitan's `parallelize_llama`):
activation recomputation and torch.compile. Parameter names and the state dict stay the same.
"""

import functools

import torch
from torch import nn

from megalite.tensor_parallel.random import checkpoint


def apply_options(model: nn.Module, *, recompute_granularity: str | None = None, compile: bool = False) -> nn.Module:
    """Apply `--recompute-granularity` and `--compile` to a GPTModel (one pipeline chunk); returns it.

    "selective" recomputes each layer's attention core (its `[b, heads, s, s]`-sized intermediates),
    "full" whole layers (keeping only their inputs), both replaying the TP RNG streams. compile:
    each layer and the final norm compiled in place (one traced graph serves all layers).
    """
    for layer in model.layers.values():
        if recompute_granularity == "full":
            layer.forward = _recomputed(layer.forward)
        elif recompute_granularity == "selective":
            layer.self_attention.core_attention = _recomputed(layer.self_attention.core_attention)
        if compile:
            layer.compile()
    if compile and model.final_layernorm is not None:
        model.final_layernorm.compile()
    return model


def _recomputed(function):
    """`function`, run under activation checkpointing while autograd records (training), plainly otherwise."""
    @functools.wraps(function)
    def run(*args):
        return checkpoint(function, *args) if torch.is_grad_enabled() else function(*args)
    return run
