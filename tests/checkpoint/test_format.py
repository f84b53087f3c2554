"""The on-disk format: metadata.json and its index, reading any slice, and refusing what does not fit or
is not a megalite checkpoint (nothing unpickled)."""

import json
import os

import pytest
import torch

from megalite.checkpoint import (FORMAT_VERSION, CheckpointReader, Piece, checkpoint_dir, load_checkpoint,
                                 read_latest_iteration, read_metadata)
from megalite.errors import UserError
from megalite.model.gpt import build_model
from tests.helpers.checkpoint import FakeAdamW, save, save_pieces, small_config


def test_folder_and_latest_file_follow_megatron(tmp_path):
    model = build_model(small_config(), seed=1)
    assert read_latest_iteration(str(tmp_path)) is None
    final = save(tmp_path, 100, model)
    assert final == checkpoint_dir(str(tmp_path), 100) == str(tmp_path / "iter_0000100")
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text() == "100"
    assert read_latest_iteration(str(tmp_path)) == 100
    assert sorted(os.listdir(final)) == ["metadata.json", "model_00000.safetensors", "rng_00000.safetensors"]
    metadata = json.loads((tmp_path / "iter_0000100" / "metadata.json").read_text())
    assert metadata["version"] == FORMAT_VERSION and metadata["iteration"] == 100
    entry = metadata["tensors"]["model"]["layers.0.mlp.linear_fc1.weight"]
    assert entry == {"shape": [128, 32], "dtype": "float32", "pieces": [
        {"file": "model_00000.safetensors", "key": "layers.0.mlp.linear_fc1.weight", "offsets": [0, 0],
         "shape": [128, 32]}]}


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
    path = save_pieces(tmp_path, 1, [{"w": [Piece(full[:3], (6, 4), (0, 0))]},
                                     {"w": [Piece(full[3:], (6, 4), (3, 0))]}])
    metadata = read_metadata(path)
    metadata["tensors"]["model"]["w"]["pieces"].pop()  # an index that lost rank 1's half
    with CheckpointReader(path, metadata) as reader:
        assert torch.equal(reader.read("model", "w", (0, 0), (3, 4)), full[:3])
        with pytest.raises(UserError, match=r"lacks part of model tensor 'w'"):
            reader.read("model", "w", (2, 0), (2, 4))


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


def test_a_checkpoint_from_before_a_config_field_existed_loads_with_its_default():
    import dataclasses
    from megalite.checkpoint.format import check_model_config

    config = small_config()
    saved = {key: value for key, value in dataclasses.asdict(config).items() if not key.startswith("moe_")}
    del saved["num_experts"]  # as a checkpoint written before the MoE options
    check_model_config(saved, config, "old")
    with pytest.raises(UserError, match="num_experts .checkpoint None, now 4."):
        check_model_config(saved, dataclasses.replace(config, num_experts=4), "old")


def test_a_finetune_may_change_the_context_and_rope_frequencies_but_not_a_learned_position_table(tmp_path):
    rope = small_config(position_embedding_type="rope")
    save(tmp_path / "rope", 1, build_model(rope, seed=1))
    longer = small_config(position_embedding_type="rope", seq_length=16, rotary_base=500000.0, use_rope_scaling=True,
                          rope_scaling_factor=4.0)
    with pytest.raises(UserError, match=r"^checkpoint \S+ was saved with other settings of --rope-scaling-factor "
                                        r"--rotary-base --seq-length --use-rope-scaling: .*seq_length \(checkpoint 8, "
                                        r"now 16\).*; a resume continues the saved run as it was, so pass its values, "
                                        r"or add --finetune to start a new run from its weights"):
        load_checkpoint(str(tmp_path / "rope"), build_model(longer, seed=2), model_config=longer)
    model = build_model(longer, seed=2)
    load_checkpoint(str(tmp_path / "rope"), model, model_config=longer, load_rng=False, finetune=True)
    saved = build_model(rope, seed=1).state_dict()
    assert all(torch.equal(value, saved[name]) for name, value in model.state_dict().items())

    # Learned positions: the table has max_position_embeddings rows (here derived from --seq-length).
    save(tmp_path / "learned", 1, build_model(small_config(), seed=1))
    with pytest.raises(UserError, match=r"max_position_embeddings \(checkpoint 8, now 16\) \(learned position "
                                        r"embeddings hold one row per position, so --max-position-embeddings must "
                                        r"stay the checkpoint's"):
        load_checkpoint(str(tmp_path / "learned"), build_model(small_config(seq_length=16), seed=1),
                        model_config=small_config(seq_length=16), load_rng=False, finetune=True)
    table = small_config(max_position_embeddings=16)  # a table long enough: a finetune may use more of it
    save(tmp_path / "table", 1, build_model(table, seed=1))
    longer = small_config(seq_length=16, max_position_embeddings=16)
    load_checkpoint(str(tmp_path / "table"), build_model(longer, seed=2), model_config=longer, load_rng=False,
                    finetune=True)


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
