"""Causal self-attention on a CPU in query blocks, keeping the probabilities for the backward (docs/kernels.md: why, and
what it costs). Each block of `BLOCK` query rows of all heads is one batched GEMM against the keys up to the block's
end, softmax, and one GEMM with the values; with each block's softmax P kept (hence MAX_SEQ_LENGTH), the backward
recomputes nothing:
    dV += P^T dO,  dP = dO V^T,  dS = P * (dP - rowsum(dO * O)),  dQ = scale * dS K,  dK += scale * dS^T Q
Forward and backward are custom ops, opaque to torch.compile (traced, the block loop ran slower)."""

import functools
import math

import torch

BLOCK = 64  # query rows per block (other sizes measured slower: docs/benchmarks.md)
MAX_SEQ_LENGTH = 1024


def use_blocked_attention(q: torch.Tensor, dropout_p: float) -> bool:
    """Whether causal attention on q `[s, b, heads, d]` takes this path: fp32 on a CPU, no attention
    dropout (the probabilities would need a mask), sequences up to MAX_SEQ_LENGTH."""
    return q.device.type == "cpu" and q.dtype == torch.float32 and dropout_p == 0.0 and q.shape[0] <= MAX_SEQ_LENGTH


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T / sqrt(d), causal) v `[s, b, heads, d]` for q `[s, b, heads, d]`, k/v `[s, b, groups, d]`;
    query head i attends with key/value head i // (heads / groups)."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        return _CausalAttention.apply(q, k, v)
    return _ops()[0](q, k, v, False)[0]  # no probabilities kept


def _blocks(s: int):
    """(first, end) query rows of each block."""
    return [(first, min(first + BLOCK, s)) for first in range(0, s, BLOCK)]


def _split_heads(x: torch.Tensor, groups: int) -> torch.Tensor:
    """x `[s, b, heads, d]` -> the view `[b, groups, heads/groups, s, d]`."""
    return x.unflatten(2, (groups, x.shape[2] // groups)).permute(1, 2, 3, 0, 4)


class _BlockRows:
    """A block's rows of x5 `[b, g, r, s, d]` (from _split_heads) as the flat `[b * g, r * rows, d]`
    operand of the batched GEMMs: a view when r = 1, else copied into one buffer made once per call."""

    def __init__(self, x5: torch.Tensor):
        b, groups, per_group, s, d = x5.shape
        self.x5 = x5
        self.buffer = None if per_group == 1 else x5.new_empty(b * groups, per_group * BLOCK, d)

    def __call__(self, first: int, end: int) -> torch.Tensor:
        block = self.x5[..., first:end, :]  # [b, g, r, rows, d]
        if self.buffer is None:
            return block.flatten(0, 2)
        flat = self.buffer[:, :block.shape[2] * (end - first)]
        flat.view(block.shape).copy_(block)
        return flat


@functools.cache
def _causal_bias(size: int, device: torch.device) -> torch.Tensor:
    """`[size, size]`: -inf where the key comes after the query, else 0; added to the diagonal block
    (an add of a ready bias is cheaper than a masked fill with a boolean mask)."""
    return torch.full((size, size), float("-inf"), device=device).triu_(1)


def _by_group(x: torch.Tensor) -> torch.Tensor:
    """k or v `[s, b, groups, d]` -> `[b * groups, s, d]` (a view when the strides allow)."""
    return x.permute(1, 2, 0, 3).flatten(0, 1)


def _attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       keep_probs: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(output `[s, b, heads, d]`, each block's P `[b * groups, r * rows, end]` if keep_probs)."""
    s, b, heads, d = q.shape
    groups = k.shape[2]
    scale = 1.0 / math.sqrt(d)
    keys_t, values = _by_group(k).transpose(1, 2), _by_group(v)  # [b*g, d, s], [b*g, s, d]
    out = torch.empty(s, b, heads, d, dtype=q.dtype, device=q.device)
    query, out5 = _BlockRows(_split_heads(q, groups)), _split_heads(out, groups)
    causal_bias = _causal_bias(BLOCK, q.device)  # made once, not per call
    probs = []
    for first, end in _blocks(s):
        rows = end - first
        q_block = query(first, end)  # [b*g, r*rows, d]
        # beta=0: the first argument only gives the shape; alpha applies the 1/sqrt(d) scale.
        scores = torch.baddbmm(_shape_only(q_block, q_block.shape[1], end), q_block, keys_t[..., :end],
                               beta=0.0, alpha=scale)  # [b*g, r*rows, end]
        scores.view(b, groups, -1, rows, end)[..., first:end].add_(causal_bias[:rows, :rows])
        p = torch.softmax(scores, dim=-1, out=scores)  # in place
        out_rows = out5[..., first:end, :]
        out_rows.copy_(torch.bmm(p, values[:, :end]).view(out_rows.shape))
        if keep_probs:
            probs.append(p)
    return out, probs


def _shape_only(like: torch.Tensor, rows: int, columns: int) -> torch.Tensor:
    """A `[like's batch, rows, columns]` stand-in with no memory of its own: baddbmm's ignored input at beta=0."""
    return like.new_empty(()).expand(like.shape[0], rows, columns)


def _attention_forward_fake(q, k, v, keep_probs):
    s, b, heads = q.shape[:3]
    groups = k.shape[2]
    probs = [q.new_empty(b * groups, heads // groups * (end - first), end) for first, end in _blocks(s)]
    return q.new_empty(q.shape), probs if keep_probs else []


def _attention_backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                        probs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq `[s, b, heads, d]`, dk and dv `[b * groups, s, d]`) from the forward's output and P."""
    s, b, heads, d = q.shape
    groups = k.shape[2]
    scale = 1.0 / math.sqrt(d)
    keys, values_t = _by_group(k), _by_group(v).transpose(1, 2)  # [b*g, s, d], [b*g, d, s]
    grad_q = torch.empty(s, b, heads, d, dtype=q.dtype, device=q.device)
    grad_k, grad_v = (torch.empty(b * groups, s, d, dtype=q.dtype, device=q.device) for _ in range(2))
    delta = (grad_out * out).sum(-1, keepdim=True)  # rowsum(dO * O) `[s, b, heads, 1]`
    query, grad_block, delta_block = (_BlockRows(_split_heads(x, groups)) for x in (q, grad_out, delta))
    grad_q5 = _split_heads(grad_q, groups)
    # Last block first: it covers every key, so it writes dk and dv whole (no zeroing);
    # the earlier blocks add into their key prefixes.
    for (first, end), p in reversed(list(zip(_blocks(s), probs))):
        q_block, grad_o = query(first, end), grad_block(first, end)  # [b*g, r*rows, d]
        grad_s = torch.bmm(grad_o, values_t[..., :end]).sub_(delta_block(first, end)).mul_(p)  # dS
        grad_q_rows = grad_q5[..., first:end, :]
        torch.mul(torch.bmm(grad_s, keys[:, :end]).view(grad_q_rows.shape), scale, out=grad_q_rows)
        if end == s:
            torch.bmm(p.transpose(1, 2), grad_o, out=grad_v)
            torch.baddbmm(grad_k, grad_s.transpose(1, 2), q_block, beta=0.0, alpha=scale, out=grad_k)
        else:  # into new memory, then added: baddbmm_ into a strided prefix runs no faster
            grad_v[:, :end] += torch.bmm(p.transpose(1, 2), grad_o)
            grad_k[:, :end] += torch.baddbmm(_shape_only(q_block, end, d), grad_s.transpose(1, 2), q_block,
                                             beta=0.0, alpha=scale)
    return grad_q, grad_k, grad_v


def _attention_backward_fake(grad_out, q, k, v, out, probs):
    s, b, groups, d = k.shape
    return q.new_empty(q.shape), k.new_empty(b * groups, s, d), v.new_empty(b * groups, s, d)


_forward_op = torch.library.custom_op("megalite::causal_attention_forward", _attention_forward, mutates_args=())
_forward_op.register_fake(_attention_forward_fake)
_backward_op = torch.library.custom_op("megalite::causal_attention_backward", _attention_backward, mutates_args=())
_backward_op.register_fake(_attention_backward_fake)


def _ops():
    """(forward, backward): the custom ops under torch.compile, where they stay opaque; in eager
    their Python bodies, called directly (no op dispatch cost)."""
    if torch.compiler.is_compiling():
        return torch.ops.megalite.causal_attention_forward, torch.ops.megalite.causal_attention_backward
    return _attention_forward, _attention_backward


class _CausalAttention(torch.autograd.Function):
    """The two ops as one differentiable function (lighter than a custom op's own autograd)."""

    @staticmethod
    def forward(ctx, q, k, v):
        out, probs = _ops()[0](q, k, v, True)
        ctx.save_for_backward(q, k, v, out, *probs)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, *probs = ctx.saved_tensors
        grad_q, grad_k, grad_v = _ops()[1](grad_out.contiguous(), q, k, v, out, probs)
        s, b, groups, d = k.shape
        return grad_q, *(grad.unflatten(0, (b, groups)).permute(2, 0, 1, 3) for grad in (grad_k, grad_v))
