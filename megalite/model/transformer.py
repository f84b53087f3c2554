"""The transformer layer: pre-norm attention (GQA, RoPE; optionally a QKV bias and per-head q/k norms)
and MLP (GELU or SwiGLU) on `[s, b, h]`.

Every projection is a tensor-parallel layer, so head and feature counts are per TP partition.
`kernels` (`--kernels`: auto, triton or torch) picks, when a module is built, its fused ops' path.
"""

import contextlib
import math

import torch
import torch.nn.functional as F
from torch import nn

from megalite.config import ModelConfig
from megalite.kernels.layernorm import layer_norm
from megalite.kernels.rmsnorm import rms_norm
from megalite.kernels.rotary import apply_rotary
from megalite.kernels.swiglu import swiglu
from megalite.model.moe import MoELayer
from megalite.parallel_state import ONE_PROCESS, ParallelState
from megalite.tensor_parallel.comm import copy_to_tensor_parallel_region
from megalite.tensor_parallel.layers import (ColumnParallelLinear, RowParallelLinear, mark_parameter,
                                             tensor_parallel_group)
from megalite.tensor_parallel.random import model_parallel_rng_tracker


def hidden_dropout(x: torch.Tensor, p: float, training: bool, parallel: ParallelState = ONE_PROCESS) -> torch.Tensor:
    """Dropout on the residual stream `[s, b, h]`: the same mask on every TP rank from the default
    RNG, or where ranks hold other tokens (under SP `[s/tp, b, h]`, under CP their chunks) from the per-rank
    tensor-parallel RNG."""
    if not training or p == 0.0:
        return x
    other_tokens = parallel.sequence_parallel or parallel.cp_size > 1
    with model_parallel_rng_tracker.fork() if other_tokens else contextlib.nullcontext():
        return F.dropout(x, p, True)


def output_projection_std(config: ModelConfig) -> float:
    """Megatron's init std for the projections that write into the residual stream."""
    return config.init_method_std / math.sqrt(2.0 * config.num_layers)


class Norm(nn.Module):
    """`config.normalization`: LayerNorm (weight and bias) or RMSNorm (weight only; computed in fp32
    and returned in x's dtype, as LLaMA does), replicated on every TP rank. With --apply-layernorm-1p the
    weight is stored as w - 1 and applied as 1 + w (Megatron's zero-centred gamma).

    By default over the hidden size of the residual stream `[s, b, h]` (under SP each TP rank sees its
    own tokens: the params are marked sequence_parallel). `heads_of` given: a --qk-layernorm norm over each
    head's channels of q or k `[s, b, heads/tp, d]`, one weight shared by every head. Each TP rank then
    sees its own heads, so the weights pass copy_to_tensor_parallel_region (grads summed over TP in
    backward, with or without SP) and are not marked sequence_parallel (DDP would sum them again)."""

    def __init__(self, config: ModelConfig, kernels: str = "auto", heads_of: ParallelState | None = None):
        super().__init__()
        self.eps, self.kernels = config.norm_epsilon, kernels
        self.one_plus = config.apply_layernorm_1p
        self.heads_group = None if heads_of is None else tensor_parallel_group(heads_of)
        size = config.hidden_size if heads_of is None else config.head_dim
        self.weight = self._parameter(size, heads_of is None)
        self.bias = self._parameter(size, heads_of is None) if config.normalization == "LayerNorm" else None

    @staticmethod
    def _parameter(size: int, sequence_parallel: bool) -> nn.Parameter:
        return mark_parameter(nn.Parameter(torch.empty(size)), False, sequence_parallel=sequence_parallel)

    def init_weights(self, seed: int, prefix: str) -> None:
        with torch.no_grad():
            self.weight.fill_(0.0 if self.one_plus else 1.0)
            if self.bias is not None:
                self.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = self.weight, self.bias
        if self.heads_group is not None:
            weight = copy_to_tensor_parallel_region(weight, self.heads_group)
            bias = None if bias is None else copy_to_tensor_parallel_region(bias, self.heads_group)
        weight = weight + 1 if self.one_plus else weight
        if bias is None:
            return rms_norm(x, weight, self.eps, self.kernels)
        return layer_norm(x, weight, bias, self.eps, self.kernels)


class Attention(nn.Module):
    """Causal self-attention with grouped-query heads and optional RoPE. The fused QKV output holds, group
    by group, its query heads, key and value (Megatron's layout): TP row blocks give whole groups."""

    def __init__(self, config: ModelConfig, parallel: ParallelState = ONE_PROCESS, kernels: str = "auto"):
        super().__init__()
        self.tp_size, self.kernels = parallel.tp_size, kernels
        self.head_dim = config.head_dim
        self.num_heads = config.num_attention_heads // self.tp_size
        self.num_groups = config.query_groups // self.tp_size
        self.heads_per_group = config.num_attention_heads // config.query_groups
        self.attention_dropout = config.attention_dropout
        qkv_size = (config.num_attention_heads + 2 * config.query_groups) * self.head_dim
        self.linear_qkv = ColumnParallelLinear(config.hidden_size, qkv_size,
                                               bias=config.add_bias_linear or config.add_qkv_bias,
                                               init_std=config.init_method_std, parallel=parallel)
        # --qk-layernorm (Megatron's names): per head, before rotary, as Qwen3 does.
        self.q_layernorm = Norm(config, kernels, heads_of=parallel) if config.qk_layernorm else None
        self.k_layernorm = Norm(config, kernels, heads_of=parallel) if config.qk_layernorm else None
        self.linear_proj = RowParallelLinear(config.num_attention_heads * self.head_dim, config.hidden_size,
                                             bias=config.add_bias_linear, init_std=output_projection_std(config),
                                             parallel=parallel)

    def core_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal softmax(q k^T / sqrt(d)) v: q [s, b, heads, d], k/v [s, b, groups, d] -> context
        [s, b, heads * d]. Query head i attends with key/value head i // (heads / groups)."""
        dropout = self.attention_dropout if self.training else 0.0
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, n, s, d], SDPA's layout
        # Each TP rank holds other heads, so their dropout masks come from the per-rank RNG.
        with model_parallel_rng_tracker.fork() if dropout and self.tp_size > 1 else contextlib.nullcontext():
            context = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout,
                                                     enable_gqa=self.num_groups != self.num_heads)
        return context.permute(2, 0, 1, 3).flatten(2)

    def forward(self, hidden: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        qkv = self.linear_qkv(hidden)  # [s, b, qkv/tp]: under SP the full sequence, gathered by the layer
        s, b = qkv.shape[:2]
        qkv = qkv.view(s, b, self.num_groups, (self.heads_per_group + 2) * self.head_dim)
        q, k, v = qkv.split([self.heads_per_group * self.head_dim, self.head_dim, self.head_dim], dim=-1)
        q = q.reshape(s, b, self.num_heads, self.head_dim)  # query heads of group g are contiguous
        if self.q_layernorm is not None:
            q, k = self.q_layernorm(q), self.k_layernorm(k)
        if rotary is not None:
            q, k = apply_rotary(q, k, *rotary, self.kernels)
        return self.linear_proj(self.core_attention(q, k, v))


class MLP(nn.Module):
    """fc1 -> GELU (exact, or tanh with openai_gelu) -> fc2; or SwiGLU: silu(gate) * up -> fc2, fc1
    then being one fused [gate; up] projection sharded block by block (matching slices per TP rank)."""

    def __init__(self, config: ModelConfig, parallel: ParallelState = ONE_PROCESS, kernels: str = "auto",
                 ffn_hidden_size: int | None = None):
        super().__init__()
        self.swiglu, self.kernels = config.swiglu, kernels
        self.gelu_approximate = "tanh" if config.openai_gelu else "none"
        ffn_hidden_size = ffn_hidden_size or config.ffn_hidden_size  # another size: MoE's shared experts
        fc1_size = ffn_hidden_size * (2 if config.swiglu else 1)
        self.linear_fc1 = ColumnParallelLinear(config.hidden_size, fc1_size, bias=config.add_bias_linear,
                                               init_std=config.init_method_std, output_chunks=2 if config.swiglu else 1,
                                               parallel=parallel)
        self.linear_fc2 = RowParallelLinear(ffn_hidden_size, config.hidden_size, bias=config.add_bias_linear,
                                            init_std=output_projection_std(config), parallel=parallel)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        x = self.linear_fc1(hidden)
        x = swiglu(x, self.kernels) if self.swiglu else F.gelu(x, approximate=self.gelu_approximate)
        return self.linear_fc2(x)


def build_mlp(config: ModelConfig, layer_id: int, parallel: ParallelState = ONE_PROCESS,
              kernels: str = "auto") -> nn.Module:
    """Layer `layer_id`'s MLP: the MoE layer where --moe-layer-freq puts one, else the dense MLP."""
    if not config.is_moe_layer(layer_id):
        return MLP(config, parallel, kernels)
    shared = config.moe_shared_expert_intermediate_size
    return MoELayer(config, output_projection_std(config), parallel, kernels,
                    shared_experts=MLP(config, parallel, kernels, shared) if shared else None)


class TransformerLayer(nn.Module):
    """x + drop(attn(norm(x))), then + drop(mlp(norm(.))): `[s, b, h]` in and out; global layer `layer_id`'s
    MLP is dense or MoE (`build_mlp`)."""

    def __init__(self, config: ModelConfig, parallel: ParallelState = ONE_PROCESS, kernels: str = "auto",
                 layer_id: int = 0):
        super().__init__()
        self.hidden_dropout, self.parallel = config.hidden_dropout, parallel
        self.input_layernorm = Norm(config, kernels)
        self.self_attention = Attention(config, parallel, kernels)
        self.pre_mlp_layernorm = Norm(config, kernels)
        self.mlp = build_mlp(config, layer_id, parallel, kernels)

    def forward(self, hidden: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        attention = self.self_attention(self.input_layernorm(hidden), rotary)
        hidden = hidden + hidden_dropout(attention, self.hidden_dropout, self.training, self.parallel)
        mlp = self.mlp(self.pre_mlp_layernorm(hidden))
        return hidden + hidden_dropout(mlp, self.hidden_dropout, self.training, self.parallel)
