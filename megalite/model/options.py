"""Options applied to a built model from outside it (as torchtitan's `parallelize_llama`):
activation recomputation and torch.compile. Parameter names and the state dict stay the same.
"""

import functools

import torch
from torch import nn

from megalite.config import recompute_segments
from megalite.tensor_parallel.random import checkpoint


def apply_options(model: nn.Module, *, recompute_granularity: str | None = None, recompute_method: str | None = None,
                  recompute_num_layers: int | None = None, compile: bool = False) -> nn.Module:
    """Apply `--recompute-*` and `--compile` to a GPTModel (one pipeline chunk); returns it.

    "selective" recomputes each layer's attention core (its `[b, heads, s, s]`-sized intermediates), "full" whole
    layers, keeping only the input of each checkpointed unit: the segments of the chunk's layers that
    `recompute_segments` cuts by `recompute_method` and `recompute_num_layers` (default: each layer). Both replay the TP
    RNG streams. compile: each layer and the final norm compiled in place (one traced graph serves all layers).
    """
    layers = list(model.layers.values())
    if recompute_granularity == "full":
        segments = [([layers[i] for i in positions], checkpointed) for positions, checkpointed
                    in recompute_segments(len(layers), recompute_method, recompute_num_layers)]
        model.run_layers = functools.partial(_run_segments, segments)
    for layer in layers:
        if recompute_granularity == "selective":
            layer.self_attention.core_attention = _recomputed(layer.self_attention.core_attention)
        if compile:
            layer.compile()
    if compile and model.final_layernorm is not None:
        model.final_layernorm.compile()
    return model


def _run_segments(segments: list[tuple[list[nn.Module], bool]], hidden: torch.Tensor, rotary) -> torch.Tensor:
    """GPTModel.run_layers over `segments` (layers, checkpointed): a checkpointed segment is one unit whose
    backward recomputes all its layers from its input `[s, b, h]`."""
    for layers, checkpointed in segments:
        run = functools.partial(_run_in_order, layers)
        hidden = _recomputed(run)(hidden, rotary) if checkpointed else run(hidden, rotary)
    return hidden


def _run_in_order(layers: list[nn.Module], hidden: torch.Tensor, rotary) -> torch.Tensor:
    for layer in layers:
        hidden = layer(hidden, rotary)
    return hidden


def _recomputed(function):
    """`function`, run under activation checkpointing while autograd records (training), plainly otherwise."""
    @functools.wraps(function)
    def run(*args):
        return checkpoint(function, *args) if torch.is_grad_enabled() else function(*args)
    return run
