"""Global batches that are the same samples, in the same order, for every layout.

Global batch k holds samples `[c0 + k*G, c0 + (k+1)*G)`, where G is the global batch size
and c0 the samples consumed before this run started (resume). Data-parallel rank r takes
the slice `[r*G/dp, (r+1)*G/dp)` of each and cuts it into micro-batches in order, so the DP
slices concatenated are the DP=1 batch, and a resumed run continues exactly where it stopped.
"""

import itertools

import torch

from megalite.config.rules import check_batch_sizes
from megalite.errors import UserError


class MicroBatchSampler(torch.utils.data.Sampler):
    """Yields this DP rank's micro-batches (lists of sample indices) while whole global batches remain."""

    def __init__(self, total_samples: int, consumed_samples: int, global_batch_size: int,
                 micro_batch_size: int, data_parallel_rank: int = 0, data_parallel_size: int = 1):
        self.num_microbatches = check_batch_sizes(global_batch_size, micro_batch_size, data_parallel_size)
        if not 0 <= consumed_samples <= total_samples:
            raise UserError(f"the run has consumed {consumed_samples} samples but the dataset has {total_samples}; "
                            "train on more samples or check the checkpoint given to --load")
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.rank_offset = data_parallel_rank * (global_batch_size // data_parallel_size)

    def __len__(self) -> int:
        return (self.total_samples - self.consumed_samples) // self.global_batch_size * self.num_microbatches

    def __iter__(self):
        for batch_start in range(self.consumed_samples, self.total_samples - self.global_batch_size + 1,
                                 self.global_batch_size):
            for m in range(self.num_microbatches):
                first = batch_start + self.rank_offset + m * self.micro_batch_size
                yield list(range(first, first + self.micro_batch_size))


def build_data_loader(dataset, consumed_samples: int, global_batch_size: int, micro_batch_size: int,
                      data_parallel_rank: int = 0, data_parallel_size: int = 1,
                      num_workers: int = 0) -> torch.utils.data.DataLoader:
    """A DataLoader of micro-batches: dicts of `tokens`, `labels`, `loss_mask`, `position_ids`, each [micro, seq]."""
    sampler = MicroBatchSampler(len(dataset), consumed_samples, global_batch_size,
                                micro_batch_size, data_parallel_rank, data_parallel_size)
    # An own generator: DataLoader draws its worker base seed when an iterator starts, and
    # drawing it from the global RNG would shift dropout after a resume.
    return torch.utils.data.DataLoader(
        dataset, batch_sampler=sampler, num_workers=num_workers,
        persistent_workers=num_workers > 0, pin_memory=torch.cuda.is_available(),
        generator=torch.Generator().manual_seed(0),
    )


def next_global_batch(micro_batches, num_microbatches: int) -> list[dict[str, torch.Tensor]]:
    """This rank's micro-batches of the next global batch, from a micro-batch iterator."""
    batch = list(itertools.islice(micro_batches, num_microbatches))
    if len(batch) < num_microbatches:
        raise RuntimeError("the data loader ran out before the run's last iteration: the datasets were built "
                           "for fewer samples than the run consumes")
    return batch
