"""Tensor-parallel layers: ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding. Each reads its TP rank,
size, group and SP flag from `parallel` (default one process: plain `F.linear` / `F.embedding`). Each weight is drawn as
the full tensor from (seed, global name), then sliced, so initialisation is layout-independent. Parameter attributes,
read by grad clipping, DDP, SP and checkpoints: `tensor_model_parallel` (sharded, else replicated), `partition_dim` and
`partition_chunks` (see shard_full_tensor), `sequence_parallel` (acts on sequence-split activations: its grads are
summed over TP under SP)."""

import hashlib

import torch
import torch.nn.functional as F
from torch import nn

from megalite.parallel_state import ONE_PROCESS, ParallelState
from megalite.tensor_parallel.comm import (copy_to_tensor_parallel_region, divide, gather_from_sequence_parallel_region,
                                           reduce_from_tensor_parallel_region,
                                           reduce_scatter_to_sequence_parallel_region)
from megalite.tensor_parallel.grad_accumulation import linear


def init_full_tensor(shape: tuple[int, ...], std: float, seed: int, name: str,
                     real_rows: int | None = None) -> torch.Tensor:
    """The full fp32 CPU tensor normal(0, std) for parameter `name`; with `real_rows` only those rows are
    drawn and the rest (vocabulary padding) are zero, whatever padding TP adds."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()  # stable across runs, processes and platforms
    generator = torch.Generator(device="cpu").manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))
    rows = shape[0] if real_rows is None else real_rows
    # Explicitly on the CPU: models are built under a default-device context (cuda, meta).
    full = torch.zeros(shape, dtype=torch.float32, device="cpu")
    full[:rows].normal_(0.0, std, generator=generator)
    return full


def shard_full_tensor(full: torch.Tensor, dim: int, rank: int, size: int, chunks: int = 1) -> torch.Tensor:
    """Rank `rank`'s shard of `full` along `dim` among `size` ranks; with `chunks` > 1 its slice of
    each of that many equal blocks (SwiGLU's [gate; up]), in order, so the shard splits alike."""
    blocks = full.chunk(chunks, dim=dim)
    return torch.cat([block.chunk(size, dim=dim)[rank] for block in blocks], dim=dim)


def mark_parameter(param: nn.Parameter, tensor_model_parallel: bool, partition_dim: int = -1,
                   sequence_parallel: bool = False, partition_chunks: int = 1) -> nn.Parameter:
    """Set the attributes described in the module docstring; return the parameter."""
    param.tensor_model_parallel = tensor_model_parallel
    param.partition_dim = partition_dim
    param.partition_chunks = partition_chunks
    param.sequence_parallel = sequence_parallel
    return param


def tensor_parallel_group(parallel: ParallelState):
    """The group the comm.py collectives take: `parallel.tp_group`, or None at TP=1, so they
    return at once without asking torch.distributed (and a compiled graph holds no group)."""
    if parallel.tp_size == 1:
        return None
    if parallel.tp_group is None:
        raise ValueError(f"tensor-parallel size {parallel.tp_size} needs a process group, got tp_group=None")
    return parallel.tp_group


def initialize(module: nn.Module, seed: int, prefix: str = "") -> None:
    """Call `init_weights(seed, global name)` on `module` (named `prefix`) and every submodule that has one."""
    for name, submodule in module.named_modules(prefix=prefix):
        if hasattr(submodule, "init_weights"):
            submodule.init_weights(seed, name)


class ColumnParallelLinear(nn.Module):
    """y = x A^T + b with A's rows (output features) split across TP ranks: `[*, in]` (TP+SP: `[s/tp, b, in]`,
    all-gathered) -> `[*, out/tp]`. output_chunks: the output is that many equal blocks sharded block by block.
    skip_weight_param: the weight is passed to forward (tied output layer). real_output_size: rows from it on
    are padding."""

    def __init__(self, input_size: int, output_size: int, *, bias: bool = True, init_std: float = 0.02,
                 output_chunks: int = 1, skip_weight_param: bool = False, real_output_size: int | None = None,
                 parallel: ParallelState = ONE_PROCESS):
        super().__init__()
        self.tp_rank, self.tp_size = parallel.tp_rank, parallel.tp_size
        self.tp_group, self.sequence_parallel = tensor_parallel_group(parallel), parallel.sequence_parallel
        self.input_size, self.output_size = input_size, output_size
        self.output_size_per_partition = divide(output_size, self.tp_size, "output size")
        if output_size % (output_chunks * self.tp_size):
            raise ValueError(f"output size {output_size} ({output_chunks} equal blocks) is not divisible into "
                             f"{output_chunks} x tensor-parallel size {self.tp_size} parts")
        self.init_std, self.output_chunks, self.real_output_size = init_std, output_chunks, real_output_size
        rows = self.output_size_per_partition
        self.weight = None if skip_weight_param else mark_parameter(
            nn.Parameter(torch.empty(rows, input_size)), True, 0, partition_chunks=output_chunks)
        self.bias = None
        if bias:
            self.bias = mark_parameter(nn.Parameter(torch.empty(rows)), True, 0, partition_chunks=output_chunks)

    def init_weights(self, seed: int, prefix: str) -> None:
        with torch.no_grad():
            if self.weight is not None:
                full = init_full_tensor((self.output_size, self.input_size), self.init_std, seed,
                                        f"{prefix}.weight", self.real_output_size)
                self.weight.copy_(shard_full_tensor(full, 0, self.tp_rank, self.tp_size, self.output_chunks))
            if self.bias is not None:
                self.bias.zero_()

    def forward(self, input: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        if self.sequence_parallel:
            input = gather_from_sequence_parallel_region(input, self.tp_group)  # [s/tp, b, in] -> [s, b, in]
        else:
            input = copy_to_tensor_parallel_region(input, self.tp_group)
        if weight is None or weight is self.weight:
            return linear(input, self.weight, self.bias)
        return F.linear(input, weight, self.bias)  # a tied weight, used elsewhere too: autograd sums its grads

    def extra_repr(self) -> str:
        return f"in={self.input_size}, out={self.output_size}, tp={self.tp_size}, bias={self.bias is not None}"


class RowParallelLinear(nn.Module):
    """y = x A^T + b with A's columns (input features) split across TP ranks: `[*, in/tp]` -> `[*, out]` summed
    over TP (TP+SP: `[s/tp, b, out]`)."""

    def __init__(self, input_size: int, output_size: int, *, bias: bool = True, init_std: float = 0.02,
                 parallel: ParallelState = ONE_PROCESS):
        super().__init__()
        self.tp_rank, self.tp_size = parallel.tp_rank, parallel.tp_size
        self.tp_group, self.sequence_parallel = tensor_parallel_group(parallel), parallel.sequence_parallel
        self.input_size, self.output_size = input_size, output_size
        self.input_size_per_partition = divide(input_size, self.tp_size, "input size")
        self.init_std = init_std
        self.weight = mark_parameter(nn.Parameter(torch.empty(output_size, self.input_size_per_partition)), True, 1)
        self.bias = None
        if bias:
            self.bias = mark_parameter(nn.Parameter(torch.empty(output_size)), False, sequence_parallel=True)

    def init_weights(self, seed: int, prefix: str) -> None:
        with torch.no_grad():
            full = init_full_tensor((self.output_size, self.input_size), self.init_std, seed, f"{prefix}.weight")
            self.weight.copy_(shard_full_tensor(full, 1, self.tp_rank, self.tp_size))
            if self.bias is not None:
                self.bias.zero_()

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        output = linear(input, self.weight)  # this rank's partial sum
        if self.sequence_parallel:
            output = reduce_scatter_to_sequence_parallel_region(output, self.tp_group)  # -> [s/tp, b, out]
        else:
            output = reduce_from_tensor_parallel_region(output, self.tp_group)
        if self.bias is not None:
            output = output + self.bias
        return output

    extra_repr = ColumnParallelLinear.extra_repr


class VocabParallelEmbedding(nn.Module):
    """Embedding table `[num, dim]` with rows (vocabulary) split across TP ranks: ids `[*]` -> `[*, dim]`,
    each rank's rows looked up, summed over TP. `real_num_embeddings`: rows from it on are padding."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *, init_std: float = 0.02,
                 real_num_embeddings: int | None = None, parallel: ParallelState = ONE_PROCESS):
        super().__init__()
        self.tp_rank, self.tp_size, self.tp_group = parallel.tp_rank, parallel.tp_size, tensor_parallel_group(parallel)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.num_embeddings_per_partition = divide(num_embeddings, self.tp_size, "vocabulary size")
        self.vocab_start_index = self.tp_rank * self.num_embeddings_per_partition
        self.init_std, self.real_num_embeddings = init_std, real_num_embeddings
        self.weight = mark_parameter(
            nn.Parameter(torch.empty(self.num_embeddings_per_partition, embedding_dim)), True, 0)

    def init_weights(self, seed: int, prefix: str) -> None:
        with torch.no_grad():
            full = init_full_tensor((self.num_embeddings, self.embedding_dim), self.init_std, seed,
                                    f"{prefix}.weight", self.real_num_embeddings)
            self.weight.copy_(shard_full_tensor(full, 0, self.tp_rank, self.tp_size))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local_ids = input_ids - self.vocab_start_index
        elsewhere = (local_ids < 0) | (local_ids >= self.num_embeddings_per_partition)  # another rank's row
        output = F.embedding(local_ids.masked_fill(elsewhere, 0), self.weight)
        output = output.masked_fill(elsewhere.unsqueeze(-1), 0.0)
        return reduce_from_tensor_parallel_region(output, self.tp_group)

    def extra_repr(self) -> str:
        return f"num={self.num_embeddings}, dim={self.embedding_dim}, tp={self.tp_size}"

