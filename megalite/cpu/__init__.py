"""The CPU backend: speed paths applied from outside the model, each gaining at least 5% on a default-run step
(docs/benchmarks.md). `set_up_process()` keeps freed memory and uses huge pages, so activations reuse pages already
faulted in; `apply(model)` gives each layer the blocked attention of attention.py. Only run/ and the entry script import
this package."""

import ctypes
import os

from torch import nn

from megalite.cpu.attention import causal_attention, use_blocked_attention

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
M_MMAP_MAX = -4


def set_up_process() -> bool:
    """The process's memory for CPU training; call before the first CPU tensor is made.

    Huge pages back CPU tensors of 2 MB and more (PyTorch reads THP_MEM_ALLOC_ENABLE at its first CPU allocation; a
    value already set is left alone), and glibc keeps freed memory (no heap trimming, no mmap blocks), like a GPU
    caching allocator, unless MEGALITE_KEEP_FREED_MEMORY=0. Returns whether freed memory is kept: False off glibc (no
    `mallopt`) or when opted out."""
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
    if os.environ.get("MEGALITE_KEEP_FREED_MEMORY", "1") == "0":
        return False
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)  # the C library already loaded
    if mallopt is None:
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    # Large blocks then come from the heap; glibc still maps memory when the heap cannot grow.
    return bool(mallopt(M_TRIM_THRESHOLD, 2 ** 31 - 1) and mallopt(M_MMAP_MAX, 0))


def apply(model: nn.Module) -> nn.Module:
    """Give each layer of `model` (a GPTModel chunk) the blocked attention, before `apply_options` wraps it."""
    for layer in model.layers.values():
        attention = layer.self_attention
        attention.core_attention = _blocked(attention, attention.core_attention)
    return model


def _blocked(attention: nn.Module, sdpa):
    """The core attention of `attention` (q `[s, b, heads, d]`, k/v `[s, b, groups, d]` -> `[s, b, heads * d]`)
    in query blocks where `use_blocked_attention` says so, else `sdpa` (the layer's own)."""
    def core_attention(q, k, v):
        dropout = attention.attention_dropout if attention.training else 0.0
        if not use_blocked_attention(q, dropout):
            return sdpa(q, k, v)
        return causal_attention(q, k, v).flatten(2)  # [s, b, heads * d]
    return core_attention
