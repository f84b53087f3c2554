"""Causal self-attention on a CPU in query blocks, keeping the probabilities for the backward.

PyTorch's CPU flash-attention kernel runs its small per-block GEMMs at about a third of
the CPU's matmul peak at training shapes (seq 256-1024, head dim 64-128). Here each
block of `BLOCK` query positions of all heads is one batched GEMM against the keys up
to the block's end (the causal prefix: the blocks do ~(n+1)/2n of the full s x s work),
then softmax, then one batched GEMM with the values. The softmax output P of every block
is kept for the backward, so the backward is four batched GEMMs and two elementwise
passes per block, with no recomputation:

    dV += P^T dO,   dP = dO V^T,   dS = P * (dP - rowsum(dO * O)),
    dQ = scale * dS K,   dK += scale * dS^T Q

Keeping P costs (n+1)/2n * b * heads * s^2 floats per layer (config B, seq 512: 18 MB),
so this path is used only up to `MAX_SEQ_LENGTH` (where it measured faster, too: at seq
2048 the flash kernel catches up). Grouped-query attention is one GEMM per key/value
group: the group's query heads are rows of the same batch entry.

`self_attention(q, k, v, dropout_p)` is what the model calls, in megalite's
`[s, b, heads, d]` layout: this path where `use_blocked_attention` says so, else
PyTorch's `scaled_dot_product_attention`, both with fp32 products for bf16 on CPUs
without bf16 units (kernels/matmul.py). The blocked path's forward and backward are
`torch.library` custom ops joined by an autograd Function: opaque to torch.compile,
which traced through the loop of blocks ran ~40% slower than this eager code.
"""

import math

import torch
import torch.nn.functional as F

from megalite.kernels.matmul import fp32_products

BLOCK = 64  # query rows per block: 32 and 128 measured slower on configs A and B
MAX_SEQ_LENGTH = 1024

_enabled = True


def set_blocked_attention(enabled: bool) -> None:
    """Turn the blocked path on (default) or off (PyTorch's SDPA everywhere; benchmarks, tests)."""
    global _enabled
    _enabled = enabled


def use_blocked_attention(q: torch.Tensor, dropout_p: float) -> bool:
    """Whether causal attention on q `[s, b, heads, d]` takes this module's path.

    fp32 on a CPU (bf16 arrives here as fp32 on CPUs without bf16 units), no attention
    dropout (the probabilities would need a mask), sequences up to MAX_SEQ_LENGTH.
    """
    return (_enabled and q.device.type == "cpu" and q.dtype == torch.float32 and dropout_p == 0.0
            and q.shape[0] <= MAX_SEQ_LENGTH)


def self_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0) -> torch.Tensor:
    """Causal attention, q `[s, b, heads, d]`, k/v `[s, b, groups, d]` -> `[s, b, heads, d]` in q's dtype.

    With fp32 products (bf16 on a CPU without bf16 units) the fp32 copies of q, k, v are
    what the attention saves for its backward: memory, for a ~7x faster backward there.
    """
    dtype = q.dtype
    if fp32_products(q):
        q, k, v = q.float(), k.float(), v.float()
    if use_blocked_attention(q, dropout_p):
        return causal_attention(q, k, v).to(dtype)
    q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, n, s, d]
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout_p,
                                         enable_gqa=k.shape[1] != q.shape[1])
    return out.permute(2, 0, 1, 3).to(dtype)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T / sqrt(d), causal) v for q `[s, b, heads, d]`, k/v `[s, b, groups, d]`.

    Query head i attends with key/value head i // (heads / groups). Returns `[s, b, heads, d]`.
    """
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        return _CausalAttention.apply(q, k, v)
    return torch.ops.megalite.causal_attention_forward(q, k, v, False)[0]  # no probabilities kept


def _blocks(s: int):
    """(first, end) query rows of each block."""
    return [(first, min(first + BLOCK, s)) for first in range(0, s, BLOCK)]


def _to_blocks(x: torch.Tensor, groups: int, first: int, end: int, out: torch.Tensor, scale: float = 1.0):
    """Rows [first, end) of x `[s, b, heads, d]` into out `[b * groups, heads/groups * rows, d]`, times scale."""
    s, b, heads, d = x.shape
    rows = x[first:end].unflatten(2, (groups, heads // groups)).permute(1, 2, 3, 0, 4)  # [b, g, r, rows, d]
    torch.mul(rows, scale, out=out.view(rows.shape))
    return out


def _from_blocks(block: torch.Tensor, x: torch.Tensor, groups: int, first: int, end: int, scale: float = 1.0):
    """Inverse of _to_blocks: block `[b * groups, r * rows, d]` times scale into rows [first, end) of x."""
    s, b, heads, d = x.shape
    rows = x[first:end].unflatten(2, (groups, heads // groups)).permute(1, 2, 3, 0, 4)  # [b, g, r, rows, d]
    torch.mul(block.view(rows.shape), scale, out=rows)


def _by_group(x: torch.Tensor) -> torch.Tensor:
    """k or v `[s, b, groups, d]` -> `[b * groups, s, d]` (a view when the strides allow)."""
    return x.permute(1, 2, 0, 3).flatten(0, 1)


def _causal_mask(rows: int, device) -> torch.Tensor:
    """True above the diagonal of the block's own `[rows, rows]` square: keys after the query."""
    return torch.ones(rows, rows, dtype=torch.bool, device=device).triu_(1)


@torch.library.custom_op("megalite::causal_attention_forward", mutates_args=())
def _attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       keep_probs: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(output `[s, b, heads, d]`, each block's P `[b * groups, r * rows, end]` if keep_probs)."""
    s, b, heads, d = q.shape
    groups = k.shape[2]
    per_group = heads // groups
    scale = 1.0 / math.sqrt(d)
    keys, values = _by_group(k), _by_group(v)  # [b * g, s, d]
    out = torch.empty(s, b, heads, d, dtype=q.dtype, device=q.device)
    query = torch.empty(b * groups, per_group * BLOCK, d, dtype=q.dtype, device=q.device)
    probs = []
    for first, end in _blocks(s):
        rows = end - first
        q_block = _to_blocks(q, groups, first, end, query[:, :per_group * rows], scale)  # [b*g, r*rows, d]
        scores = torch.bmm(q_block, keys[:, :end].transpose(1, 2))  # [b*g, r*rows, end]
        diagonal = scores.view(b * groups, per_group, rows, end)[..., first:end]
        diagonal.masked_fill_(_causal_mask(rows, q.device), float("-inf"))
        p = torch.softmax(scores, dim=-1, out=scores)  # in place
        _from_blocks(torch.bmm(p, values[:, :end]), out, groups, first, end)
        if keep_probs:
            probs.append(p)
    return out, probs


@_attention_forward.register_fake
def _(q, k, v, keep_probs):
    s, b, heads = q.shape[:3]
    groups = k.shape[2]
    probs = [q.new_empty(b * groups, heads // groups * (end - first), end) for first, end in _blocks(s)]
    return q.new_empty(q.shape), probs if keep_probs else []


@torch.library.custom_op("megalite::causal_attention_backward", mutates_args=())
def _attention_backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        out: torch.Tensor, probs: list[torch.Tensor]
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq `[s, b, heads, d]`, dk and dv `[b * groups, s, d]`) from the forward's output and P."""
    s, b, heads, d = q.shape
    groups = k.shape[2]
    per_group = heads // groups
    scale = 1.0 / math.sqrt(d)
    keys, values = _by_group(k), _by_group(v)
    grad_q = torch.empty(s, b, heads, d, dtype=q.dtype, device=q.device)
    grad_k = torch.empty(b * groups, s, d, dtype=q.dtype, device=q.device)
    grad_v = torch.empty(b * groups, s, d, dtype=q.dtype, device=q.device)
    delta = (grad_out * out).sum(-1, keepdim=True)  # rowsum(dO * O) `[s, b, heads, 1]`
    query = torch.empty(b * groups, per_group * BLOCK, d, dtype=q.dtype, device=q.device)
    grad_block = torch.empty_like(query)
    delta_block = torch.empty(b * groups, per_group * BLOCK, 1, dtype=q.dtype, device=q.device)
    # Last block first: it covers every key, so it writes dk and dv whole (no zeroing);
    # the earlier blocks add into their key prefixes.
    for (first, end), p in reversed(list(zip(_blocks(s), probs))):
        rows = end - first
        q_block = _to_blocks(q, groups, first, end, query[:, :per_group * rows], scale)
        grad_o = _to_blocks(grad_out, groups, first, end, grad_block[:, :per_group * rows])
        row_delta = _to_blocks(delta, groups, first, end, delta_block[:, :per_group * rows])
        grad_s = torch.bmm(grad_o, values[:, :end].transpose(1, 2)).sub_(row_delta).mul_(p)  # dS
        _from_blocks(torch.bmm(grad_s, keys[:, :end]), grad_q, groups, first, end, scale)
        if end == s:
            torch.bmm(p.transpose(1, 2), grad_o, out=grad_v)
            torch.bmm(grad_s.transpose(1, 2), q_block, out=grad_k)  # q_block carries the scale
        else:  # into new memory, then added: baddbmm_ into a strided prefix runs one GEMM call per batch entry
            grad_v[:, :end] += torch.bmm(p.transpose(1, 2), grad_o)
            grad_k[:, :end] += torch.bmm(grad_s.transpose(1, 2), q_block)
    return grad_q, grad_k, grad_v


@_attention_backward.register_fake
def _(grad_out, q, k, v, out, probs):
    s, b, groups, d = k.shape
    return q.new_empty(q.shape), k.new_empty(b * groups, s, d), v.new_empty(b * groups, s, d)


class _CausalAttention(torch.autograd.Function):
    """The two ops as one differentiable function (lighter than a custom op's own autograd)."""

    @staticmethod
    def forward(ctx, q, k, v):
        out, probs = torch.ops.megalite.causal_attention_forward(q, k, v, True)
        ctx.save_for_backward(q, k, v, out, *probs)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, *probs = ctx.saved_tensors
        grad_q, grad_k, grad_v = torch.ops.megalite.causal_attention_backward(
            grad_out.contiguous(), q, k, v, out, probs)
        s, b, groups, d = k.shape
        return grad_q, *(grad.unflatten(0, (b, groups)).permute(2, 0, 1, 3) for grad in (grad_k, grad_v))
