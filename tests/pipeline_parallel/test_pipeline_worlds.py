"""Pipeline schedules on gloo worlds against one process: loss and every gradient.

Each world builds its pipeline ranks' model chunks from the same seed as a one-process
model, runs one global batch through the real schedule (1F1B, interleaved, with TP and
SP) and returns its parameters' grads by global name; the test compares them with the
one-process grads. One world per layout runs every check.
"""

import pytest
import torch

from megalite.data_parallel.ddp import ParallelModel
from megalite.parallel_state import build_parallel_state
from megalite.pipeline_parallel.comm import PipelineComm
from megalite.pipeline_parallel.schedules import ScheduleRunner
from megalite.pipeline_parallel.stages import build_model_chunks
from megalite.run.training import forward_backward
from tests.helpers.distributed import run_world
from tests.helpers.pipeline import MICRO, SEQ, config, full_grads, micro_batches


class Unscaled:
    """The one optimizer method the schedule calls."""

    @staticmethod
    def scale_loss(loss):
        return loss


def pipeline_world(rank, world_size, tp, pp, vp, sequence_parallel, tied):
    """One global batch through the schedule: (loss, grads by global name, the storage bytes of
    each sent output at the time of its backward)."""
    parallel = build_parallel_state(tp, pp, sequence_parallel=sequence_parallel)
    model = build_model_chunks(config(tied), seed=11, parallel=parallel, vp=vp)
    ddp = ParallelModel(model, parallel)  # grads accumulate in its buffer (param.main_grad)
    tokens = SEQ // tp if sequence_parallel else SEQ
    comm = PipelineComm(parallel, (tokens, MICRO, 32), torch.float32)
    released = []

    class Watching(ScheduleRunner):
        def _backward(self, op):
            output = self.saved[(op.chunk, op.microbatch)][1]
            released.append(output.untyped_storage().nbytes() if not self.chunks[op.chunk].post_process else None)
            super()._backward(op)

    import megalite.run.training as training

    original = training.ScheduleRunner
    training.ScheduleRunner = Watching
    try:
        loss = float(forward_backward(model, micro_batches(), Unscaled(), parallel, comm))
    finally:
        training.ScheduleRunner = original
    ddp.finish_grad_sync()  # the tied embedding's sum over its stages, SP grads over TP
    for param in model.parameters():
        param.grad = param.main_grad
    return loss, full_grads(model, parallel), [size for size in released if size is not None]


@pytest.fixture(scope="module")
def single():
    """The one-process loss and grads, tied and untied."""
    references = {}
    for tied in (False, True):
        model = build_model_chunks(config(tied), seed=11)
        loss = float(forward_backward(model, micro_batches(), Unscaled()))
        references[tied] = (loss, {name: param.grad.clone() for name, param in model.named_parameters()})
    return references


LAYOUTS = {  # name -> (tp, pp, vp, sequence parallel, tied, tolerance)
    "pp2-1f1b-untied": (1, 2, 1, False, False, 1e-6),
    "pp2-interleaved-tied": (1, 2, 2, False, True, 1e-6),
    "pp4-1f1b-tied": (1, 4, 1, False, True, 1e-6),
    "pp2-vp2-tp2-sp-untied": (2, 2, 2, True, False, 1e-5),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_pipeline_matches_one_process_loss_and_grads(layout, single, one_thread):
    tp, pp, vp, sequence_parallel, tied, tolerance = LAYOUTS[layout]
    results = run_world(tp * pp, pipeline_world, tp, pp, vp, sequence_parallel, tied)
    loss, grads = single[tied]
    seen, released = set(), []
    for rank, (rank_loss, rank_grads, rank_released) in enumerate(results):
        assert abs(rank_loss - loss) <= tolerance * abs(loss), (rank, rank_loss, loss)  # every rank gets it
        for name, grad in rank_grads.items():
            torch.testing.assert_close(grad, grads[name], rtol=tolerance, atol=tolerance, msg=name)
            seen.add(name)
        released += rank_released
    assert seen == set(grads)  # every parameter lives on some rank
    # Every output sent to the next stage was freed before its backward (a 1-element placeholder).
    assert released and max(released) <= 4
