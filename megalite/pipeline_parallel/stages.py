"""Which layers each pipeline rank holds, and the model chunks it builds from them.

The model's layers are cut into `P x V` virtual stages (P pipeline ranks, V model chunks
per rank). Megatron's interleaving: chunk `c` of rank `r` is virtual stage `v = c*P + r`,
so with P=2, V=2 and 8 layers rank 0 holds layers 0-1 and 4-5, rank 1 holds 2-3 and 6-7.
The first virtual stage also holds the embedding; the last one also holds the final
norm, the output layer and the loss.

Layers are split evenly, or with `first` / `last` layers on the first and last virtual
stage and the rest split evenly over the others (Megatron's
--decoder-first/last-pipeline-num-layers, for stages that also carry the embedding or
the output layer). Every virtual stage holds at least one layer.
"""

import torch
from torch import nn

from megalite.config import ModelConfig
from megalite.errors import UserError
from megalite.model.gpt import build_model
from megalite.parallel_state import ONE_PROCESS, ParallelState


def virtual_stage_layers(num_layers: int, pp: int, vp: int = 1, first: int | None = None,
                         last: int | None = None) -> list[list[int]]:
    """The global layer ids of each of the `pp * vp` virtual stages, in pipeline order.

    UserError, naming the flags, when the layers cannot be split that way.
    """
    stages = pp * vp
    sizes = _stage_sizes(num_layers, stages, first, last)
    bounds = [sum(sizes[:i]) for i in range(stages + 1)]
    return [list(range(bounds[i], bounds[i + 1])) for i in range(stages)]


def _stage_sizes(num_layers: int, stages: int, first: int | None, last: int | None) -> list[int]:
    split = f"--pipeline-model-parallel-size x virtual stages = {stages} stage(s)"
    if stages == 1:
        if first is not None or last is not None:
            raise UserError("--decoder-first/last-pipeline-num-layers need --pipeline-model-parallel-size 2 or "
                            "more; drop them")
        return [num_layers]
    fixed = {0: first, stages - 1: last}
    for flag, value in [("--decoder-first-pipeline-num-layers", first), ("--decoder-last-pipeline-num-layers", last)]:
        if value is not None and value < 1:
            raise UserError(f"{flag} must be at least 1, got {value}")
    given = {stage: value for stage, value in fixed.items() if value is not None}
    rest_layers = num_layers - sum(given.values())
    rest_stages = stages - len(given)
    if rest_layers < rest_stages or (rest_stages and rest_layers % rest_stages) or (not rest_stages and rest_layers):
        if given:
            raise UserError(
                f"--num-layers {num_layers} minus the first/last stage layers ({sum(given.values())}) leaves "
                f"{rest_layers}, which does not split evenly over the other {rest_stages} of {split} with at "
                f"least one layer each; change --decoder-first/last-pipeline-num-layers or --num-layers")
        raise UserError(f"--num-layers {num_layers} is not divisible by {split}; use a multiple of {stages} "
                        f"layers, or --decoder-first/last-pipeline-num-layers for uneven ends")
    per_stage = rest_layers // rest_stages if rest_stages else 0
    return [given.get(stage, per_stage) for stage in range(stages)]


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
