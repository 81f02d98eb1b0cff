"""RMSNorm with the residual add fused (gpt-oss-model.md §2.2).

y = h * rsqrt(mean(h^2) + eps) * weight, h = x (+ residual), statistics in fp32, gain only.
"""

from __future__ import annotations

import torch


def rms_norm_ref(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, C] -> (normed [T, C] in x.dtype, h = x + residual [T, C] in x.dtype)."""
    h = x.float() if residual is None else x.float() + residual.float()
    h_out = h.to(x.dtype)
    h = h_out.float()  # the residual stream is stored in x.dtype; normalise what is stored
    y = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return y.to(x.dtype), h_out
