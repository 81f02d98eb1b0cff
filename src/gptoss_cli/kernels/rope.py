"""YaRN rotary embedding: one cos/sin table shared by all layers, half-split rotation.

gpt-oss-model.md §2.4: inv_freq blends original and factor-scaled frequencies over a linear
ramp between unrounded `low`/`high`; the concentration 0.1*ln(factor)+1 multiplies cos and sin.
Tables are fp32 [max_positions, head_dim/2]; position p uses row p.

`apply_rope` rotates q and k in place in one launch, one program per token (all heads of q and k
share that token's cos/sin row). q and k may be strided views, e.g. the q and k columns of the
fused qkv projection output (`apply_rope_qkv`), so no copy is needed. For decode the same launch
can also write the rotated K row and the V row into the paged cache (kv_store's layout), which
saves a launch per layer.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .kv_store import _check_store_args, cache_geometry, store_token_heads
from .pdl import pdl_enabled, pdl_launch, wait_for_previous


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


@triton.jit
def _rotate_heads(base, stride_h, stride_d, num_heads, c, s, live,
                  HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """Rotate heads [0, num_heads) of one token in place: (x1, x2) -> (x1 c - x2 s, x2 c + x1 s).
    Returns the two rotated halves as stored (input dtype), [BLOCK_H, BLOCK_HALF] each."""
    h = tl.arange(0, BLOCK_H)[:, None]
    j = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (h < num_heads) & (j < HALF)
    p1 = base + h * stride_h + j * stride_d
    p2 = p1 + HALF * stride_d
    x1 = tl.load(p1, mask=mask, other=0.0)
    x2 = tl.load(p2, mask=mask, other=0.0)
    a = x1.to(tl.float32)
    b = x2.to(tl.float32)
    # Out-of-table positions (`live` false) keep their values.
    r1 = tl.where(live, (a * c - b * s).to(x1.dtype), x1)
    r2 = tl.where(live, (b * c + a * s).to(x2.dtype), x2)
    tl.store(p1, r1, mask=mask & live)
    tl.store(p2, r2, mask=mask & live)
    return r1, r2


@triton.jit
def _rope_kernel(
    q_ptr, k_ptr, pos_ptr, cos_ptr, sin_ptr, num_positions,
    stride_qt, stride_qh, stride_qd, stride_kt, stride_kh, stride_kd, stride_cs,
    H, HKV,
    v_ptr, stride_vt, stride_vh, kc_ptr, vc_ptr, slot_ptr, stride_cb, stride_co, stride_ch,
    HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HKV: tl.constexpr,
    STORE_KV: tl.constexpr, BLOCK_SIZE: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous(PDL)
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    # Out-of-table positions (e.g. -1 for padded slots of a captured batch) are left untouched.
    live = (pos >= 0) & (pos < num_positions)
    pos = tl.where(live, pos, 0)
    j = tl.arange(0, BLOCK_HALF)
    c = tl.load(cos_ptr + pos * stride_cs + j, mask=j < HALF, other=0.0)[None, :]
    s = tl.load(sin_ptr + pos * stride_cs + j, mask=j < HALF, other=0.0)[None, :]
    _rotate_heads(q_ptr + t * stride_qt, stride_qh, stride_qd, H, c, s, live, HALF, BLOCK_H, BLOCK_HALF)
    k1, k2 = _rotate_heads(k_ptr + t * stride_kt, stride_kh, stride_kd, HKV, c, s, live, HALF, BLOCK_HKV,
                           BLOCK_HALF)
    if STORE_KV:
        # Decode: the rotated K row and the V row go to the cache here instead of in kv_store.
        slot = tl.load(slot_ptr + t)
        h = tl.arange(0, BLOCK_HKV)[:, None]
        jj = tl.arange(0, BLOCK_HALF)[None, :]
        mask = (h < HKV) & (jj < HALF)
        store_token_heads(kc_ptr, slot, h, jj, k1, mask, stride_cb, stride_co, stride_ch, BLOCK_SIZE)
        store_token_heads(kc_ptr, slot, h, jj + HALF, k2, mask, stride_cb, stride_co, stride_ch, BLOCK_SIZE)
        vrow = v_ptr + t * stride_vt + h * stride_vh
        v1 = tl.load(vrow + jj, mask=mask, other=0.0)
        v2 = tl.load(vrow + jj + HALF, mask=mask, other=0.0)
        store_token_heads(vc_ptr, slot, h, jj, v1, mask, stride_cb, stride_co, stride_ch, BLOCK_SIZE)
        store_token_heads(vc_ptr, slot, h, jj + HALF, v2, mask, stride_cb, stride_co, stride_ch, BLOCK_SIZE)


def _check_rope_args(q, k, positions, cos, sin) -> None:
    if q.dim() != 3 or k.dim() != 3:
        raise ValueError(f"q and k must be [T, heads, D], got {tuple(q.shape)} and {tuple(k.shape)}")
    t, _, d = q.shape
    if k.shape[0] != t or k.shape[2] != d or d % 2:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} need the same T and an even D")
    if positions.shape != (t,) or positions.dtype.is_floating_point:
        raise ValueError(f"positions must be an integer tensor of shape ({t},), got {tuple(positions.shape)}")
    if cos.dtype != torch.float32 or sin.dtype != torch.float32:
        raise TypeError(f"cos/sin tables must be fp32, got {cos.dtype}/{sin.dtype}")
    if cos.dim() != 2 or cos.shape != sin.shape or cos.shape[1] != d // 2:
        raise ValueError(f"cos/sin must both be [P, {d // 2}], got {tuple(cos.shape)} and {tuple(sin.shape)}")
    if len({q.device, k.device, positions.device, cos.device, sin.device}) != 1:
        raise ValueError("q, k, positions, cos and sin must be on one device")


def apply_rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor, store: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> None:
    """`apply_rope_ref` on q [T, H, D] and k [T, Hkv, D], in place, in one launch.

    q and k may be any strided views (math in fp32, stored in their dtype). Positions outside
    [0, P) leave their token untouched. No host sync, so it can be captured in a CUDA graph.
    `store` = (v, k_cache, v_cache, slot_mapping): also `kv_store(rotated k, v, ...)` in the same
    launch (v [T, Hkv, D] with contiguous D; slot -1 skips a token).
    """
    _check_rope_args(q, k, positions, cos, sin)
    tokens, heads, d = q.shape
    if store is not None:
        v, k_cache, v_cache, slots = store
        block_size, _, _ = cache_geometry(k_cache, v_cache)
        _check_store_args(k, v, k_cache, slots, k.shape[1], d)
    else:
        v = k_cache = v_cache = slots = k  # placeholders; STORE_KV=False never reads them
        block_size = 1
    if tokens == 0:
        return
    cos, sin = cos.contiguous(), sin.contiguous()  # no-ops for the shared tables
    half = d // 2
    _rope_kernel[(tokens,)](
        q, k, positions, cos, sin, cos.shape[0],
        *q.stride(), *k.stride(), cos.stride(0),
        heads, k.shape[1],
        v, v.stride(0), v.stride(1), k_cache, v_cache, slots,
        *(k_cache.stride()[:3] if store is not None else (0, 0, 0)),
        HALF=half, BLOCK_HALF=triton.next_power_of_2(half), BLOCK_H=triton.next_power_of_2(heads),
        BLOCK_HKV=triton.next_power_of_2(k.shape[1]), STORE_KV=store is not None, BLOCK_SIZE=block_size,
        num_warps=4, **pdl_launch(pdl_enabled(q)))


def qkv_views(qkv: torch.Tensor, num_heads: int, num_kv_heads: int,
              head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split fused qkv [T, (H + 2 Hkv) D] (q | k | v columns) into views [T, H, D], [T, Hkv, D] x2."""
    width = (num_heads + 2 * num_kv_heads) * head_dim
    if qkv.dim() != 2 or qkv.shape[1] != width:
        raise ValueError(f"qkv must be [T, {width}], got {tuple(qkv.shape)}")
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=1)
    return (q.unflatten(1, (num_heads, head_dim)), k.unflatten(1, (num_kv_heads, head_dim)),
            v.unflatten(1, (num_kv_heads, head_dim)))


def apply_rope_qkv(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   num_heads: int, num_kv_heads: int, head_dim: int,
                   kv_cache: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> None:
    """Rotate the q and k columns of fused qkv [T, (H + 2 Hkv) D] in place (v is not touched).
    `kv_cache` = (k_cache, v_cache, slot_mapping): also store the rotated k and v there (decode)."""
    q, k, v = qkv_views(qkv, num_heads, num_kv_heads, head_dim)
    apply_rope(q, k, positions, cos, sin, None if kv_cache is None else (v, *kv_cache))
