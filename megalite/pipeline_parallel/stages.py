"""Which layers each pipeline rank holds, and the model chunks it builds from them.

The model's layers are cut into `P x V` virtual stages (P pipeline ranks, V model chunks
per rank). Megatron's interleaving: chunk `c` of rank `r` is virtual stage `v = c*P + r`,
so with P=2, V=2 and 8 layers rank 0 holds layers 0-1 and 4-5, rank 1 holds 2-3 and 6-7.
The first virtual stage also holds the embedding; the last one also holds the final
norm, the output layer and the loss.

Layers are split evenly, or with `first` / `last` layers on the first and last virtual
stage and the rest split evenly over the others (Megatron's
--decoder-first/last-pipeline-num-layers, for stages that also carry the embedding or
the output layer). Every virtual stage holds at least one layer. The split itself,
`virtual_stage_layers`, is pure arithmetic in megalite/config/rules.py, so the config
refuses a layout that does not split before any work starts.
"""

import torch
from torch import nn

from megalite.config import ModelConfig
from megalite.config.rules import virtual_stage_layers
from megalite.model.gpt import build_model
from megalite.parallel_state import ONE_PROCESS, ParallelState


def chunk_layers(num_layers: int, pp: int, pp_rank: int, vp: int = 1, first: int | None = None,
                 last: int | None = None) -> list[list[int]]:
    """The layer ids of each of rank `pp_rank`'s `vp` model chunks (chunk c = virtual stage c*pp + rank)."""
    stages = virtual_stage_layers(num_layers, pp, vp, first, last)
    return [stages[chunk * pp + pp_rank] for chunk in range(vp)]


class ModelChunks(nn.Module):
    """The model chunks one pipeline rank holds, seen as one model with global parameter names.

    `named_parameters()` and `state_dict()` yield every chunk's entries under their
    global names (`layers.5.mlp...`), exactly as one GPTModel holding them all would,
    so the optimizer and checkpoints need not know about chunks. Names never collide:
    each layer lives in one chunk, and only the first and the last virtual stage (never
    on the same rank when P > 1) hold the embedding or the output.
    """

    def __init__(self, chunks: list[nn.Module]):
        super().__init__()
        self.chunks = nn.ModuleList(chunks)

    def __len__(self) -> int:
        return len(self.chunks)

    def __getitem__(self, index: int) -> nn.Module:
        return self.chunks[index]

    def __iter__(self):
        return iter(self.chunks)

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        for chunk in self.chunks:
            yield from chunk.named_parameters(prefix, recurse, remove_duplicate)

    def state_dict(self, *args, **kwargs):
        merged = {}
        for chunk in self.chunks:
            merged.update(chunk.state_dict(*args, **kwargs))
        return merged

    def forward(self, *args, **kwargs):
        raise TypeError("ModelChunks is run chunk by chunk by megalite/pipeline_parallel/schedules.py")


def build_model_chunks(config: ModelConfig, seed: int, device="cpu", dtype: torch.dtype = torch.float32,
                       parallel: ParallelState = ONE_PROCESS, vp: int = 1, first: int | None = None,
                       last: int | None = None) -> ModelChunks:
    """This rank's `vp` chunks of the model (one GPTModel each), in chunk order.

    parallel: supplies pp_rank / pp_size (default: one process, one stage).
    """
    pp, pp_rank = parallel.pp_size, parallel.pp_rank
    layers = chunk_layers(config.num_layers, pp, pp_rank, vp, first, last)
    last_stage = pp * vp - 1
    chunks = []
    for chunk, layer_ids in enumerate(layers):
        stage = chunk * pp + pp_rank
        chunks.append(build_model(config, seed, device, dtype, layer_ids=layer_ids, pre_process=stage == 0,
                                  post_process=stage == last_stage, parallel=parallel))
    return ModelChunks(chunks)
