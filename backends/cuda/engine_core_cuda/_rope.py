"""Rotary position embeddings (the "rotate half" layout of HF Llama), with llama3 and linear
frequency scaling. The cos/sin tables are computed once, exactly as transformers computes them;
the kernels index them by position each step."""

from __future__ import annotations

import math

import torch

from engine_core_cuda._hf_config import RopeConfig

__all__ = ["RotaryTables", "inverse_frequencies"]


def inverse_frequencies(rope: RopeConfig, head_size: int) -> torch.Tensor:
    """The ``head_size // 2`` rotation frequencies (float32, on the CPU)."""
    exponents = torch.arange(0, head_size, 2, dtype=torch.int64).to(torch.float32) / head_size
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.scaling == "linear":
        return inv_freq / rope.factor
    if rope.scaling != "llama3":
        return inv_freq
    old_len = rope.original_max_position_embeddings
    low_freq_wavelen = old_len / rope.low_freq_factor
    high_freq_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are slowed down by the factor, short ones kept, the middle interpolated.
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryTables(torch.nn.Module):
    """The ``[max_positions, head_size]`` cos and sin tables, in the model dtype."""

    def __init__(
        self,
        rope: RopeConfig,
        head_size: int,
        max_positions: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        inv_freq = inverse_frequencies(rope, head_size)
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]
        angles = torch.cat((freqs, freqs), dim=-1)
        self.cos: torch.Tensor
        self.sin: torch.Tensor
        self.register_buffer("cos", angles.cos().to(dtype=dtype, device=device), persistent=False)
        self.register_buffer("sin", angles.sin().to(dtype=dtype, device=device), persistent=False)
