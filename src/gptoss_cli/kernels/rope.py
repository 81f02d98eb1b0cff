"""YaRN rotary embedding: one cos/sin table shared by all layers, half-split rotation.

gpt-oss-model.md §2.4: inv_freq blends original and factor-scaled frequencies over a linear
ramp between unrounded `low`/`high`; the concentration 0.1*ln(factor)+1 multiplies cos and sin.
Tables are fp32 [max_positions, head_dim/2]; position p uses row p.
"""

from __future__ import annotations

import math

import torch


def yarn_inv_freq(head_dim: int, theta: float, factor: float, beta_fast: float, beta_slow: float,
                  original_max_positions: int, truncate: bool = False) -> torch.Tensor:
    """[head_dim/2] fp32 inverse frequencies (same arithmetic order as HF's yarn init)."""
    def correction_dim(rotations: float) -> float:
        return head_dim * math.log(original_max_positions / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    pos_freqs = theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def rope_cos_sin(config, max_positions: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin), each fp32 [max_positions, head_dim/2], with the YaRN concentration folded in."""
    rs = config.rope_scaling
    inv_freq = yarn_inv_freq(config.head_dim, config.rope_theta, rs.factor, rs.beta_fast, rs.beta_slow,
                             rs.original_max_position_embeddings, rs.truncate).to(device)
    angles = torch.arange(max_positions, dtype=torch.float32, device=device)[:, None] * inv_freq[None, :]
    return angles.cos() * rs.attention_factor, angles.sin() * rs.attention_factor


def apply_rope_ref(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, H, D] by positions [T]; returns a new tensor in x.dtype (math in fp32)."""
    c = cos[positions][:, None, :]
    s = sin[positions][:, None, :]
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)
