"""MXFP4 weights (gpt-oss's published experts) dequantised to the model dtype at load.

An MXFP4 tensor is stored as ``…_blocks`` (``uint8`` ``[*rows, groups, 16]``: 32 FP4 e2m1 values per
group, two per byte, the low nibble first) and ``…_scales`` (``uint8`` ``[*rows, groups]``: one
power-of-two scale per group, e8m0 with bias 127). The value of element ``j`` of group ``g`` is
``FP4[code] * 2 ** (scale[g] - 127)``; the dequantised tensor is ``[*rows, groups * 32]`` (for
gpt-oss's experts: ``[experts, out_features, in_features]``, the layout of stacked ``nn.Linear``
weights).
"""

from __future__ import annotations

import torch

__all__ = ["FP4_E2M1_VALUES", "dequantize_mxfp4"]

FP4_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                   -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)  # fmt: skip
"""The 16 values of an e2m1 code (sign bit, two exponent bits, one mantissa bit)."""
_SCALE_BIAS = 127


def dequantize_mxfp4(
    blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """``[*rows, groups * 32]`` in ``dtype`` from MXFP4 ``blocks`` ``[*rows, groups, 16]`` and
    ``scales`` ``[*rows, groups]``. Raises ``ValueError`` for mismatched shapes."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(
            f"MXFP4 blocks and scales must be uint8, got {blocks.dtype}, {scales.dtype}"
        )
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ValueError(
            f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)} "
            "(blocks: [*rows, groups, 16], scales: [*rows, groups])"
        )
    lut = torch.tensor(FP4_E2M1_VALUES, dtype=torch.float32, device=blocks.device)
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).long()  # low nibble first
    values = lut[codes].flatten(-2)  # [*rows, groups, 32]
    exponents = scales.to(torch.int32) - _SCALE_BIAS
    out = torch.ldexp(values, exponents[..., None].float())
    return out.flatten(-2).to(dtype)
