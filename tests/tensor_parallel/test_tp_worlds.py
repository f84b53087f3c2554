"""Tensor and sequence parallelism in gloo worlds of 2 and 4 ranks, against one process.

Every parallel layer is compared with the unsharded layer built from the same seed:
forward output, input grad, weight grad (this rank's shard against the matching slice
of the full grad) and bias grad. Spawning a world costs seconds, so one world per size
runs every check below (CHECKS) and each check is reported as its own test.
"""

import traceback

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megalite.model.rotary import RotaryEmbedding
from megalite.model.transformer import Attention
from megalite.parallel_state import ONE_PROCESS, ParallelState
from megalite.tensor_parallel import comm
from megalite.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megalite.tensor_parallel.comm import allreduce_sequence_parallel_grads
from megalite.tensor_parallel.layers import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                                             initialize, mark_parameter, shard_full_tensor)
from megalite.tensor_parallel.random import model_parallel_rng_tracker, model_parallel_seed
from tests.helpers.configs import llama_config
from tests.helpers.distributed import run_world

SEQ, BATCH = 8, 2  # SEQ divisible by every TP size tested


def close(actual, expected, tolerance=1e-6):
    torch.testing.assert_close(actual, expected, rtol=tolerance, atol=tolerance)


def randn(*shape, seed: int) -> torch.Tensor:
    """The same tensor on every rank."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def tp_state(rank: int, world_size: int, sequence_parallel: bool = False) -> ParallelState:
    return ParallelState(rank=rank, world_size=world_size, tp_rank=rank, tp_size=world_size,
                         tp_group=dist.group.WORLD, expert_tp_size=world_size, sequence_parallel=sequence_parallel)


def seq_chunk(tensor: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    return tensor.chunk(world_size, dim=0)[rank]


def gather_all(tensor: torch.Tensor) -> list[torch.Tensor]:
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, tensor.contiguous())
    return parts


# ---------------------------------------------------------------------------- comm.py

def check_comm_functions(rank, world_size):
    """Each autograd collective: forward and backward against the math it promises."""
    group = dist.group.WORLD
    ranks = range(world_size)
    xs = [randn(SEQ, BATCH, 12, seed=10 + r) for r in ranks]         # rank r's input
    grads = [randn(SEQ, BATCH, 12, seed=20 + r) for r in ranks]      # rank r's incoming full-size grad
    small = [randn(SEQ // world_size, BATCH, 12 // world_size, seed=30 + r) for r in ranks]

    def run(function, x, grad):
        x = x.clone().requires_grad_()
        y = function(x, group)
        y.backward(grad)
        return y.detach(), x.grad

    # copy: identity / all-reduce grad
    y, dx = run(comm.copy_to_tensor_parallel_region, xs[rank], grads[rank])
    close(y, xs[rank]), close(dx, sum(grads))
    # reduce: all-reduce / identity
    y, dx = run(comm.reduce_from_tensor_parallel_region, xs[rank], grads[rank])
    close(y, sum(xs)), close(dx, grads[rank])
    # gather last dim: all-gather / own slice of the grad
    y, dx = run(comm.gather_from_tensor_parallel_region, small[rank], grads[rank][:SEQ // world_size])
    close(y, torch.cat(small, -1)), close(dx, grads[rank][:SEQ // world_size].chunk(world_size, -1)[rank])
    # scatter sequence: own chunk / all-gather grad
    chunk_grads = [seq_chunk(g, r, world_size) for r, g in enumerate(grads)]
    y, dx = run(comm.scatter_to_sequence_parallel_region, xs[0], chunk_grads[rank])
    close(y, seq_chunk(xs[0], rank, world_size)), close(dx, torch.cat(chunk_grads))
    # gather sequence: all-gather / reduce-scatter grad
    chunks = [seq_chunk(x, r, world_size) for r, x in enumerate(xs)]
    y, dx = run(comm.gather_from_sequence_parallel_region, chunks[rank], grads[rank])
    close(y, torch.cat(chunks)), close(dx, seq_chunk(sum(grads), rank, world_size))
    # reduce-scatter sequence: reduce-scatter / all-gather grad
    y, dx = run(comm.reduce_scatter_to_sequence_parallel_region, xs[rank], chunk_grads[rank])
    close(y, seq_chunk(sum(xs), rank, world_size)), close(dx, torch.cat(chunk_grads))

    # Non-contiguous inputs are fine; inputs are never modified in place.
    x = xs[rank].transpose(0, 2)  # [12, b, s], non-contiguous
    kept = x.clone()
    close(comm.gather_from_sequence_parallel_region(x, group), torch.cat([t.transpose(0, 2) for t in xs]))
    close(comm.reduce_from_tensor_parallel_region(x, group), sum(t.transpose(0, 2) for t in xs))
    assert torch.equal(x, kept)
    # Shapes that do not divide fail before any collective, on every rank alike.
    with pytest.raises(ValueError, match="sequence length 5 is not divisible"):
        comm.reduce_scatter_to_sequence_parallel_region(torch.ones(5, 1, world_size), group)


def check_allreduce_sequence_parallel_grads(rank, world_size):
    """Marked parameters' grads (main_grad first, else grad) are summed; others are left alone."""
    group = dist.group.WORLD
    with_main = mark_parameter(torch.nn.Parameter(torch.zeros(3)), False, sequence_parallel=True)
    with_main.main_grad = torch.full((3,), float(rank + 1))
    with_grad = mark_parameter(torch.nn.Parameter(torch.zeros(2, 2)), False, sequence_parallel=True)
    with_grad.grad = torch.full((2, 2), float(rank))
    unmarked = mark_parameter(torch.nn.Parameter(torch.zeros(2)), True, 0)
    unmarked.grad = torch.full((2,), float(rank))
    no_grad = mark_parameter(torch.nn.Parameter(torch.zeros(2)), False, sequence_parallel=True)
    allreduce_sequence_parallel_grads([with_main, with_grad, unmarked, no_grad, with_main], group)
    total = world_size * (world_size + 1) / 2
    assert with_main.main_grad.eq(total).all() and with_main.grad is None
    assert with_grad.grad.eq(total - world_size).all()
    assert unmarked.grad.eq(rank).all() and no_grad.grad is None


# --------------------------------------------------------------------------- layers.py

def check_column_parallel_linear(rank, world_size):
    for bias in (True, False):
        for chunks in (1, 2):
            for sequence_parallel in (False, True):
                _check_column(rank, world_size, bias, chunks, sequence_parallel)


def _check_column(rank, world_size, bias, chunks, sequence_parallel):
    hidden, out = 6, 16
    layer = ColumnParallelLinear(hidden, out, bias=bias, output_chunks=chunks, init_std=1.0,
                                 parallel=tp_state(rank, world_size, sequence_parallel))
    reference = ColumnParallelLinear(hidden, out, bias=bias, output_chunks=chunks, init_std=1.0)
    initialize(layer, seed=3, prefix="fc")
    initialize(reference, seed=3, prefix="fc")
    if bias:
        full_bias = randn(out, seed=1)
        with torch.no_grad():
            reference.bias.copy_(full_bias)
            layer.bias.copy_(shard_full_tensor(full_bias, 0, rank, world_size, chunks))
    assert layer.weight.shape == (out // world_size, hidden)
    close(layer.weight, shard_full_tensor(reference.weight, 0, rank, world_size, chunks), 0)

    def shard(t):
        return shard_full_tensor(t, t.dim() - 1, rank, world_size, chunks)

    x, grad = randn(SEQ, BATCH, hidden, seed=2), randn(SEQ, BATCH, out, seed=3)
    reference_x = x.clone().requires_grad_()
    expected = reference(reference_x)
    expected.backward(grad)

    local_x = (seq_chunk(x, rank, world_size) if sequence_parallel else x).clone().requires_grad_()
    output = layer(local_x)
    close(output, shard(expected))
    output.backward(shard(grad))
    expected_dx = seq_chunk(reference_x.grad, rank, world_size) if sequence_parallel else reference_x.grad
    close(local_x.grad, expected_dx)
    close(layer.weight.grad, shard_full_tensor(reference.weight.grad, 0, rank, world_size, chunks))
    if bias:
        close(layer.bias.grad, shard(reference.bias.grad))


def check_column_parallel_linear_with_external_weight(rank, world_size):
    """The tied output layer: the weight comes in (here a vocab-sharded table's shard)."""
    layer = ColumnParallelLinear(6, 16, bias=False, skip_weight_param=True, parallel=tp_state(rank, world_size))
    full_weight, grad = randn(16, 6, seed=4).requires_grad_(), randn(SEQ, BATCH, 16, seed=6)
    x = randn(SEQ, BATCH, 6, seed=5).requires_grad_()
    expected = x @ full_weight.t()
    expected_dx, expected_dweight = torch.autograd.grad(expected, (x, full_weight), grad)
    weight = shard_full_tensor(full_weight.detach(), 0, rank, world_size).requires_grad_()
    local_x = x.detach().clone().requires_grad_()
    output = layer(local_x, weight)
    close(output, shard_full_tensor(expected.detach(), 2, rank, world_size))
    output.backward(shard_full_tensor(grad, 2, rank, world_size))
    close(local_x.grad, expected_dx)
    close(weight.grad, shard_full_tensor(expected_dweight, 0, rank, world_size))


def check_row_parallel_linear(rank, world_size):
    for bias in (True, False):
        for sequence_parallel in (False, True):
            _check_row(rank, world_size, bias, sequence_parallel)


def _check_row(rank, world_size, bias, sequence_parallel):
    hidden, out = 16, 6
    layer = RowParallelLinear(hidden, out, bias=bias, init_std=1.0,
                              parallel=tp_state(rank, world_size, sequence_parallel))
    reference = RowParallelLinear(hidden, out, bias=bias, init_std=1.0)
    initialize(layer, seed=5, prefix="fc2")
    initialize(reference, seed=5, prefix="fc2")
    if bias:
        with torch.no_grad():
            reference.bias.copy_(randn(out, seed=1))
            layer.bias.copy_(reference.bias)
    assert layer.weight.shape == (out, hidden // world_size)

    def shard(t):
        return shard_full_tensor(t, t.dim() - 1, rank, world_size)

    x, grad = randn(SEQ, BATCH, hidden, seed=6), randn(SEQ, BATCH, out, seed=7)
    reference_x = x.clone().requires_grad_()
    expected = reference(reference_x)
    expected.backward(grad)

    local_x = shard(x).clone().requires_grad_()
    output = layer(local_x)
    close(output, seq_chunk(expected, rank, world_size) if sequence_parallel else expected)
    output.backward(seq_chunk(grad, rank, world_size) if sequence_parallel else grad)
    close(local_x.grad, shard(reference_x.grad))
    close(layer.weight.grad, shard(reference.weight.grad))
    if bias:
        if sequence_parallel:  # this rank's tokens only, until summed over TP
            close(layer.bias.grad, seq_chunk(grad, rank, world_size).sum((0, 1)))
            allreduce_sequence_parallel_grads(layer.parameters(), dist.group.WORLD)
        close(layer.bias.grad, reference.bias.grad)


def check_vocab_parallel_embedding(rank, world_size):
    """Padded vocabulary (13 real of 16); with SP the model scatters the output afterwards."""
    group = dist.group.WORLD
    vocab, real_vocab, dim = 16, 13, 4
    ids = torch.randint(0, real_vocab, (SEQ, BATCH), generator=torch.Generator().manual_seed(8))
    ids[0, 0], ids[1, 0] = 0, real_vocab - 1
    for sequence_parallel in (False, True):
        layer = VocabParallelEmbedding(vocab, dim, init_std=1.0, real_num_embeddings=real_vocab,
                                       parallel=tp_state(rank, world_size, sequence_parallel))
        reference = VocabParallelEmbedding(vocab, dim, init_std=1.0, real_num_embeddings=real_vocab)
        initialize(layer, seed=9, prefix="embedding")
        initialize(reference, seed=9, prefix="embedding")
        close(layer.weight, shard_full_tensor(reference.weight, 0, rank, world_size), 0)
        assert reference.weight[real_vocab:].eq(0).all()

        grad = randn(SEQ, BATCH, dim, seed=10)
        expected = reference(ids)
        expected.backward(grad)
        output = layer(ids)
        if sequence_parallel:
            output = comm.scatter_to_sequence_parallel_region(output, group)
            expected, grad = seq_chunk(expected, rank, world_size), seq_chunk(grad, rank, world_size)
        close(output, expected)
        output.backward(grad)
        close(layer.weight.grad, shard_full_tensor(reference.weight.grad, 0, rank, world_size))


def check_sequence_parallel_mlp_block(rank, world_size):
    """norm -> column -> gelu -> row under SP, grads in main_grad buffers, then the TP grad sum."""
    group = dist.group.WORLD
    hidden, ffn = 6, 16

    def build(parallel):
        norm_weight = mark_parameter(torch.nn.Parameter(randn(hidden, seed=11)), False, sequence_parallel=True)
        norm_bias = mark_parameter(torch.nn.Parameter(randn(hidden, seed=12)), False, sequence_parallel=True)
        fc1 = ColumnParallelLinear(hidden, ffn, init_std=1.0, parallel=parallel)
        fc2 = RowParallelLinear(ffn, hidden, init_std=1.0, parallel=parallel)
        initialize(fc1, seed=1, prefix="fc1")
        initialize(fc2, seed=1, prefix="fc2")
        with torch.no_grad():
            fc1.bias.copy_(shard_full_tensor(randn(ffn, seed=13), 0, parallel.tp_rank, parallel.tp_size))
            fc2.bias.copy_(randn(hidden, seed=14))

        def forward(x):
            return fc2(F.gelu(fc1(F.layer_norm(x, (hidden,), norm_weight, norm_bias))))
        return forward, {"norm_weight": norm_weight, "norm_bias": norm_bias, "fc1.weight": fc1.weight,
                         "fc1.bias": fc1.bias, "fc2.weight": fc2.weight, "fc2.bias": fc2.bias}

    x, grad = randn(SEQ, BATCH, hidden, seed=15), randn(SEQ, BATCH, hidden, seed=16)
    reference, reference_params = build(ONE_PROCESS)
    reference_x = x.clone().requires_grad_()
    reference(reference_x).backward(grad)

    block, params = build(tp_state(rank, world_size, sequence_parallel=True))
    local_x = seq_chunk(x, rank, world_size).clone().requires_grad_()
    output = block(local_x)
    # The row-parallel sum adds the two halves of fc2's products in another order than one
    # matmul does; with unit-scale weights that differs by a few ulps (2e-6 seen on some CPUs).
    close(output, seq_chunk(reference(x), rank, world_size), 1e-5)
    output.backward(seq_chunk(grad, rank, world_size))
    for param in params.values():  # as the optimizer's grad buffer leaves them
        param.main_grad, param.grad = param.grad, None
    allreduce_sequence_parallel_grads(params.values(), group)

    close(local_x.grad, seq_chunk(reference_x.grad, rank, world_size), 1e-5)
    expected = {name: param.grad for name, param in reference_params.items()}
    expected["fc1.weight"] = shard_full_tensor(expected["fc1.weight"], 0, rank, world_size)
    expected["fc1.bias"] = shard_full_tensor(expected["fc1.bias"], 0, rank, world_size)
    expected["fc2.weight"] = shard_full_tensor(expected["fc2.weight"], 1, rank, world_size)
    for name, param in params.items():
        close(param.main_grad, expected[name], 1e-5)


def check_attention_with_qkv_bias_and_qk_layernorm(rank, world_size):
    """Attention with --add-qkv-bias and --qk-layernorm under TP and TP+SP: the QKV bias is column-parallel,
    the q/k norm weights (shared by every head) get the full grad on every rank, before and after the SP sum."""
    heads, groups, head_dim = 8, 4, 4  # whole groups on each of up to 4 ranks
    config = llama_config(hidden_size=16, num_attention_heads=heads, num_query_groups=groups, kv_channels=head_dim,
                          add_qkv_bias=True, qk_layernorm=True, seq_length=SEQ)
    rotary = RotaryEmbedding(head_dim)(SEQ)

    def build(parallel):
        attention = Attention(config, parallel)
        initialize(attention, seed=3, prefix="attention")
        with torch.no_grad():  # off their init values (zero bias, unit norms), so that their grads matter
            bias = attention.linear_qkv.bias
            bias.copy_(shard_full_tensor(randn(attention.linear_qkv.output_size, seed=21), 0, parallel.tp_rank,
                                         parallel.tp_size))
            attention.q_layernorm.weight.copy_(1 + 0.3 * randn(head_dim, seed=22))
            attention.k_layernorm.weight.copy_(1 + 0.3 * randn(head_dim, seed=23))
        return attention

    x, grad = randn(SEQ, BATCH, 16, seed=24), randn(SEQ, BATCH, 16, seed=25)
    reference = build(ONE_PROCESS)
    reference_x = x.clone().requires_grad_()
    reference(reference_x, rotary).backward(grad)
    for sequence_parallel in (False, True):
        attention = build(tp_state(rank, world_size, sequence_parallel))
        split = (lambda t: seq_chunk(t, rank, world_size)) if sequence_parallel else (lambda t: t)
        local_x = split(x).clone().requires_grad_()
        output = attention(local_x, rotary)
        close(output, split(reference(x, rotary)), 1e-5)
        output.backward(split(grad))
        params = dict(attention.named_parameters())
        if sequence_parallel:  # as DDP sums them: the q/k norms are not among them
            for param in params.values():
                param.main_grad, param.grad = param.grad, None
            allreduce_sequence_parallel_grads(params.values(), dist.group.WORLD)
        close(local_x.grad, split(reference_x.grad), 1e-5)
        for name, param in params.items():
            expected = dict(reference.named_parameters())[name].grad
            if param.tensor_model_parallel:
                expected = shard_full_tensor(expected, param.partition_dim, rank, world_size)
            close(param.main_grad if sequence_parallel else param.grad, expected, 1e-5)


def check_sequence_parallel_moe_layer(rank, world_size):
    """The MoE layer under TP+SP (tokens all-gathered, every expert split, outputs reduce-scattered) against
    one process, with biases, shared experts and their gate, and the balancing losses' injected gradients:
    output, input grad, and every weight grad after the SP grad sum."""
    from megalite.config import ModelConfig
    from megalite.model.transformer import build_mlp

    config = ModelConfig.of(num_layers=1, hidden_size=16, num_attention_heads=4, seq_length=SEQ, vocab_size=64,
                            swiglu=True, ffn_hidden_size=32, num_experts=4, moe_ffn_hidden_size=8,
                            moe_aux_loss_coeff=0.1, moe_z_loss_coeff=0.01,
                            moe_router_load_balancing_type="seq_aux_loss", moe_shared_expert_intermediate_size=8,
                            moe_shared_expert_gate=True)
    x, grad = randn(SEQ, BATCH, 16, seed=17), randn(SEQ, BATCH, 16, seed=18)
    reference = build_mlp(config, 0)
    initialize(reference, seed=1, prefix="mlp")
    reference_x = x.clone().requires_grad_()
    expected_output = reference(reference_x)
    expected_output.backward(grad)

    layer = build_mlp(config, 0, tp_state(rank, world_size, sequence_parallel=True))
    initialize(layer, seed=1, prefix="mlp")
    local_x = seq_chunk(x, rank, world_size).clone().requires_grad_()
    output = layer(local_x)
    close(output, seq_chunk(expected_output, rank, world_size), 1e-5)
    output.backward(seq_chunk(grad, rank, world_size))
    params = dict(layer.named_parameters())
    for param in params.values():  # as the optimizer's grad buffer leaves them
        param.main_grad, param.grad = param.grad, None
    allreduce_sequence_parallel_grads(params.values(), dist.group.WORLD)
    close(local_x.grad, seq_chunk(reference_x.grad, rank, world_size), 1e-5)
    for name, expected in reference.named_parameters():
        param, expected = params[name], expected.grad
        if param.tensor_model_parallel:
            expected = shard_full_tensor(expected, param.partition_dim, rank, world_size, param.partition_chunks)
        close(param.main_grad, expected, 1e-5)


# --------------------------------------------------------------------- cross_entropy.py

def check_vocab_parallel_cross_entropy(rank, world_size):
    """Losses and logit grads equal F.cross_entropy on the full logits, padding excluded.

    11 real ids of 16: with 4 ranks the last rank's shard is all padding.
    """
    group = dist.group.WORLD
    vocab = 16
    per_rank = vocab // world_size
    start = rank * per_rank
    labels = torch.randint(0, 11, (SEQ, BATCH), generator=torch.Generator().manual_seed(17))
    labels[0] = torch.tensor([0, 10])
    loss_mask = (randn(SEQ, BATCH, seed=18) > -0.5).float()
    for real_vocab in (11, None):
        for dtype, tolerance in ((torch.float32, 1e-6), (torch.bfloat16, 1e-2)):
            full = (randn(SEQ, BATCH, vocab, seed=19) * 3).to(dtype)
            if real_vocab is not None:
                full[..., real_vocab:] = 50.0  # would dominate if padding were not excluded
            used = vocab if real_vocab is None else real_vocab
            reference_logits = full.clone().requires_grad_()
            expected = F.cross_entropy(reference_logits[..., :used].float().flatten(0, 1), labels.flatten(),
                                       reduction="none").view(SEQ, BATCH)
            ((expected * loss_mask).sum() / loss_mask.sum()).backward()

            logits = full[..., start:start + per_rank].clone().requires_grad_()
            losses = vocab_parallel_cross_entropy(logits, labels, group, start, real_vocab)
            assert losses.dtype == torch.float32 and losses.shape == (SEQ, BATCH)
            close(losses, expected, tolerance)
            ((losses * loss_mask).sum() / loss_mask.sum()).backward()
            assert logits.grad.dtype == dtype
            close(logits.grad.float(), reference_logits.grad[..., start:start + per_rank].float(), tolerance)


# ---------------------------------------------------------------------------- random.py

def check_rng_tracker(rank, world_size):
    """Forked dropout masks differ across TP ranks; default-RNG masks are equal."""
    model_parallel_seed(1234, tp_rank=rank)
    ones = torch.ones(256)
    default_mask = F.dropout(ones, 0.5)
    with model_parallel_rng_tracker.fork():
        forked_mask = F.dropout(ones, 0.5)
    default_after = F.dropout(ones, 0.5)
    default_masks, forked_masks, after_masks = gather_all(default_mask), gather_all(forked_mask), \
        gather_all(default_after)
    assert all(torch.equal(mask, default_masks[0]) for mask in default_masks)
    assert all(torch.equal(mask, after_masks[0]) for mask in after_masks)
    assert not torch.equal(default_after, default_mask)
    for other in range(world_size):
        if other != rank:
            assert not torch.equal(forked_masks[other], forked_mask)


CHECKS = {check.__name__.removeprefix("check_"): check for check in (
    check_comm_functions, check_allreduce_sequence_parallel_grads, check_column_parallel_linear,
    check_column_parallel_linear_with_external_weight, check_row_parallel_linear,
    check_vocab_parallel_embedding, check_sequence_parallel_mlp_block, check_attention_with_qkv_bias_and_qk_layernorm,
    check_sequence_parallel_moe_layer, check_vocab_parallel_cross_entropy, check_rng_tracker)}


def run_checks(rank, world_size, names):
    """Every named check on this rank; {name: None or the traceback}."""
    failures = {}
    for name in names:
        try:
            CHECKS[name](rank, world_size)
            failures[name] = None
        except Exception:  # noqa: BLE001 - reported per check by the tests below
            failures[name] = traceback.format_exc()
    return failures


@pytest.fixture(scope="module", params=[2, 4], ids=lambda size: f"tp{size}")
def world_failures(request):
    return run_world(request.param, run_checks, list(CHECKS))


@pytest.mark.parametrize("check", list(CHECKS))
def test_tensor_parallel(world_failures, check):
    reports = [f"rank {rank}:\n{failures[check]}" for rank, failures in enumerate(world_failures)
               if failures[check]]
    assert not reports, "\n".join(reports)
