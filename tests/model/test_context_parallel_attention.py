"""Context-parallel attention (model/context_parallel.py) against one process's causal SDPA, in fp64.

Every rank draws the whole sequence's q, k, v and upstream grad from one seed, attends over its zig-zag slices
under CP, and compares its output and dQ, dK, dV with the same slices of the one-process result. One gloo world
per CP size runs every check (comm type x GQA), each reported as its own test.
"""

import functools
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megalite.errors import UserError
from megalite.model import context_parallel
from megalite.config.rules import check_a2a_heads, check_sequence_split
from megalite.data.loader import context_parallel_positions
from megalite.model.context_parallel import CP_COMM_TYPES, context_parallel_attention
from megalite.parallel_state import group_ranks
from tests.helpers.distributed import run_world

SEQ, BATCH, HEADS, HEAD_DIM = 24, 2, 8, 8
TOLERANCE = 1e-10
# Key/value heads: 8 is plain multi-head; 2 is GQA, which a2a splits over CP 2 as is and repeats for CP 4.
GROUPS = {"mha": HEADS, "gqa": 2}
CP_SIZES = (2, 4)


def randn(*shape, seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def inputs(groups: int) -> tuple[torch.Tensor, ...]:
    """The whole sequence's q `[S, b, heads, d]`, k, v `[S, b, groups, d]` and upstream grad, on every rank."""
    return (randn(SEQ, BATCH, HEADS, HEAD_DIM, seed=1), randn(SEQ, BATCH, groups, HEAD_DIM, seed=2),
            randn(SEQ, BATCH, groups, HEAD_DIM, seed=3), randn(SEQ, BATCH, HEADS, HEAD_DIM, seed=4))


def reference(q, k, v, grad):
    """One process: causal SDPA on the whole sequence; (out, dq, dk, dv), all `[S, b, n, d]`."""
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(*(t.permute(1, 2, 0, 3) for t in (q, k, v)), is_causal=True,
                                         enable_gqa=True).permute(2, 0, 1, 3)
    out.backward(grad)
    return out.detach(), q.grad, k.grad, v.grad


def hierarchical_levels(size: int) -> tuple:
    """a2a+p2p's (all-to-all, ring) groups of this rank: all-to-all among 2 adjacent ranks, the ring over the
    size/2 pairs (every rank creates every group, in the same order)."""
    groups = group_ranks(size, 1, 1, cp=size, cp_a2a=2)
    mine = {}
    for kind in ("cp_a2a", "cp_p2p"):
        for ranks in groups[kind]:
            group = dist.new_group(ranks)
            if dist.get_rank() in ranks:
                mine[kind] = group
    return mine["cp_a2a"], mine["cp_p2p"]


def max_errors(comm_type: str, groups: int) -> dict:
    """This rank's max |CP - one process| of the output and each input grad."""
    size, rank = dist.get_world_size(), dist.get_rank()
    q, k, v, grad = inputs(groups)
    expected = reference(q, k, v, grad)
    mine = context_parallel_positions(SEQ, rank, size)
    q, k, v = (t[mine].clone().requires_grad_() for t in (q, k, v))
    levels = hierarchical_levels(size) if comm_type == "a2a+p2p" else None
    out = context_parallel_attention(q, k, v, dist.group.WORLD, comm_type, levels=levels)
    out.backward(grad[mine])
    actual = (out.detach(), q.grad, k.grad, v.grad)
    return {name: (a - e[mine]).abs().max().item()
            for name, a, e in zip(("out", "dq", "dk", "dv"), actual, expected)}


def check_attention(comm_type: str, groups: int) -> dict:
    errors = max_errors(comm_type, groups)
    assert max(errors.values()) <= TOLERANCE, errors
    return errors


DROPOUT, EPS = 0.3, 1e-6


def dropped_attention(comm_type: str, q, k, v, dropout: float = DROPOUT) -> torch.Tensor:
    """This rank's CP attention with dropout, its masks from a seeded RNG: the same masks on every call."""
    torch.manual_seed(1000 + dist.get_rank())
    levels = hierarchical_levels(dist.get_world_size()) if comm_type == "a2a+p2p" else None
    return context_parallel_attention(q, k, v, dist.group.WORLD, comm_type, levels=levels, dropout=dropout)


def check_dropout_gradients(comm_type: str, groups: int) -> dict:
    """Attention dropout under CP: it drops (the output moves off the undropped one), and its grads are those of
    the function it computes, with the masks fixed: central differences of the loss summed over every rank, at
    coordinates of each rank's q, k and v in turn (fp64). A backward that drew other masks than its forward, or
    that left the masks out of dV or dP, fails."""
    size, rank = dist.get_world_size(), dist.get_rank()
    q, k, v, grad = inputs(groups)
    mine = context_parallel_positions(SEQ, rank, size)
    local = [t[mine].clone().requires_grad_() for t in (q, k, v)]
    weights = grad[mine]
    undropped = dropped_attention(comm_type, *local, dropout=0.0).detach()
    out = dropped_attention(comm_type, *local)
    moved = (out - undropped).abs().max().item()
    torch.rand(100)  # the RNG moves on before the backward, as other layers' dropout moves it
    out.backward(weights)

    def global_loss(tensors) -> float:
        with torch.no_grad():
            loss = (dropped_attention(comm_type, *tensors) * weights).sum()
        dist.all_reduce(loss)
        return loss.item()

    worst = 0.0
    for owner in range(size):
        for which, tensor in enumerate(local):
            for index in (3, tensor.numel() // 2, tensor.numel() - 5):
                values = []
                for sign in (1, -1):
                    perturbed = [t.detach().clone() for t in local]
                    if rank == owner:
                        perturbed[which].view(-1)[index] += sign * EPS
                    values.append(global_loss(perturbed))
                if rank == owner:
                    numeric = (values[0] - values[1]) / (2 * EPS)
                    worst = max(worst, abs(numeric - tensor.grad.view(-1)[index].item()))
    assert moved > 1e-2 and worst < 1e-6, (moved, worst)
    return {"moved": moved, "gradient": worst}


def check_merge_trap() -> dict:
    """The ring's forward differentiated by plain autograd: the kernels' LSE carries no grad, so the dQ through
    the merge is wrong by far more than the bar (the reason the ring has its own backward)."""
    size, rank = dist.get_world_size(), dist.get_rank()
    q, k, v, grad = inputs(HEADS)
    expected_dq = reference(q, k, v, grad)[1]
    mine = context_parallel_positions(SEQ, rank, size)
    q, k, v = (t[mine].permute(1, 2, 0, 3).contiguous() for t in (q, k, v))
    q.requires_grad_()
    out, _ = context_parallel.ring_forward(q, k, v, dist.group.WORLD, HEAD_DIM ** -0.5)
    out.backward(grad[mine].permute(1, 2, 0, 3))
    error = (q.grad.permute(2, 0, 1, 3) - expected_dq[mine]).abs().max().item()
    assert error > 1e-3, error
    return {"dq": error}


def checks(size: int) -> dict:
    """name: a function with no arguments, in the order every rank runs them; a2a+p2p (all-to-all among 2 ranks,
    the ring over the pairs) from CP 4."""
    table = {f"{comm_type}-{kind}": functools.partial(check_attention, comm_type, groups)
             for comm_type in CP_COMM_TYPES if comm_type != "a2a+p2p" or size >= 4 for kind, groups in GROUPS.items()}
    table |= {f"{comm_type}-dropout": functools.partial(check_dropout_gradients, comm_type, GROUPS["gqa"])
              for comm_type in CP_COMM_TYPES if comm_type != "a2a+p2p" or size >= 4}
    table["p2p-autograd-through-the-merge-is-wrong"] = check_merge_trap
    return table


def run_checks(rank: int, world_size: int) -> dict:
    """Every check on this rank; {name: (traceback or None, its max errors)}."""
    results = {}
    for name, check in checks(world_size).items():
        try:
            results[name] = (None, check())
        except Exception:  # noqa: BLE001 - reported per check by the tests below
            results[name] = (traceback.format_exc(), None)
    return results


@functools.cache
def world_results(size: int) -> list[dict]:
    """Every rank's results in a CP world of `size`, run once, when a test first asks for it."""
    return run_world(size, run_checks)


@pytest.mark.parametrize("size, check", [(size, name) for size in CP_SIZES for name in checks(size)])
def test_context_parallel_attention_matches_one_process(size, check):
    reports = [f"rank {rank}:\n{results[check][0]}" for rank, results in enumerate(world_results(size))
               if results[check][0]]
    assert not reports, "\n".join(reports)


def test_the_attention_checks_the_sequence_split():
    with pytest.raises(UserError, match="--seq-length 12 is not divisible by 2 x --context-parallel-size 4 = 8"):
        check_sequence_split(12, 4)


def test_a2a_needs_heads_divisible_by_cp():
    check_a2a_heads(8, 4)
    with pytest.raises(UserError, match=r"heads per tensor-parallel rank \(6\) divisible by the 4 context-parallel "
                                        "ranks exchanging them"):
        check_a2a_heads(6, 4)


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
@pytest.mark.parametrize("block_ops", ["device", "matmul"])
def test_blocks_merged_by_lse_match_sdpa(device, block_ops):
    """The ring's arithmetic in one process: attention over a first and second half of the keys, each block's
    (out, LSE) merged, and each block's backward from the merged output and LSE, equal causal SDPA. On a GPU
    the device's block ops run in fp32 (TF32 off), so the bar there is fp32's."""
    dtype = torch.float64 if device == "cpu" else torch.float32
    ops = (context_parallel._block_ops(torch.device(device), dtype=dtype, head_dim=HEAD_DIM) if block_ops == "device"
           else (context_parallel._block_forward_matmul, context_parallel._block_backward_matmul))
    check_merged_blocks(*ops, device, dtype, TOLERANCE if dtype == torch.float64 else 1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_on_cuda_16_bit_blocks_run_the_flash_kernel_and_merge_to_sdpa(dtype):
    """The ring's bf16/fp16 blocks on a GPU: CUDA's flash kernel (its scores never whole), its backward taking
    the merged output and LSE; within 16-bit rounding of fp32 SDPA."""
    device = torch.device("cuda")
    assert context_parallel.ring_blocks(device) == "flash"
    ops = context_parallel._block_ops(device, dtype=dtype, head_dim=HEAD_DIM)
    assert ops == (context_parallel._block_forward_flash, context_parallel._block_backward_flash)
    check_merged_blocks(*ops, "cuda", dtype, 3e-2, relative=True)


def test_the_flash_blocks_calls_fit_the_kernels_schema(monkeypatch):
    """Off a GPU, the flash kernel's meta (shape) functions run the calls as the ring makes them: a causal
    diagonal forward, then a backward over other rows' keys from an fp32 LSE, with the markers the forward
    returned."""
    q, k, v, grad = (torch.empty(1, 2, 64, 64, device="meta", dtype=torch.bfloat16) for _ in range(4))
    results = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, scale=0.125)
    monkeypatch.setitem(context_parallel._FLASH, "meta", ((results[2], results[3], results[6], results[7]), ""))
    out, lse = context_parallel._block_forward_flash(q, k, v, True, 0.125)
    assert out.shape == q.shape and lse.shape == (1, 2, 64) and lse.dtype == torch.float32
    grads = context_parallel._block_backward_flash(grad, q, k[:, :, :32], v[:, :, :32], out, lse, False, 0.125)
    assert [tuple(g.shape) for g in grads] == [(1, 2, 64, 64), (1, 2, 32, 64), (1, 2, 32, 64)]


def test_off_cuda_the_ring_blocks_say_why_they_are_matmuls():
    assert context_parallel.ring_blocks(torch.device("cpu")) == "matmul (not a CUDA device)"
    assert context_parallel._block_ops(torch.device("cpu"), dtype=torch.bfloat16, head_dim=HEAD_DIM)[0] is (
        context_parallel._block_forward_cpu)


def check_merged_blocks(forward, backward, device: str, dtype: torch.dtype, tolerance: float,
                        relative: bool = False) -> None:
    """Three blocks: the first half's rows with the first half's keys (a diagonal), the second half's rows with
    them (full) and with the second half's keys (a diagonal); the last two merge by LSE. Output and grads against
    causal SDPA on the same (rounded) inputs in at least fp32, within `tolerance` (of the largest value, with
    `relative`)."""
    q, k, v, grad = (t[:16].to(device, dtype).permute(1, 2, 0, 3).contiguous() for t in inputs(HEADS))
    half, scale = 8, HEAD_DIM ** -0.5
    wide = torch.promote_types(dtype, torch.float32)
    expected = reference(*(t.to(wide).permute(2, 0, 1, 3) for t in (q, k, v, grad)))
    first, second = slice(None, half), slice(half, None)
    blocks = [(first, first, True), (second, first, False), (second, second, True)]
    (top_out, top_lse), (full_out, full_lse), (diagonal_out, diagonal_lse) = (
        forward(q[:, :, rows], k[:, :, keys], v[:, :, keys], causal, scale) for rows, keys, causal in blocks)
    bottom_lse = torch.logaddexp(full_lse, diagonal_lse)
    bottom_out = (full_out * torch.exp(full_lse - bottom_lse)[..., None]
                  + diagonal_out * torch.exp(diagonal_lse - bottom_lse)[..., None])
    out, lse = torch.cat([top_out, bottom_out.to(dtype)], dim=2), torch.cat([top_lse, bottom_lse], dim=2)
    top, full, diagonal = (backward(grad[:, :, rows], q[:, :, rows], k[:, :, keys], v[:, :, keys], out[:, :, rows],
                                    lse[:, :, rows].contiguous(), causal, scale) for rows, keys, causal in blocks)
    grad_q = torch.cat([top[0], full[0] + diagonal[0]], dim=2)
    grad_k, grad_v = (torch.cat([top[i] + full[i], diagonal[i]], dim=2) for i in (1, 2))
    for name, actual, wanted in zip(("out", "dq", "dk", "dv"), (out, grad_q, grad_k, grad_v), expected):
        error = (actual.permute(2, 0, 1, 3).to(wanted.dtype) - wanted).abs().max().item()
        bar = tolerance * (wanted.abs().max().item() if relative else 1.0)
        assert error <= bar, (name, error, bar)
