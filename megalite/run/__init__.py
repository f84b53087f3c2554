"""A training run: the loop (training.py) and what surrounds it, one concern per module."""
