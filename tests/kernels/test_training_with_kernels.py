"""A tiny model trained with --kernels triton (the interpreter on CPU) follows --kernels torch."""

import pytest

from megalite import kernels
from tools.check_layouts import COMMON, MODELS, run
from tools.loss_compare import compare, read_losses

pytestmark = [pytest.mark.skipif(not kernels.triton_available(), reason="triton is not installed"),
              pytest.mark.interpreter]  # the runs are CPU worlds (tools/check_layouts.py)


# llama: RMSNorm, rotary, SwiGLU, the chunked output layer + loss with z-loss;
# gpt: LayerNorm and the (unfused) cross-entropy kernel.
@pytest.mark.parametrize("model,extra", [("llama", ["--fused-output-cross-entropy", "--z-loss-weight", "1e-3"]),
                                         ("gpt", [])])
def test_three_iterations_with_triton_kernels_match_torch_kernels(model, extra, tmp_path):
    # The interpreter runs one Python loop per kernel program (per token for most kernels): few tokens
    # per micro-batch, and no evaluation (forwards the training iterations already run), keep it short.
    flags = [*COMMON, *MODELS[model], *extra, "--train-iters", "3", "--num-layers", "2", "--seq-length", "8",
             "--micro-batch-size", "1", "--global-batch-size", "2", "--eval-iters", "0"]
    losses = {}
    for mode in ("torch", "triton"):
        metrics = str(tmp_path / f"{mode}.jsonl")
        run(1, [*flags, "--kernels", mode], metrics)
        losses[mode] = read_losses(metrics)
    rows, worst = compare(losses["torch"], losses["triton"])
    assert len(rows) == 3 and worst <= 1e-5
