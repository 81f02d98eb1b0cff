"""Attention with learned sinks, GQA and an optional sliding window (gpt-oss-model.md §2.3).

For query i (position qp_i) and key j (position kp_j), key j is visible when kp_j <= qp_i and,
on sliding layers, kp_j > qp_i - window (exactly `window` keys including the query itself).
p_j = exp(s_j) / (sum_visible exp(s) + exp(sink_h)), s = (q . k) * sm_scale; the sink is not
scaled and has no value. Query head h reads KV head h // (H / Hkv).
"""

from __future__ import annotations

import torch


def attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sinks: torch.Tensor,
    sm_scale: float,
    q_positions: torch.Tensor,
    k_positions: torch.Tensor,
    window: int = 0,
) -> torch.Tensor:
    """q [T, H, D], k/v [S, Hkv, D], sinks [H], positions [T]/[S]; window 0 = full. -> [T, H, D]."""
    t, h, d = q.shape
    hkv = k.shape[1]
    group = h // hkv
    qf = q.float().view(t, hkv, group, d)
    scores = torch.einsum("tkgd,skd->kgts", qf, k.float()) * sm_scale  # [Hkv, G, T, S]
    qp, kp = q_positions[:, None], k_positions[None, :]
    visible = kp <= qp
    if window:
        visible &= kp > qp - window
    scores = scores.masked_fill(~visible, float("-inf"))
    sink = sinks.float().view(hkv, group, 1, 1).expand(hkv, group, t, 1)
    logits = torch.cat((scores, sink), dim=-1)
    probs = torch.softmax(logits, dim=-1)[..., :-1]
    out = torch.einsum("kgts,skd->tkgd", probs, v.float())
    return out.reshape(t, h, d).to(q.dtype)
