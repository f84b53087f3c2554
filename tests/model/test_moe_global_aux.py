"""--moe-router-load-balancing-type global_aux_loss as Megatron's: each micro-batch's tokens per expert summed
over the data-parallel ranks, averaged over the step's micro-batches so far, over the micro-batch's tokens on
all DP ranks; against a hand computation from every rank's tokens, on one process, at DP 2 and at DP 2 x EP 2
(EP folded over DP), and once per micro-batch under activation recomputation."""

import pytest
import torch

from megalite.config import ModelConfig
from megalite.model.gpt import build_model
from megalite.model.moe import Router, moe_routers, reset_global_aux_loss, set_aux_loss_scale, take_moe_statistics
from megalite.model.options import apply_options
from megalite.model.transformer import build_mlp
from megalite.parallel_state import build_parallel_state
from megalite.tensor_parallel.comm import all_reduce
from megalite.tensor_parallel.layers import initialize
from megalite.tensor_parallel.random import checkpoint
from megalite.run.training import forward_backward
from tests.helpers.distributed import run_world

pytestmark = pytest.mark.usefixtures("one_thread")

SEQ, BATCH, HIDDEN, EXPERTS, TOPK, COEFF = 3, 2, 16, 4, 2, 0.5
MICRO_BATCHES = 3


def config(**overrides) -> ModelConfig:
    values = dict(num_layers=1, hidden_size=HIDDEN, num_attention_heads=2, seq_length=SEQ, vocab_size=64,
                  num_experts=EXPERTS, moe_router_topk=TOPK, ffn_hidden_size=32, moe_ffn_hidden_size=8, swiglu=True,
                  add_bias_linear=False, init_method_std=0.3, moe_router_load_balancing_type="global_aux_loss",
                  moe_aux_loss_coeff=COEFF)
    return ModelConfig.of(**{**values, **overrides}).validate()


def tokens(micro_batch: int, rank: int) -> torch.Tensor:
    """A micro-batch's `[s, b, h]` hidden states on a DP rank, the same in every process."""
    return torch.randn(SEQ, BATCH, HIDDEN, generator=torch.Generator().manual_seed(100 + 10 * micro_batch + rank))


def hand_shares(weight: torch.Tensor, micro_batches: list[list[torch.Tensor]]) -> list[list[torch.Tensor]]:
    """Each DP rank's share of Megatron's global_aux_loss per micro-batch, `micro_batches[m][d]` `[t, h]`: E / (k
    T^2) x sum_e (the rank's summed softmax scores of e) x (e's top-k assignments of micro-batches 0..m on all
    ranks, over m + 1), T the micro-batch's tokens on all ranks."""
    total = sum(len(x) for x in micro_batches[0])
    seen = torch.zeros(EXPERTS)
    shares = []
    for m, per_rank in enumerate(micro_batches):
        scores = [torch.softmax(x @ weight.t(), dim=-1) for x in per_rank]
        for rank_scores in scores:
            seen = seen + torch.zeros_like(rank_scores).scatter(1, rank_scores.topk(TOPK, dim=-1).indices, 1.0).sum(0)
        average = seen / (m + 1)
        shares.append([COEFF * EXPERTS / (TOPK * total ** 2) * (s.sum(dim=0) * average).sum() for s in scores])
    return shares


def hand_reference(weight: torch.Tensor, micro_batches: list[list[torch.Tensor]]) -> tuple[torch.Tensor, float]:
    """(the router's grad summed over DP, at the aux-loss scale 1 / (micro-batches x DP); the logged
    load_balancing_loss: per micro-batch the sum of the ranks' shares, as Megatron's tracker, averaged)."""
    weight = weight.detach().clone().requires_grad_()
    shares = hand_shares(weight, micro_batches)
    dp = len(micro_batches[0])
    scaled = sum(sum(per_rank) for per_rank in shares) / (len(micro_batches) * dp)
    logged = sum(sum(per_rank).item() for per_rank in shares) / len(micro_batches)
    return torch.autograd.grad(scaled, weight)[0], logged


def router_step(router: Router, micro_batches, dp_size: int = 1) -> None:
    """One step's micro-batches through `router`, only the balancing loss's gradient reaching its weight."""
    set_aux_loss_scale(router, 1 / (len(micro_batches) * dp_size))
    reset_global_aux_loss(router)
    for x in micro_batches:
        probs, _ = router(x.reshape(-1, HIDDEN), SEQ)
        (probs * 0).sum().backward()


def test_one_process_averages_the_counts_of_the_step_micro_batches():
    router = Router(config())
    router.init_weights(seed=1, prefix="router")
    for step in range(2):  # the second step's counts start afresh
        micro_batches = [tokens(m + MICRO_BATCHES * step, 0) for m in range(MICRO_BATCHES)]
        router.weight.grad = None
        router_step(router, micro_batches)
        grad, logged = hand_reference(router.weight, [[x.reshape(-1, HIDDEN)] for x in micro_batches])
        torch.testing.assert_close(router.weight.grad, grad)
        assert take_moe_statistics(router, router.config)["load_balancing_loss"] == pytest.approx(logged, rel=1e-6)
        assert router.global_forwards == MICRO_BATCHES


def _two_micro_batches_pipelined(router: Router, recompute: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward micro-batches 0 and 1, then their backwards (a pipeline's warm-up order), the router under
    activation recomputation or not -> (the router's weight grad, the inputs' grads)."""
    router.init_weights(seed=1, prefix="router")
    set_aux_loss_scale(router, 0.5)
    reset_global_aux_loss(router)
    inputs = [tokens(m, 0).reshape(-1, HIDDEN).requires_grad_() for m in range(2)]
    route = (lambda x: router(x, SEQ)[0])
    outputs = [checkpoint(route, x) if recompute else route(x) for x in inputs]
    for m, probs in enumerate(outputs):
        probs.backward(tokens(10 + m, 0).reshape(-1, HIDDEN)[:, :EXPERTS])
    return router.weight.grad, torch.cat([x.grad for x in inputs])


def test_a_recomputed_router_counts_once_and_reuses_its_forward_average():
    plain, recomputed = Router(config()), Router(config())
    expected = _two_micro_batches_pipelined(plain, recompute=False)
    actual = _two_micro_batches_pipelined(recomputed, recompute=True)
    assert recomputed.global_forwards == 2 and not recomputed.global_averages  # each recomputation took its own
    assert torch.equal(recomputed.global_tokens_per_expert, plain.global_tokens_per_expert)
    for got, want in zip(actual, expected):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


class Unscaled:
    """The one optimizer method forward_backward calls."""

    @staticmethod
    def scale_loss(loss):
        return loss


def test_forward_backward_counts_each_global_batch_afresh_under_recomputation():
    model = apply_options(build_model(config(num_layers=2, hidden_dropout=0.0, attention_dropout=0.0), seed=3),
                          recompute_granularity="full")
    generator = torch.Generator().manual_seed(4)
    batch = [{"tokens": ids, "labels": ids, "loss_mask": torch.ones(BATCH, SEQ),
              "position_ids": torch.arange(SEQ).expand(BATCH, SEQ)}
             for ids in torch.randint(0, 64, (MICRO_BATCHES, BATCH, SEQ), generator=generator)]
    grads = []
    for _ in range(2):  # the same global batch twice: the same counts, so the same grads
        model.zero_grad()
        forward_backward(model, batch, Unscaled())
        grads.append([router.weight.grad.clone() for router in moe_routers(model)])
        assert [router.global_forwards for router in moe_routers(model)] == [MICRO_BATCHES] * 2
    for first, second in zip(*grads):
        assert torch.equal(first, second)


def _dp_world(rank: int, world_size: int) -> dict:
    """At DP 2: a lone router, and an MoE layer at EP 2 (alltoall), each through one step of MICRO_BATCHES;
    their router grads summed over DP and their logged balancing losses."""
    micro_batches = [tokens(m, rank) for m in range(MICRO_BATCHES)]
    result = {}
    parallel = build_parallel_state()
    router = Router(config(), parallel)
    router.init_weights(seed=1, prefix="router")
    router_step(router, micro_batches, world_size)
    result["router"] = (router.weight.detach(), all_reduce(router.weight.grad, parallel.dp_group),
                        take_moe_statistics(router, router.config, parallel)["load_balancing_loss"])
    parallel = build_parallel_state(ep=2)
    layer = build_mlp(config(moe_token_dispatcher_type="alltoall"), 0, parallel)
    initialize(layer, seed=2, prefix="mlp")
    set_aux_loss_scale(layer, 1 / (MICRO_BATCHES * world_size))
    reset_global_aux_loss(layer)
    for x in micro_batches:
        (layer(x) * 0).sum().backward()
    router = layer.router
    result["moe_ep2"] = (router.weight.detach(), all_reduce(router.weight.grad, parallel.dp_group),
                         take_moe_statistics(layer, router.config, parallel)["load_balancing_loss"])
    return result


def test_dp2_and_dp2_ep2_count_every_data_parallel_rank_tokens():
    results = run_world(2, _dp_world)
    micro_batches = [[tokens(m, rank).reshape(-1, HIDDEN) for rank in range(2)] for m in range(MICRO_BATCHES)]
    for case in ("router", "moe_ep2"):
        weight, grad, logged = results[0][case]
        expected_grad, expected_logged = hand_reference(weight, micro_batches)
        for rank in range(2):
            torch.testing.assert_close(results[rank][case][1], expected_grad, msg=lambda text: f"{case}: {text}")
            assert results[rank][case][2] == pytest.approx(expected_logged, rel=1e-6), case
