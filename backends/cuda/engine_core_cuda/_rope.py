"""Rotary position embeddings (the "rotate half" layout of HF Llama), with llama3, linear and YaRN
(gpt-oss) frequency scaling. The cos/sin tables are computed once, exactly as transformers computes
them; the kernels index them by position each step."""

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
    if rope.scaling == "yarn":
        return _yarn(rope, head_size, inv_freq)
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


def _yarn(rope: RopeConfig, head_size: int, inv_freq: torch.Tensor) -> torch.Tensor:
    """YaRN: dimensions that turn more than ``beta_fast`` times over the original context keep
    their frequency, those turning fewer than ``beta_slow`` times are divided by ``factor``,
    and a linear ramp blends the dimensions between (transformers' arithmetic)."""

    def dimension(rotations: float) -> float:
        turns = rope.original_max_position_embeddings / (rotations * 2 * math.pi)
        return head_size * math.log(turns) / (2 * math.log(rope.theta))

    low, high = dimension(rope.beta_fast), dimension(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_size - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_size // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp
    return (inv_freq / rope.factor) * (1 - keep) + inv_freq * keep


class RotaryTables(torch.nn.Module):
    """The ``[max_positions, head_size]`` cos and sin tables, in the model dtype (YaRN: times
    its ``attention_factor``)."""

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
        cos, sin = angles.cos(), angles.sin()
        if rope.attention_factor != 1.0:
            cos, sin = cos * rope.attention_factor, sin * rope.attention_factor
        self.cos: torch.Tensor
        self.sin: torch.Tensor
        self.register_buffer("cos", cos.to(dtype=dtype, device=device), persistent=False)
        self.register_buffer("sin", sin.to(dtype=dtype, device=device), persistent=False)
