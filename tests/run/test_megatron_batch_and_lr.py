"""Megatron's --rampup-batch-size, per-token loss and --decoupled-lr/--decoupled-min-lr, by their
behaviour: the batch ramp's schedule and resume, the per-token loss's gradients over uneven masks, and
the embeddings' and output layer's own learning rate (one process, ZeRO, checkpoints)."""

import copy
import json

import pytest
import torch

from megalite.arguments import parse_args
from megalite.data_parallel.ddp import ParallelModel
from megalite.data_parallel.optimizer import DECOUPLED_PARAM_SUFFIXES, MixedPrecisionOptimizer
from megalite.errors import UserError
from megalite.parallel_state import build_parallel_state
from megalite.run.lr_schedule import LRSchedule
from megalite.run.training import forward_backward, pretrain
from tests.helpers.distributed import run_world
from tests.helpers.model import token_losses
from tests.helpers.optimizer import HYPER, backward_iteration, params_of, tiny_llama
from tests.helpers.runs import MOCK, SMALL
from tools.check_layouts import COMMON, MODELS, run
from tools.loss_compare import compare, read_losses

pytestmark = pytest.mark.usefixtures("one_thread", *(["deterministic"] if torch.cuda.is_available() else []))

# Micro-batch 2, global 8, ramp 2 2 12: 3 increments of 4 samples; consumed 0, 2 -> 2; 4 -> 4; 8 -> 6; 14 > 12 -> 8.
RAMP = ["--global-batch-size", "8", "--rampup-batch-size", "2", "2", "12", "--train-iters", "7", "--log-interval", "1"]
RAMP_CONSUMED = [2, 4, 8, 14, 22, 30, 38]


def train(*flags):
    lines = []
    trainer, state = pretrain(parse_args([*SMALL, *MOCK, *flags]), log=lines.append)
    return trainer, state, lines


def train_records(path) -> list[dict]:
    """The training records of a metrics file."""
    return [record for record in map(json.loads, open(path)) if "split" not in record]


def test_rampup_grows_the_batch_on_megatron_s_schedule_and_resumes_mid_ramp_bitwise(tmp_path):
    common = [*RAMP, "--hidden-dropout", "0.1"]
    _, straight, lines = train(*common, "--save", str(tmp_path / "a"))
    assert [record["consumed_samples"] for record in train_records(tmp_path / "a" / "metrics.jsonl")] == RAMP_CONSUMED
    assert any("global batch starts at 2 and grows by 2 over the first 12 samples to 8" in line for line in lines)
    _, first, _ = train(*common, "--save", str(tmp_path / "b"), "--exit-interval", "3")  # 8 consumed, batch 6 next
    assert first.consumed_train_samples == 8
    _, second, _ = train(*common, "--save", str(tmp_path / "b"), "--load", str(tmp_path / "b"))
    assert first.losses + second.losses == straight.losses  # bitwise: the same samples in the same order
    assert second.consumed_train_samples == RAMP_CONSUMED[-1]


def test_train_samples_count_the_ramp_s_iterations_as_megatron_does():
    run = parse_args([*MOCK, "--micro-batch-size", "2", "--global-batch-size", "8", "--rampup-batch-size", "2", "2",
                      "12", "--train-samples", "39"])
    assert run.train.train_iters == 4 + (39 - 14) // 8  # the ramp while <= 12 consumed, then whole batches
    assert [run.global_batch_at(consumed) for consumed in (0, 2, 4, 8, 14)] == [2, 2, 4, 6, 8]


@pytest.mark.parametrize("flags, message", [
    (["--rampup-batch-size", "2", "2"], "takes three numbers"),
    (["--rampup-batch-size", "3", "1", "12"], "reaches a global batch of 3, which is not a multiple of "
                                              "--micro-batch-size 2"),
    (["--rampup-batch-size", "4", "3", "12"], "must reach --global-batch-size 8"),
    (["--decoupled-min-lr", "1e-5"], "--decoupled-min-lr needs --decoupled-lr"),
    (["--decoupled-lr", "1e-5", "--min-lr", "1e-4"], "--min-lr 0.0001 .* is larger than --decoupled-lr 1e-05"),
])
def test_bad_values_stop_with_one_sentence(flags, message):
    with pytest.raises(UserError, match=message):
        parse_args([*MOCK, "--micro-batch-size", "2", "--global-batch-size", "8", *flags])


DP2_RAMP = [*COMMON, *MODELS["llama"], "--micro-batch-size", "1", "--rampup-batch-size", "2", "2", "12",
            "--train-iters", "6", "--decoupled-lr", "3e-3", "--decoupled-min-lr", "3e-4", "--lr", "1e-3"]


@pytest.fixture(scope="module")
def one_process_ramp(tmp_path_factory):
    """DP2_RAMP's metrics file on one process: the reference of both strategies below."""
    metrics = str(tmp_path_factory.mktemp("ramp") / "one.jsonl")
    run(1, DP2_RAMP, metrics)
    return metrics


@pytest.mark.parametrize("sharding", ["--use-distributed-optimizer",
                                      "--data-parallel-sharding-strategy=optim_grads_params"])
def test_rampup_on_dp2_with_zero_and_decoupled_lr_matches_one_process(tmp_path, sharding, one_process_ramp):
    """A ramp over DP 2 (micro-batch 1), with the decoupled LR on the distributed optimizer's shards (ZeRO-1,
    ZeRO-3), trains as one process does: the same samples per iteration and the same losses."""
    run(2, [*DP2_RAMP, sharding], str(tmp_path / "dp2.jsonl"))
    rows, worst = compare(read_losses(one_process_ramp), read_losses(str(tmp_path / "dp2.jsonl")))
    assert len(rows) == 9 and worst <= 1e-5  # 6 training iterations, validation at 5 and 6, test
    consumed = [[record["consumed_samples"] for record in train_records(path)]
                for path in (one_process_ramp, tmp_path / "dp2.jsonl")]
    assert consumed[0] == consumed[1] == [2, 4, 8, 14, 22, 30]


def per_token_world(rank, world_size, batches):
    """This DP rank's micro-batches through forward_backward: (loss, every param's grad)."""
    parallel = build_parallel_state(1, 1)
    model = tiny_llama()
    ddp = ParallelModel(model, parallel)
    optimizer = MixedPrecisionOptimizer(ddp, lr=1e-3, **HYPER)
    optimizer.zero_grad()
    ddp.start_iteration(len(batches[rank]))
    loss = float(forward_backward(model, batches[rank], optimizer, parallel))
    ddp.finish_grad_sync()
    return loss, {name: param.main_grad.clone() for name, param in model.named_parameters()}


def test_per_token_loss_sums_over_micro_batches_and_dp_ranks_and_divides_once():
    """Uneven masks: rank 0's two micro-batches keep 16 and 2 tokens, rank 1's keep 9 and 0. The loss and the
    grads are those of the sum of the 27 tokens' losses over 27, not of the mean of the micro-batches' means."""
    generator = torch.Generator().manual_seed(5)
    kept = [[16, 2], [9, 0]]
    batches = []
    for rank_kept in kept:
        rank_batches = []
        for count in rank_kept:
            tokens = torch.randint(0, 64, (2, 9), generator=generator)
            mask = torch.zeros(2 * 8)
            mask[torch.randperm(16, generator=generator)[:count]] = 1
            rank_batches.append({"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": mask.view(2, 8),
                                 "position_ids": torch.arange(8).expand(2, 8)})
        batches.append(rank_batches)
    results = run_world(2, per_token_world, batches)

    reference = tiny_llama()
    micro_batches = sum(batches, [])
    per_token = [token_losses(reference, mb["tokens"], mb["labels"]) * mb["loss_mask"] for mb in micro_batches]
    loss = sum(losses.sum() for losses in per_token) / 27
    loss.backward()
    loss = float(loss.detach())
    for rank_loss, grads in results:
        assert rank_loss == pytest.approx(loss, rel=1e-6)
        for name, param in reference.named_parameters():
            torch.testing.assert_close(grads[name], param.grad, rtol=1e-5, atol=1e-7)
    micro_means = [losses.sum() / mb["loss_mask"].sum() for losses, mb in zip(per_token, micro_batches)
                   if mb["loss_mask"].sum()]
    assert abs(float(sum(micro_means).detach()) / len(micro_means) - loss) > 1e-3  # Megatron's default differs


def test_decoupled_lr_steps_the_embeddings_and_output_layer_at_their_own_rate():
    model = tiny_llama()
    reference = copy.deepcopy(model)
    optimizer = MixedPrecisionOptimizer(ParallelModel(model), lr=1e-2, clip_grad=0.0, **HYPER)
    optimizer.zero_grad()
    backward_iteration(model, 0, optimizer)
    optimizer.step(1e-2, decoupled_lr=1e-3)

    backward_iteration(reference, 0)
    named = dict(reference.named_parameters())
    decoupled = [name for name in named if name.endswith(DECOUPLED_PARAM_SUFFIXES)]
    assert sorted(decoupled) == ["embedding.word_embeddings.weight", "output_layer.weight"]
    groups = [{"params": [named[name] for name in names], "weight_decay": HYPER["weight_decay"] if decay else 0.0,
               "lr": lr}
              for lr, chosen in ((1e-3, True), (1e-2, False)) for decay in (True, False)
              if (names := [name for name, p in named.items()
                            if (p.ndim >= 2) == decay and (name in decoupled) == chosen])]
    torch_adamw = torch.optim.AdamW(groups, betas=HYPER["betas"], eps=HYPER["eps"], fused=True)
    torch_adamw.step()
    torch.testing.assert_close(params_of(model), params_of(reference), rtol=0, atol=1e-7)
    # At lr 1e-2 the embeddings would have moved 10 times as far: the rate really is the decoupled one.
    moved = (params_of(model)["output_layer.weight"] - params_of(tiny_llama())["output_layer.weight"]).abs().max()
    assert float(moved) == pytest.approx(1e-3, rel=0.05)


def test_decoupled_schedule_shares_the_shape_and_checkpoints_its_settings():
    schedule = LRSchedule(1e-3, 1e-4, 2, 10, "cosine", decoupled_lr=5e-3, decoupled_min_lr=5e-4)
    for iteration in range(12):
        assert schedule.decoupled_lr_at(iteration) == pytest.approx(5 * schedule.lr_at(iteration), rel=1e-12)
    assert LRSchedule(1e-3, 1e-4, 2, 10).decoupled_lr_at(3) is None
    assert LRSchedule(1e-3, 1e-4, 2, 10, decoupled_lr=2e-3).decoupled_lr_at(11) == 1e-4  # floor: --min-lr
    # A resume with another decoupled LR needs a flag, like any other schedule setting.
    with pytest.raises(UserError, match="--decoupled-lr is 0.005 in the checkpoint but 0.001 in this run"):
        LRSchedule(1e-3, 1e-4, 2, 10, decoupled_lr=1e-3, decoupled_min_lr=5e-4).load_state_dict(schedule.state_dict())
    plain = LRSchedule(1e-3, 1e-4, 2, 10).state_dict()  # a run without --decoupled-lr saves None for both
    assert plain["decoupled_lr"] is None and plain["decoupled_min_lr"] is None
    LRSchedule(1e-3, 1e-4, 2, 10).load_state_dict(plain)
    adopted = LRSchedule(1e-3, 1e-4, 2, 10)
    adopted.load_state_dict(schedule.state_dict(), use_checkpoint=True)
    assert adopted.decoupled_lr_at(0) == schedule.decoupled_lr_at(0)


def test_decoupled_lr_resumes_bitwise_from_its_checkpoint(tmp_path):
    common = ["--train-iters", "6", "--decoupled-lr", "1e-2", "--decoupled-min-lr", "1e-3"]
    _, straight, _ = train(*common, "--save", str(tmp_path / "a"))
    _, plain, _ = train("--train-iters", "6")
    assert straight.losses != plain.losses
    _, first, _ = train(*common, "--save", str(tmp_path / "b"), "--exit-interval", "3")
    _, second, _ = train(*common, "--save", str(tmp_path / "b"), "--load", str(tmp_path / "b"))
    assert first.losses + second.losses == straight.losses
    with pytest.raises(UserError, match="--decoupled-lr is 0.01 in the checkpoint but None in this run"):
        train("--train-iters", "8", "--lr-decay-iters", "6", "--load", str(tmp_path / "b"))
