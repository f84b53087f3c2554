"""The start-up line says what a run is: its model (by its preset's name only when it is the preset), the
parameters and the layout. Multi-process worlds print it once: tests/test_parallel_training.py."""

import torch

from megalite.arguments import parse_args
from megalite.run.training import startup_line

TINY_SHAPE = "4 layers, hidden 256, vocab 8192 (padded 8192), seq 256, "


def line_of(*flags: str, vocab: int = 8192) -> str:
    """The start-up line of a one-process run of `flags` whose tokenizer has `vocab` tokens."""
    return startup_line(parse_args(list(flags)).with_tokenizer_vocab(vocab), 0, torch.device("cpu"))


def test_a_run_names_its_preset_only_when_its_model_is_the_preset():
    assert line_of().startswith(f"model tiny: 7,096,576 parameters, {TINY_SHAPE}")
    assert "rank" not in line_of()  # one process: no layout
    # How the model is trained changes nothing it is; tiny has no biases already.
    trained_otherwise = line_of("--recompute-activations", "--hidden-dropout", "0.1", "--init-method-std", "0.01",
                                "--disable-bias-linear")
    assert trained_otherwise.startswith(f"model tiny: 7,096,576 parameters, {TINY_SHAPE}")
    assert line_of("--num-layers", "2").startswith("custom model (--model tiny with num_layers 2): 5,645,568 "
                                                   "parameters, 2 layers, hidden 256, ")
    assert line_of(vocab=1000).startswith("custom model (--model tiny with vocabulary 1000): 3,426,560 parameters")
    assert line_of("--model", "gpt2-124m", vocab=50257).startswith("model gpt2-124m: 124,475,904 parameters")
