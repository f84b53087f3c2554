"""The MoE layer under expert and context parallelism, both dispatchers, in gloo worlds of 2 and 4 ranks, against
one process.

EP folds over DP: every data-parallel replica routes its own micro-batch, and the one-process reference runs each
replica's micro-batch through the full (all-experts) layer built from the same seed. Compared per rank: the
output, the input grad, the routing counts, and every parameter's grad after the sums DDP makes (SP params over
TP, dense params over DP, expert params over expert-DP), against the slice of the reference's grads summed over
the micro-batches. Spawning a world costs seconds, so one world per size runs every check (CHECKS) and each check
is reported as its own test.
"""

import functools
import traceback

import pytest
import torch
import torch.distributed as dist

from megalite.config import ModelConfig
from megalite.data.loader import context_parallel_positions
from megalite.model.transformer import build_mlp
from megalite.parallel_state import ONE_PROCESS, build_parallel_state
from megalite.tensor_parallel.comm import all_reduce, allreduce_sequence_parallel_grads
from megalite.tensor_parallel.layers import initialize, shard_full_tensor
from tests.helpers.distributed import run_world

SEQ, BATCH, HIDDEN, EXPERTS = 8, 2, 16, 8
FP64, FP32 = (1e-10, 1e-10), (1e-5, 1e-5)  # (rtol, atol)
# The router's logits and probs are fp32 in every model dtype (Megatron's --moe-router-dtype fp32): the grads
# that flow back through them (the input's, the router's, fc2's bias's: prob x bias) carry fp32 rounding in an
# fp64 model too.
FP32_PATHS = ("input", "router.weight", "experts.linear_fc2.bias")

# name: (model options, dtype, (rtol, atol)); the grouped GEMM does not run fp64.
CASES = {
    "balancing": (dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                       moe_aux_loss_coeff=0.1, moe_z_loss_coeff=0.01, add_bias_linear=True,
                       moe_shared_expert_intermediate_size=8, moe_shared_expert_gate=True), torch.float64, FP64),
    "capacity": (dict(moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True,
                      moe_aux_loss_coeff=0.1, moe_router_load_balancing_type="seq_aux_loss"), torch.float64, FP64),
    "grouped_gemm": (dict(moe_grouped_gemm=True, add_bias_linear=True, moe_z_loss_coeff=0.01), torch.float32, FP32),
}
# (TP, CP, EP, ETP) per world size; TP 2 at EP 1 with whole experts (ETP 1) too. Under CP the router sees the whole
# sequence (its logits gathered over CP) and EP folds over the DP x CP x TP ranks.
LAYOUTS = {2: [(1, 1, 2, 1), (2, 1, 1, 1), (1, 2, 1, 1)],
           4: [(1, 1, 4, 1), (2, 1, 2, 1), (2, 1, 2, 2), (1, 2, 2, 1), (2, 2, 2, 2)]}


def close(actual, expected, tolerance, what):
    rtol, atol = max(tolerance, FP32) if what in FP32_PATHS else tolerance
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, msg=lambda text: f"{what}: {text}")


def randn(*shape, seed: int, dtype=torch.float64) -> torch.Tensor:
    """The same tensor on every rank."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def moe_config(case: str, dispatcher: str) -> ModelConfig:
    # A wide init: logits far enough apart that tokens spread over the experts (some get none) and the
    # expert bias moves some of them.
    return ModelConfig.of(num_layers=1, hidden_size=HIDDEN, num_attention_heads=2, seq_length=SEQ, vocab_size=64,
                          swiglu=True, ffn_hidden_size=32, num_experts=EXPERTS, moe_ffn_hidden_size=8,
                          init_method_std=0.3, moe_token_dispatcher_type=dispatcher, **CASES[case][0]).validate()


def build_layer(config: ModelConfig, dtype, parallel=ONE_PROCESS):
    layer = build_mlp(config, 0, parallel)
    initialize(layer, seed=1, prefix="mlp")
    if layer.router.expert_bias is not None:  # a bias that changes the routing
        layer.router.expert_bias.copy_(randn(EXPERTS, seed=5, dtype=torch.float32) * 0.1)
    return layer.to(dtype)


def reference(config: ModelConfig, dtype, micro_batches: int) -> dict:
    """The one-process layer on each replica's micro-batch: outputs, input grads, routing counts, summed grads."""
    layer = build_layer(config, dtype)
    result = {"output": [], "input_grad": [], "counts": []}
    for replica in range(micro_batches):
        x = randn(SEQ, BATCH, HIDDEN, seed=100 + replica, dtype=dtype).requires_grad_()
        before = layer.router.routed_tokens.clone()
        output = layer(x)
        output.backward(randn(SEQ, BATCH, HIDDEN, seed=200 + replica, dtype=dtype))
        result["output"].append(output.detach())
        result["input_grad"].append(x.grad)
        result["counts"].append(layer.router.routed_tokens - before)
    result["grads"] = {name: param.grad for name, param in layer.named_parameters()}
    return result


def check_layout(tp: int, cp: int, ep: int, etp: int, case: str, dispatcher: str) -> None:
    """This rank's layer of (TP with SP, CP, EP, ETP) against the one-process reference."""
    parallel = build_parallel_state(tp, 1, cp=cp, ep=ep, etp=etp, sequence_parallel=tp > 1)
    config, (_, dtype, tolerance) = moe_config(case, dispatcher), CASES[case]
    expected = reference(config, dtype, parallel.dp_size)
    layer = build_layer(config, dtype, parallel)
    replica = parallel.dp_rank  # EP ranks are DP, CP or TP ranks: each holds different tokens
    positions = context_parallel_positions(SEQ, parallel.cp_rank, cp)

    def mine(full: torch.Tensor) -> torch.Tensor:  # this rank's tokens of a [SEQ, b, h] tensor
        return full[positions].chunk(tp)[parallel.tp_rank]

    x = mine(randn(SEQ, BATCH, HIDDEN, seed=100 + replica, dtype=dtype)).requires_grad_()
    output = layer(x)
    output.backward(mine(randn(SEQ, BATCH, HIDDEN, seed=200 + replica, dtype=dtype)))
    params = dict(layer.named_parameters())
    for param in params.values():  # as the grad buffers leave them
        param.main_grad, param.grad = param.grad, None
    allreduce_sequence_parallel_grads(params.values(), parallel.tp_group if tp > 1 else None)
    for param in params.values():
        expert = getattr(param, "expert_parallel", False)
        all_reduce(param.main_grad, parallel.expert_dp_group if expert else parallel.dp_cp_group)

    close(output, mine(expected["output"][replica]), tolerance, "output")
    close(x.grad, mine(expected["input_grad"][replica]), tolerance, "input")
    # The router statistics count every expert's tokens before the dispatch, as one process does.
    assert torch.equal(layer.router.routed_tokens, expected["counts"][replica])
    local = slice(parallel.ep_rank * EXPERTS // ep, (parallel.ep_rank + 1) * EXPERTS // ep)
    for name, full in expected["grads"].items():
        param = params[name]
        if name.startswith("experts."):
            assert param.expert_parallel and param.shape[0] == EXPERTS // ep, name
            full = full[local]
            size, rank = etp, parallel.expert_tp_rank
        else:
            size, rank = tp, parallel.tp_rank
        if param.tensor_model_parallel:
            full = shard_full_tensor(full, param.partition_dim, rank, size, param.partition_chunks)
        close(param.main_grad, full, tolerance, name)


def check_all_to_all(rank: int, world_size: int) -> None:
    """Uneven splits, zero-size ones among them (a rank sending nothing, one receiving nothing), forward and
    backward, for 2-D rows and 1-D values."""
    from megalite.tensor_parallel.comm import all_to_all

    sends = torch.tensor([[1, 0, 2, 0], [0, 0, 3, 1], [2, 0, 0, 0], [0, 0, 0, 0]])[:world_size, :world_size]
    rows = [randn(int(sends[source].sum()), 3, seed=300 + source) for source in range(world_size)]
    weights = [randn(int(sends[:, target].sum()), 3, seed=400 + target) for target in range(world_size)]
    # Rank r receives, in source order, the block each source addressed to r.
    blocks = [row.split(sends[source].tolist()) for source, row in enumerate(rows)]
    expected = torch.cat([blocks[source][rank] for source in range(world_size)])
    x = rows[rank].clone().requires_grad_()
    received = all_to_all(x, dist.group.WORLD, sends[:, rank].tolist(), sends[rank].tolist())
    (received * weights[rank]).sum().backward()
    assert torch.equal(received, expected)
    # The grad of the block this rank sent to r is r's weights for that block.
    weight_blocks = [weight.split(sends[:, target].tolist()) for target, weight in enumerate(weights)]
    assert torch.equal(x.grad, torch.cat([weight_blocks[target][rank] for target in range(world_size)]))
    values = rows[rank][:, 0].clone().requires_grad_()
    received = all_to_all(values, dist.group.WORLD, sends[:, rank].tolist(), sends[rank].tolist())
    received.backward(weights[rank][:, 0])
    assert torch.equal(received, expected[:, 0]) and torch.equal(values.grad, x.grad[:, 0])


def checks(world_size: int) -> dict:
    """name: a function of (rank, world_size), in the order every rank runs them."""
    table = {"all_to_all": check_all_to_all}
    for tp, cp, ep, etp in LAYOUTS[world_size]:
        for case in CASES:
            for dispatcher in ("allgather", "alltoall"):
                name = f"tp{tp}-{f'cp{cp}-' if cp > 1 else ''}ep{ep}-etp{etp}-{case}-{dispatcher}"
                table[name] = lambda rank, size, args=(tp, cp, ep, etp, case, dispatcher): check_layout(*args)
    return table


def run_checks(rank: int, world_size: int) -> dict:
    """Every check on this rank; {name: None or the traceback}."""
    failures = {}
    for name, check in checks(world_size).items():
        try:
            check(rank, world_size)
            failures[name] = None
        except Exception:  # noqa: BLE001 - reported per check by the tests below
            failures[name] = traceback.format_exc()
    return failures


@functools.cache
def world_failures(size: int) -> list[dict]:
    """Every rank's failures in a world of `size`, run once, when a test first asks for it."""
    return run_world(size, run_checks)


@pytest.mark.parametrize("size, check", [(size, name) for size in LAYOUTS for name in checks(size)])
def test_expert_parallel(size, check):
    reports = [f"rank {rank}:\n{failures[check]}" for rank, failures in enumerate(world_failures(size))
               if failures[check]]
    assert not reports, "\n".join(reports)
