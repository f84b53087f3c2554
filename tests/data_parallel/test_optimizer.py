"""MixedPrecisionOptimizer and DynamicLossScaler: parity with torch's AdamW, mixed precision,
loss scaling, and exact resume from a state dict."""

import copy
import io
import json
import math

import pytest
import torch
from torch import nn

from megalite.config import Sharding
from megalite.data_parallel.ddp import ParallelModel
from megalite.data_parallel.optimizer import DynamicLossScaler, MixedPrecisionOptimizer
from megalite.errors import UserError
from tests.helpers.optimizer import HYPER, backward_iteration, params_of, tiny_llama

LRS = [3e-3, 1e-2, 5e-3, 2e-3]  # one lr per step: the optimizer must use the one it is given


pytestmark = pytest.mark.usefixtures("one_thread")


def train(model, optimizer, steps) -> list:
    """Run iterations `steps` with LRS; returns the StepResults."""
    results = []
    for step in steps:
        optimizer.zero_grad()
        backward_iteration(model, step, optimizer)
        results.append(optimizer.step(LRS[step % len(LRS)]))
    return results


def max_difference(first: dict, second: dict) -> float:
    return max(float((first[name].float() - second[name].float()).abs().max()) for name in first)


@pytest.mark.parametrize("clip_grad", [0.05, 100.0])
def test_fp32_model_matches_torch_adamw_with_clip_grad_norm(clip_grad):
    model = tiny_llama()
    reference = copy.deepcopy(model)
    initial = params_of(model)
    optimizer = MixedPrecisionOptimizer(ParallelModel(model), lr=LRS[0], clip_grad=clip_grad, **HYPER)
    assert all(main is param for main, param in zip(optimizer.main_params, optimizer.model_params))

    decay = [p for p in reference.parameters() if p.ndim >= 2]
    no_decay = [p for p in reference.parameters() if p.ndim < 2]
    assert decay and no_decay
    torch_adamw = torch.optim.AdamW([{"params": decay, "weight_decay": HYPER["weight_decay"]},
                                     {"params": no_decay, "weight_decay": 0.0}],  # fused, as the optimizer
                                    lr=LRS[0], betas=HYPER["betas"], eps=HYPER["eps"], fused=True)
    for step, lr in enumerate(LRS):
        torch_adamw.zero_grad(set_to_none=True)
        backward_iteration(reference, step)
        reference_norm = float(torch.nn.utils.clip_grad_norm_(reference.parameters(), clip_grad))
        for group in torch_adamw.param_groups:
            group["lr"] = lr
        torch_adamw.step()

        optimizer.zero_grad()
        backward_iteration(model, step, optimizer)
        updated, grad_norm = optimizer.step(lr)
        assert updated
        assert float(grad_norm) == pytest.approx(reference_norm, rel=1e-6)
        assert (grad_norm > clip_grad) == (clip_grad < 1)  # one case clips, the other does not
        assert max_difference(params_of(model), params_of(reference)) <= 1e-6
        assert all(param.grad is None for param in model.parameters())
    assert max_difference(params_of(model), initial) > 1e-2  # training really moved the model


def test_weight_decay_skips_one_dimensional_params():
    model = tiny_llama()
    initial = params_of(model)
    optimizer = MixedPrecisionOptimizer(ParallelModel(model), lr=0.1, weight_decay=0.5)
    optimizer.zero_grad()
    optimizer.step(0.1)  # zero grads: AdamW's only change is the decoupled decay 1 - lr * wd
    for name, param in model.named_parameters():
        factor = 0.95 if param.ndim >= 2 else 1.0
        assert torch.equal(param.detach(), initial[name] * factor), name


def test_bf16_model_keeps_fp32_main_params_and_takes_their_cast():
    model = tiny_llama(dtype=torch.bfloat16)
    initial = params_of(model)
    optimizer = MixedPrecisionOptimizer(ParallelModel(model), lr=LRS[0], clip_grad=0.0, **HYPER)
    # The first step by hand: torch's AdamW on fp32 copies of the bf16 params, with the main grads.
    copies = [param.detach().float().requires_grad_() for param in optimizer.model_params]
    torch_adamw = torch.optim.AdamW(
        [{"params": [c for c in copies if c.ndim >= 2], "weight_decay": HYPER["weight_decay"]},
         {"params": [c for c in copies if c.ndim < 2], "weight_decay": 0.0}],
        lr=LRS[0], betas=HYPER["betas"], eps=HYPER["eps"], fused=True)  # as the optimizer runs it
    optimizer.zero_grad()
    backward_iteration(model, 0, optimizer)
    for copied, param in zip(copies, optimizer.model_params):
        copied.grad = param.main_grad.clone()
    torch_adamw.step()
    assert optimizer.step(LRS[0]).updated
    for main, copied in zip(optimizer.main_params, copies):
        assert torch.equal(main, copied.detach())

    train(model, optimizer, range(1, 3))
    for main, param in zip(optimizer.main_params, optimizer.model_params):
        assert main.dtype == torch.float32 and param.dtype == torch.bfloat16
        assert torch.equal(param.detach(), main.to(torch.bfloat16))
    # The main params hold what bf16 cannot: updates smaller than a bf16 ulp are not lost.
    assert not all(torch.equal(main.to(torch.bfloat16).float(), main) for main in optimizer.main_params)
    assert max_difference(params_of(model), initial) > 1e-2


def test_a_loss_scale_changes_nothing_but_the_backward_values():
    unscaled, scaled = tiny_llama(), tiny_llama()
    plain = MixedPrecisionOptimizer(ParallelModel(unscaled), lr=LRS[0], **HYPER)
    scaler = DynamicLossScaler(initial_scale=2.0 ** 10)
    with_scaler = MixedPrecisionOptimizer(ParallelModel(scaled), lr=LRS[0], loss_scaler=scaler, **HYPER)
    assert float(with_scaler.loss_scaler.scale) == 2.0 ** 10
    loss = torch.tensor(3.0)
    assert plain.scale_loss(loss) is loss and float(with_scaler.scale_loss(loss)) == 3.0 * 2 ** 10
    plain_results = train(unscaled, plain, range(3))
    scaled_results = train(scaled, with_scaler, range(3))
    # Scaling by a power of two is exact in fp32, so unscaled grads, norms and updates agree bitwise.
    assert [float(r.grad_norm) for r in scaled_results] == [float(r.grad_norm) for r in plain_results]
    assert max_difference(params_of(scaled), params_of(unscaled)) == 0


class TinyMLP(nn.Module):
    def __init__(self, dtype: torch.dtype):
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.fc1 = nn.Linear(4, 8).to(dtype)
        self.fc2 = nn.Linear(8, 1).to(dtype)
        with torch.no_grad():
            for param in self.parameters():
                param.copy_(torch.randn(param.shape, generator=generator) * 0.3)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x))).float().pow(2).mean()


def mlp_step(model, optimizer, lr: float = 1e-2):
    optimizer.zero_grad()
    x = torch.linspace(-1, 1, 12).view(3, 4).to(model.fc1.weight.dtype)
    optimizer.scale_loss(model(x)).backward()
    return optimizer.step(lr)


def test_fp16_overflow_skips_the_step_and_backs_off_after_hysteresis():
    model = TinyMLP(torch.float16)
    scaler = DynamicLossScaler()  # 2**32: fp16 grads of the scaled loss overflow
    optimizer = MixedPrecisionOptimizer(ParallelModel(model), lr=1e-2, loss_scaler=scaler)
    initial = params_of(model)
    updated, grad_norm = mlp_step(model, optimizer)
    assert not updated and math.isnan(grad_norm)
    assert scaler.scale == 2.0 ** 32  # hysteresis 2: the first overflow is tolerated
    assert max_difference(params_of(model), initial) == 0
    assert adam_untouched(optimizer)
    assert not mlp_step(model, optimizer).updated
    assert scaler.scale == 2.0 ** 31
    skipped = 2
    while not mlp_step(model, optimizer).updated:
        skipped += 1
        assert max_difference(params_of(model), initial) == 0
        assert scaler.scale == 2.0 ** (33 - skipped)  # halved on every further overflow
    assert skipped > 2
    assert max_difference(params_of(model), initial) > 0
    assert optimizer.state_dict()["meta"]["step"] == 1
    for main, param in zip(optimizer.main_params, optimizer.model_params):
        assert main.dtype == torch.float32 and torch.equal(param.detach(), main.half())


def test_an_injected_inf_skips_the_step_and_leaves_params_and_adam_state_unchanged():
    model = TinyMLP(torch.float32)
    scaler = DynamicLossScaler(initial_scale=8.0, hysteresis=1)
    optimizer = MixedPrecisionOptimizer(ParallelModel(model), lr=1e-2, loss_scaler=scaler)
    assert mlp_step(model, optimizer).updated
    before = copy.deepcopy(optimizer.state_dict())
    optimizer.zero_grad()
    optimizer.scale_loss(model(torch.ones(3, 4))).backward()
    model.fc1.weight.main_grad[0, 0] = float("inf")
    assert not optimizer.step(1e-2).updated
    assert scaler.scale == 4.0
    after = optimizer.state_dict()
    assert all(torch.equal(after["tensors"][key], value) for key, value in before["tensors"].items())
    assert after["meta"]["step"] == before["meta"]["step"] == 1


def test_the_scale_grows_after_growth_interval_clean_steps():
    model = TinyMLP(torch.float32)
    scaler = DynamicLossScaler(initial_scale=8.0, growth_interval=3)
    optimizer = MixedPrecisionOptimizer(ParallelModel(model), lr=1e-2, loss_scaler=scaler)
    scales = []
    for _ in range(7):
        assert mlp_step(model, optimizer).updated
        scales.append(float(scaler.scale))
    assert scales == [8.0, 8.0, 16.0, 16.0, 16.0, 32.0, 32.0]


def test_loss_scaler_rules_and_state():
    scaler = DynamicLossScaler(initial_scale=4.0, min_scale=1.0, growth_interval=2, hysteresis=2)
    scaler.update(True)
    assert scaler.scale == 4.0  # tolerated by hysteresis
    scaler.update(False)
    scaler.update(True)  # hysteresis is not refilled by a clean step, only by growth
    assert scaler.scale == 2.0
    scaler.update(True)
    scaler.update(True)
    assert scaler.scale == 1.0  # floored at min_scale
    scaler.update(False)
    scaler.update(False)
    assert scaler.scale == 2.0 and scaler.hysteresis_tracker == 2
    copied = DynamicLossScaler(initial_scale=4.0, growth_interval=2)
    copied.load_state_dict(json.loads(json.dumps(scaler.state_dict())))
    assert copied.state_dict() == scaler.state_dict()


def adam_untouched(optimizer) -> bool:
    """Whether AdamW has taken no step: its step counts are 0 and its moments zero, where it has state."""
    return all(float(state["step"]) == 0 and not state["exp_avg"].any() and not state["exp_avg_sq"].any()
               for state in optimizer.adam.state.values())


@pytest.mark.parametrize("cause", ["grad", "skip"])
def test_a_non_finite_grad_norm_or_a_skip_without_a_scaler_skips_the_step_and_changes_nothing(cause):
    model = TinyMLP(torch.float32)
    optimizer = MixedPrecisionOptimizer(ParallelModel(model), lr=1e-2)
    initial = params_of(model)
    optimizer.zero_grad()
    optimizer.scale_loss(model(torch.ones(3, 4))).backward()
    if cause == "grad":
        model.fc2.bias.main_grad.fill_(float("nan"))
    updated, grad_norm = optimizer.step(1e-2, skip=torch.tensor(cause == "skip"))
    assert not updated and math.isnan(grad_norm)
    assert max_difference(params_of(model), initial) == 0 and adam_untouched(optimizer)
    assert optimizer.state_dict()["meta"]["step"] == 0
    assert mlp_step(model, optimizer).updated  # the next clean step goes on as the first
    assert optimizer.state_dict()["meta"]["step"] == 1 and max_difference(params_of(model), initial) > 0


def save_and_load(state: dict) -> dict:
    """Through the formats a checkpoint uses: torch.save for tensors, JSON for meta."""
    stream = io.BytesIO()
    torch.save(state["tensors"], stream)
    stream.seek(0)
    return {"tensors": torch.load(stream), "meta": json.loads(json.dumps(state["meta"]))}


@pytest.mark.parametrize("dtype, scaled", [(torch.float32, False), (torch.bfloat16, False),
                                           (torch.float32, True)])
def test_a_resumed_optimizer_continues_bitwise_like_an_uninterrupted_one(dtype, scaled):
    def build(seed):
        model = tiny_llama(seed, dtype)
        scaler = DynamicLossScaler(initial_scale=2.0 ** 8, growth_interval=2) if scaled else None
        return model, MixedPrecisionOptimizer(ParallelModel(model), lr=LRS[0], clip_grad=0.5, loss_scaler=scaler,
                                              **HYPER)

    model, optimizer = build(seed=0)
    train(model, optimizer, range(3))
    state = save_and_load(optimizer.state_dict())
    assert state["meta"]["step"] == 3
    name = "layers.0.mlp.linear_fc1.weight"
    assert state["tensors"][f"{name}.exp_avg_sq"].dtype == torch.float32
    assert state["tensors"][f"{name}.main_param"].shape == dict(model.named_parameters())[name].shape

    resumed_model, resumed = build(seed=1)  # different weights: all must come from the state
    resumed.load_state_dict(state)
    assert max_difference(params_of(resumed_model), params_of(model)) == 0
    uninterrupted = train(model, optimizer, range(3, 7))
    continued = train(resumed_model, resumed, range(3, 7))
    assert [float(r.grad_norm) for r in continued] == [float(r.grad_norm) for r in uninterrupted]
    assert max_difference(params_of(resumed_model), params_of(model)) == 0
    final, resumed_final = optimizer.state_dict(), resumed.state_dict()
    assert all(torch.equal(resumed_final["tensors"][key], value) for key, value in final["tensors"].items())
    assert resumed_final["meta"] == final["meta"]
    if scaled:
        assert final["meta"]["loss_scaler"]["scale"] > 2.0 ** 8  # the scaler state really mattered


def test_a_state_dict_taken_before_any_step_loads():
    model = tiny_llama()
    fresh = MixedPrecisionOptimizer(ParallelModel(model), lr=LRS[0], **HYPER)
    state = fresh.state_dict()
    assert state["meta"]["step"] == 0 and float(state["tensors"]["output_layer.weight.exp_avg"].abs().sum()) == 0
    other_model = tiny_llama(seed=1)
    other = MixedPrecisionOptimizer(ParallelModel(other_model), lr=LRS[0], **HYPER)
    other.load_state_dict(state)
    train(model, fresh, range(2))
    train(other_model, other, range(2))
    assert max_difference(params_of(other_model), params_of(model)) == 0


def test_load_errors_name_the_missing_unexpected_and_misshaped_entries():
    model = tiny_llama()
    optimizer = MixedPrecisionOptimizer(ParallelModel(model), lr=LRS[0])
    state = optimizer.state_dict()
    tensors = dict(state["tensors"])
    del tensors["final_layernorm.weight.exp_avg"]
    tensors["layers.9.mlp.linear_fc2.weight.main_param"] = torch.zeros(1)
    tensors["output_layer.weight.exp_avg_sq"] = torch.zeros(3, 3)
    with pytest.raises(UserError) as error:
        optimizer.load_state_dict({"tensors": tensors, "meta": state["meta"]})
    message = str(error.value)
    assert "missing: final_layernorm.weight.exp_avg" in message
    assert "unexpected: layers.9.mlp.linear_fc2.weight.main_param" in message
    assert "mis-shaped: output_layer.weight.exp_avg_sq [3, 3] vs [64, 32]" in message
    assert "--no-load-optim" in message


@pytest.mark.parametrize("kind", ["MixedPrecisionOptimizer", "DistributedOptimizer"])
def test_reload_model_params_restarts_bf16_main_params_from_newly_loaded_weights(kind):
    """--finetune / --no-load-optim load weights after the optimizer copied the old ones."""
    from megalite.data_parallel import optimizer as module

    model = tiny_llama(dtype=torch.bfloat16)
    sharding = Sharding.OPTIM if kind == "DistributedOptimizer" else Sharding.NO_SHARD
    optimizer = getattr(module, kind)(ParallelModel(model, sharding=sharding), lr=1e-3)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(1.0)  # what loading other weights does
    optimizer.reload_model_params()
    for main, param in zip(optimizer.main_params, optimizer.model_params):
        assert torch.equal(main, param.detach().float().view(main.shape))
