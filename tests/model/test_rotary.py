"""Rotary embeddings: relative positions, position ids, offsets, and HF's tables."""

import pytest
import torch

from megalite.kernels.rotary import apply_rotary_pos_emb, rotate_half
from megalite.model.rotary import RotaryEmbedding

HEAD_DIM = 16


def rotated(rope: RotaryEmbedding, x: torch.Tensor, position: int) -> torch.Tensor:
    """x [d] rotated to `position`."""
    cos, sin = rope(1, torch.tensor([[position]]))
    return apply_rotary_pos_emb(x.view(1, 1, 1, -1), cos, sin).flatten()


def test_rotate_half_pairs_channel_i_with_i_plus_half():
    x = torch.arange(6.0)
    assert rotate_half(x).tolist() == [-3.0, -4.0, -5.0, 0.0, 1.0, 2.0]


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


def test_position_ids_and_offsets():
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
    # An offset continues the sequence; a longer request after a shorter one still works.
    off_cos, off_sin = rope(4, offset=8)
    long_cos, long_sin = rope(40)
    torch.testing.assert_close(off_cos, long_cos[8:12])
    torch.testing.assert_close(off_sin, rope(12)[1][8:12])


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
