"""Global batches that are the same samples, in the same order, for every layout and after a resume:
batch k starts where batch k-1 ended, and DP rank r takes the r-th contiguous slice of it, cut into
micro-batches in order (docs/data.md, "Batches and resume"). Under context parallelism the CP ranks of one DP
rank read the same samples, and each keeps its load-balanced chunks of every sequence (`context_parallel_split`)."""

import functools
import itertools
import os

import torch

from megalite.config.rules import check_batch_sizes, check_rampup, check_rampup_layout, global_batch_at
from megalite.data.worker_signals import leave_stop_signals_to, workers_starting
from megalite.errors import UserError


class MicroBatchSampler(torch.utils.data.Sampler):
    """Yields this DP rank's micro-batches (lists of sample indices) while whole global batches remain.
    rampup: --rampup-batch-size's START INCREMENT RAMPUP_SAMPLES, or None for a constant global batch."""

    def __init__(self, total_samples: int, consumed_samples: int, global_batch_size: int, micro_batch_size: int,
                 data_parallel_rank: int = 0, data_parallel_size: int = 1, rampup: list[int] | None = None):
        check_batch_sizes(global_batch_size, micro_batch_size, data_parallel_size)
        if rampup is not None:
            check_rampup(rampup, global_batch_size)
            check_rampup_layout(global_batch_size, rampup, micro_batch_size, data_parallel_size, 1, 1)
        if not 0 <= consumed_samples <= total_samples:
            raise UserError(f"the run has consumed {consumed_samples} samples but the dataset has {total_samples}; "
                            "train on more samples or check the checkpoint given to --load")
        self.total_samples, self.consumed_samples = total_samples, consumed_samples
        self.global_batch_size, self.rampup, self.micro_batch_size = global_batch_size, rampup, micro_batch_size
        self.data_parallel_rank, self.data_parallel_size = data_parallel_rank, data_parallel_size

    def global_batches(self):
        """(first sample, size) of each whole global batch left, in order."""
        start = self.consumed_samples
        while start + (size := global_batch_at(start, self.global_batch_size, self.rampup)) <= self.total_samples:
            yield start, size
            start += size

    def __len__(self) -> int:
        per_step = self.micro_batch_size * self.data_parallel_size
        return sum(size // per_step for _, size in self.global_batches())

    def __iter__(self):
        for batch_start, size in self.global_batches():
            rank_start = batch_start + self.data_parallel_rank * (size // self.data_parallel_size)
            for first in range(rank_start, rank_start + size // self.data_parallel_size, self.micro_batch_size):
                yield list(range(first, first + self.micro_batch_size))


def build_data_loader(dataset, consumed_samples: int, global_batch_size: int, micro_batch_size: int,
                      data_parallel_rank: int = 0, data_parallel_size: int = 1,
                      num_workers: int = 0, rampup: list[int] | None = None,
                      context_parallel_rank: int = 0, context_parallel_size: int = 1) -> torch.utils.data.DataLoader:
    """A DataLoader of micro-batches: dicts of `tokens`, `labels`, `loss_mask`, `position_ids`, each [micro, seq],
    or under context parallelism this CP rank's [micro, seq / CP] part (`context_parallel_split`). The data-
    parallel rank and size are the dense DP's: the CP ranks of one DP rank get the same samples. Its workers
    (`num_workers`) leave SIGINT and SIGTERM to this process (worker_signals.py); start them with `iterate(loader)`."""
    sampler = MicroBatchSampler(len(dataset), consumed_samples, global_batch_size,
                                micro_batch_size, data_parallel_rank, data_parallel_size, rampup)
    # An own generator: DataLoader draws its worker base seed when an iterator starts, and
    # drawing it from the global RNG would shift dropout after a resume.
    collate = None
    if context_parallel_size > 1:
        collate = functools.partial(_collate_context_parallel, context_parallel_rank, context_parallel_size)
    return torch.utils.data.DataLoader(
        dataset, batch_sampler=sampler, collate_fn=collate, num_workers=num_workers, persistent_workers=num_workers > 0,
        pin_memory=torch.cuda.is_available(), generator=torch.Generator().manual_seed(0),
        worker_init_fn=functools.partial(_init_worker, os.getpid()))


def context_parallel_positions(seq_length: int, cp_rank: int, cp_size: int) -> torch.Tensor:
    """The sequence positions CP rank `cp_rank` holds, int64 [seq_length / cp_size]: Megatron's load-balanced
    split cuts the sequence into 2 x CP equal chunks and the rank keeps chunks cp_rank and 2 x CP - 1 - cp_rank, so
    every rank does the same share of causal attention work. seq_length must be a multiple of 2 x CP."""
    chunk = seq_length // (2 * cp_size)
    first, second = cp_rank * chunk, (2 * cp_size - 1 - cp_rank) * chunk
    return torch.cat([torch.arange(first, first + chunk), torch.arange(second, second + chunk)])


def context_parallel_split(micro_batch: dict[str, torch.Tensor], cp_rank: int,
                           cp_size: int) -> dict[str, torch.Tensor]:
    """This CP rank's part of a micro-batch: each [b, s] tensor (`tokens`, `labels`, `loss_mask`, `position_ids`)
    at `context_parallel_positions`, [b, s / CP]. The labels were shifted by the dataset, before this split, so
    each kept token keeps its own next token as label; position ids (also reset ones) travel with their tokens."""
    if cp_size == 1:
        return micro_batch
    positions = context_parallel_positions(next(iter(micro_batch.values())).shape[1], cp_rank, cp_size)
    return {key: value.index_select(1, positions) for key, value in micro_batch.items()}


def _collate_context_parallel(cp_rank: int, cp_size: int, samples: list[dict]) -> dict[str, torch.Tensor]:
    return context_parallel_split(torch.utils.data.default_collate(samples), cp_rank, cp_size)


def _init_worker(main_pid: int, worker_id: int) -> None:
    leave_stop_signals_to(main_pid)


def iterate(loader: torch.utils.data.DataLoader):
    """`iter(loader)`, whose workers start with the stop signals held for their policy."""
    with workers_starting():
        return iter(loader)


def next_global_batch(micro_batches, num_microbatches: int) -> list[dict[str, torch.Tensor]]:
    """This rank's micro-batches of the next global batch, from a micro-batch iterator."""
    batch = list(itertools.islice(micro_batches, num_microbatches))
    if len(batch) < num_microbatches:
        raise RuntimeError("the data loader ran out before the run's last iteration: the datasets were built "
                           "for fewer samples than the run consumes")
    return batch
