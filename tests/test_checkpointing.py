"""Checkpoints: bitwise round trip and exact resume, pieces across layouts, atomic saves, no pickle."""

import json
import os
import random
import threading

import numpy as np
import pytest
import torch

from megalite import checkpointing
from megalite.checkpointing import (CheckpointReader, Piece, begin_save, checkpoint_dir, finalize_save,
                                    load_checkpoint, read_latest_iteration, read_metadata, save_checkpoint,
                                    tensor_parallel_pieces, write_rank_files)
from megalite.config import ModelConfig
from megalite.errors import UserError
from megalite.model.gpt import build_model
from megalite.tensor_parallel.layers import mark_parameter, shard_full_tensor


def small_config(**overrides) -> ModelConfig:
    values = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=8, vocab_size=64,
                  hidden_dropout=0.0, attention_dropout=0.0)
    values.update(overrides)
    return ModelConfig(**values).validate()


class FakeAdamW:
    """AdamW on fp32 main params, written without torch.optim, with megalite's optimizer checkpoint API.

    state_dict() -> {"tensors": {"<param>.main_param" | ".exp_avg" | ".exp_avg_sq": Tensor},
    "meta": {"step", "lr"}}; load_state_dict takes the same and copies main params into the model.
    """

    def __init__(self, model, lr=1e-2, betas=(0.9, 0.95), eps=1e-8):
        self.params = dict(model.named_parameters())
        self.lr, self.betas, self.eps, self.step_count = lr, betas, eps, 0
        self.main = {name: p.detach().float().clone() for name, p in self.params.items()}
        self.exp_avg = {name: torch.zeros_like(main) for name, main in self.main.items()}
        self.exp_avg_sq = {name: torch.zeros_like(main) for name, main in self.main.items()}

    def step(self):
        self.step_count += 1
        beta1, beta2 = self.betas
        for name, param in self.params.items():
            grad = param.grad.float()
            self.exp_avg[name].mul_(beta1).add_(grad, alpha=1 - beta1)
            self.exp_avg_sq[name].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            m_hat = self.exp_avg[name] / (1 - beta1 ** self.step_count)
            v_hat = self.exp_avg_sq[name] / (1 - beta2 ** self.step_count)
            self.main[name].add_(-self.lr * m_hat / (v_hat.sqrt() + self.eps))
        self._copy_to_model()

    def _copy_to_model(self):
        with torch.no_grad():
            for name, param in self.params.items():
                param.copy_(self.main[name])

    def state_dict(self):
        tensors = {}
        for name in self.params:
            tensors[f"{name}.main_param"] = self.main[name]
            tensors[f"{name}.exp_avg"] = self.exp_avg[name]
            tensors[f"{name}.exp_avg_sq"] = self.exp_avg_sq[name]
        return {"tensors": tensors, "meta": {"step": self.step_count, "lr": self.lr}}

    def load_state_dict(self, state):
        tensors = state["tensors"]
        for name in self.params:
            self.main[name].copy_(tensors[f"{name}.main_param"])
            self.exp_avg[name].copy_(tensors[f"{name}.exp_avg"])
            self.exp_avg_sq[name].copy_(tensors[f"{name}.exp_avg_sq"])
        self.step_count = state["meta"]["step"]
        self._copy_to_model()


def train(model, optimizer, first_step, steps):
    """`steps` AdamW steps on fixed per-step batches; returns the losses (dropout draws the global RNG)."""
    losses = []
    for step in range(first_step, first_step + steps):
        tokens = torch.randint(0, model.config.vocab_size, (2, model.config.seq_length),
                               generator=torch.Generator().manual_seed(step))
        loss = model(tokens, labels=tokens.roll(-1, dims=1)).mean()
        model.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def assert_same_tensors(first: dict, second: dict):
    assert first.keys() == second.keys()
    for name in first:
        assert first[name].dtype == second[name].dtype, name
        assert torch.equal(first[name], second[name]), name


def save(path, iteration, model, optimizer=None, config=None, **kwargs):
    kwargs.setdefault("consumed_samples", iteration * 4)
    return save_checkpoint(str(path), iteration, model, optimizer, model_config=config or model.config, **kwargs)


# -- format and round trip ---------------------------------------------------------------------


def test_folder_and_latest_file_follow_megatron(tmp_path):
    model = build_model(small_config(), seed=1)
    assert read_latest_iteration(str(tmp_path)) is None
    final = save(tmp_path, 100, model)
    assert final == checkpoint_dir(str(tmp_path), 100) == str(tmp_path / "iter_0000100")
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text() == "100"
    assert read_latest_iteration(str(tmp_path)) == 100
    assert sorted(os.listdir(final)) == ["metadata.json", "model_00000.safetensors", "rng_00000.safetensors"]
    metadata = json.loads((tmp_path / "iter_0000100" / "metadata.json").read_text())
    assert metadata["version"] == checkpointing.FORMAT_VERSION and metadata["iteration"] == 100
    entry = metadata["tensors"]["model"]["layers.0.mlp.linear_fc1.weight"]
    assert entry == {"shape": [128, 32], "dtype": "float32", "pieces": [
        {"file": "model_00000.safetensors", "key": "layers.0.mlp.linear_fc1.weight", "offsets": [0, 0],
         "shape": [128, 32]}]}


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
    from megalite.data_parallel.optimizer import MixedPrecisionOptimizer

    def steps(model, optimizer, first):
        losses = []
        for step in range(first, first + 2):
            tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(step))
            optimizer.zero_grad()
            loss = model(tokens, labels=tokens.roll(-1, dims=1)).float().mean()
            optimizer.scale_loss(loss).backward()
            optimizer.step(1e-2)
            losses.append(loss.item())
        return losses

    config = small_config()
    model = build_model(config, seed=1, dtype=dtype)
    optimizer = MixedPrecisionOptimizer(model, lr=1e-2)
    steps(model, optimizer, 0)
    save(tmp_path, 2, model, optimizer)
    expected = steps(model, optimizer, 2)
    resumed = build_model(config, seed=2, dtype=dtype)
    resumed_optimizer = MixedPrecisionOptimizer(resumed, lr=1e-2)
    load_checkpoint(str(tmp_path), resumed, resumed_optimizer, model_config=config)
    assert steps(resumed, resumed_optimizer, 2) == expected
    assert_same_tensors(model.state_dict(), resumed.state_dict())


def test_rng_draws_after_load_equal_draws_after_save(tmp_path):
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    np.random.randn()  # leaves a cached gaussian in numpy's state
    save(tmp_path, 1, build_model(small_config(), seed=1))
    expected = (random.random(), random.gauss(0, 1), np.random.randn(3).tolist(), torch.rand(3))
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    load_checkpoint(str(tmp_path), build_model(small_config(), seed=1), model_config=small_config())
    drawn = (random.random(), random.gauss(0, 1), np.random.randn(3).tolist(), torch.rand(3))
    assert drawn[:3] == expected[:3] and torch.equal(drawn[3], expected[3])


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
    load_checkpoint(str(tmp_path), fresh, fresh_optimizer, model_config=config, load_optim=False, load_rng=False)
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


# -- pieces: any layout reads any slice --------------------------------------------------------


def save_pieces(save_dir, iteration, pieces_per_rank: list[dict]):
    """Save as if each entry of `pieces_per_rank` were one rank's model pieces."""
    staging = begin_save(str(save_dir), iteration)
    for rank, pieces in enumerate(pieces_per_rank):
        write_rank_files(staging, rank, pieces)
    finalize_save(str(save_dir), iteration, {"iteration": iteration, "model_config": {}, "extra": {}})
    return checkpoint_dir(str(save_dir), iteration)


def test_row_halves_from_two_ranks_read_back_as_any_slice(tmp_path):
    full = torch.arange(6 * 4, dtype=torch.float32).view(6, 4)
    replicated = torch.randn(5)
    path = save_pieces(tmp_path, 1, [
        {"w": [Piece(full[:3], (6, 4), (0, 0))], "norm": [Piece.full(replicated)]},
        {"w": [Piece(full[3:], (6, 4), (3, 0))], "norm": [Piece.full(replicated)]}])
    metadata = read_metadata(path)
    assert [p["file"] for p in metadata["tensors"]["model"]["w"]["pieces"]] == [
        "model_00000.safetensors", "model_00001.safetensors"]
    assert len(metadata["tensors"]["model"]["norm"]["pieces"]) == 1  # replicas are listed once
    with CheckpointReader(path, metadata) as reader:
        assert torch.equal(reader.read("model", "w"), full)
        assert torch.equal(reader.read("model", "w", (0, 0), (6, 2)), full[:, :2])  # column halves
        assert torch.equal(reader.read("model", "w", (0, 2), (6, 2)), full[:, 2:])
        assert torch.equal(reader.read("model", "w", (1, 1), (4, 2)), full[1:5, 1:3])  # across both files
        assert torch.equal(reader.read("model", "norm"), replicated)


def test_reading_what_no_piece_covers_is_a_user_error(tmp_path):
    full = torch.randn(6, 4)
    path = save_pieces(tmp_path, 1, [{"w": [Piece(full[:3], (6, 4), (0, 0))]}])  # rank 1's half is lost
    with CheckpointReader(path, read_metadata(path)) as reader:
        assert torch.equal(reader.read("model", "w", (0, 0), (3, 4)), full[:3])
        with pytest.raises(UserError, match=r"lacks part of model tensor 'w'"):
            reader.read("model", "w", (2, 0), (2, 4))


def test_tensor_parallel_shards_of_chunked_weights_load_into_any_tp_size(tmp_path):
    # A SwiGLU fc1 weight [gate; up] sharded block by block over TP=2, as ColumnParallelLinear does.
    full = torch.randn(8, 3)
    shards = [shard_full_tensor(full, 0, rank, 2, chunks=2) for rank in range(2)]
    params = [mark_parameter(torch.nn.Parameter(shard), True, 0, partition_chunks=2) for shard in shards]
    pieces = [tensor_parallel_pieces(p.detach(), p, rank, 2) for rank, p in enumerate(params)]
    assert [piece.offsets for piece in pieces[1]] == [(2, 0), (6, 0)]
    path = save_pieces(tmp_path, 1, [{"fc1": rank_pieces} for rank_pieces in pieces])
    with CheckpointReader(path, read_metadata(path)) as reader:
        assert torch.equal(reader.read("model", "fc1"), full)  # TP=1
        for rank in range(4):  # TP=4: load through the same pieces, into views of an empty shard
            shard = torch.empty(2, 3)
            param = mark_parameter(torch.nn.Parameter(shard), True, 0, partition_chunks=2)
            for piece in tensor_parallel_pieces(shard, param, rank, 4):
                piece.tensor.copy_(reader.read("model", "fc1", piece.offsets, piece.tensor.shape))
            assert torch.equal(shard, shard_full_tensor(full, 0, rank, 4, chunks=2))


def test_ranks_write_their_own_files_between_barriers(tmp_path):
    config = small_config()
    model = build_model(config, seed=1)
    run_ranks(2, lambda rank, barrier: save(tmp_path, 5, model, rank=rank, barrier=barrier))
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


class ShardedOptimizer:
    """A ZeRO-like optimizer state: rank r of 2 holds rows [3r, 3r+3) of a [6, 4] moment, as a Piece."""

    def __init__(self, rank, values=None):
        self.rank = rank
        self.shard = torch.zeros(3, 4) if values is None else values[3 * rank:3 * rank + 3].clone()

    def state_dict(self):
        return {"tensors": {"w.exp_avg": Piece(self.shard, (6, 4), (3 * self.rank, 0))}, "meta": {"step": 1}}

    def load_state_dict(self, state):
        piece = state["tensors"]["w.exp_avg"]
        assert isinstance(piece, Piece) and piece.offsets == (3 * self.rank, 0)
        self.shard.copy_(piece.tensor)


class WholeOptimizer:
    """The same state unsharded, as one process holds it."""

    def __init__(self, values=None):
        self.moment = torch.zeros(6, 4) if values is None else values.clone()

    def state_dict(self):
        return {"tensors": {"w.exp_avg": self.moment}, "meta": {"step": 1}}

    def load_state_dict(self, state):
        self.moment.copy_(state["tensors"]["w.exp_avg"])


def run_ranks(world_size, rank_main):
    """Run `rank_main(rank, barrier)` on `world_size` threads, as ranks of one save; re-raise errors."""
    barrier = threading.Barrier(world_size)
    errors = []

    def guarded(rank):
        try:
            rank_main(rank, barrier.wait)
        except Exception as error:  # surfaced below; a dead thread would otherwise hang the others
            errors.append(error)
            barrier.abort()

    threads = [threading.Thread(target=guarded, args=(rank,)) for rank in range(world_size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]


def test_optimizer_shards_saved_as_pieces_load_whole_and_back(tmp_path):
    values, model = torch.randn(6, 4), torch.nn.Linear(2, 2)
    run_ranks(2, lambda rank, barrier: save(tmp_path, 1, model, ShardedOptimizer(rank, values),
                                            config=small_config(), rank=rank, barrier=barrier))
    whole = WholeOptimizer()
    load_checkpoint(str(tmp_path), model, whole, model_config=small_config(), load_rng=False)
    assert torch.equal(whole.moment, values)

    save(tmp_path, 2, model, WholeOptimizer(values * 2), config=small_config())
    for rank in range(2):
        shard = ShardedOptimizer(rank)
        load_checkpoint(str(tmp_path), model, shard, model_config=small_config(), load_rng=False)
        assert torch.equal(shard.shard, values[3 * rank:3 * rank + 3] * 2)


def test_a_different_vocabulary_padding_loads_with_zero_padding_rows(tmp_path):
    # Padding depends on the TP size: 50 tokens pad to 64 at one size and 128 at another.
    small, large = small_config(vocab_size=64, tokenizer_vocab_size=50), small_config(
        vocab_size=128, tokenizer_vocab_size=50)
    model = build_model(small, seed=1)
    optimizer = FakeAdamW(model)
    train_tokens = torch.randint(0, 50, (2, 8))
    loss = model(train_tokens, labels=train_tokens.roll(-1, dims=1)).mean()
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


# -- atomicity -----------------------------------------------------------------------------------


class SimulatedCrash(BaseException):
    """Stands for a kill: no except clause of the save catches it, so nothing is cleaned up.
    (A save that fails with an OSError cleans up: tests/test_faults.py.)"""


def failing_on_call(real, failing_call: int):
    """A stand-in for `real` that crashes on call number `failing_call` (1-based)."""
    calls = []

    def wrapper(*args):
        calls.append(args)
        if len(calls) == failing_call:
            raise SimulatedCrash("simulated crash")
        return real(*args)
    return wrapper


def test_crash_before_the_rename_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    config = small_config()
    first, second = build_model(config, seed=1), build_model(config, seed=2)
    save(tmp_path, 100, first)
    monkeypatch.setattr(os, "rename", failing_on_call(os.rename, 1))
    with pytest.raises(SimulatedCrash, match="simulated crash"):
        save(tmp_path, 200, second)
    monkeypatch.undo()
    assert read_latest_iteration(str(tmp_path)) == 100
    assert (tmp_path / "iter_0000200.tmp-new").is_dir()  # the killed save's leftover ...
    fresh = build_model(config, seed=3)
    assert load_checkpoint(str(tmp_path), fresh, model_config=config)["iteration"] == 100  # ... is ignored
    assert_same_tensors(first.state_dict(), fresh.state_dict())

    save(tmp_path, 200, second)  # a re-save works and cleans up
    assert sorted(os.listdir(tmp_path)) == ["iter_0000100", "iter_0000200", "latest_checkpointed_iteration.txt"]
    assert load_checkpoint(str(tmp_path), fresh, model_config=config)["iteration"] == 200
    assert_same_tensors(second.state_dict(), fresh.state_dict())


def test_crash_before_the_latest_file_is_replaced_keeps_it_old(tmp_path, monkeypatch):
    model = build_model(small_config(), seed=1)
    save(tmp_path, 100, model)
    monkeypatch.setattr(os, "replace", failing_on_call(os.replace, 1))
    with pytest.raises(SimulatedCrash, match="simulated crash"):
        save(tmp_path, 200, model)
    monkeypatch.undo()
    assert read_latest_iteration(str(tmp_path)) == 100
    assert load_checkpoint(str(tmp_path), model, model_config=small_config())["iteration"] == 100


def test_crash_while_replacing_the_same_iteration_keeps_a_complete_copy(tmp_path, monkeypatch):
    config = small_config()
    first, second = build_model(config, seed=1), build_model(config, seed=2)
    save(tmp_path, 100, first)
    # Rename 1 moves the old copy away, rename 2 (moving the new one in) dies.
    monkeypatch.setattr(os, "rename", failing_on_call(os.rename, 2))
    with pytest.raises(SimulatedCrash, match="simulated crash"):
        save(tmp_path, 100, second)
    monkeypatch.undo()
    assert not (tmp_path / "iter_0000100").exists() and read_latest_iteration(str(tmp_path)) == 100
    fresh = build_model(config, seed=3)
    load_checkpoint(str(tmp_path), fresh, model_config=config)  # the old copy still loads
    assert_same_tensors(first.state_dict(), fresh.state_dict())

    save(tmp_path, 100, second)  # restores the old copy, then replaces it properly
    assert sorted(os.listdir(tmp_path)) == ["iter_0000100", "latest_checkpointed_iteration.txt"]
    load_checkpoint(str(tmp_path), fresh, model_config=config)
    assert_same_tensors(second.state_dict(), fresh.state_dict())


# -- user errors ----------------------------------------------------------------------------------


def test_garbled_latest_file_names_the_file_and_its_content(tmp_path):
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("iter_100\n")
    with pytest.raises(UserError, match=r"latest_checkpointed_iteration.txt should hold an iteration number "
                                        r"but holds 'iter_100'"):
        read_latest_iteration(str(tmp_path))


@pytest.mark.parametrize("case, message", [
    ("no load dir", r"--load directory .*missing does not exist"),
    ("no latest file", r"has no latest_checkpointed_iteration.txt"),
    ("no folder", r"checkpoint folder .*iter_0000007 for iteration 7 does not exist"),
    ("no metadata", r"metadata.json is missing"),
    ("garbled metadata", r"metadata.json is not valid JSON"),
    ("newer format", r"format version 99, newer than"),
])
def test_missing_or_garbled_checkpoints_are_user_errors(tmp_path, case, message):
    config = small_config()
    model = build_model(config, seed=1)
    save(tmp_path, 7, model)
    load, metadata = tmp_path, tmp_path / "iter_0000007" / "metadata.json"
    if case == "no load dir":
        load = tmp_path / "missing"
    elif case == "no latest file":
        os.remove(tmp_path / "latest_checkpointed_iteration.txt")
    elif case == "no folder":
        os.rename(tmp_path / "iter_0000007", tmp_path / "elsewhere")
    elif case == "no metadata":
        os.remove(metadata)
    elif case == "garbled metadata":
        metadata.write_text(metadata.read_text()[:100])
    else:
        metadata.write_text(metadata.read_text().replace('"version": 1', '"version": 99'))
    with pytest.raises(UserError, match=message):
        load_checkpoint(str(load), model, model_config=config)


def test_a_different_model_config_names_every_differing_field(tmp_path):
    save(tmp_path, 1, build_model(small_config(), seed=1))
    other = small_config(num_layers=3, hidden_size=64, swiglu=True)
    with pytest.raises(UserError) as error:
        load_checkpoint(str(tmp_path), build_model(other, seed=1), model_config=other)
    message = str(error.value)
    for field in ("num_layers (checkpoint 2, now 3)", "hidden_size (checkpoint 32, now 64)",
                  "swiglu (checkpoint False, now True)"):
        assert field in message
    assert "pass the same model flags (or --model) as the saved run" in message
    # SwiGLU's 2/3 rule gives 128 at h=64 too: equal fields are not listed.
    assert "num_attention_heads" not in message and "ffn_hidden_size" not in message


def test_a_model_that_does_not_match_its_config_is_a_user_error(tmp_path):
    config = small_config()
    save(tmp_path, 1, build_model(config, seed=1))
    with pytest.raises(UserError, match=r"holds 'layers.0.mlp.linear_fc1.weight' with shape \[128, 32\] but this "
                                        r"run has \[64, 32\]"):
        load_checkpoint(str(tmp_path), build_model(small_config(ffn_hidden_size=64), seed=1), model_config=config)
    with pytest.raises(UserError, match=r"holds no model tensor 'layers.2.input_layernorm.weight'"):
        load_checkpoint(str(tmp_path), build_model(small_config(num_layers=3), seed=1), model_config=config)


def test_optimizer_requested_from_a_checkpoint_without_one_is_a_user_error(tmp_path):
    config = small_config()
    model = build_model(config, seed=1)
    save(tmp_path, 1, model)
    with pytest.raises(UserError, match=r"holds no optimizer state .*--no-load-optim"):
        load_checkpoint(str(tmp_path), model, FakeAdamW(model), model_config=config)


class WritesMarker:
    """Unpickling this runs `open(marker, 'w')`: what a malicious checkpoint would do."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return open, (self.marker, "w")


def test_a_pickle_in_place_of_a_safetensors_file_is_refused_unexecuted(tmp_path):
    config = small_config()
    model = build_model(config, seed=1)
    save(tmp_path, 1, model)
    # The payload is live: unpickling it really creates its marker.
    probe = tmp_path / "probe.pt"
    torch.save({"weights": WritesMarker(str(tmp_path / "probe-marker"))}, probe)
    torch.load(probe, weights_only=False)
    assert (tmp_path / "probe-marker").exists()

    marker = tmp_path / "marker"
    target = tmp_path / "iter_0000001" / "model_00000.safetensors"
    torch.save({"weights": WritesMarker(str(marker))}, target)
    with pytest.raises(UserError, match=r"model_00000.safetensors is not a valid safetensors file"):
        load_checkpoint(str(tmp_path), model, model_config=config)
    assert not marker.exists()


@pytest.mark.parametrize("damage", ["truncate", "garbage", "delete model", "delete rng"])
def test_damaged_tensor_files_are_user_errors_naming_the_file(tmp_path, damage):
    config = small_config()
    model = build_model(config, seed=1)
    save(tmp_path, 1, model)
    file_name = "rng_00000.safetensors" if damage == "delete rng" else "model_00000.safetensors"
    path = tmp_path / "iter_0000001" / file_name
    if damage == "truncate":
        path.write_bytes(path.read_bytes()[:-100])
    elif damage == "garbage":
        path.write_bytes(b"\x00" * 64)
    else:
        os.remove(path)
    expected = "is missing" if damage.startswith("delete") else "is not a valid safetensors file"
    with pytest.raises(UserError, match=rf"{path.name} {expected}"):
        load_checkpoint(str(tmp_path), model, model_config=config)


@pytest.mark.parametrize("shape, dim, chunks", [((8, 6), 0, 2), ((8, 6), 1, 1), ((8, 6), 0, 1), ((12,), 0, 1)])
@pytest.mark.parametrize("tp_size", [1, 2])
def test_flat_range_pieces_place_every_distributed_optimizer_range_in_the_global_tensor(shape, dim, chunks, tp_size):
    """Any contiguous range of a TP shard's flattened values maps to pieces holding exactly
    those values at the right global offsets (partial rows, whole rows, chunked dims)."""
    full = torch.arange(float(torch.Size(shape).numel())).view(shape)
    for tp_rank in range(tp_size):
        local = shard_full_tensor(full, dim, tp_rank, tp_size, chunks)
        param = mark_parameter(torch.nn.Parameter(local.clone()), tp_size > 1, dim, partition_chunks=chunks)
        flat = local.reshape(-1)
        for start, end in [(0, flat.numel()), (1, 5), (3, flat.numel() - 2), (2, 3), (local.shape[-1], flat.numel())]:
            values = flat[start:end].clone()
            pieces = checkpointing.flat_range_pieces(values, param, start, tp_rank, tp_size)
            assert sum(piece.tensor.numel() for piece in pieces) == end - start
            for piece in pieces:  # views of `values`: loading into them fills the optimizer's state
                assert piece.tensor.untyped_storage().data_ptr() == values.untyped_storage().data_ptr()
                assert piece.global_shape == shape
                region = full[tuple(slice(o, o + n) for o, n in zip(piece.offsets, piece.tensor.shape))]
                assert torch.equal(region, piece.tensor), (start, end, piece.offsets)
