"""Token sampling with per-row parameters and counter-based randomness (no host sync, no state).

Semantics of one row (logits l over V tokens):
  temperature == 0 -> argmax(l) (lowest index on ties).
  otherwise z = l / temperature;
    top_k > 0  : keep tokens whose z >= the k-th largest z;
    p = softmax(z over kept);
    top_p < 1  : sort kept by p descending, keep a token while the mass before it is < top_p;
    min_p > 0  : keep tokens with p >= min_p * max(p);
    token = argmax over kept of log p_i + G_i, G_i = -log(-log u_i)   (Gumbel-max == sampling p).
u_i depends only on (seed, offset, i) through a 32-bit integer hash, so the same seed and step
give the same token on CPU and GPU, in any batch composition. `offset` is the step counter.
"""

from __future__ import annotations

import torch

MASK32 = 0xFFFFFFFF
GOLDEN = 0x9E3779B9


def _mul32(a: torch.Tensor, b: int) -> torch.Tensor:
    """(a * b) mod 2**32 for int64 a in [0, 2**32) without int64 overflow."""
    lo = (a * (b & 0xFFFF)) & MASK32
    hi = ((a * (b >> 16)) & 0xFFFF) << 16
    return (lo + hi) & MASK32


def hash32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 integer hash on int64 tensors holding uint32 values."""
    x = x & MASK32
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def row_key(seeds: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """[B] int64 seeds and offsets -> [B] uint32 keys (as int64)."""
    s = seeds.long()
    return hash32((s & MASK32) ^ hash32(((s >> 32) & MASK32) ^ hash32(offsets.long() & MASK32)))


def uniform_ref(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B] keys -> [B, V] fp32 uniforms in (0, 1)."""
    idx = torch.arange(vocab, dtype=torch.int64, device=keys.device)
    x = hash32(_mul32(idx, GOLDEN)[None, :] + keys[:, None])
    return ((x >> 8).float() + 0.5) * (1.0 / (1 << 24))


def sample_ref(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    seeds: torch.Tensor,
    offsets: torch.Tensor,
) -> torch.Tensor:
    """logits [B, V]; per-row temperature/top_p/min_p fp32, top_k int, seeds/offsets int64 -> [B] int64."""
    b, v = logits.shape
    z = logits.float()
    greedy = temperature <= 0
    z = z / torch.where(greedy, 1.0, temperature.float())[:, None]
    neg_inf = torch.finfo(torch.float32).min
    k = top_k.long().clamp(0, v)
    kth = torch.sort(z, dim=-1, descending=True).values.gather(1, (k - 1).clamp(min=0)[:, None])
    z = torch.where((k[:, None] > 0) & (z < kth), neg_inf, z)
    p = torch.softmax(z, dim=-1)
    sorted_p, order = torch.sort(p, dim=-1, descending=True, stable=True)
    mass_before = torch.cumsum(sorted_p, dim=-1) - sorted_p
    drop_sorted = mass_before >= top_p.float()[:, None]
    drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
    drop |= p < (min_p.float() * p.max(dim=-1).values)[:, None]
    drop |= p <= 0
    u = uniform_ref(row_key(seeds, offsets), v)
    score = torch.log(p.clamp_min(1e-38)) - torch.log(-torch.log(u))
    score = score.masked_fill(drop, float("-inf"))
    sampled = score.argmax(dim=-1)
    return torch.where(greedy, logits.float().argmax(dim=-1), sampled)
