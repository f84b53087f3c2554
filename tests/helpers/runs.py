"""Training runs of pretrain_gpt.py on CPU ranks (tools/check_layouts.py's `run`), read back as
their losses, and the comparison of two runs' losses."""

import os

from tools.check_layouts import COMMON, MODELS, run
from tools.loss_compare import compare, read_losses

# A small model on mock data, for runs in process (megalite.run.training.pretrain).
SMALL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--group-query-attention",
         "--num-query-groups", "2", "--ffn-hidden-size", "64", "--seq-length", "16", "--micro-batch-size", "2",
         "--global-batch-size", "4", "--lr", "3e-3", "--lr-warmup-iters", "2", "--eval-interval", "3",
         "--eval-iters", "1", "--log-interval", "2"]
MOCK = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "99"]

# The layout tests' run: the llama model of tools/check_layouts.py for 4 iterations.
FLAGS = [*COMMON, *MODELS["llama"], "--train-iters", "4", "--eval-interval", "2"]


def train_logged(folder, processes: int, *flags: str, load: bool = False, base: list[str] = FLAGS) -> tuple[dict, str]:
    """Run pretrain_gpt.py with `base` + `flags` saving into `folder` (resuming from it with `load`);
    its losses and standard output."""
    out = run(processes, [*base, *flags, "--save", str(folder), *(["--load", str(folder)] if load else [])],
              os.path.join(folder, "metrics.jsonl"))
    return read_losses(os.path.join(folder, "metrics.jsonl")), out


def train(folder, processes: int, *flags: str, load: bool = False, base: list[str] = FLAGS) -> dict:
    """train_logged's losses."""
    return train_logged(folder, processes, *flags, load=load, base=base)[0]


def assert_matches(reference: dict, losses: dict, records: int, tolerance: float = 1e-5) -> None:
    rows, worst = compare({key: reference[key] for key in losses}, losses)
    assert len(rows) == records and worst <= tolerance
    assert len({row[2] for row in rows}) == records  # the losses move: a real comparison
