"""The CPU backend: speed paths for training on CPUs, applied from outside the model.

The model, the parallel layers and the kernels have no CPU-specific code; a CPU run gets
these two paths, each kept because it gains at least 5% on a whole step of the default run
(docs/benchmarks.md says by how much, and which other paths were measured and removed):

- `set_up_process()`, called by the entry script before training: huge pages for large CPU
  tensors, and glibc keeping freed memory in the process, so each iteration's activations
  reuse pages already faulted in instead of having the kernel unmap, fault in and zero them;
- `apply(model)`, called by the run where the model is built on a CPU: each layer's core
  attention runs in query blocks (`attention.py`) where that path applies, and PyTorch's SDPA
  (the layer's own code) elsewhere.

Nothing else in megalite imports this package (tests/test_imports.py).
"""

import ctypes
import os

from torch import nn

from megalite.cpu.attention import causal_attention, use_blocked_attention

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
M_MMAP_MAX = -4


def set_up_process() -> bool:
    """The process's memory for CPU training; call before the first CPU tensor is made.

    - Huge pages back CPU tensors of 2 MB and more (PyTorch reads THP_MEM_ALLOC_ENABLE at its
      first CPU allocation; a value already set, 0 included, is left alone): far fewer page
      faults for each iteration's large temporaries.
    - glibc keeps freed memory for reuse: no heap trimming, no blocks served by mmap, so the
      process's memory stays at its peak, as with a GPU caching allocator.
      MEGALITE_KEEP_FREED_MEMORY=0 opts out.
    Returns whether freed memory is kept: False off glibc (no `mallopt`) or when opted out.
    """
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
    """Give each transformer layer of `model` (a GPTModel chunk) the blocked CPU attention; returns it.

    Apply before `model.options.apply_options`, so that selective recomputation wraps this
    attention too. Parameter names and results are unchanged (the same function of q, k, v).
    """
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
        s, b = q.shape[:2]
        return causal_attention(q, k, v).reshape(s, b, -1)
    return core_attention
