"""Global batches: the same samples for every layout, and exact resume."""

import pytest
import torch

from megalite.data import build_data_loader, build_gpt_datasets
from megalite.data.loader import MicroBatchSampler, next_global_batch
from megalite.errors import UserError

GLOBAL, MICRO = 8, 2


@pytest.fixture(scope="module")
def dataset():
    return build_gpt_datasets(None, "1,0,0", 16, 3, (200, 0, 0), mock_vocab_size=64, eod=64)[0]


def batches(dataset, consumed, dp_rank=0, dp_size=1, micro=MICRO, iterations=5):
    loader = iter(build_data_loader(dataset, consumed, GLOBAL, micro, dp_rank, dp_size))
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
