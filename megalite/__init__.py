"""megalite: a compact Megatron-style pretraining codebase (see ../shared/ARCHITECTURE.md)."""

__version__ = "0.1.0"
