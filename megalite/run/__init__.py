"""A training run: the loop (training.py) and what surrounds it, one concern per module.

The entry points below are imported on first use, so that a module of this package (the command line
reads tracking's wandb defaults) can be imported without the training loop.
"""

_EXPORTS = {
    "pretrain": "megalite.run.training",
    "Trainer": "megalite.run.training",
    "TrainState": "megalite.run.training",
    "generate": "megalite.run.generation",
    "hold_signals_until_exit": "megalite.run.resilience",
    "read_metrics_records": "megalite.run.metrics",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'megalite.run' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_EXPORTS[name]), name)
