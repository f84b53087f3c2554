"""Context-parallel (CP) causal attention: each rank of the CP group holds a part of the sequence, and the
ranks together compute one process's causal attention over the whole of it.

The split is Megatron's load-balanced zig-zag: a sequence of length S is cut into 2·CP chunks of S/(2·CP) and
CP rank r holds chunks r and 2·CP-1-r, in that order (`data.loader.context_parallel_positions`), so every rank
does the same causal work. q, k and v arrive already split, in the attention core's layout: q `[S/CP, b, heads, d]`, k and v
`[S/CP, b, groups, d]` (grouped-query attention: query head i attends with key/value head i // (heads/groups)).

`--cp-comm-type` (Megatron's names) picks how the keys and values meet the queries:
- `all_gather`: K and V gathered over CP, attention masked by global positions; dK, dV reduce-scattered back.
- `p2p`: a ring. K/V blocks travel rank to rank, the next block's send/receive overlapping the current block's
  attention; the partial attentions merge by their log-sum-exp (LSE). The fused kernels return an LSE that is
  not differentiable, so autograd through the merge would give a wrong dQ: the ring is its own autograd
  Function, whose backward recomputes each block from the merged output and LSE and sends dK/dV around the
  ring back to their owners.
- `a2a` (Ulysses): an all-to-all turns the sequence split into a head split, each rank attends over the whole
  sequence for its heads, and an all-to-all turns it back.
- `a2a+p2p` (hierarchical): the all-to-all among A adjacent CP ranks, then the ring over the P = CP/A such groups.
  The A ranks' chunks, put in order, are chunks p and 2P-1-p of the sequence cut in 2P: the ring's own zig-zag.
"""

import contextlib
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megalite.config.rules import check_a2a_heads, check_sequence_split
from megalite.data.loader import context_parallel_positions
from megalite.errors import UserError
from megalite.tensor_parallel.comm import all_to_all, gather_from_sequence_parallel_region, group_size
from megalite.tensor_parallel.random import get_rng_state, model_parallel_rng_tracker, set_rng_state

CP_COMM_TYPES = ("p2p", "all_gather", "a2a", "a2a+p2p")
# The ring's two messages in flight between the same ranks, told apart (gloo matches by tag).
_KV_TAG, _GRAD_KV_TAG = 1, 2
# device type -> (CUDA flash kernel's markers for its backward, or None; why not): `_flash_markers`.
_FLASH: dict[str, tuple[tuple | None, str]] = {}


def context_parallel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group, comm_type: str,
                               scale: float | None = None, levels: tuple | None = None,
                               dropout: float = 0.0) -> torch.Tensor:
    """Causal softmax(scale · q k^T) v over the global positions of the CP group's zig-zag split: q
    `[s, b, heads, d]`, k and v `[s, b, groups, d]` (this rank's s = S/CP tokens) -> `[s, b, heads, d]`.
    `scale` None: 1/sqrt(d). A group of one (or None) is plain causal attention. `levels`: a2a+p2p's (all-to-all
    group, ring group) within `group`. `dropout`: the attention probabilities' dropout, its masks drawn from the
    current RNG (the caller forks the per-rank stream)."""
    if comm_type not in CP_COMM_TYPES:
        raise UserError(f"--cp-comm-type {comm_type} is not supported: use one of {', '.join(CP_COMM_TYPES)}")
    size = group_size(group)
    check_sequence_split(q.shape[0] * size, size)
    if comm_type == "a2a+p2p" and size > 1:
        check_a2a_heads(q.shape[2], group_size(levels[0]))
    if comm_type == "a2a":
        check_a2a_heads(q.shape[2], size)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if size == 1:
        return _causal_sdpa(q, k, v, scale, dropout=dropout)
    if comm_type == "all_gather":
        return _all_gather_attention(q, k, v, group, scale, dropout)
    if comm_type == "a2a":
        return _a2a_attention(q, k, v, group, scale, dropout)
    if comm_type == "a2a+p2p":
        return _a2a_ring_attention(q, k, v, *levels, scale, dropout)
    return _ring_attention(q, k, v, group, scale, dropout)


def _ring_attention(q, k, v, group, scale, dropout=0.0):
    """The ring on `[s, b, n, d]` tensors in the zig-zag order of `group`."""
    ring_layout = [t.permute(1, 2, 0, 3).contiguous() for t in (q, k, v)]  # [b, n, s, d], the kernels' layout
    return _RingAttention.apply(*ring_layout, group, scale, dropout).permute(2, 0, 1, 3)


def _a2a_ring_attention(q, k, v, a2a_group, ring_group, scale, dropout=0.0):
    """a2a+p2p: heads split over the all-to-all group's A ranks, which then hold the tokens of all A; put in order,
    those are the two zig-zag chunks of the ring group's split of the sequence in 2P (module docstring)."""
    size, s = group_size(a2a_group), q.shape[0]
    k, v = _repeat_for_split(k, size), _repeat_for_split(v, size)
    half = torch.arange(s // 2)
    # Gathered in rank order: rank i's first chunk then its second. The firsts in rank order, then the seconds in
    # reverse rank order, are each one run of consecutive chunks.
    order = torch.cat([i * s + half for i in range(size)] + [i * s + s // 2 + half for i in reversed(range(size))])
    order = order.to(q.device)
    q, k, v = (_heads_to_sequence(t, a2a_group)[order] for t in (q, k, v))  # [A·s, b, n/A, d]
    out = _ring_attention(q, k, v, ring_group, scale, dropout)[torch.argsort(order)]
    return _sequence_to_heads(out, a2a_group)


def _repeat_for_split(x: torch.Tensor, size: int) -> torch.Tensor:
    """k or v `[s, b, groups, d]` with each key/value head repeated only as far as needed to split the heads over
    `size` ranks: query head chunk j then holds the query heads of key/value head chunk j (heads/groups is a
    multiple of the repeat, since `size` divides the heads)."""
    repeat = size // math.gcd(x.shape[2], size)
    return x.repeat_interleave(repeat, dim=2) if repeat > 1 else x


def rank_order_positions(seq_length: int, size: int) -> torch.Tensor:
    """The global positions `[S]` of a sequence of `seq_length` S gathered from its `size` CP ranks in rank order."""
    return torch.cat([context_parallel_positions(seq_length, rank, size) for rank in range(size)])


def gather_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """This CP rank's part `[s, ...]` of a sequence -> the whole sequence `[CP·s, ...]` in global order, on every
    rank of `group`; backward sums each rank's rows' grads back to it (a reduce-scatter)."""
    gathered = gather_from_sequence_parallel_region(x, group)
    return gathered[torch.argsort(rank_order_positions(len(gathered), group_size(group))).to(x.device)]


def bytes_sent(comm_type: str, cp: int, tokens: int, batch: int, heads: int, groups: int, head_dim: int,
               element_bytes: int, a2a_size: int = 1) -> int:
    """Bytes one CP rank sends in one attention forward + backward: `tokens` (s = S/CP) of its own, `heads` (n) and
    `groups` (g) of `head_dim` (d) elements of `element_bytes` (e) per rank; KV = 2 s b g d e, its K and V.
    - p2p: K/V go P-1 hops round the ring in the forward and again in the backward, and the dK/dV accumulator (in
      the LSE's dtype, fp32 or wider) P hops, the last bringing each rank its own;
    - all_gather: K and V all-gathered, dK and dV reduce-scattered: 2 (P-1) KV;
    - a2a: q, k, v turned from sequence to heads and the output back, each grad the reverse way, each rank sending
      (P-1)/P of each; k and v with their heads repeated to lcm(g, P) to split over P;
    - a2a+p2p: a2a among `a2a_size` (A) ranks, then p2p over CP/A ranks of A·s tokens, n/A heads and lcm(g, A)/A
      key/value heads."""
    if cp == 1:
        return 0
    if comm_type == "a2a+p2p":
        a2a = bytes_sent("a2a", a2a_size, tokens, batch, heads, groups, head_dim, element_bytes)
        return a2a + bytes_sent("p2p", cp // a2a_size, tokens * a2a_size, batch, heads // a2a_size,
                                math.lcm(groups, a2a_size) // a2a_size, head_dim, element_bytes)
    per_head = tokens * batch * head_dim
    if comm_type == "p2p":
        return 2 * groups * per_head * ((2 * cp - 2) * element_bytes + cp * max(element_bytes, 4))
    if comm_type == "all_gather":
        return 2 * (cp - 1) * 2 * groups * per_head * element_bytes
    return 4 * (cp - 1) * per_head * element_bytes * (heads + math.lcm(groups, cp)) // cp


def _causal_sdpa(q, k, v, scale, mask=None, dropout=0.0):
    """SDPA on `[s, b, n, d]` tensors: causal by local order, or by `mask` `[s_q, s_k]` (True: attend)."""
    q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale,
                                         dropout_p=dropout, enable_gqa=k.shape[1] != q.shape[1])
    return out.permute(2, 0, 1, 3)


def _all_gather_attention(q, k, v, group, scale, dropout=0.0):
    """All of K and V on every rank (gathered in rank order), masked by global positions."""
    size, rank, s = group_size(group), dist.get_rank(group), q.shape[0]
    key_positions = rank_order_positions(s * size, size).to(q.device)
    query_positions = key_positions[rank * s:(rank + 1) * s]
    mask = key_positions[None, :] <= query_positions[:, None]  # [s, S]
    k, v = (gather_from_sequence_parallel_region(t, group) for t in (k, v))  # backward: reduce-scatter
    return _causal_sdpa(q, k, v, scale, mask, dropout)


def _a2a_attention(q, k, v, group, scale, dropout=0.0):
    """Ulysses: heads split over CP, the whole sequence on each rank, put in global order for causal SDPA."""
    size, s = group_size(group), q.shape[0]
    k, v = _repeat_for_split(k, size), _repeat_for_split(v, size)
    gathered = rank_order_positions(s * size, size).to(q.device)
    to_global = torch.argsort(gathered)
    q, k, v = (_heads_to_sequence(t, group)[to_global] for t in (q, k, v))  # [S, b, n/CP, d]
    return _sequence_to_heads(_causal_sdpa(q, k, v, scale, dropout=dropout)[gathered], group)


def _heads_to_sequence(x, group):
    """`[s, b, n, d]` (this rank's tokens, all heads) -> `[CP·s, b, n/CP, d]` (every rank's tokens, in rank
    order, for this rank's head chunk)."""
    size, s, b, n, d = group_size(group), *x.shape
    by_rank = x.reshape(s, b, size, n // size, d).permute(2, 0, 1, 3, 4).reshape(size * s, b, n // size, d)
    return all_to_all(by_rank, group, [s] * size, [s] * size)


def _sequence_to_heads(x, group):
    """The inverse of `_heads_to_sequence`."""
    size, total, b, n_local, d = group_size(group), *x.shape
    s = total // size
    x = all_to_all(x.contiguous(), group, [s] * size, [s] * size)  # row block i: head chunk i of my tokens
    return x.reshape(size, s, b, n_local, d).permute(1, 2, 0, 3, 4).reshape(s, b, size * n_local, d)


# The ring ------------------------------------------------------------------------------------------------

def _block_forward_cpu(q, k, v, causal, scale):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)


def _block_backward_cpu(grad_out, q, k, v, out, lse, causal, scale):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out, q, k, v, out, lse, 0.0, causal, scale=scale)


def _block_forward_flash(q, k, v, causal, scale):
    return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, scale=scale)[:2]


def _block_backward_flash(grad_out, q, k, v, out, lse, causal, scale, markers=None):
    """The kernel's backward from a given (out, lse); `markers` (default: the device's) as `_flash_markers`."""
    cum_seq_q, cum_seq_k, rng_state, rng_offset = markers or _flash_markers(q.device)
    return torch.ops.aten._scaled_dot_product_flash_attention_backward(
        grad_out, q, k, v, out, lse, cum_seq_q, cum_seq_k, q.shape[2], k.shape[2], 0.0, causal, rng_state,
        rng_offset, scale=scale)


def _flash_markers(device: torch.device) -> tuple | None:
    """What CUDA's flash kernel returned beside (out, lse) for a dense call without dropout (its sequence offsets
    and RNG state), which its backward takes back; None where the ring's blocks cannot use it (`ring_blocks`)."""
    if device.type not in _FLASH:
        _FLASH[device.type] = _probe_flash(device) if device.type == "cuda" else (None, "not a CUDA device")
    return _FLASH[device.type][0]


def ring_blocks(device: torch.device) -> str:
    """How the ring computes its 16-bit blocks on `device` without dropout: "flash" (CUDA's fused kernel, the
    scores never whole), or "matmul" and why the kernel is not used."""
    _flash_markers(device)
    markers, why = _FLASH[device.type]
    return "flash" if markers is not None else f"matmul ({why})"


def _probe_flash(device: torch.device) -> tuple[tuple | None, str]:
    """(the markers, "") when the flash kernel's forward and its backward from a given (out, lse) match the
    matmul blocks on a small bf16 causal block, else (None, why not)."""
    generator = torch.Generator().manual_seed(0)
    q, k, v, grad = (torch.randn(1, 2, 64, 64, generator=generator).to(device, torch.bfloat16) for _ in range(4))
    scale = 64 ** -0.5
    try:
        results = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, scale=scale)
        out, lse, markers = results[0], results[1], (results[2], results[3], results[6], results[7])
        grads = _block_backward_flash(grad, q, k, v, out, lse, True, scale, markers)
    except (RuntimeError, TypeError, NotImplementedError, IndexError) as error:
        return None, f"its call failed: {type(error).__name__}: {str(error).splitlines()[0]}"
    wide = [t.float() for t in (grad, q, k, v)]
    expected_out, expected_lse = _block_forward_matmul(*wide[1:], True, scale)
    expected = (expected_out, expected_lse, *_block_backward_matmul(*wide, out.float(), lse.float(), True, scale))
    for name, actual, wanted in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *grads), expected):
        error = ((actual.float() - wanted).norm() / wanted.norm()).item()
        if not error <= 2e-2:  # bf16's rounding of a 64-long dot product, with margin
            return None, f"its {name} differs from the matmul blocks' by {error:.2e} (relative)"
    return markers, ""


def _block_forward_matmul(q, k, v, causal, scale, keep=None):
    """(out, lse) of one block by plain matmuls, on any device and dtype: q `[b, n, s_q, d]`, k/v
    `[b, n, s_k, d]` -> `[b, n, s_q, d]`, `[b, n, s_q]` (fp32 or wider). `keep`: dropout's scaled keep mask
    `[b, n, s_q, s_k]` (0 or 1/(1-p)) on the probabilities; the LSE is the undropped one, which merges."""
    scores = _scores(q, k, causal, scale)
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse.unsqueeze(-1))
    return ((probs if keep is None else probs * keep).to(v.dtype) @ v), lse


def _block_backward_matmul(grad_out, q, k, v, out, lse, causal, scale, keep=None):
    """One block's (dq, dk, dv) from the MERGED output and LSE (the block's probabilities are exp(scores -
    lse)): dS = P * (dP - rowsum(dO * O)), dP = dO V^T (times `keep` under dropout, whose dV takes the dropped
    probabilities; the rowsum still is dO·O, as O is the dropped output)."""
    probs = torch.exp(_scores(q, k, causal, scale) - lse.unsqueeze(-1))
    delta = (grad_out.to(probs.dtype) * out.to(probs.dtype)).sum(-1, keepdim=True)
    grad_probs = (grad_out @ v.transpose(-1, -2)).to(probs.dtype)
    dropped = probs if keep is None else probs * keep
    grad_scores = probs * ((grad_probs if keep is None else grad_probs * keep) - delta)
    grad_scores, dropped = grad_scores.to(q.dtype), dropped.to(q.dtype)
    return (grad_scores @ k) * scale, (grad_scores.transpose(-1, -2) @ q) * scale, dropped.transpose(-1, -2) @ grad_out


def _scores(q, k, causal, scale):
    scores = (q @ k.transpose(-1, -2)).to(torch.promote_types(q.dtype, torch.float32)) * scale
    if causal:  # only square (diagonal) blocks are causal
        scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu_(1), float("-inf"))
    return scores


def _block_ops(device: torch.device, dropout: float = 0.0, dtype: torch.dtype | None = None, head_dim: int = 0):
    """(forward, backward) of one attention block, the one device dispatch: CPU's fused flash kernel (it returns
    the LSE; it has no dropout); CUDA's flash kernel for bf16/fp16 blocks of head size 8k <= 256 without dropout,
    where it works (`ring_blocks`); plain matmuls elsewhere and under dropout."""
    if device.type == "cpu" and not dropout:
        return _block_forward_cpu, _block_backward_cpu
    if (device.type == "cuda" and not dropout and dtype in (torch.bfloat16, torch.float16)
            and head_dim % 8 == 0 and 0 < head_dim <= 256 and _flash_markers(device) is not None):
        return _block_forward_flash, _block_backward_flash
    return _block_forward_matmul, _block_backward_matmul


def _keep_masks(dropout: float):
    """`keep(shape, device)`: dropout's next scaled keep mask (0 or 1/(1-p)) from the current RNG, or None
    without dropout. The ring draws one per block in step order, forward and (from the same RNG state) backward."""
    if not dropout:
        return lambda shape, device: None
    return lambda shape, device: (torch.rand(shape, device=device) >= dropout) / (1.0 - dropout)


def _block(step: int, source: int, rank: int, half: int) -> tuple[slice, slice, bool]:
    """(query rows, key rows, causal) of the ring's block at `step`, where this rank holds `source`'s K/V.
    Rank r's rows are chunks (r, 2CP-1-r): its own K/V is the causal diagonal; an earlier rank's first
    chunk is wholly before both of r's chunks and its second wholly after; a later rank's two chunks are
    both before r's second chunk and after its first."""
    everything = slice(None)
    if step == 0:
        return everything, everything, True
    if source < rank:
        return everything, slice(None, half), False
    return slice(half, None), everything, False


def _repeat_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """k or v `[b, groups, s, d]` -> `[b, heads, s, d]`, each head repeated for its query heads."""
    return x if x.shape[1] == heads else x.repeat_interleave(heads // x.shape[1], dim=1)


def _sum_heads(grad: torch.Tensor, groups: int) -> torch.Tensor:
    """The grad of `_repeat_heads`: `[b, heads, s, d]` -> `[b, groups, s, d]`."""
    return grad if grad.shape[1] == groups else grad.unflatten(1, (groups, -1)).sum(2)


def _send_to_next(tensor: torch.Tensor, group, tag: int):
    """Start sending `tensor` to the next rank of the ring and receiving the previous rank's into a new
    tensor; (that tensor, the requests to wait on)."""
    size, rank = group_size(group), dist.get_rank(group)
    received = torch.empty_like(tensor)
    operations = [dist.P2POp(dist.isend, tensor, dist.get_global_rank(group, (rank + 1) % size), group, tag),
                  dist.P2POp(dist.irecv, received, dist.get_global_rank(group, (rank - 1) % size), group, tag)]
    return received, dist.batch_isend_irecv(operations)


def _wait(requests) -> None:
    for request in requests:
        request.wait()


def ring_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group, scale: float, dropout: float = 0.0):
    """The ring's (out `[b, heads, s, d]`, lse `[b, heads, s]`) for q `[b, heads, s, d]`, k/v `[b, groups, s, d]`
    (contiguous). Differentiable in q only through the block kernels' outputs, NOT their LSE: `_RingAttention`
    is the differentiable form. `dropout`: each block's keep mask drawn from the current RNG, in step order."""
    size, rank, half, heads = group_size(group), dist.get_rank(group), q.shape[2] // 2, q.shape[1]
    forward, keep = _block_ops(q.device, dropout, q.dtype, q.shape[-1])[0], _keep_masks(dropout)
    key_values = torch.stack([k, v])
    out = lse = None
    for step in range(size):
        if step + 1 < size:  # the next block travels while this one is computed
            next_key_values, requests = _send_to_next(key_values, group, _KV_TAG)
        rows, keys, causal = _block(step, (rank - step) % size, rank, half)
        block_k, block_v = (_repeat_heads(t[:, :, keys], heads) for t in key_values)
        mask = keep((*q[:, :, rows].shape[:3], block_k.shape[2]), q.device)
        block_out, block_lse = forward(q[:, :, rows], block_k, block_v, causal, scale,
                                       **({} if mask is None else {"keep": mask}))
        if step == 0:  # the diagonal block covers every row
            out, lse = block_out.to(block_lse.dtype), block_lse
        else:
            out, lse = _merge(out, lse, rows, block_out, block_lse)
        if step + 1 < size:
            _wait(requests)
            key_values = next_key_values
    return out.to(q.dtype), lse


def _merge(out, lse, rows, block_out, block_lse):
    """(out, lse) with a block's partial attention over other keys merged into `rows`, weighted by exp(LSE)."""
    merged_lse = torch.logaddexp(lse[:, :, rows], block_lse)
    merged = (out[:, :, rows] * torch.exp(lse[:, :, rows] - merged_lse).unsqueeze(-1)
              + block_out * torch.exp(block_lse - merged_lse).unsqueeze(-1))
    out, lse = out.clone(), lse.clone()  # not in place: the caller may differentiate through the merge
    out[:, :, rows], lse[:, :, rows] = merged, merged_lse
    return out, lse


def _ring_backward(grad_out, q, k, v, out, lse, group, scale, dropout=0.0):
    """(dq, dk, dv) of the ring: K/V travel the ring again, each rank adds its queries' share of every
    block's dK/dV into the accumulator travelling with that block, and one last step hands each rank its own.
    Under dropout the RNG must be where the forward drew its masks: they are drawn again, in the same order."""
    size, rank, half, heads, groups = group_size(group), dist.get_rank(group), q.shape[2] // 2, q.shape[1], k.shape[1]
    backward, keep = _block_ops(q.device, dropout, q.dtype, q.shape[-1])[1], _keep_masks(dropout)
    key_values = torch.stack([k, v])
    grad_q = torch.zeros_like(q, dtype=lse.dtype)
    for step in range(size):
        if step + 1 < size:
            next_key_values, kv_requests = _send_to_next(key_values, group, _KV_TAG)
        rows, keys, causal = _block(step, (rank - step) % size, rank, half)
        block_k, block_v = (_repeat_heads(t[:, :, keys], heads) for t in key_values)
        mask = keep((*q[:, :, rows].shape[:3], block_k.shape[2]), q.device)
        block_grads = backward(grad_out[:, :, rows].contiguous(), q[:, :, rows].contiguous(), block_k, block_v,
                               out[:, :, rows].contiguous(), lse[:, :, rows].contiguous(), causal, scale,
                               **({} if mask is None else {"keep": mask}))
        grad_q[:, :, rows] += block_grads[0]
        grad_key_values = torch.zeros_like(key_values, dtype=lse.dtype)
        for held, grad in zip(grad_key_values, block_grads[1:]):
            held[:, :, keys] = _sum_heads(grad, groups)
        if step > 0:  # the accumulator of this block's owner, from the previous rank
            _wait(grad_requests)
            grad_key_values += received
        received, grad_requests = _send_to_next(grad_key_values, group, _GRAD_KV_TAG)
        if step + 1 < size:
            _wait(kv_requests)
            key_values = next_key_values
    _wait(grad_requests)  # after CP steps the accumulator that arrives is this rank's own
    return grad_q.to(q.dtype), received[0].to(k.dtype), received[1].to(v.dtype)


class _RingAttention(torch.autograd.Function):
    """The ring as one differentiable function of q, k, v `[b, n, s, d]` (see `ring_forward`). Under dropout the
    forward keeps the RNG state it drew its masks from; the backward draws them again from it, in a fork of the
    RNG, so that it neither stores the masks nor moves the RNG."""

    @staticmethod
    def forward(ctx, q, k, v, group, scale, dropout=0.0):
        ctx.rng_state = get_rng_state(q.device) if dropout else None
        out, lse = ring_forward(q, k, v, group, scale, dropout)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.scale, ctx.dropout = group, scale, dropout
        return out

    @staticmethod
    def backward(ctx, grad_out):
        saved = ctx.saved_tensors  # unpacked once: under recomputation a second unpacking is an error
        device = saved[0].device
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else [],
                                   enabled=ctx.rng_state is not None):
            if ctx.rng_state is not None:
                set_rng_state(ctx.rng_state, device)
            grads = _ring_backward(grad_out.contiguous(), *saved, ctx.group, ctx.scale, ctx.dropout)
        return *grads, None, None, None



def comm_levels(layout, parallel) -> tuple[str, tuple | None]:
    """(comm type, levels) for `apply` from a ParallelConfig and its ParallelState: a2a+p2p with its (all-to-all,
    ring) groups, or plain a2a (p2p) where its all-to-all level spans all of CP (none of it)."""
    if layout.cp_comm_type != "a2a+p2p":
        return layout.cp_comm_type, None
    if layout.cp_a2a_size in (1, layout.context_parallel_size):
        return ("p2p" if layout.cp_a2a_size == 1 else "a2a"), None
    return "a2a+p2p", (parallel.cp_a2a_group, parallel.cp_p2p_group)


def apply(model: torch.nn.Module, group, comm_type: str, levels: tuple | None = None) -> torch.nn.Module:
    """Give each layer of `model` (a GPTModel chunk) context-parallel attention over `group` as its core (q
    `[s, b, heads, d]`, k/v `[s, b, groups, d]` -> `[s, b, heads * d]`, the layer's own core's contract);
    `levels`: a2a+p2p's (all-to-all group, ring group)."""
    for layer in model.layers.values():
        layer.self_attention.core_attention = _core(layer.self_attention, group, comm_type, levels)
    return model


def _core(attention: torch.nn.Module, group, comm_type: str, levels: tuple | None):
    """The CP core of one attention module; its dropout masks from this rank's own stream of the TP-style
    tracker (seeded with the CP rank), since the CP ranks hold other tokens (or, under a2a, other heads)."""
    def core_attention(q, k, v):
        dropout = attention.attention_dropout if attention.training else 0.0
        with model_parallel_rng_tracker.fork() if dropout else contextlib.nullcontext():
            return context_parallel_attention(q, k, v, group, comm_type, levels=levels, dropout=dropout).flatten(2)
    return core_attention
