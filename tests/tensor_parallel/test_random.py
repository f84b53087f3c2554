"""The RNG tracker: per-TP-rank streams that leave the default RNG alone, exact save/restore,
and recomputation that replays the forked stream. (Across real ranks: test_tp_worlds.py.)"""

import pytest
import torch
import torch.nn.functional as F

from megalite.tensor_parallel.random import (RNGStatesTracker, TENSOR_PARALLEL_RNG, checkpoint,
                                             model_parallel_rng_tracker, model_parallel_seed)


def masks(tp_rank: int, pp_rank: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(default mask, forked mask, default mask after the fork) of a freshly seeded rank."""
    model_parallel_seed(1234, tp_rank=tp_rank, pp_rank=pp_rank)
    ones = torch.ones(512)
    default = F.dropout(ones, 0.5)
    with model_parallel_rng_tracker.fork():
        forked = F.dropout(ones, 0.5)
    return default, forked, F.dropout(ones, 0.5)


def test_forked_masks_differ_between_tp_ranks_and_default_masks_do_not():
    default0, forked0, after0 = masks(tp_rank=0)
    default1, forked1, after1 = masks(tp_rank=1)
    assert torch.equal(default0, default1) and torch.equal(after0, after1)
    assert not torch.equal(forked0, forked1)
    assert not torch.equal(forked0, default0)
    # Another pipeline stage draws other default masks (seed + 100 * pp_rank).
    assert not torch.equal(masks(tp_rank=0, pp_rank=1)[0], default0)


def test_a_fork_does_not_advance_the_default_stream():
    model_parallel_seed(7, tp_rank=0)
    expected = torch.rand(16)
    model_parallel_seed(7, tp_rank=0)
    with model_parallel_rng_tracker.fork():
        torch.rand(1000)
    assert torch.equal(torch.rand(16), expected)


def test_states_round_trip_exactly():
    model_parallel_seed(7, tp_rank=3)
    with model_parallel_rng_tracker.fork():
        torch.rand(5)  # advance it: a restored state is not just a re-seed
    saved = model_parallel_rng_tracker.get_states()
    assert set(saved) == {TENSOR_PARALLEL_RNG} and saved[TENSOR_PARALLEL_RNG].dtype == torch.uint8
    with model_parallel_rng_tracker.fork():
        first = torch.rand(8)
    model_parallel_rng_tracker.set_states(saved)
    with model_parallel_rng_tracker.fork():
        assert torch.equal(torch.rand(8), first)
    # get_states hands out copies: drawing later does not change a saved dict.
    model_parallel_rng_tracker.set_states(saved)
    with model_parallel_rng_tracker.fork():
        assert torch.equal(torch.rand(8), first)


def test_untracked_states_are_refused():
    with pytest.raises(KeyError, match="model_parallel_seed"):
        with RNGStatesTracker().fork():
            pass


def test_checkpoint_replays_the_forked_stream_in_recomputation():
    def block(x):
        with model_parallel_rng_tracker.fork():
            x = F.dropout(x, 0.5)
        return F.dropout(x.sin(), 0.5)  # and one default-RNG dropout

    x = torch.randn(64)
    grads, states = [], []
    for recompute in (False, True):
        model_parallel_seed(11, tp_rank=1)
        inputs = x.clone().requires_grad_()
        output = checkpoint(block, inputs) if recompute else block(inputs)
        with model_parallel_rng_tracker.fork():
            torch.rand(3)  # the stream moves on between forward and backward
        output.sum().backward()
        grads.append(inputs.grad)
        states.append(model_parallel_rng_tracker.get_states()[TENSOR_PARALLEL_RNG])
    assert torch.equal(grads[0], grads[1])
    assert torch.equal(states[0], states[1])  # recomputation leaves the tracker where it was


def test_context_parallel_ranks_drop_other_positions_of_their_tokens():
    """Under CP each rank holds other chunks of the sequence: its residual dropout masks come from its own
    tracker stream (seeded by its CP rank), not from the default stream every rank of a stage shares."""
    from megalite.model.transformer import hidden_dropout
    from megalite.parallel_state import ParallelState

    def mask(cp_rank: int) -> torch.Tensor:
        model_parallel_seed(1234, tp_rank=0, cp_rank=cp_rank)
        return hidden_dropout(torch.ones(8, 2, 16), 0.5, True, ParallelState(cp_size=2, cp_rank=cp_rank))

    assert not torch.equal(mask(0), mask(1))
    assert torch.equal(mask(1), mask(1))  # each rank's stream is its seed's
