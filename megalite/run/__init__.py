"""A training run: the loop and what surrounds it, one concern per module.

    training.py     Trainer and pretrain(): build, load, iterate, evaluate, save, stop
    data.py         the built-in corpus for the default run; datasets sized for the run
    lr_schedule.py  LRSchedule: the learning rate of every iteration
    resilience.py   signals (one SIGTERM/SIGINT owner), dead peers, divergence, loss spikes,
                    skipped steps, when to stop, token-id checks
    flops.py        model FLOPs per iteration and the peak FLOP/s of a device (MFU)
    metrics.py      the metrics JSONL file: its keys, writing, trimming on resume, reading
    logger.py       TrainingLogger: Megatron's log line, progress bar, metrics records
    tracking.py     wandb and TensorBoard
    generation.py   sampling a continuation from a trained model

The entry points below are imported on first use, so that a module of this package (the
command line reads tracking's wandb defaults) can be imported without the training loop.
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
