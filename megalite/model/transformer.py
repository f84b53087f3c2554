"""The transformer layer: pre-norm attention (GQA, RoPE) and MLP (GELU or SwiGLU).

Activations are `[s, b, h]`. Every projection is a tensor-parallel layer, so the head
and feature counts below are per TP partition (the whole model at TP=1).
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
from megalite.parallel_state import ONE_PROCESS, ParallelState
from megalite.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, mark_parameter
from megalite.tensor_parallel.random import model_parallel_rng_tracker


def hidden_dropout(x: torch.Tensor, p: float, training: bool, parallel: ParallelState = ONE_PROCESS) -> torch.Tensor:
    """Dropout on the residual stream `[s, b, h]` (`[s/tp, b, h]` under SP).

    Without SP every TP rank holds the same activations and draws the same mask from the
    default RNG (identical on TP ranks); under SP each rank holds other tokens, so it
    draws from the tensor-parallel RNG, which differs per rank.
    """
    if not training or p == 0.0:
        return x
    if parallel.sequence_parallel:
        with model_parallel_rng_tracker.fork():
            return F.dropout(x, p, True)
    return F.dropout(x, p, True)


def output_projection_std(config: ModelConfig) -> float:
    """Megatron's init std for the projections that write into the residual stream."""
    return config.init_method_std / math.sqrt(2.0 * config.num_layers)


class LayerNorm(nn.Module):
    """LayerNorm with weight and bias, replicated on every TP rank."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = mark_parameter(nn.Parameter(torch.empty(hidden_size)), False, sequence_parallel=True)
        self.bias = mark_parameter(nn.Parameter(torch.empty(hidden_size)), False, sequence_parallel=True)

    def init_weights(self, seed: int, prefix: str) -> None:
        with torch.no_grad():
            self.weight.fill_(1.0)
            self.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return layer_norm(x, self.weight, self.bias, self.eps)  # Triton or PyTorch per --kernels


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in fp32 and returned in x's dtype (as LLaMA does)."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = mark_parameter(nn.Parameter(torch.empty(hidden_size)), False, sequence_parallel=True)

    def init_weights(self, seed: int, prefix: str) -> None:
        with torch.no_grad():
            self.weight.fill_(1.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)  # Triton or PyTorch per --kernels


def make_norm(config: ModelConfig) -> nn.Module:
    norm = LayerNorm if config.normalization == "LayerNorm" else RMSNorm
    return norm(config.hidden_size, config.norm_epsilon)


class Attention(nn.Module):
    """Causal self-attention with grouped-query heads and optional RoPE.

    The fused QKV output is laid out group by group (Megatron's layout): for each of
    the G key/value groups, its H/G query heads, then its key head, then its value
    head, each `head_dim` wide. Splitting the rows into TP contiguous blocks thus gives
    every rank whole groups with their own query heads.
    """

    def __init__(self, config: ModelConfig, parallel: ParallelState = ONE_PROCESS):
        super().__init__()
        tp_size = parallel.tp_size
        self.tp_size = tp_size
        self.head_dim = config.head_dim
        self.num_heads = config.num_attention_heads // tp_size
        self.num_groups = config.query_groups // tp_size
        self.heads_per_group = config.num_attention_heads // config.query_groups
        self.attention_dropout = config.attention_dropout
        qkv_size = (config.num_attention_heads + 2 * config.query_groups) * self.head_dim
        self.linear_qkv = ColumnParallelLinear(
            config.hidden_size, qkv_size, bias=config.add_bias_linear,
            init_std=config.init_method_std, parallel=parallel)
        self.linear_proj = RowParallelLinear(
            config.num_attention_heads * self.head_dim, config.hidden_size, bias=config.add_bias_linear,
            init_std=output_projection_std(config), input_is_parallel=True, parallel=parallel)

    def core_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal softmax(q k^T / sqrt(d)) v: q [s, b, heads, d], k/v [s, b, groups, d] -> context
        [s, b, heads * d]. Query head i attends with key/value head i // (heads / groups)."""
        s, b = q.shape[:2]
        dropout = self.attention_dropout if self.training else 0.0
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, n, s, d], SDPA's layout
        # Each TP rank holds other heads, so their dropout masks come from the per-rank RNG.
        with model_parallel_rng_tracker.fork() if dropout and self.tp_size > 1 else contextlib.nullcontext():
            context = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout,
                                                     enable_gqa=self.num_groups != self.num_heads)
        return context.permute(2, 0, 1, 3).reshape(s, b, self.num_heads * self.head_dim)

    def forward(self, hidden: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        qkv = self.linear_qkv(hidden)  # [s, b, qkv/tp]: under SP the full sequence, gathered by the layer
        s, b = qkv.shape[:2]
        qkv = qkv.view(s, b, self.num_groups, (self.heads_per_group + 2) * self.head_dim)
        q, k, v = qkv.split([self.heads_per_group * self.head_dim, self.head_dim, self.head_dim], dim=-1)
        q = q.reshape(s, b, self.num_heads, self.head_dim)  # query heads of group g are contiguous
        if rotary is not None:
            q, k = apply_rotary(q, k, *rotary)  # Triton or PyTorch per --kernels
        return self.linear_proj(self.core_attention(q, k, v))


class MLP(nn.Module):
    """fc1 -> GELU (exact, or tanh with openai_gelu) -> fc2; or SwiGLU: silu(gate) * up -> fc2.

    With SwiGLU, fc1 is one fused [gate; up] projection of 2 x ffn outputs, sharded
    block by block so each TP rank holds matching gate and up slices.
    """

    def __init__(self, config: ModelConfig, parallel: ParallelState = ONE_PROCESS):
        super().__init__()
        self.swiglu = config.swiglu
        self.gelu_approximate = "tanh" if config.openai_gelu else "none"
        fc1_size = config.ffn_hidden_size * (2 if config.swiglu else 1)
        self.linear_fc1 = ColumnParallelLinear(
            config.hidden_size, fc1_size, bias=config.add_bias_linear, init_std=config.init_method_std,
            output_chunks=2 if config.swiglu else 1, parallel=parallel)
        self.linear_fc2 = RowParallelLinear(
            config.ffn_hidden_size, config.hidden_size, bias=config.add_bias_linear,
            init_std=output_projection_std(config), input_is_parallel=True, parallel=parallel)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        x = self.linear_fc1(hidden)
        if self.swiglu:
            x = swiglu(x)  # silu(gate) * up of the [gate; up] halves; Triton or PyTorch per --kernels
        else:
            x = F.gelu(x, approximate=self.gelu_approximate)
        return self.linear_fc2(x)


class TransformerLayer(nn.Module):
    """x + drop(attn(norm(x))), then + drop(mlp(norm(.))): `[s, b, h]` in and out."""

    def __init__(self, config: ModelConfig, parallel: ParallelState = ONE_PROCESS):
        super().__init__()
        self.hidden_dropout, self.parallel = config.hidden_dropout, parallel
        self.input_layernorm = make_norm(config)
        self.self_attention = Attention(config, parallel)
        self.pre_mlp_layernorm = make_norm(config)
        self.mlp = MLP(config, parallel)

    def forward(self, hidden: torch.Tensor,
                rotary: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        attention = self.self_attention(self.input_layernorm(hidden), rotary)
        hidden = hidden + hidden_dropout(attention, self.hidden_dropout, self.training, self.parallel)
        mlp = self.mlp(self.pre_mlp_layernorm(hidden))
        return hidden + hidden_dropout(mlp, self.hidden_dropout, self.training, self.parallel)
