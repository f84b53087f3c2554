"""Tensor and sequence parallelism: autograd collectives (comm.py) and parallel layers (layers.py)."""
