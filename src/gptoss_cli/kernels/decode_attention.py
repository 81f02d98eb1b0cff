"""Decode attention: one new query per sequence against its paged/ring KV cache (flash-decoding).

Semantics are `attention_ref` (attention.py) with q at position seq_lens[b] - 1 and keys at
positions [0, seq_lens[b]) (the last one already appended), or only the last `window` of them.
One program owns one (sequence, KV head, split): the G = H / Hkv query heads of that KV head form
the rows of its tl.dot tile, padded to 16 rows (the smallest tensor-core M), so each K/V byte is
read once. With several splits the key range is cut into `num_splits` equal chunks (at least
`DecodeTiles.min_chunk` keys each, so short rows leave trailing splits empty); each writes an
unnormalised partial (acc, running max m, sum l; a split without keys writes m = sink, l = 0,
acc = 0) and a small reduce kernel folds all of them with the sink:
    out = sum_s 2^(m_s - M) acc_s / (sum_s 2^(m_s - M) l_s + 2^(sink - M))   (base-2 logits)
num_splits is a host-side static choice (CUDA graphs), never derived from device data.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .attention import LOG2E, LOG2E_C, check_int32, check_sinks_scale, softmax_step
from .interpreter import dot_dtype, is_interpreted
from .kv_store import cache_geometry, load_kv_tile
from .pdl import pdl_enabled, pdl_launch, wait_for_previous


# From this many splits (choose_num_splits: about 8 rows or fewer on 132 SMs) a split takes as few
# as 128 keys (decode_tiles).
SPLIT_SPREAD = 8


@dataclass(frozen=True)
class DecodeTiles:
    """Launch shape of the split kernel: keys per tile, warps, pipeline depth, and the fewest keys
    a split streams (a multiple of block_n; longer rows spread over all splits)."""

    block_n: int
    num_warps: int
    num_stages: int
    min_chunk: int = 0  # 0: block_n


def decode_tiles(num_splits: int = 1) -> DecodeTiles:
    """Host heuristic; the interpreter gets a small tile, the GPU a pipelined key tile.

    GPU with splits (H200 sweeps, batch 1, docs/performance.md): 128-key tiles and >= 1,024 keys
    per split took 32k context from 42.2 to 34.2 us per layer and 131k from 93 to 87 us (session
    3); >= 512 keys then took 32k from 27.5 to 23.8 us, 131k unchanged (session 8: at 1,024 only
    32 of 66 splits held keys at 32k, ~2 programs per SM). 2 warps were 0.6-1.0 us slower at 1k-32k
    and 1.3 us faster at 131k (session 19). The static split count is sized for the
    longest context, so a shorter row leaves splits idle instead of cutting its keys into
    slivers. One split (large batches) keeps the measured 64-key tile.
    Many splits (SPLIT_SPREAD): >= 128 keys per split, so a short row's keys spread over
    several programs instead of one program's serial loop. H200 batch 1, the engine's 66 splits
    (bench_attention --short-sweep, session 26): 256 / 1k / 4k keys 6.7 / 9.2 / 9.9 -> 5.3 / 5.6 /
    6.8 us; 32k keys are >= 512 per split either way. At batch 64 (2 splits) 128 was no faster."""
    if is_interpreted():
        return DecodeTiles(block_n=32, num_warps=4, num_stages=1)
    if num_splits > 1:
        return DecodeTiles(block_n=128, num_warps=4, num_stages=3, min_chunk=128 if num_splits >= SPLIT_SPREAD else 512)
    return DecodeTiles(block_n=64, num_warps=4, num_stages=3)


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_keys: int, num_sms: int,
                      min_keys_per_split: int = 512) -> int:
    """Splits so that about 4 programs per SM exist, but each split still streams >= min_keys."""
    want = triton.cdiv(4 * num_sms, max(num_seqs * num_kv_heads, 1))
    return max(1, min(want, triton.cdiv(max_keys, min_keys_per_split), 128))


@triton.jit
def _key_chunks(seq_len, window, NUM_SPLITS: tl.constexpr, MIN_CHUNK: tl.constexpr, BLOCK_N: tl.constexpr):
    """(first key, keys per split) of one row. Chunks follow the row's real length, so short rows
    leave trailing splits empty; an empty split still writes a neutral partial (m = sink, l = 0,
    acc = 0), which the reduce reads like the others."""
    start = tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)
    chunk = tl.cdiv(tl.maximum(tl.cdiv(seq_len - start, NUM_SPLITS), MIN_CHUNK), BLOCK_N) * BLOCK_N
    return start, chunk


@triton.jit
def _decode_split_kernel(
    q_ptr, kc_ptr, vc_ptr, bt_ptr, seq_lens_ptr, sinks_ptr, out_ptr, part_o_ptr, part_ml_ptr,
    qk_scale, window, ring_blocks, num_heads,
    stride_qb, stride_qh, stride_cb, stride_co, stride_ch, stride_btb, stride_ob, stride_oh,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, MIN_CHUNK: tl.constexpr, DOT_DTYPE: tl.constexpr,
    PDL: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    offs_g = tl.arange(0, BLOCK_G)
    g_ok = offs_g < GROUP
    head = kv_head * GROUP + offs_g
    sink = tl.load(sinks_ptr + head, mask=g_ok, other=0.0).to(tl.float32) * LOG2E_C  # a weight: before the wait
    wait_for_previous(PDL)
    seq_len = tl.load(seq_lens_ptr + seq)
    start, chunk = _key_chunks(seq_len, window, NUM_SPLITS, MIN_CHUNK, BLOCK_N)
    lo = start + split * chunk
    hi = tl.minimum(lo + chunk, seq_len)

    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + seq * stride_qb + head[:, None] * stride_qh + offs_d[None, :],
                mask=g_ok[:, None], other=0.0).to(DOT_DTYPE)
    m = sink
    l = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], dtype=tl.float32)
    bt_row = bt_ptr + seq * stride_btb
    for n0 in range(lo, hi, BLOCK_N):
        pos = n0 + offs_n
        valid = pos < hi
        k, v = load_kv_tile(kc_ptr, vc_ptr, bt_row, pos, valid, kv_head, ring_blocks,
                            stride_cb, stride_co, stride_ch, BLOCK_SIZE, HEAD_DIM)
        m, l, acc = softmax_step(q, k, v, m, l, acc, valid[None, :], qk_scale, True, DOT_DTYPE)

    if NUM_SPLITS == 1:
        out = acc / (l + tl.exp2(sink - m))[:, None]
        tl.store(out_ptr + seq * stride_ob + head[:, None] * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=g_ok[:, None])
    else:
        # partials: o [B, H, S, D], (m, l) [B, H, S, 2], all fp32
        row = (seq * num_heads + head) * NUM_SPLITS + split
        tl.store(part_o_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=g_ok[:, None])
        tl.store(part_ml_ptr + row * 2, m, mask=g_ok)
        tl.store(part_ml_ptr + row * 2 + 1, l, mask=g_ok)


@triton.jit
def _decode_reduce_kernel(
    part_o_ptr, part_ml_ptr, sinks_ptr, out_ptr, num_heads, stride_ob, stride_oh,
    HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, PDL: tl.constexpr,
):
    """One program per (sequence, query head): all partials in one masked load (a loop over the
    splits made this kernel cost more than the split kernel). Splits without keys hold neutral
    partials (m = sink, l = 0, acc = 0), which add exact zeros, so every split is read: the loads
    do not wait for the row's key count first."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    sink = tl.load(sinks_ptr + head).to(tl.float32) * LOG2E_C  # a weight: before the wait
    wait_for_previous(PDL)
    offs_s = tl.arange(0, BLOCK_S)
    live = offs_s < NUM_SPLITS
    rows = (seq * num_heads + head) * NUM_SPLITS + offs_s
    m = tl.load(part_ml_ptr + rows * 2, mask=live, other=float("-inf"))
    l = tl.load(part_ml_ptr + rows * 2 + 1, mask=live, other=0.0)
    # Every partial max is >= the sink (splits start from it); an idle row has M = sink.
    big_m = tl.maximum(tl.max(m, axis=0), sink)
    w = tl.exp2(m - big_m)  # multiplies l = 0 and acc = 0 for splits without keys
    den = tl.sum(w * l, axis=0) + tl.exp2(sink - big_m)
    offs_d = tl.arange(0, HEAD_DIM)
    o = tl.load(part_o_ptr + rows[:, None] * HEAD_DIM + offs_d[None, :], mask=live[:, None], other=0.0)
    num = tl.sum(w[:, None] * o, axis=0)
    tl.store(out_ptr + seq * stride_ob + head * stride_oh + offs_d, (num / den).to(out_ptr.dtype.element_ty))


def _check_decode_args(q, block_table, seq_lens, out, num_kv_heads, head_dim) -> None:
    if q.dim() != 3 or q.shape[2] != head_dim or q.shape[1] % num_kv_heads:
        raise ValueError(f"q must be [B, H, {head_dim}] with H a multiple of {num_kv_heads}, got {tuple(q.shape)}")
    if head_dim < 16 or head_dim & (head_dim - 1):
        raise ValueError(f"head dim must be a power of two >= 16, got {head_dim}")
    if q.stride(-1) != 1:
        raise ValueError("q must be contiguous in the head dimension")
    check_int32(block_table=block_table, seq_lens=seq_lens)
    num_seqs = q.shape[0]
    if block_table.dim() != 2 or block_table.shape[0] != num_seqs or seq_lens.shape != (num_seqs,):
        raise ValueError(f"need block_table [{num_seqs}, MAXB] and seq_lens [{num_seqs}], got "
                         f"{tuple(block_table.shape)} and {tuple(seq_lens.shape)}")
    if out is not None and (out.shape != q.shape or out.stride(-1) != 1):
        raise ValueError(f"out must be {tuple(q.shape)} and contiguous in the head dimension")
    for name, t in (("block_table", block_table), ("seq_lens", seq_lens), ("out", out)):
        if t is not None and t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q is on {q.device}")


def _static_num_splits(q: torch.Tensor, num_kv_heads: int, block_size: int, max_blocks: int, window: int) -> int:
    """Pick splits from shapes only: the longest context the block table can describe (or the window)."""
    max_keys = window if window > 0 else max_blocks * block_size
    num_sms = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 4
    return choose_num_splits(q.shape[0], num_kv_heads, max_keys, num_sms)


def decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
    seq_lens: torch.Tensor, sinks: torch.Tensor, sm_scale: float, window: int, ring_blocks: int,
    num_splits: int | None = None, out: torch.Tensor | None = None, tiles: DecodeTiles | None = None,
) -> torch.Tensor:
    """q [B, H, D] at position seq_lens[b] - 1 against cached keys -> [B, H, D] (written into `out`).

    window = 0: all seq_lens[b] keys; window > 0: positions > seq_lens[b] - 1 - window.
    ring_blocks = R > 0: block_table[b, j % R] holds logical block j. Rows with seq_lens[b] == 0
    read nothing and produce zeros. No host synchronisation; shapes alone decide the launch.
    """
    block_size, num_kv_heads, head_dim = cache_geometry(k_cache, v_cache)
    _check_decode_args(q, block_table, seq_lens, out, num_kv_heads, head_dim)
    num_seqs, num_heads, _ = q.shape
    check_sinks_scale(sinks, num_heads, sm_scale, window, ring_blocks, block_size, block_table.shape[1])
    if num_splits is None:
        num_splits = _static_num_splits(q, num_kv_heads, block_size, block_table.shape[1], window)
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    out = torch.empty_like(q, memory_format=torch.contiguous_format) if out is None else out
    if num_seqs == 0:
        return out
    tiles = tiles or decode_tiles(num_splits)
    group = num_heads // num_kv_heads
    block_g = max(16, triton.next_power_of_2(group))
    min_chunk = max(tiles.min_chunk, tiles.block_n)
    part_o = part_ml = out  # placeholders, unused when num_splits == 1
    if num_splits > 1:
        part_o = torch.empty((num_seqs, num_heads, num_splits, head_dim), dtype=torch.float32, device=q.device)
        part_ml = torch.empty((num_seqs, num_heads, num_splits, 2), dtype=torch.float32, device=q.device)
    _decode_split_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_table, seq_lens, sinks, out, part_o, part_ml,
        sm_scale * LOG2E, window, ring_blocks, num_heads,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_table.stride(0), out.stride(0), out.stride(1),
        GROUP=group, BLOCK_G=block_g, HEAD_DIM=head_dim, BLOCK_SIZE=block_size, BLOCK_N=tiles.block_n,
        NUM_SPLITS=num_splits, MIN_CHUNK=min_chunk, DOT_DTYPE=dot_dtype(q.dtype),
        num_warps=tiles.num_warps, num_stages=tiles.num_stages, **pdl_launch(pdl_enabled(q)),
    )
    if num_splits > 1:
        _decode_reduce_kernel[(num_seqs, num_heads)](
            part_o, part_ml, sinks, out, num_heads, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, NUM_SPLITS=num_splits, BLOCK_S=triton.next_power_of_2(num_splits),
            num_warps=4, **pdl_launch(pdl_enabled(q)),
        )
    return out
