"""GPTModel: embedding -> transformer layers -> final norm, and the output layer that the loss
(model/loss.py) or `GPTModel.logits` applies to the last stage's hidden states.

GPT-2 (learned positions, LayerNorm, GELU, biases, tied) or LLaMA (rope, RMSNorm, SwiGLU, GQA,
untied). Layers are keyed by global id, so parameter names and initial values are the same under
every layout; vocabulary padding rows start at zero and get -inf logits, so they stay zero.
"""

import torch
import torch.nn.functional as F
from torch import nn

from megalite.config import ModelConfig
from megalite.model.rotary import RotaryEmbedding
from megalite.model.transformer import Norm, TransformerLayer, hidden_dropout
from megalite.parallel_state import ONE_PROCESS, ParallelState
from megalite.tensor_parallel.comm import gather_from_tensor_parallel_region, scatter_to_sequence_parallel_region
from megalite.tensor_parallel.layers import (ColumnParallelLinear, VocabParallelEmbedding, init_full_tensor,
                                             initialize, mark_parameter, tensor_parallel_group)


class Embedding(nn.Module):
    """Token ids [b, s] (+ learned positions) -> hidden [s, b, h], with hidden dropout."""

    def __init__(self, config: ModelConfig, parallel: ParallelState = ONE_PROCESS, with_positions: bool = True):
        super().__init__()
        self.config, self.parallel = config, parallel
        self.word_embeddings = VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, init_std=config.init_method_std,
            real_num_embeddings=config.real_vocab_size, parallel=parallel)
        self.position_embeddings = None
        if with_positions and config.position_embedding_type == "learned_absolute":
            self.position_embeddings = mark_parameter(
                nn.Parameter(torch.empty(config.max_position_embeddings, config.hidden_size)), False)

    def init_weights(self, seed: int, prefix: str) -> None:
        if self.position_embeddings is not None:
            with torch.no_grad():
                self.position_embeddings.copy_(init_full_tensor(
                    tuple(self.position_embeddings.shape), self.config.init_method_std, seed,
                    f"{prefix}.position_embeddings"))

    def forward(self, tokens: torch.Tensor, position_ids: torch.Tensor | None) -> torch.Tensor:
        hidden = self.word_embeddings(tokens.t())  # [s, b, h]
        if self.position_embeddings is not None:
            if position_ids is None:
                position_ids = torch.arange(tokens.shape[1], device=tokens.device)[None, :]
            hidden = hidden + F.embedding(position_ids.t(), self.position_embeddings)
        if self.parallel.sequence_parallel:
            hidden = scatter_to_sequence_parallel_region(hidden, tensor_parallel_group(self.parallel))  # [s/tp, b, h]
        return hidden_dropout(hidden, self.config.hidden_dropout, self.training, self.parallel)


class GPTModel(nn.Module):
    """A GPT / LLaMA model, or the part one pipeline stage holds: the layers `layer_ids` (default all), the embedding
    if `pre_process`, the final norm and output layer if `post_process`; its fused ops (norms, rotary, SwiGLU) on the
    path `kernels` (`--kernels`) picks. The forward returns hidden states (the module docstring says what follows)."""

    def __init__(self, config: ModelConfig, seed: int, layer_ids=None, pre_process: bool = True,
                 post_process: bool = True, parallel: ParallelState = ONE_PROCESS, kernels: str = "auto"):
        super().__init__()
        config.validate()
        self.config, self.parallel, self.kernels = config, parallel, kernels
        self.pre_process, self.post_process = pre_process, post_process
        self.tied = not config.untie_embeddings_and_output_weights
        layer_ids = range(config.num_layers) if layer_ids is None else sorted(layer_ids)
        if any(not 0 <= i < config.num_layers for i in layer_ids):
            raise ValueError(f"layer ids {list(layer_ids)} are outside 0..{config.num_layers - 1}")

        self.embedding = None
        if pre_process or (post_process and self.tied):
            # A tied last stage keeps its own copy of the word embeddings, with the same name and
            # initial values; DDP sums the copies' grads (parameters marked shared_embedding).
            self.embedding = Embedding(config, parallel, with_positions=pre_process)
            self.embedding.word_embeddings.weight.shared_embedding = self.tied

        scaling = config.rope_scaling_factor if config.use_rope_scaling else None
        self.rotary = (RotaryEmbedding(config.head_dim, config.rotary_base, scaling, config.rotary_percent)
                       if config.position_embedding_type == "rope" else None)

        self.layers = nn.ModuleDict({str(i): TransformerLayer(config, parallel, kernels, i) for i in layer_ids})

        self.final_layernorm = self.output_layer = None
        if post_process:
            self.final_layernorm = Norm(config, kernels)
            # TP: the loss's logits stay vocab-sharded; the vocab-parallel cross-entropy combines them.
            self.output_layer = ColumnParallelLinear(
                config.hidden_size, config.vocab_size, bias=False, init_std=config.init_method_std,
                skip_weight_param=self.tied, real_output_size=config.real_vocab_size, parallel=parallel)

        if not any(p.is_meta for p in self.parameters()):
            initialize(self, seed)

    def forward(self, tokens: torch.Tensor | None, position_ids: torch.Tensor | None = None,
                hidden_states: torch.Tensor | None = None) -> torch.Tensor:
        """Run this stage on tokens and position_ids `[b, s]` (None: 0..s-1), or on the previous stage's
        hidden_states `[s, b, h]`. Returns the hidden states `[s, b, h]` (`[s/tp, b, h]` under sequence
        parallelism), the last stage's after the final norm."""
        hidden = self.embedding(tokens, position_ids) if self.pre_process else hidden_states
        rotary = None
        if self.rotary is not None:
            seq_length = hidden.shape[0] * (self.parallel.tp_size if self.parallel.sequence_parallel else 1)
            rotary = self.rotary(seq_length, position_ids, device=hidden.device)

        hidden = self.run_layers(hidden, rotary)
        return self.final_layernorm(hidden) if self.post_process else hidden

    def output_weight(self) -> torch.Tensor:
        """The output layer's weight `[vocab/tp, h]` (last stage): the word embeddings' when they are tied."""
        return self.embedding.word_embeddings.weight if self.tied else self.output_layer.weight

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The last stage's hidden states `[s, b, h]` -> logits `[b, s, real_vocab]`, gathered over TP (for
        inference, generation and comparisons; the loss never gathers them)."""
        logits = self.output_layer(hidden, self.output_weight())  # [s, b, vocab/tp]
        logits = gather_from_tensor_parallel_region(logits, tensor_parallel_group(self.parallel))
        return logits[..., :self.config.real_vocab_size].transpose(0, 1).contiguous()

    def sharding_units(self) -> list[list[nn.Module]]:
        """ZeRO-3's units (data_parallel/param_shards.py) in forward order: each a list of modules whose parameters are
        gathered together before any of them runs and released after the last one's forward. Each layer, the embedding,
        and the head (final norm, output layer); a tied head holds the embedding, whose weight the output layer uses."""
        layers = [[layer] for layer in self.layers.values()]
        head = [module for module in (self.final_layernorm, self.output_layer) if module is not None]
        if self.post_process and self.tied:
            return [[self.embedding, *head], *layers]
        return [unit for unit in ([self.embedding] if self.embedding is not None else [], *layers, head) if unit]

    def run_layers(self, hidden: torch.Tensor, rotary) -> torch.Tensor:
        """This stage's layers in order, `[s, b, h]` -> `[s, b, h]`; full recomputation (model/options.py)
        replaces it on the instance to checkpoint groups of them."""
        for layer in self.layers.values():
            hidden = layer(hidden, rotary)
        return hidden


def build_model(config: ModelConfig, seed: int, device="cpu", dtype: torch.dtype = torch.float32,
                layer_ids=None, pre_process: bool = True, post_process: bool = True,
                parallel: ParallelState = ONE_PROCESS, kernels: str = "auto") -> GPTModel:
    """GPTModel on `device` in `dtype`, its fused ops per `--kernels kernels`; 'meta': shapes only (no memory, no init).
    Weights are drawn on the CPU in fp32, then copied and cast, so a GPU model starts from exactly the CPU model."""
    # Built directly on the device: Module.to_empty would drop the parameters' TP attributes.
    with torch.device(device):
        model = GPTModel(config, seed, layer_ids, pre_process, post_process, parallel, kernels)
    return model.to(dtype)
