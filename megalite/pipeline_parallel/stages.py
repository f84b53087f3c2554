"""Which layers each pipeline rank holds, and the model chunks it builds from them. The layers are cut into P
x V virtual stages (config/rules.py). Megatron's interleaving: chunk c of rank r is virtual stage c*P + r, so
with P=2, V=2 and 8 layers rank 0 holds layers 0-1 and 4-5. The first stage also holds the embedding, the last
the final norm, output layer and loss."""

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


class ModelChunks(nn.ModuleList):
    """The model chunks one pipeline rank holds, seen as one model: `named_parameters()` and `state_dict()`
    use global names, as one GPTModel holding them all would (each layer lives in one chunk)."""

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        for chunk in self:
            yield from chunk.named_parameters(prefix, recurse, remove_duplicate)

    def state_dict(self, *args, **kwargs):
        return {name: value for chunk in self for name, value in chunk.state_dict(*args, **kwargs).items()}

    def forward(self, *args, **kwargs):
        raise TypeError("ModelChunks is run chunk by chunk by megalite/pipeline_parallel/schedules.py")


def build_model_chunks(config: ModelConfig, seed: int, device="cpu", dtype: torch.dtype = torch.float32,
                       parallel: ParallelState = ONE_PROCESS, vp: int = 1, first: int | None = None,
                       last: int | None = None, kernels: str = "auto") -> ModelChunks:
    """This rank's (`parallel.pp_rank`'s) `vp` chunks of the model, one GPTModel each, in chunk order,
    their fused ops per `--kernels kernels`."""
    pp, pp_rank = parallel.pp_size, parallel.pp_rank
    layers = chunk_layers(config.num_layers, pp, pp_rank, vp, first, last)
    last_stage = pp * vp - 1
    chunks = []
    for chunk, layer_ids in enumerate(layers):
        stage = chunk * pp + pp_rank
        chunks.append(build_model(config, seed, device, dtype, layer_ids=layer_ids, pre_process=stage == 0,
                                  post_process=stage == last_stage, parallel=parallel, kernels=kernels))
    return ModelChunks(chunks)
