"""The cost of fresh CPU memory in training, and the two remedies megalite takes.

Every training iteration's large temporaries (logits, activations, fresh grads) are new
memory: glibc serves blocks above 32 MB from new mappings and returns them on free, so
each first touch of each page is a page fault, and the kernel zeroes the page.

- Huge pages (`use_huge_pages`): with 4 KiB pages a config-B step on 2 cores took 246k
  faults and 0.88 s of system time; with transparent huge pages for tensors of 2 MB
  and more, 12k and 0.48 s. PyTorch reads THP_MEM_ALLOC_ENABLE once, at its first CPU
  allocation, so this must run before torch is imported (this module imports torch
  only inside `RecycledBuffer`'s methods).
- A recycled buffer (`RecycledBuffer`) for the largest temporary, the output layer's
  logits `[tokens, vocab/tp]`: even with huge pages, writing them into fresh memory
  made config B's logits GEMM ~25% slower than into memory already touched.

GPU memory is unaffected: PyTorch's CUDA caching allocator already reuses its blocks.
"""

import os


def use_huge_pages() -> None:
    """Back CPU tensors of 2 MB and more with huge pages, unless THP_MEM_ALLOC_ENABLE is already set (0 opts out)."""
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")


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

    def take(self, shape, dtype, device):
        """An uninitialised contiguous tensor `shape` of `dtype` on `device`, over the kept block when free."""
        import torch

        device = torch.device(device)
        use_count = getattr(torch._C, "_storage_Use_Count", None)  # private: without it, no recycling
        if device.type != "cpu" or use_count is None:
            return torch.empty(shape, dtype=dtype, device=device)
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        if self._storage is None or self._storage.nbytes() < nbytes or use_count(self._storage._cdata) > 1:
            self._storage = torch.empty(shape, dtype=dtype).untyped_storage()  # the old block, if busy, lives on
        return torch.empty(0, dtype=dtype).set_(self._storage, 0, shape)
