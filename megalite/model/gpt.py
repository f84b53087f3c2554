"""GPTModel: embedding -> transformer layers -> final norm -> output layer -> loss.

GPT-2 (learned positions, LayerNorm, GELU, biases, tied) or LLaMA (rope, RMSNorm, SwiGLU, GQA,
untied). Layers are keyed by global id, so parameter names and initial values are the same under
every layout; vocabulary padding rows start at zero and get -inf logits, so they stay zero.
"""

import torch
import torch.nn.functional as F
from torch import nn

from megalite.config import ModelConfig
from megalite.kernels.linear_cross_entropy import linear_cross_entropy
from megalite.model.rotary import RotaryEmbedding
from megalite.model.transformer import Norm, TransformerLayer, hidden_dropout
from megalite.parallel_state import ONE_PROCESS, ParallelState
from megalite.tensor_parallel.comm import gather_from_tensor_parallel_region, scatter_to_sequence_parallel_region
from megalite.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
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
    """A GPT / LLaMA model, or the part one pipeline stage holds: the layers `layer_ids` (default all), the
    embedding if `pre_process`, the final norm, output layer and loss if `post_process`; its fused ops
    (norms, rotary, SwiGLU, the loss) on the path `kernels` (`--kernels`) picks."""

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
        if self.embedding is not None and self.tied:
            self.embedding.word_embeddings.weight.shared_embedding = True
        # RunConfig.validate refuses it; a model built in code would take the loss over its vocabulary shard only.
        assert not (config.fused_output_cross_entropy and parallel.tp_size > 1), "fused cross-entropy needs TP 1"

        self.rotary = None
        if config.position_embedding_type == "rope":
            self.rotary = RotaryEmbedding(config.head_dim, config.rotary_base,
                                          config.rope_scaling_factor if config.use_rope_scaling else None,
                                          config.rotary_percent)

        self.layers = nn.ModuleDict({str(i): TransformerLayer(config, parallel, kernels) for i in layer_ids})

        self.final_layernorm = self.output_layer = None
        if post_process:
            self.final_layernorm = Norm(config, kernels)
            # TP: the logits stay vocab-sharded; the vocab-parallel cross-entropy combines them.
            self.output_layer = ColumnParallelLinear(
                config.hidden_size, config.vocab_size, bias=False, init_std=config.init_method_std,
                skip_weight_param=self.tied, real_output_size=config.real_vocab_size, parallel=parallel)

        if not any(p.is_meta for p in self.parameters()):
            initialize(self, seed)

    def forward(self, tokens: torch.Tensor | None, position_ids: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, loss_mask: torch.Tensor | None = None,
                hidden_states: torch.Tensor | None = None) -> torch.Tensor:
        """Run this stage on tokens, position_ids (None: 0..s-1), labels, loss_mask `[b, s]`, or on the
        previous stage's hidden_states `[s, b, h]`. Returns on the last stage per-token fp32 losses
        `[b, s]` (times loss_mask) if labels are given, else logits `[b, s, real_vocab]`; elsewhere
        the hidden states `[s, b, h]`."""
        hidden = self.embedding(tokens, position_ids) if self.pre_process else hidden_states
        rotary = None
        if self.rotary is not None:
            seq_length = hidden.shape[0] * (self.parallel.tp_size if self.parallel.sequence_parallel else 1)
            rotary = self.rotary(seq_length, position_ids, device=hidden.device)

        hidden = self.run_layers(hidden, rotary)
        if not self.post_process:
            return hidden
        hidden = self.final_layernorm(hidden)
        weight = self.embedding.word_embeddings.weight if self.tied else None
        if labels is not None and self.config.fused_output_cross_entropy:  # TP = 1: no logits at all
            weight = self.output_layer.weight if weight is None else weight
            losses = linear_cross_entropy(hidden, weight, labels.t(), self.config.real_vocab_size,
                                          self.config.z_loss_weight, kernels=self.kernels).t()  # [b, s] fp32
        else:
            logits = self.output_layer(hidden, weight)  # [s, b, vocab/tp]: never gathered for the loss
            group = tensor_parallel_group(self.parallel)
            if labels is None:
                logits = gather_from_tensor_parallel_region(logits, group)
                return logits[..., :self.config.real_vocab_size].transpose(0, 1).contiguous()
            vocab_start = self.output_layer.tp_rank * self.output_layer.output_size_per_partition
            # The logits are this forward's own: the loss may overwrite them with their grad.
            losses = vocab_parallel_cross_entropy(logits, labels.t(), group, vocab_start, self.config.real_vocab_size,
                                                  self.config.z_loss_weight, inplace=True, kernels=self.kernels).t()
        return (losses if loss_mask is None else losses * loss_mask).contiguous()

    def sharding_units(self) -> list[list[nn.Module]]:
        """ZeRO-3's units (data_parallel/param_shards.py) in forward order: each a list of modules whose parameters
        are gathered together before any of them runs and released after the last one's forward. Each layer, the
        embedding, and the head (final norm, output layer); a tied head holds the embedding, whose weight the
        output layer reads."""
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
    """GPTModel on `device` in `dtype`, its fused ops per `--kernels kernels`; 'meta' gives shapes only (no
    memory, no init). Weights are drawn on the CPU in fp32, then copied and cast, so a GPU model starts
    from exactly the CPU model."""
    # Built directly on the device: Module.to_empty would drop the parameters' TP attributes.
    with torch.device(device):
        model = GPTModel(config, seed, layer_ids, pre_process, post_process, parallel, kernels)
    return model.to(dtype)
