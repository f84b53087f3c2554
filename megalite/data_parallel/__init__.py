"""Data parallelism: contiguous grad buffers, gradient reduction and the distributed (ZeRO-1) optimizer."""
