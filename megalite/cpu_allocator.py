"""The cost of fresh CPU memory in training, and the three remedies megalite takes.

Every training iteration's large temporaries (logits, activations, fresh grads) are new
memory: glibc serves blocks above 32 MB from new mappings and returns them on free, so
each first touch of each page is a page fault, and the kernel zeroes the page.

- Huge pages (`use_huge_pages`): with 4 KiB pages a config-B step on 2 cores took 246k
  faults and 0.88 s of system time; with transparent huge pages for tensors of 2 MB
  and more, 12k and 0.48 s. PyTorch reads THP_MEM_ALLOC_ENABLE once, at its first CPU
  allocation, so this must run before torch is imported (this module imports torch
  only inside `RecycledBuffer`'s methods).
- Freed memory kept in the process (`keep_freed_memory`): by default glibc hands large
  blocks back to the kernel on free (unmapping them, or trimming the heap's top), so the
  next iteration's activations fault in and zero the same pages again. A forward GEMM
  writing its `[2048, 1376]` output into such memory took 13.4 ms, into memory kept by
  the process 9.2 ms; the page faults' system time per step went from 0.14-0.19 s to
  0.01-0.05 s on config B (docs/benchmarks.md).
- A recycled buffer (`RecycledBuffer`) for the largest temporary, the output layer's
  logits `[tokens, vocab/tp]`: even with huge pages, writing them into fresh memory
  made config B's logits GEMM ~25% slower than into memory already touched.

One more cost is not about fresh memory but about where rows land: a GEMM output whose
rows are a whole number of 4 KiB apart (logits of a power-of-two vocabulary, e.g. 8,192
fp32 columns = 32 KiB) puts every row's first bytes in the same cache sets, and the
kernel's tiles of several rows evict one another. `padded_row_length` gives such rows one
cache line more; `RecycledBuffer.take(..., pad_rows=True)` lays the logits out so (config
A's output layer: forward GEMM 1.05-1.4x, its three GEMMs 1.04-1.15x, a whole step ~1.03x;
`tools/bench/logits_layout.py`, docs/benchmarks.md).

GPU memory is unaffected: PyTorch's CUDA caching allocator already reuses its blocks.
"""

import os


def use_huge_pages() -> None:
    """Back CPU tensors of 2 MB and more with huge pages, unless THP_MEM_ALLOC_ENABLE is already set (0 opts out)."""
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")


PAGE_BYTES = 4096  # the span of the L1 data cache's sets on x86 (64 sets x 64 B lines) and a small page
CACHE_LINE_BYTES = 64


def padded_row_length(columns: int, itemsize: int) -> int:
    """The row stride, in elements, for a `[rows, columns]` matrix a CPU GEMM writes.

    `columns`, plus one cache line when a row is a whole number of 4 KiB: rows that far
    apart map to the same sets of the L1 and L2 caches, so a GEMM's output tile (several
    rows) has its lines evicted by its own other rows.
    """
    row_bytes = columns * itemsize
    if row_bytes % PAGE_BYTES or CACHE_LINE_BYTES % itemsize:
        return columns
    return columns + CACHE_LINE_BYTES // itemsize


_row_padding = True  # set_row_padding


def set_row_padding(enabled: bool) -> None:
    """Pad GEMM outputs' rows as `padded_row_length` says (default), or lay them out contiguous
    everywhere (tools/bench/logits_layout.py measures one against the other)."""
    global _row_padding
    _row_padding = enabled


def _laid_out(shape, itemsize: int, pad_rows: bool):
    """The memory's shape for a tensor `shape`: its last dimension `padded_row_length` long when
    `pad_rows` and row padding is on, else `shape` itself."""
    if not (pad_rows and _row_padding and len(shape) >= 2):
        return tuple(shape)
    return (*shape[:-1], padded_row_length(shape[-1], itemsize))


def empty_padded_rows(rows: int, columns: int, dtype, device):
    """An uninitialised `[rows, columns]` tensor for a GEMM to write; on a CPU its rows are
    `padded_row_length` apart (a view of a wider block), elsewhere contiguous."""
    import torch

    if torch.device(device).type != "cpu":
        return torch.empty(rows, columns, dtype=dtype, device=device)
    return torch.empty(_laid_out((rows, columns), dtype.itemsize, True), dtype=dtype, device=device)[:, :columns]


M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
M_MMAP_MAX = -4


def keep_freed_memory() -> bool:
    """Make glibc keep freed memory for reuse: no heap trimming, no blocks served by mmap.

    The process's memory then stays at its peak, as with a GPU caching allocator, and every
    later allocation reuses pages already faulted in. MEGALITE_KEEP_FREED_MEMORY=0 opts
    out. Returns whether the setting took: False off glibc (no `mallopt`) or when opted out.
    """
    if os.environ.get("MEGALITE_KEEP_FREED_MEMORY", "1") == "0":
        return False
    import ctypes

    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)  # the C library already loaded
    if mallopt is None:
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    # Large blocks then come from the heap; glibc still maps memory when the heap cannot grow.
    return bool(mallopt(M_TRIM_THRESHOLD, 2 ** 31 - 1) and mallopt(M_MMAP_MAX, 0))


class RecycledBuffer:
    """One block of CPU memory handed out again and again, but only while nothing else holds it.

    `take(shape, dtype, device)` returns a new tensor over the kept block when the block
    is free and large enough; otherwise it allocates a new block, keeps that one and
    returns a tensor over it. "Free" means no tensor, view or autograd-saved tensor
    refers to the block any more (its storage's reference count is the keeper's own),
    so a caller cannot be handed memory someone still reads, whatever it did with the
    previous tensor: kept it, saved it for a backward, or returned it to a user.
    The tensors are not autograd views of each other (each has its own version counter).

    CPU only: on other devices `take` is `torch.empty` (their caching allocators reuse
    blocks already). A deep copy (of a model holding one) starts empty.
    """

    def __init__(self):
        self._storage = None  # torch.UntypedStorage, or None before the first take

    def __deepcopy__(self, memo):
        return RecycledBuffer()

    def take(self, shape, dtype, device, pad_rows: bool = False):
        """An uninitialised tensor `shape` of `dtype` on `device`, over the kept block when free.

        Contiguous, or with `pad_rows` its rows `padded_row_length` elements apart (unless
        `set_row_padding(False)`): a GEMM's output layout (`torch.mm(..., out=)` writes into
        it in place).
        """
        import torch

        device = torch.device(device)
        use_count = getattr(torch._C, "_storage_Use_Count", None)  # private: without it, no recycling
        if device.type != "cpu" or use_count is None:
            return torch.empty(shape, dtype=dtype, device=device)
        laid_out = torch.Size(_laid_out(shape, dtype.itemsize, pad_rows))
        nbytes = laid_out.numel() * dtype.itemsize
        if self._storage is None or self._storage.nbytes() < nbytes or use_count(self._storage._cdata) > 1:
            # The old block, if busy, lives on with whoever holds it.
            self._storage = torch.empty(laid_out, dtype=dtype, device=device).untyped_storage()
        stride = torch.empty(laid_out, device="meta").stride()  # a padded row keeps its spacing in `shape`
        return torch.empty(0, dtype=dtype, device=device).set_(self._storage, 0, shape, stride)
