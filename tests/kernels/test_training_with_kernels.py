"""A tiny model trained with --kernels triton (the interpreter on CPU) follows --kernels torch."""

import pytest

from megalite import kernels
from tools.check_layouts import COMMON, MODELS, run
from tools.loss_compare import compare, read_losses

pytestmark = pytest.mark.skipif(not kernels.triton_available(), reason="triton is not installed")


@pytest.mark.parametrize("model", ["llama", "gpt"])  # RMSNorm; LayerNorm
def test_three_iterations_with_triton_kernels_match_torch_kernels(model, tmp_path):
    flags = [*COMMON, *MODELS[model], "--train-iters", "3", "--num-layers", "2"]
    losses = {}
    for mode in ("torch", "triton"):
        metrics = str(tmp_path / f"{mode}.jsonl")
        run(1, [*flags, "--kernels", mode], metrics)
        losses[mode] = read_losses(metrics)
    rows, worst = compare(losses["torch"], losses["triton"])
    assert len(rows) == 5 and worst <= 1e-5
