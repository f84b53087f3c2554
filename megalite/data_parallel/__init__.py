"""Data parallelism: grad buffers, gradient reduction, ZeRO-3's parameter shards and the distributed optimizer."""
