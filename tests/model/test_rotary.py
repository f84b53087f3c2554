"""Rotary embeddings: relative positions, position ids, cached lengths, HF's tables, and partial rotation
(--rotary-percent) in the model, under TP and in checkpoints."""

import math
from dataclasses import replace

import pytest
import torch

from megalite.checkpoint import load_checkpoint, save_checkpoint
from megalite.errors import UserError
from megalite.kernels.rotary import apply_rotary_pos_emb
from megalite.model.gpt import build_model
from megalite.model.rotary import RotaryEmbedding
from megalite.parallel_state import build_parallel_state
from tests.helpers.distributed import run_world
from tests.helpers.model import token_losses
from tests.helpers.pipeline import config, full_grads, micro_batches

HEAD_DIM = 16


def rotated(rope: RotaryEmbedding, x: torch.Tensor, position: int) -> torch.Tensor:
    """x [d] rotated to `position`."""
    cos, sin = rope(1, torch.tensor([[position]]))
    return apply_rotary_pos_emb(x.view(1, 1, 1, -1), cos, sin).flatten()


def test_rotation_pairs_channel_i_with_i_plus_half():
    x = torch.arange(6.0).view(1, 1, 1, 6)
    quarter_turn = apply_rotary_pos_emb(x, torch.zeros(1, 1, 1, 6), torch.ones(1, 1, 1, 6))  # cos 0, sin 1
    assert quarter_turn.flatten().tolist() == [-3.0, -4.0, -5.0, 0.0, 1.0, 2.0]


def test_scores_depend_only_on_position_difference():
    rope = RotaryEmbedding(HEAD_DIM, base=10000.0)
    generator = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, HEAD_DIM, generator=generator, dtype=torch.float64).float()
    reference = rotated(rope, q, 7) @ rotated(rope, k, 3)
    for shift in (1, 10, 100):
        score = rotated(rope, q, 7 + shift) @ rotated(rope, k, 3 + shift)
        torch.testing.assert_close(score, reference, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(rotated(rope, q, 8) @ rotated(rope, k, 3), reference, atol=1e-3)


def test_rotation_keeps_the_norm_and_position_zero_is_identity():
    rope = RotaryEmbedding(HEAD_DIM)
    x = torch.randn(HEAD_DIM, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(rotated(rope, x, 0), x)
    torch.testing.assert_close(rotated(rope, x, 123).norm(), x.norm())


def test_position_ids_and_cached_lengths():
    rope = RotaryEmbedding(HEAD_DIM)
    s, b = 12, 2
    cos, sin = rope(s)
    assert cos.shape == (s, 1, 1, HEAD_DIM)
    # A document restarting at token 5 of sample 0 sees positions 0..6 again.
    positions = torch.arange(s).repeat(b, 1)
    positions[0, 5:] -= 5
    reset_cos, reset_sin = rope(s, positions)
    assert reset_cos.shape == (s, b, 1, HEAD_DIM)
    torch.testing.assert_close(reset_cos[5:, 0], cos[: s - 5, 0])
    torch.testing.assert_close(reset_sin[:, 1], sin[:, 0])
    # A longer request after a shorter one grows the table; a shorter one after it slices it.
    long_cos, long_sin = rope(40)
    torch.testing.assert_close(long_cos[:s], cos)
    torch.testing.assert_close(rope(4)[1], long_sin[:4])


def test_rotated_queries_of_a_reset_document_equal_a_fresh_document():
    rope = RotaryEmbedding(HEAD_DIM)
    x = torch.randn(6, 1, 2, HEAD_DIM, generator=torch.Generator().manual_seed(2))
    positions = torch.tensor([[0, 1, 2, 0, 1, 2]])
    out = apply_rotary_pos_emb(x, *rope(6, positions))
    fresh = apply_rotary_pos_emb(x[3:], *rope(3))
    torch.testing.assert_close(out[3:], fresh)


@pytest.mark.parametrize("scaling", [None, 32.0], ids=["plain", "llama3-scaling"])
def test_tables_match_hugging_face_llama(scaling):
    transformers = pytest.importorskip("transformers")
    rope_scaling = None
    if scaling:
        rope_scaling = {"rope_type": "llama3", "factor": scaling, "low_freq_factor": 1.0,
                        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    hf_config = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, head_dim=HEAD_DIM,
                                         rope_theta=500000.0, rope_scaling=rope_scaling,
                                         max_position_embeddings=131072)
    hf_rope = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(hf_config)
    positions = torch.tensor([[0, 1, 17, 4095, 8191, 30000, 100000]])
    hf_cos, hf_sin = hf_rope(torch.zeros(1, dtype=torch.float32), positions)  # [b, s, d]
    cos, sin = RotaryEmbedding(HEAD_DIM, 500000.0, scaling)(positions.shape[1], positions)
    torch.testing.assert_close(cos[:, :, 0].transpose(0, 1), hf_cos, atol=1e-5, rtol=0)
    torch.testing.assert_close(sin[:, :, 0].transpose(0, 1), hf_sin, atol=1e-5, rtol=0)
    if scaling:  # the scaling really changes the slow frequencies
        plain_cos, _ = RotaryEmbedding(HEAD_DIM, 500000.0)(positions.shape[1], positions)
        assert (plain_cos - cos).abs().max() > 0.1


# -- --rotary-percent: the first int(head_dim x P) channels rotate, the rest pass through --------------------


def hand_rotated(x: torch.Tensor, positions: torch.Tensor, rotated_channels: int, base: float) -> torch.Tensor:
    """x [s, b, heads, d] (float64) rotated channel pair by channel pair, as written in RoFormer with
    Hugging Face's pairing (i with i + r/2) over the first r channels; the others copied."""
    out = x.clone()
    half = rotated_channels // 2
    for t in range(x.shape[0]):
        for j in range(x.shape[1]):
            for i in range(half):
                angle = float(positions[j, t]) * base ** (-2 * i / rotated_channels)
                first, second = x[t, j, :, i], x[t, j, :, i + half]
                out[t, j, :, i] = first * math.cos(angle) - second * math.sin(angle)
                out[t, j, :, i + half] = second * math.cos(angle) + first * math.sin(angle)
    return out


def test_full_rotary_percent_is_bitwise_the_whole_head_rotation():
    x = torch.randn(5, 2, 3, HEAD_DIM, generator=torch.Generator().manual_seed(4))
    cos, sin = RotaryEmbedding(HEAD_DIM)(5)
    full_cos, full_sin = RotaryEmbedding(HEAD_DIM, rotary_percent=1.0)(5)
    assert torch.equal(cos, full_cos) and torch.equal(sin, full_sin)
    rotated_half = torch.cat([-x[..., HEAD_DIM // 2:], x[..., :HEAD_DIM // 2]], dim=-1)
    assert torch.equal(apply_rotary_pos_emb(x, full_cos, full_sin), x * cos + rotated_half * sin)


@pytest.mark.parametrize("percent, rotated_channels", [(0.5, 8), (0.25, 4), (1.0, 16)])
def test_partial_rotary_matches_a_hand_written_rotation_and_passes_the_rest_through(percent, rotated_channels):
    s, b = 6, 2
    rope = RotaryEmbedding(HEAD_DIM, base=100.0, rotary_percent=percent)
    positions = torch.tensor([[0, 1, 2, 3, 4, 5], [7, 3, 0, 1, 2, 9]])
    cos, sin = rope(s, positions)
    assert cos.shape == (s, b, 1, rotated_channels)
    x = torch.randn(s, b, 3, HEAD_DIM, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    out = apply_rotary_pos_emb(x, cos.double(), sin.double())
    torch.testing.assert_close(out, hand_rotated(x, positions, rotated_channels, 100.0), atol=1e-6, rtol=0)
    assert torch.equal(out[..., rotated_channels:], x[..., rotated_channels:])  # untouched, bit for bit
    x.requires_grad_()
    grad = torch.randn(x.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    apply_rotary_pos_emb(x, cos.double(), sin.double()).backward(grad)
    assert torch.equal(x.grad[..., rotated_channels:], grad[..., rotated_channels:])


def test_partial_rotary_scores_still_depend_only_on_the_position_difference():
    rope = RotaryEmbedding(HEAD_DIM, rotary_percent=0.5)
    q, k = torch.randn(2, HEAD_DIM, generator=torch.Generator().manual_seed(0), dtype=torch.float64).float()
    reference = rotated(rope, q, 7) @ rotated(rope, k, 3)
    torch.testing.assert_close(rotated(rope, q, 57) @ rotated(rope, k, 53), reference, atol=1e-5, rtol=1e-5)


def test_the_model_applies_its_rotary_percent(llama_config):
    """--rotary-percent reaches the layers: 0.5 changes the logits, and a 0.5 model is the same model
    whether its tables come from the config or are built by hand."""
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    whole, half = (build_model(llama_config(rotary_percent=p), seed=3) for p in (1.0, 0.5))
    assert half.rotary.inv_freq.numel() == llama_config().head_dim // 4
    torch.testing.assert_close(half.rotary.inv_freq, RotaryEmbedding(8).inv_freq)
    with torch.no_grad():
        assert not torch.allclose(whole(tokens), half(tokens), atol=1e-3)


def tp_world(rank, world_size, percent):
    """One micro-batch through a TP=`world_size` model with `percent`: (loss, grads by global name)."""
    parallel = build_parallel_state(world_size, 1)
    model = build_model(replace(config(tied=False), rotary_percent=percent), seed=11, parallel=parallel)
    batch = micro_batches()[0]
    losses = token_losses(model, batch["tokens"], batch["labels"], batch["loss_mask"], batch["position_ids"])
    loss = losses.sum() / batch["loss_mask"].sum()
    loss.backward()
    return loss.item(), {name: grad.numpy() for name, grad in full_grads(model, parallel).items()}


def test_partial_rotary_under_tensor_parallelism_matches_one_process(one_thread):
    (one_loss, one_grads), = run_world(1, tp_world, 0.5)
    tp_loss, tp_grads = run_world(2, tp_world, 0.5)[0]
    _, whole_grads = run_world(1, tp_world, 1.0)[0]
    assert abs(tp_loss - one_loss) < 1e-6
    assert any(not torch.allclose(torch.from_numpy(whole_grads[name]), torch.from_numpy(grad), atol=1e-4)
               for name, grad in one_grads.items())  # the percent changes the model: a real comparison
    for name, grad in one_grads.items():
        torch.testing.assert_close(torch.from_numpy(tp_grads[name]), torch.from_numpy(grad), atol=1e-5, rtol=1e-4)


def test_a_checkpoint_keeps_its_rotary_percent(tmp_path, llama_config):
    """A --rotary-percent 0.5 checkpoint loads into the same model bitwise and is refused by a whole-head one."""
    half = llama_config(rotary_percent=0.5)
    model = build_model(half, seed=1)
    save_checkpoint(str(tmp_path), 1, model, consumed_samples=0, model_config=half)
    fresh = build_model(half, seed=2)
    load_checkpoint(str(tmp_path), fresh, model_config=half)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values()))
    with pytest.raises(UserError, match=r"rotary_percent \(checkpoint 0.5, now 1.0\)"):
        load_checkpoint(str(tmp_path), build_model(llama_config(), seed=2), model_config=llama_config())
