"""Under context parallelism each rank holds part of every sequence's tokens: the loss normaliser counts the
global batch's tokens once (summed over DP x CP), and every rank reports the same global mean."""

import pytest

from megalite.data.loader import context_parallel_split
from megalite.model.gpt import build_model
from megalite.parallel_state import build_parallel_state
from megalite.run.training import forward_backward
from tests.helpers.distributed import run_world
from tests.helpers.pipeline import config, micro_batches


def _losses(rank, world_size):
    """(the loss forward_backward reports at CP 2, this rank's summed token losses, its token count)."""
    parallel = build_parallel_state(cp=2)
    model = build_model(config(tied=False), 0)
    mine = [context_parallel_split(batch, parallel.cp_rank, parallel.cp_size) for batch in micro_batches()]
    count = sum(float(batch["loss_mask"].sum()) for batch in mine)
    local_mean = float(forward_backward(model, mine))  # one process: the mean over this rank's tokens alone
    return float(forward_backward(model, mine, parallel=parallel)), local_mean * count, count


def test_the_loss_is_the_mean_over_the_tokens_of_every_context_parallel_rank():
    results = run_world(2, _losses)
    expected = sum(total for _, total, _ in results) / sum(count for _, _, count in results)
    assert [loss for loss, _, _ in results] == pytest.approx([expected] * 2, rel=1e-6)  # fp32 sums in another order
    assert results[0][1] / results[0][2] != pytest.approx(expected, rel=1e-3)  # the ranks' tokens differ
