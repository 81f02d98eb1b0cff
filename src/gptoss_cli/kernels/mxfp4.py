"""MXFP4 layout of the gpt-oss expert weights, and its exact dequantisation (the reference).

Layout (gpt-oss-model.md §3.1): a weight W [N, K] is stored as
  blocks: uint8 [N, K/32, 16]  — 32 E2M1 values per block, element 2b in the low nibble of byte b,
                                 element 2b+1 in the high nibble;
  scales: uint8 [N, K/32]      — E8M0, value 2**(s - 127).
W[n, 32g + i] = FP4_VALUES[nibble_i(blocks[n, g])] * 2**(scales[n, g] - 127), exact in bf16/fp32.
Leading dimensions (experts) pass through unchanged.
"""

from __future__ import annotations

import torch

VALUES_PER_BLOCK = 32
BYTES_PER_BLOCK = 16
SCALE_BIAS = 127

# E2M1: bit 3 sign, bits 2..1 exponent, bit 0 mantissa.
FP4_VALUES = (
    +0.0, +0.5, +1.0, +1.5, +2.0, +3.0, +4.0, +6.0,
    -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
)  # fmt: skip


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[..., N, K/32, 16] uint8 + [..., N, K/32] uint8 -> [..., N, K] in `dtype` (exact)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise TypeError(f"MXFP4 blocks/scales must be uint8, got {blocks.dtype}/{scales.dtype}")
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != BYTES_PER_BLOCK:
        raise ValueError(f"MXFP4 shapes do not match: blocks {tuple(blocks.shape)}, scales {tuple(scales.shape)}")
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    lo = lut[(blocks & 0x0F).long()]
    hi = lut[(blocks >> 4).long()]
    values = torch.stack((lo, hi), dim=-1).flatten(-2)  # [..., N, K/32, 32]
    exponents = scales.to(torch.int32) - SCALE_BIAS
    values = torch.ldexp(values, exponents.unsqueeze(-1))
    return values.flatten(-2).to(dtype)


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Round W [..., N, K] to MXFP4 (nearest E2M1 after a per-block power-of-two scale).

    Only for building test inputs; the engine never re-quantises checkpoint weights.
    """
    *lead, n, k = w.shape
    if k % VALUES_PER_BLOCK:
        raise ValueError(f"K={k} is not a multiple of {VALUES_PER_BLOCK}")
    x = w.float().reshape(*lead, n, k // VALUES_PER_BLOCK, VALUES_PER_BLOCK)
    amax = x.abs().amax(dim=-1, keepdim=True).clamp_min(2.0**-120)
    # Largest E2M1 magnitude is 6 = 1.5 * 2**2: choose the exponent so amax / scale <= 6.
    exp = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    scaled = x / torch.exp2(exp)
    grid = torch.tensor(FP4_VALUES[:8], dtype=torch.float32, device=w.device)
    idx = (scaled.abs().unsqueeze(-1) - grid).abs().argmin(dim=-1)
    nib = (idx | ((scaled < 0).long() << 3)).to(torch.uint8)
    blocks = nib[..., 0::2] | (nib[..., 1::2] << 4)
    scales = (exp.squeeze(-1) + SCALE_BIAS).to(torch.uint8)
    return blocks.contiguous(), scales.contiguous()
