"""Global batches: the same samples for every layout, and exact resume."""

import pytest
import torch

from megalite.data import build_data_loader, build_gpt_datasets
from megalite.data.loader import MicroBatchSampler, context_parallel_positions, next_global_batch
from megalite.config.rules import global_batch_at, iterations_for_samples
from megalite.errors import UserError

GLOBAL, MICRO = 8, 2


@pytest.fixture(scope="module")
def dataset():
    return build_gpt_datasets(None, "1,0,0", 16, 3, (200, 0, 0), mock_vocab_size=64, eod=64)[0]


def batches(dataset, consumed, dp_rank=0, dp_size=1, micro=MICRO, iterations=5, cp=(0, 1)):
    loader = iter(build_data_loader(dataset, consumed, GLOBAL, micro, dp_rank, dp_size, context_parallel_rank=cp[0],
                                    context_parallel_size=cp[1]))
    num_micro = GLOBAL // (micro * dp_size)
    return [next_global_batch(loader, num_micro) for _ in range(iterations)]


def concat(micro_batches, key="tokens"):
    return torch.cat([mb[key] for mb in micro_batches])


def test_global_batch_k_is_samples_k_times_g(dataset):
    for k, batch in enumerate(batches(dataset, 0)):
        expected = torch.stack([dataset[i]["tokens"] for i in range(k * GLOBAL, (k + 1) * GLOBAL)])
        assert torch.equal(concat(batch), expected)
        assert batch[0]["loss_mask"].shape == (MICRO, 16) and batch[0]["position_ids"].dtype == torch.int64


def test_resume_from_consumed_samples_gives_identical_batches(dataset):
    full = batches(dataset, 0, iterations=6)
    resumed = batches(dataset, 3 * GLOBAL, iterations=3)
    for a, b in zip(full[3:], resumed):
        for key in ("tokens", "labels", "loss_mask", "position_ids"):
            assert torch.equal(concat(a, key), concat(b, key))


@pytest.mark.parametrize("dp_size, micro", [(2, 1), (2, 2), (4, 2), (8, 1)])
def test_dp_slices_concatenate_to_the_dp1_batch(dataset, dp_size, micro):
    reference = batches(dataset, 0)
    per_rank = [batches(dataset, 0, r, dp_size, micro) for r in range(dp_size)]
    for k in range(len(reference)):
        joined = torch.cat([concat(per_rank[r][k]) for r in range(dp_size)])
        assert torch.equal(joined, concat(reference[k]))


def test_loader_stops_before_a_partial_global_batch():
    sampler = MicroBatchSampler(20, 0, GLOBAL, MICRO)
    assert len(list(sampler)) == len(sampler) == 2 * (GLOBAL // MICRO)


def test_batch_size_errors_name_the_flags():
    with pytest.raises(UserError, match="--global-batch-size 10 is not a multiple of --micro-batch-size 4"):
        MicroBatchSampler(100, 0, 10, 4, 0, 1)
    with pytest.raises(UserError, match="x data-parallel size 4 = 8"):
        MicroBatchSampler(100, 0, 12, 2, 0, 4)
    with pytest.raises(UserError, match="consumed 500 samples"):
        MicroBatchSampler(100, 500, 8, 2)


# --rampup-batch-size 4 4 24 up to 16: 3 increments of 24 / 3 = 8 samples each (Megatron's
# RampupBatchsizeNumMicroBatchesCalculator): consumed 0, 4 -> 4; 8 -> 8; 16 -> 12; 28 > 24 -> 16.
RAMPUP, RAMPUP_GLOBAL = [4, 4, 24], 16


def ramp_batches(dataset, consumed, dp_rank=0, dp_size=1, micro=1):
    """The sample ids of each global batch left, as this DP rank sees them, from `consumed` on."""
    sampler = MicroBatchSampler(len(dataset), consumed, RAMPUP_GLOBAL, micro, dp_rank, dp_size, RAMPUP)
    micro_batches, result = iter(sampler), []
    for start, size in sampler.global_batches():
        result.append(sum((next(micro_batches) for _ in range(size // (micro * dp_size))), []))
    assert next(micro_batches, None) is None
    return result


def test_rampup_follows_megatron_s_schedule_and_takes_every_sample_once_in_order():
    dataset = range(100)
    batches = ramp_batches(dataset, 0)
    assert [len(batch) for batch in batches] == [4, 4, 8, 12] + [16] * 4  # 100 - 28 = 72 = 4 x 16 + 8 left over
    assert sum(batches, []) == list(range(92))
    assert [global_batch_at(c, RAMPUP_GLOBAL, RAMPUP) for c in (0, 4, 7, 8, 15, 16, 24, 25)] == \
        [4, 4, 4, 8, 8, 12, 16, 16]
    # Megatron's count of iterations for --train-samples: the ramp's while at most 24 are consumed, then whole batches.
    assert iterations_for_samples(100, RAMPUP_GLOBAL, RAMPUP) == 4 + (100 - 28) // 16
    assert iterations_for_samples(96, RAMPUP_GLOBAL, None) == 6


@pytest.mark.parametrize("dp_size, micro", [(2, 1), (2, 2), (4, 1)])
def test_rampup_dp_slices_concatenate_to_the_one_process_batch(dp_size, micro):
    dataset = range(100)
    reference = ramp_batches(dataset, 0)
    per_rank = [ramp_batches(dataset, 0, rank, dp_size, micro) for rank in range(dp_size)]
    assert [sum((ranks[k] for ranks in per_rank), []) for k in range(len(reference))] == reference


def test_rampup_resumes_mid_ramp_where_it_stopped():
    dataset = range(100)
    assert ramp_batches(dataset, 8) == ramp_batches(dataset, 0)[2:]
    assert ramp_batches(dataset, 16)[0] == list(range(16, 28))


def test_rampup_errors_name_the_flag():
    with pytest.raises(UserError, match="--rampup-batch-size 4 4 24 reaches a global batch of 4, which is not a "
                                        "multiple of --micro-batch-size 1 x data-parallel size 8"):
        MicroBatchSampler(100, 0, 16, 1, 0, 8, RAMPUP)
    with pytest.raises(UserError, match="takes three numbers"):
        MicroBatchSampler(100, 0, 16, 1, 0, 1, [4, 4])
    with pytest.raises(UserError, match="must reach --global-batch-size 16"):
        MicroBatchSampler(100, 0, 16, 1, 0, 1, [6, 4, 24])


def test_context_parallel_positions_are_megatron_s_load_balanced_chunks():
    assert context_parallel_positions(8, 0, 2).tolist() == [0, 1, 6, 7]
    assert context_parallel_positions(8, 1, 2).tolist() == [2, 3, 4, 5]
    assert [context_parallel_positions(16, r, 4).tolist()[::2] for r in range(4)] == [[0, 14], [2, 12], [4, 10],
                                                                                       [6, 8]]
    every = torch.cat([context_parallel_positions(24, r, 3) for r in range(3)])
    assert sorted(every.tolist()) == list(range(24))


@pytest.fixture(scope="module")
def documents():
    """Short documents (EOD inside every sample), with reset position ids and the EOD loss masked."""
    return build_gpt_datasets(None, "1,0,0", 16, 3, (200, 0, 0), mock_vocab_size=8, eod=8,
                              eod_mask_loss=True, reset_position_ids=True)[0]


@pytest.mark.parametrize("dp_size, cp_size", [(1, 2), (2, 2), (1, 4)])
def test_cp_ranks_of_a_dp_rank_read_the_same_samples_and_their_chunks_rebuild_them(documents, dp_size, cp_size):
    """Every per-token field (labels shifted before the split, reset positions, the EOD mask) travels with its
    token: putting each CP rank's [b, s/CP] back at its positions rebuilds the DP rank's [b, s] micro-batches."""
    assert (documents[0]["position_ids"] != torch.arange(16)).any() and (documents[0]["loss_mask"] == 0).any()
    for dp_rank in range(dp_size):
        whole = batches(documents, 0, dp_rank, dp_size, iterations=2)
        parts = [batches(documents, 0, dp_rank, dp_size, iterations=2, cp=(r, cp_size)) for r in range(cp_size)]
        for k, batch in enumerate(whole):
            for key in ("tokens", "labels", "loss_mask", "position_ids"):
                rebuilt = torch.empty_like(concat(batch, key))
                for cp_rank in range(cp_size):
                    rebuilt[:, context_parallel_positions(16, cp_rank, cp_size)] = concat(parts[cp_rank][k], key)
                assert torch.equal(rebuilt, concat(batch, key)), key
            assert parts[0][k][0]["tokens"].shape == (MICRO, 16 // cp_size)
