"""save_checkpoint / load_checkpoint: bitwise round trip and exact resume, across dtypes, ranks and stages."""

import os

import pytest
import torch

from megalite.checkpoint import load_checkpoint, read_metadata
from megalite.errors import UserError
from megalite.model.gpt import build_model
from tests.helpers.checkpoint import FakeAdamW, assert_same_tensors, run_ranks, save, small_config, train
from tests.helpers.model import token_losses


def test_round_trip_restores_model_optimizer_and_counters_bitwise(tmp_path):
    config = small_config()
    model = build_model(config, seed=1)
    optimizer = FakeAdamW(model)
    train(model, optimizer, 0, 2)
    extra = {"lr_schedule": {"num_steps": 2}, "args": {"lr": 0.01, "layers": [1, 2]}}
    save(tmp_path, 2, model, optimizer, consumed_samples=8, consumed_valid_samples=3, extra=extra)

    fresh = build_model(config, seed=2)
    fresh_optimizer = FakeAdamW(fresh)
    loaded = load_checkpoint(str(tmp_path), fresh, fresh_optimizer, model_config=config)
    assert loaded == {"iteration": 2, "consumed_samples": 8, "consumed_valid_samples": 3, "extra": extra,
                      "path": str(tmp_path / "iter_0000002")}
    assert_same_tensors(model.state_dict(), fresh.state_dict())
    assert_same_tensors(optimizer.state_dict()["tensors"], fresh_optimizer.state_dict()["tensors"])
    assert fresh_optimizer.state_dict()["meta"] == {"step": 2, "lr": 0.01}


def test_resume_continues_training_exactly_rng_included(tmp_path):
    config = small_config(hidden_dropout=0.1, attention_dropout=0.1)  # dropout consumes the torch RNG
    torch.manual_seed(0)
    model = build_model(config, seed=1)
    optimizer = FakeAdamW(model)
    train(model, optimizer, 0, 2)
    save(tmp_path, 2, model, optimizer)
    expected = train(model, optimizer, 2, 2)

    torch.manual_seed(123)
    resumed = build_model(config, seed=1)
    resumed_optimizer = FakeAdamW(resumed)
    load_checkpoint(str(tmp_path), resumed, resumed_optimizer, model_config=config)
    assert train(resumed, resumed_optimizer, 2, 2) == expected
    assert_same_tensors(model.state_dict(), resumed.state_dict())

    # Without the RNG the dropout masks differ, so the test above does test the RNG.
    load_checkpoint(str(tmp_path), resumed, resumed_optimizer, model_config=config, load_rng=False)
    assert train(resumed, resumed_optimizer, 2, 2) != expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_resume_with_megalites_optimizer_is_exact(tmp_path, dtype):
    from megalite.data_parallel.ddp import ParallelModel
    from megalite.data_parallel.optimizer import MixedPrecisionOptimizer

    def steps(model, optimizer, first):
        losses = []
        for step in range(first, first + 2):
            tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(step))
            optimizer.zero_grad()
            loss = token_losses(model, tokens, tokens.roll(-1, dims=1)).float().mean()
            optimizer.scale_loss(loss).backward()
            optimizer.step(1e-2)
            losses.append(loss.item())
        return losses

    config = small_config()
    model = build_model(config, seed=1, dtype=dtype)
    optimizer = MixedPrecisionOptimizer(ParallelModel(model), lr=1e-2)
    steps(model, optimizer, 0)
    save(tmp_path, 2, model, optimizer)
    expected = steps(model, optimizer, 2)
    resumed = build_model(config, seed=2, dtype=dtype)
    resumed_optimizer = MixedPrecisionOptimizer(ParallelModel(resumed), lr=1e-2)
    load_checkpoint(str(tmp_path), resumed, resumed_optimizer, model_config=config)
    assert steps(resumed, resumed_optimizer, 2) == expected
    assert_same_tensors(model.state_dict(), resumed.state_dict())


def test_no_load_optim_and_no_load_rng_leave_them_alone(tmp_path):
    config = small_config()
    model = build_model(config, seed=1)
    optimizer = FakeAdamW(model)
    train(model, optimizer, 0, 1)
    save(tmp_path, 1, model, optimizer)
    fresh = build_model(config, seed=2)
    fresh_optimizer = FakeAdamW(fresh)
    torch.manual_seed(5)
    state = torch.get_rng_state()
    load_checkpoint(str(tmp_path), fresh, None, model_config=config, load_rng=False)  # as --no-load-optim does
    assert_same_tensors(model.state_dict(), fresh.state_dict())
    assert fresh_optimizer.step_count == 0 and not fresh_optimizer.exp_avg["final_layernorm.weight"].any()
    assert torch.equal(torch.get_rng_state(), state)


def test_bf16_model_is_stored_as_bf16_and_loads_bitwise(tmp_path):
    config = small_config()
    model = build_model(config, seed=1, dtype=torch.bfloat16)
    optimizer = FakeAdamW(model)  # fp32 main params beside the bf16 model
    train(model, optimizer, 0, 1)
    save(tmp_path, 1, model, optimizer)
    index = read_metadata(str(tmp_path / "iter_0000001"))["tensors"]
    assert index["model"]["layers.0.mlp.linear_fc1.weight"]["dtype"] == "bfloat16"
    assert index["optimizer"]["layers.0.mlp.linear_fc1.weight.main_param"]["dtype"] == "float32"

    fresh = build_model(config, seed=2, dtype=torch.bfloat16)
    fresh_optimizer = FakeAdamW(fresh)
    load_checkpoint(str(tmp_path), fresh, fresh_optimizer, model_config=config)
    assert_same_tensors(model.state_dict(), fresh.state_dict())
    assert_same_tensors(optimizer.state_dict()["tensors"], fresh_optimizer.state_dict()["tensors"])
    # Loading into an fp32 model casts.
    as_fp32 = build_model(config, seed=2)
    load_checkpoint(str(tmp_path), as_fp32, model_config=config)
    assert_same_tensors({k: v.float() for k, v in model.state_dict().items()}, as_fp32.state_dict())


def test_explicit_iteration_loads_an_older_checkpoint(tmp_path):
    config = small_config()
    first, second = build_model(config, seed=1), build_model(config, seed=2)
    save(tmp_path, 10, first)
    save(tmp_path, 20, second)
    fresh = build_model(config, seed=3)
    assert load_checkpoint(str(tmp_path), fresh, model_config=config, iteration=10)["iteration"] == 10
    assert_same_tensors(first.state_dict(), fresh.state_dict())


def test_ranks_write_their_own_files_between_barriers(tmp_path):
    config = small_config()
    model = build_model(config, seed=1)
    run_ranks(2, lambda world: save(tmp_path, 5, model, **world))
    assert sorted(os.listdir(tmp_path / "iter_0000005")) == [
        "metadata.json", "model_00000.safetensors", "model_00001.safetensors",
        "rng_00000.safetensors", "rng_00001.safetensors"]
    assert read_metadata(str(tmp_path / "iter_0000005"))["ranks"] == 2
    fresh = build_model(config, seed=2)
    load_checkpoint(str(tmp_path), fresh, model_config=config, rank=1)
    assert_same_tensors(model.state_dict(), fresh.state_dict())
    with pytest.raises(UserError, match=r"not for rank 2.*--no-load-rng"):
        load_checkpoint(str(tmp_path), fresh, model_config=config, rank=2)


def test_a_pipeline_stage_loads_its_part_of_model_and_optimizer(tmp_path):
    config = small_config()
    model = build_model(config, seed=1)
    optimizer = FakeAdamW(model)
    train(model, optimizer, 0, 1)
    save(tmp_path, 1, model, optimizer)
    stage = build_model(config, seed=2, layer_ids=[1], pre_process=False)
    stage_optimizer = FakeAdamW(stage)
    load_checkpoint(str(tmp_path), stage, stage_optimizer, model_config=config)
    whole = model.state_dict()
    assert_same_tensors({name: whole[name] for name in stage.state_dict()}, stage.state_dict())
    whole_optimizer = optimizer.state_dict()["tensors"]
    stage_tensors = stage_optimizer.state_dict()["tensors"]
    assert_same_tensors({name: whole_optimizer[name] for name in stage_tensors}, stage_tensors)


def test_a_different_vocabulary_padding_loads_with_zero_padding_rows(tmp_path):
    # Padding depends on the TP size: 50 tokens pad to 64 at one size and 128 at another.
    small, large = small_config(vocab_size=64, tokenizer_vocab_size=50), small_config(
        vocab_size=128, tokenizer_vocab_size=50)
    model = build_model(small, seed=1)
    optimizer = FakeAdamW(model)
    train_tokens = torch.randint(0, 50, (2, 8))
    loss = token_losses(model, train_tokens, train_tokens.roll(-1, dims=1)).mean()
    loss.backward()
    optimizer.step()
    save(tmp_path, 1, model, optimizer)

    padded = build_model(large, seed=2)
    padded_optimizer = FakeAdamW(padded)
    load_checkpoint(str(tmp_path), padded, padded_optimizer, model_config=large)
    weight = padded.embedding.word_embeddings.weight
    assert torch.equal(weight[:64], model.embedding.word_embeddings.weight) and not weight[64:].any()
    assert torch.equal(padded(train_tokens), model(train_tokens))
    moment = padded_optimizer.exp_avg["embedding.word_embeddings.weight"]
    assert torch.equal(moment[:64], optimizer.exp_avg["embedding.word_embeddings.weight"])
    save(tmp_path, 2, padded, padded_optimizer, config=large)
    back = build_model(small, seed=3)  # and back to the smaller padding: the extra rows are dropped
    load_checkpoint(str(tmp_path), back, FakeAdamW(back), model_config=small)
    assert_same_tensors(model.state_dict(), back.state_dict())
