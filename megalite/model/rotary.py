"""Rotary position embeddings: the cos/sin tables (the rotation is megalite/kernels/rotary.py).

Hugging Face's rotate-half convention (channel i pairs with i + d/2), so converted checkpoints need no permutation;
inv_freq[j] = base^(-2j/d), with Llama 3.1's scaling given `scaling_factor`. With `rotary_percent` P < 1 (Megatron's
--rotary-percent) only the first d = int(head_dim x P) channels of a head rotate, with their own frequencies (d in the
formula); the tables are d wide and the rotation passes the other channels through.
"""

import math

import torch
from torch import nn

from megalite.config.model import rotary_dim


def llama3_scaled_inv_freq(inv_freq: torch.Tensor, factor: float, low_freq_factor: float = 1.0,
                           high_freq_factor: float = 4.0, original_context: int = 8192) -> torch.Tensor:
    """Llama 3.1's frequency scaling: long wavelengths / factor, short kept, smooth in between."""
    wavelength = 2 * math.pi / inv_freq
    long_wavelength = original_context / low_freq_factor
    short_wavelength = original_context / high_freq_factor
    smooth = (original_context / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = torch.where(wavelength > long_wavelength, inv_freq / factor, blended)
    return torch.where(wavelength < short_wavelength, inv_freq, scaled)


class RotaryEmbedding(nn.Module):
    """cos/sin tables `[s, b, 1, d]` (fp32, d = rotary_dim(head_dim, rotary_percent)) of `position_ids` `[b, s]` when
    given (--reset-position-ids), else of `arange(s)`, cached per device for the longest length seen."""

    def __init__(self, head_dim: int, base: float = 10000.0, scaling_factor: float | None = None,
                 rotary_percent: float = 1.0):
        super().__init__()
        dim = rotary_dim(head_dim, rotary_percent)
        # An explicit CPU device: the model may be built under a meta-device context.
        exponents = torch.arange(0, dim, 2, dtype=torch.float32, device="cpu") / dim
        inv_freq = 1.0 / (base ** exponents)
        if scaling_factor is not None:
            inv_freq = llama3_scaled_inv_freq(inv_freq, scaling_factor)
        self.inv_freq = inv_freq  # a plain attribute: not a parameter, not in the state dict
        self._cache: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def _tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [s, b] -> cos, sin [s, b, 1, d]."""
        freqs = positions[..., None].float() * self.inv_freq.to(positions.device)
        angles = torch.cat([freqs, freqs], dim=-1)[:, :, None, :]
        return angles.cos(), angles.sin()

    def forward(self, seq_length: int, position_ids: torch.Tensor | None = None,
                device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if position_ids is not None:
            return self._tables(position_ids.t())
        key = str(device)
        if key not in self._cache or self._cache[key][0].shape[0] < seq_length:
            # One table per device for positions [0, seq_length); shorter requests slice it.
            self._cache[key] = self._tables(torch.arange(seq_length, device=device)[:, None])
        cos, sin = self._cache[key]
        return cos[:seq_length], sin[:seq_length]
