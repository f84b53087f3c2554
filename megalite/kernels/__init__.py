"""Triton fused kernels, each beside its PyTorch reference, behind one dispatch point."""
