"""Options applied to a built model from outside it: activation recomputation and torch.compile.

The model classes have no switch for either (torchtitan's `parallelize_llama` does the same):
`apply_options` is the one place that reads the flags and changes the built modules in
place. Parameter names and the state dict stay the same, so checkpoints do not depend on
the options. Recomputation replays the tensor-parallel RNG streams too
(`tensor_parallel.random.checkpoint`), so dropout masks match the first forward.
"""

import functools

import torch
from torch import nn

from megalite.tensor_parallel.random import checkpoint


def apply_options(model: nn.Module, *, recompute_granularity: str | None = None, compile: bool = False) -> nn.Module:
    """Apply `--recompute-granularity` and `--compile` to a GPTModel (one pipeline chunk); returns it.

    recompute_granularity: "selective" recomputes each layer's attention core in the backward
    (its `[b, heads, s, s]`-sized intermediates are not kept), "full" recomputes whole layers
    (only each layer's input `[s, b, h]` is kept), None keeps everything.
    compile: each transformer layer and the final norm compiled in place (regional compilation:
    the layers share one code path, so one traced graph serves them all and compiles far faster
    than the whole model).
    """
    if recompute_granularity not in (None, "selective", "full"):
        raise ValueError(f"recompute granularity {recompute_granularity!r} is not selective, full or None")
    for layer in model.layers.values():
        if recompute_granularity == "full":
            layer.forward = _recomputed(layer.forward)
        elif recompute_granularity == "selective":
            attention = layer.self_attention
            attention.core_attention = _recomputed(attention.core_attention)
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
