"""Mixture of experts over packed MXFP4 weights (gpt-oss-model.md §2.5).

route: logits = x @ Wr^T + br; top-k of the logits, then softmax over those k.
expert e: h = x @ W1_e^T + b1_e (2I values, even = gate, odd = up, interleaved);
          a = min(gate, limit) * sigmoid(alpha * min(gate, limit)) * (clamp(up, -limit, limit) + 1);
          y_e = a @ W2_e^T + b2_e.
out = sum over the k chosen experts of w_e * y_e (the weight multiplies the bias too).
Dimension legend: T tokens, C hidden, E experts, K experts per token, I intermediate.
"""

from __future__ import annotations

import torch

from .mxfp4 import dequantize_mxfp4


def route_ref(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, E] router logits -> (weights [T, K] fp32, expert ids [T, K] int64)."""
    values, idx = torch.topk(logits.float(), top_k, dim=-1)
    return torch.softmax(values, dim=-1), idx


def swiglu_ref(h: torch.Tensor, limit: float, alpha: float) -> torch.Tensor:
    """[..., 2I] interleaved gate/up -> [..., I] (fp32 math, h.dtype out)."""
    gate = h[..., 0::2].float().clamp(max=limit)
    up = h[..., 1::2].float().clamp(-limit, limit)
    return (gate * torch.sigmoid(alpha * gate) * (up + 1)).to(h.dtype)


def moe_ref(
    x: torch.Tensor,
    router_weight: torch.Tensor,
    router_bias: torch.Tensor,
    w1_blocks: torch.Tensor,
    w1_scales: torch.Tensor,
    w1_bias: torch.Tensor,
    w2_blocks: torch.Tensor,
    w2_scales: torch.Tensor,
    w2_bias: torch.Tensor,
    top_k: int,
    limit: float = 7.0,
    alpha: float = 1.702,
) -> torch.Tensor:
    """x [T, C] -> [T, C] in x.dtype. Experts are dequantised one at a time, only when hit,
    so peak memory is one expert (this is also the CPU path for real checkpoints)."""
    dt = x.dtype
    logits = x @ router_weight.to(dt).T + router_bias.to(dt)
    weights, experts = route_ref(logits, top_k)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in experts.unique().tolist():
        tok, slot = torch.where(experts == e)
        w1 = dequantize_mxfp4(w1_blocks[e], w1_scales[e], dt)
        h = x[tok] @ w1.T + w1_bias[e].to(dt)
        del w1
        a = swiglu_ref(h, limit, alpha)
        w2 = dequantize_mxfp4(w2_blocks[e], w2_scales[e], dt)
        y = a @ w2.T + w2_bias[e].to(dt)
        out.index_add_(0, tok, y.float() * weights[tok, slot, None])
    return out.to(dt)
