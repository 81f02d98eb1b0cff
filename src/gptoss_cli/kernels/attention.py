"""Attention with learned sinks, GQA and an optional sliding window (gpt-oss-model.md §2.3).

For query i (position qp_i) and key j (position kp_j), key j is visible when kp_j <= qp_i and,
on sliding layers, kp_j > qp_i - window (exactly `window` keys including the query itself).
p_j = exp(s_j) / (sum_visible exp(s) + exp(sink_h)), s = (q . k) * sm_scale; the sink is not
scaled and has no value. Query head h reads KV head h // (H / Hkv).

This file owns the math (`attention_ref`, the twin of every attention kernel), the shared
online-softmax step, and prefill attention over packed variable-length sequences that read earlier
context from the paged/ring cache (kv_store.py) and their own new keys from fresh k/v tensors.
Decode attention lives in decode_attention.py. Legend: T tokens, B sequences, H query heads,
Hkv KV heads, G = H / Hkv query heads per KV head, D head dim.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .interpreter import dot_dtype, is_interpreted
from .kv_store import cache_geometry, load_kv_tile

LOG2E = 1.4426950408889634
LOG2E_C = tl.constexpr(LOG2E)  # the same constant, readable inside @triton.jit code


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


# ---------------------------------------------------------------------------------------------
# Shared pieces of the Triton attention kernels (prefill here, decode in decode_attention.py).


@triton.jit
def softmax_step(q, k, v, m, l, acc, mask, qk_scale, APPLY_MASK: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """One online-softmax update in base 2 over a key tile: q [M, D], k/v [N, D], mask [M, N].

    m starts at the (log2-scaled) sink and only grows, so a row whose keys are all masked keeps
    exp2(-inf - m) = 0 and never forms -inf - -inf. The scores stay unscaled: qk_scale > 0 scales
    each row's max once and enters each exponent through one fused multiply-add, instead of a
    multiply per score before the max (offline sm_90: 64 instructions fewer per key tile).
    """
    # fp32 operands get full-precision dots (not tf32): the fp32 path is the exactness reference.
    if DOT_DTYPE == tl.float32:
        s = tl.dot(q, tl.trans(k.to(DOT_DTYPE)), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k.to(DOT_DTYPE)))
    if APPLY_MASK:
        s = tl.where(mask, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1) * qk_scale)
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(tl.fma(s, qk_scale, -m_new[:, None]))
    l = l * alpha + tl.sum(p, 1)
    if DOT_DTYPE == tl.float32:
        acc = tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE), acc * alpha[:, None], input_precision="ieee")
    else:
        acc = tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE), acc * alpha[:, None])
    return m_new, l, acc


def check_sinks_scale(sinks: torch.Tensor, num_heads: int, sm_scale: float, window: int, ring_blocks: int,
                      block_size: int, max_blocks: int) -> None:
    """Argument checks shared by the prefill and decode wrappers."""
    if sinks.shape != (num_heads,):
        raise ValueError(f"sinks must be [{num_heads}], got {tuple(sinks.shape)}")
    if not sm_scale > 0:
        raise ValueError(f"sm_scale must be positive, got {sm_scale}")
    if window < 0 or ring_blocks < 0:
        raise ValueError(f"window and ring_blocks must be >= 0, got {window}, {ring_blocks}")
    if ring_blocks and (window == 0 or ring_blocks * block_size < window or ring_blocks > max_blocks):
        raise ValueError(f"a ring of {ring_blocks} blocks of {block_size} needs 0 < window <= "
                         f"{ring_blocks * block_size} and at most {max_blocks} table columns (window={window})")


def check_int32(**tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if t.dtype != torch.int32:
            raise TypeError(f"{name} must be int32, got {t.dtype}")


# ---------------------------------------------------------------------------------------------
# Prefill: packed variable-length queries, cached context from the paged/ring cache + new keys.


@dataclass(frozen=True)
class PrefillTiles:
    """Launch shape of the prefill kernel; block_m counts (token, query head) rows."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


def prefill_tiles(group_pad: int, max_seqlen_q: int) -> PrefillTiles:
    """Host heuristic (no autotune: the interpreter cannot run it, CUDA graphs want static shapes)."""
    if is_interpreted():
        return PrefillTiles(block_m=max(64, group_pad), block_n=32, num_warps=4, num_stages=1)
    block_m = 128 if max_seqlen_q * group_pad >= 128 else 64
    return PrefillTiles(block_m=max(block_m, group_pad), block_n=64, num_warps=4, num_stages=3)


@triton.jit
def _load_new_kv(k_ptr, v_ptr, rows, valid, kv_head, stride_kt, stride_kh, stride_vt, stride_vh,
                 HEAD_DIM: tl.constexpr):
    """K and V rows [len(rows), HEAD_DIM] of one KV head from the fresh packed k/v tensors."""
    offs_d = tl.arange(0, HEAD_DIM)
    rows = rows.to(tl.int64)
    k = tl.load(k_ptr + (rows * stride_kt + kv_head * stride_kh)[:, None] + offs_d[None, :],
                mask=valid[:, None], other=0.0)
    v = tl.load(v_ptr + (rows * stride_vt + kv_head * stride_vh)[:, None] + offs_d[None, :],
                mask=valid[:, None], other=0.0)
    return k, v


@triton.jit
def _attend_context(q, q_pos, m, l, acc, kc_ptr, vc_ptr, bt_row, ctx, first_pos, kv_head, qk_scale, window,
                    ring_blocks, stride_cb, stride_co, stride_ch, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
                    BLOCK_N: tl.constexpr, IS_SLIDING: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """Fold cached positions [first_pos, ctx) into the running softmax; all precede every query."""
    offs_n = tl.arange(0, BLOCK_N)
    if IS_SLIDING:
        for n0 in range(tl.maximum(first_pos, 0), ctx, BLOCK_N):
            pos = n0 + offs_n
            valid = pos < ctx
            k, v = load_kv_tile(kc_ptr, vc_ptr, bt_row, pos, valid, kv_head, ring_blocks,
                                stride_cb, stride_co, stride_ch, BLOCK_SIZE, HEAD_DIM)
            mask = valid[None, :] & (pos[None, :] > q_pos[:, None] - window)
            m, l, acc = softmax_step(q, k, v, m, l, acc, mask, qk_scale, True, DOT_DTYPE)
    else:
        full_end = (ctx // BLOCK_N) * BLOCK_N  # tiles below this need no mask
        for n0 in range(0, full_end, BLOCK_N):
            pos = n0 + offs_n
            k, v = load_kv_tile(kc_ptr, vc_ptr, bt_row, pos, pos < ctx, kv_head, ring_blocks,
                                stride_cb, stride_co, stride_ch, BLOCK_SIZE, HEAD_DIM)
            m, l, acc = softmax_step(q, k, v, m, l, acc, None, qk_scale, False, DOT_DTYPE)
        for n0 in range(full_end, ctx, BLOCK_N):
            pos = n0 + offs_n
            valid = pos < ctx
            k, v = load_kv_tile(kc_ptr, vc_ptr, bt_row, pos, valid, kv_head, ring_blocks,
                                stride_cb, stride_co, stride_ch, BLOCK_SIZE, HEAD_DIM)
            m, l, acc = softmax_step(q, k, v, m, l, acc, valid[None, :], qk_scale, True, DOT_DTYPE)
    return m, l, acc


@triton.jit
def _attend_chunk(q, i, i0, num_q, m, l, acc, k_ptr, v_ptr, q_begin, kv_head, qk_scale, window,
                  stride_kt, stride_kh, stride_vt, stride_vh, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_T: tl.constexpr, IS_SLIDING: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """Fold the chunk's own keys j <= i (tokens i0 .. i0+BLOCK_T-1) into the running softmax."""
    offs_n = tl.arange(0, BLOCK_N)
    j_hi = tl.minimum(i0 + BLOCK_T, num_q)
    if IS_SLIDING:
        j_mid = tl.maximum(i0 - window + 1, 0)
    else:
        j_mid = (i0 // BLOCK_N) * BLOCK_N  # keys below are visible to every row of the tile
        for n0 in range(0, j_mid, BLOCK_N):
            j = n0 + offs_n
            k, v = _load_new_kv(k_ptr, v_ptr, q_begin + j, j < j_hi, kv_head,
                                stride_kt, stride_kh, stride_vt, stride_vh, HEAD_DIM)
            m, l, acc = softmax_step(q, k, v, m, l, acc, None, qk_scale, False, DOT_DTYPE)
    for n0 in range(j_mid, j_hi, BLOCK_N):
        j = n0 + offs_n
        valid = j < j_hi
        k, v = _load_new_kv(k_ptr, v_ptr, q_begin + j, valid, kv_head,
                            stride_kt, stride_kh, stride_vt, stride_vh, HEAD_DIM)
        mask = valid[None, :] & (j[None, :] <= i[:, None])
        if IS_SLIDING:
            mask = mask & (j[None, :] > i[:, None] - window)
        m, l, acc = softmax_step(q, k, v, m, l, acc, mask, qk_scale, True, DOT_DTYPE)
    return m, l, acc


# Counts that vary with the step are not specialised (= 1, divisible by 16): each new
# combination would be a Triton compile in the middle of serving (runtime/gpu/warmup.py).
@triton.jit(do_not_specialize=["num_q_tiles"])
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, kc_ptr, vc_ptr, bt_ptr, cu_q_ptr, ctx_ptr, sinks_ptr, out_ptr,
    qk_scale, window, ring_blocks, num_q_tiles,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_co, stride_ch, stride_btb, stride_ot, stride_oh,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IS_SLIDING: tl.constexpr, DOT_DTYPE: tl.constexpr,
):
    # Rows of a tile are (token, query head of this KV head) pairs, so K/V tiles are shared by the
    # whole GQA group and a sliding tile spans only BLOCK_T + window keys.
    BLOCK_T: tl.constexpr = BLOCK_M // GROUP_PAD
    tile = num_q_tiles - 1 - tl.program_id(0)  # longest causal tiles first
    seq = tl.program_id(1)
    kv_head = tl.program_id(2)
    q_begin = tl.load(cu_q_ptr + seq)
    num_q = tl.load(cu_q_ptr + seq + 1) - q_begin
    i0 = tile * BLOCK_T
    if i0 >= num_q:
        return
    ctx = tl.load(ctx_ptr + seq)

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    i = i0 + offs_m // GROUP_PAD  # index among this sequence's new tokens
    g = offs_m % GROUP_PAD
    head = kv_head * GROUP + g
    row_ok = (i < num_q) & (g < GROUP)
    tok = (q_begin + i).to(tl.int64)
    q = tl.load(q_ptr + (tok * stride_qt + head * stride_qh)[:, None] + offs_d[None, :],
                mask=row_ok[:, None], other=0.0).to(DOT_DTYPE)
    sink = tl.load(sinks_ptr + head, mask=g < GROUP, other=0.0).to(tl.float32) * LOG2E_C
    l = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    m, l, acc = _attend_context(q, ctx + i, sink, l, acc, kc_ptr, vc_ptr, bt_ptr + seq * stride_btb, ctx,
                                ctx + i0 - window + 1, kv_head, qk_scale, window, ring_blocks,
                                stride_cb, stride_co, stride_ch, BLOCK_SIZE, HEAD_DIM, BLOCK_N, IS_SLIDING, DOT_DTYPE)
    m, l, acc = _attend_chunk(q, i, i0, num_q, m, l, acc, k_ptr, v_ptr, q_begin, kv_head, qk_scale, window,
                              stride_kt, stride_kh, stride_vt, stride_vh, HEAD_DIM, BLOCK_N, BLOCK_T, IS_SLIDING,
                              DOT_DTYPE)
    out = acc / (l + tl.exp2(sink - m))[:, None]
    tl.store(out_ptr + (tok * stride_ot + head * stride_oh)[:, None] + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


def _check_prefill_args(q, k, v, block_table, cu_seqlens_q, ctx_lens, num_kv_heads, head_dim) -> None:
    if q.dim() != 3 or q.shape[2] != head_dim:
        raise ValueError(f"q must be [T, H, {head_dim}], got {tuple(q.shape)}")
    expect = (q.shape[0], num_kv_heads, head_dim)
    if k.shape != expect or v.shape != expect:
        raise ValueError(f"k and v must be {expect}, got {tuple(k.shape)} and {tuple(v.shape)}")
    if q.shape[1] % num_kv_heads:
        raise ValueError(f"H={q.shape[1]} is not a multiple of Hkv={num_kv_heads}")
    if head_dim < 16 or head_dim & (head_dim - 1):
        raise ValueError(f"head dim must be a power of two >= 16, got {head_dim}")
    if min(q.stride(-1), k.stride(-1), v.stride(-1)) != 1 or max(q.stride(-1), k.stride(-1), v.stride(-1)) != 1:
        raise ValueError("q, k and v must be contiguous in the head dimension")
    check_int32(block_table=block_table, cu_seqlens_q=cu_seqlens_q, ctx_lens=ctx_lens)
    num_seqs = ctx_lens.shape[0]
    if block_table.dim() != 2 or block_table.shape[0] != num_seqs or cu_seqlens_q.shape != (num_seqs + 1,):
        raise ValueError(f"need block_table [B, MAXB], cu_seqlens_q [B+1], ctx_lens [B]; got "
                         f"{tuple(block_table.shape)}, {tuple(cu_seqlens_q.shape)}, {tuple(ctx_lens.shape)}")
    for name, t in (("k", k), ("v", v), ("block_table", block_table), ("cu_seqlens_q", cu_seqlens_q),
                    ("ctx_lens", ctx_lens)):
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q is on {q.device}")


def prefill_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    block_table: torch.Tensor, cu_seqlens_q: torch.Tensor, ctx_lens: torch.Tensor, sinks: torch.Tensor,
    sm_scale: float, window: int, ring_blocks: int, max_seqlen_q: int, max_ctx_len: int,
    tiles: PrefillTiles | None = None,
) -> torch.Tensor:
    """Causal attention of packed chunks q [T, H, D] -> [T, H, D] (q.dtype).

    Query i of sequence b (rows cu_seqlens_q[b] .. cu_seqlens_q[b+1]-1) sits at position
    ctx_lens[b] + (i - cu_seqlens_q[b]) and sees the cached positions < ctx_lens[b] (from the cache
    via block_table, a ring when ring_blocks > 0) and its sequence's new keys k/v up to itself,
    within `window` (0 = full). The cache is not written (call kv_store afterwards).
    max_seqlen_q bounds the chunk lengths (sizes the grid); max_ctx_len is a host-side hint.
    Rows outside every sequence are zero.
    """
    block_size, num_kv_heads, head_dim = cache_geometry(k_cache, v_cache)
    _check_prefill_args(q, k, v, block_table, cu_seqlens_q, ctx_lens, num_kv_heads, head_dim)
    num_heads = q.shape[1]
    check_sinks_scale(sinks, num_heads, sm_scale, window, ring_blocks, block_size, block_table.shape[1])
    if max_seqlen_q < 0 or max_ctx_len < 0:
        raise ValueError(f"max_seqlen_q and max_ctx_len must be >= 0, got {max_seqlen_q}, {max_ctx_len}")
    out = torch.zeros_like(q, memory_format=torch.contiguous_format)
    num_seqs = ctx_lens.shape[0]
    if q.shape[0] == 0 or max_seqlen_q == 0 or num_seqs == 0:
        return out
    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    tiles = tiles or prefill_tiles(group_pad, max_seqlen_q)
    if tiles.block_m % group_pad or tiles.block_m < 16 or tiles.block_n < 16:
        raise ValueError(f"{tiles}: block_m must be a multiple of {group_pad} and both blocks >= 16")
    num_q_tiles = triton.cdiv(max_seqlen_q, tiles.block_m // group_pad)
    _prefill_kernel[(num_q_tiles, num_seqs, num_kv_heads)](
        q, k, v, k_cache, v_cache, block_table, cu_seqlens_q, ctx_lens, sinks, out,
        sm_scale * LOG2E, window, ring_blocks, num_q_tiles,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_table.stride(0),
        out.stride(0), out.stride(1),
        GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, IS_SLIDING=window > 0, DOT_DTYPE=dot_dtype(q.dtype),
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )
    return out
