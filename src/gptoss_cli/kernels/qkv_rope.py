"""The decode qkv projection with RoPE and the K/V cache write in its epilogue (one launch): one
token (`qkv_rope_store`, on row_linear's tile) and 2 to 64 tokens (`qkv_rope_store_tokens`, on
skinny_linear's K loop).

Unfused, one decode token costs two launches per layer: linear.row_linear (qkv = x @ W^T + b) and
rope.apply_rope_qkv (rotate q and k, store k and v in the paged cache). The second moves almost no
bytes, yet took 2.9 us per layer of kernel time on the H200 (session 9, GPTOSS_PDL=0), 69 us per
20b step: launch and dependency latency. The rotation pairs value i of a head with value i + D/2, so
a row_linear program that owns exactly that pair of weight rows (BLOCK_N = 2, the tile row_linear
already uses) holds both halves of its rotation and can finish the job itself: round the two dot
products to the activation dtype (as row_linear stores them), rotate them in fp32 with the row of
the shared cos/sin table (as the rope kernel does), store them to qkv, and for a K or V head also
to the token's cache slot. The arithmetic is that of the two launches: bit for bit under the
interpreter; on a GPU the dot product's sum may differ in its last fp32 bit, as the compiler's FMA
in the first step of the cross-lane reduction leaves lanes with slightly different sums and each
kernel stores another lane's (H200 and PTX, session 11).

Program p owns head p // (D/2) of the fused q | k | v rows and the pair (i, i + D/2), i = p % (D/2)
(under the interpreter, several consecutive pairs: `_pairs_per_program`).
Positions outside the table leave the token unrotated and slot -1 writes no cache row, as in
rope.apply_rope.

With 2 to 64 tokens the same epilogue runs on skinny_linear's split-K plan (cuBLAS and the rope
launch took 13-14.5 us per layer at 2-32 tokens, this 11.3-12.5; docs/performance.md, session 27):
a row tile holds up to 32 rotation pairs of one head, its first halves then their second halves,
so the tile's last program holds both halves of every rotation once it has summed the partials.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .interpreter import is_interpreted
from .kv_store import _check_store_args, cache_geometry, store_token_heads
from .linear import NUM_WARPS, check_row_args
from .pdl import pdl_enabled, pdl_launch, wait_for_previous
from .rope import _check_rope_args, qkv_views
from .skinny_linear import (MIN_BLOCK, SkinnyScratch, SkinnyTiles, check_skinny_args, default_tiles, plan_launch,
                            reduce_splits, skinny_dot, split_range)


@triton.jit
def _rotate_pairs(y, c, s, live, PAIRS: tl.constexpr):
    """y [2 PAIRS] = (value i, value i + D/2) for PAIRS consecutive i of one head, rotated in fp32
    with c, s [PAIRS] and stored in y's dtype where `live`."""
    y1, y2 = tl.split(tl.reshape(y, (PAIRS, 2)))
    a = y1.to(tl.float32)
    b = y2.to(tl.float32)
    rot = tl.reshape(tl.join((a * c - b * s).to(y.dtype), (b * c + a * s).to(y.dtype)), (2 * PAIRS,))
    return tl.where(live, rot, y)


@triton.jit
def _qkv_rope_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr, k, stride_wn,
    pos_ptr, cos_ptr, sin_ptr, num_positions, stride_cs,
    kc_ptr, vc_ptr, slot_ptr, stride_cb, stride_co, stride_ch,
    H: tl.constexpr, HKV: tl.constexpr, HEAD_DIM: tl.constexpr, PAIRS: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    HALF: tl.constexpr = HEAD_DIM // 2
    PROGRAMS_PER_HEAD: tl.constexpr = HALF // PAIRS
    head = tl.program_id(0) // PROGRAMS_PER_HEAD
    i = (tl.program_id(0) % PROGRAMS_PER_HEAD) * PAIRS + tl.arange(0, PAIRS)
    dims = tl.reshape(i[:, None] + tl.arange(0, 2)[None, :] * HALF, (2 * PAIRS,))  # (i, i + D/2) pairs
    rows = head * HEAD_DIM + dims
    cols = tl.arange(0, BLOCK_K)
    col_ok = cols < k
    # Weights only before the wait (pdl.py): they stream while the previous launch finishes.
    w = tl.load(w_ptr + rows[:, None].to(tl.int64) * stride_wn + cols[None, :], mask=col_ok[None, :], other=0.0)
    bias = tl.load(b_ptr + rows)
    wait_for_previous(PDL)
    x = tl.load(x_ptr + cols, mask=col_ok, other=0.0)
    # The position, its table entries and the slot are loaded before the dot products, so their
    # latency hides behind the reduction instead of adding to the program's tail.
    pos = tl.load(pos_ptr).to(tl.int64)
    slot = tl.load(slot_ptr)
    live = (pos >= 0) & (pos < num_positions) & (head < H + HKV)  # V heads are not rotated
    pos = tl.where(live, pos, 0)
    c = tl.load(cos_ptr + pos * stride_cs + i)
    s = tl.load(sin_ptr + pos * stride_cs + i)
    y = tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1) + bias.to(tl.float32)
    y = y.to(out_ptr.dtype.element_ty)  # row_linear's output, which the rope kernel would read
    y = _rotate_pairs(y, c, s, live, PAIRS)
    tl.store(out_ptr + rows, y)
    is_k = (head >= H) & (head < H + HKV)
    all_dims = dims >= 0
    store_token_heads(kc_ptr, slot, head - H, dims, y, all_dims & is_k, stride_cb, stride_co, stride_ch, BLOCK_SIZE)
    store_token_heads(vc_ptr, slot, head - H - HKV, dims, y, all_dims & (head >= H + HKV), stride_cb, stride_co,
                      stride_ch, BLOCK_SIZE)


def _check_args(x, weight, bias, positions, cos, sin, num_heads, num_kv_heads, head_dim, k_cache, v_cache, slots,
                out, few_tokens: bool = False) -> torch.Tensor:
    """All operand checks; returns the [T, (H + 2 Hkv) D] output buffer (T = 1 unless few_tokens)."""
    rows = (num_heads + 2 * num_kv_heads) * head_dim
    if weight.shape[0] != rows:
        raise ValueError(f"weight must have (H + 2 Hkv) * D = {rows} rows, got {weight.shape[0]}")
    check = check_skinny_args if few_tokens else check_row_args
    out = check(x, weight, bias, out, "the fused qkv projection")
    q, k, v = qkv_views(out, num_heads, num_kv_heads, head_dim)  # what the two unfused launches would see
    _check_rope_args(q, k, positions, cos, sin)
    if cache_geometry(k_cache, v_cache)[1:] != (num_kv_heads, head_dim):
        raise ValueError(f"the KV cache must hold {num_kv_heads} heads of {head_dim}, got {tuple(k_cache.shape)}")
    _check_store_args(k, v, k_cache, slots, num_kv_heads, head_dim)
    return out


def _pairs_per_program(half: int) -> int:
    """Rotation pairs per program: one on a GPU (row_linear's 2-row tile). The interpreter runs
    programs one after another at ~5 ms each, so it takes the largest power of two dividing D/2
    (a whole head for gpt-oss: 1,280 -> 20 programs for random:tiny's qkv)."""
    if not is_interpreted():
        return 1
    return half & -half


def qkv_rope_store(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, positions: torch.Tensor,
                   cos: torch.Tensor, sin: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
                   k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """One decode token: qkv = row_linear(x, weight, bias) -> [1, (H + 2 Hkv) D] in x.dtype, then
    apply_rope_qkv(qkv, positions, cos, sin, H, Hkv, D, (k_cache, v_cache, slots)), in one launch."""
    out = _check_args(x, weight, bias, positions, cos, sin, num_heads, num_kv_heads, head_dim, k_cache, v_cache,
                      slots, out)
    n, k = weight.shape
    block_size = k_cache.shape[1]
    pairs = _pairs_per_program(head_dim // 2)
    cos, sin = cos.contiguous(), sin.contiguous()  # no-ops for the shared tables
    _qkv_rope_kernel[(n // (2 * pairs),)](
        x, weight, bias, out, k, weight.stride(0),
        positions, cos, sin, cos.shape[0], cos.stride(0),
        k_cache, v_cache, slots, *k_cache.stride()[:3],
        H=num_heads, HKV=num_kv_heads, HEAD_DIM=head_dim, PAIRS=pairs, BLOCK_K=triton.next_power_of_2(k),
        BLOCK_SIZE=block_size, num_warps=NUM_WARPS, **pdl_launch(pdl_enabled(x)),
    )  # fmt: skip
    return out


@triton.jit
def _qkv_rope_tokens_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr, part_ptr, count_ptr, num_tokens, k, k_per_split, stride_xt, stride_wn, stride_ot,
    pos_ptr, cos_ptr, sin_ptr, num_positions, stride_cs,
    kc_ptr, vc_ptr, slot_ptr, stride_cb, stride_co, stride_ch,
    H: tl.constexpr, HKV: tl.constexpr, HEAD_DIM: tl.constexpr, PAIRS: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_K: tl.constexpr, SPLITS: tl.constexpr, BLOCK_SIZE: tl.constexpr, DOT: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    HALF: tl.constexpr = HEAD_DIM // 2
    PROGRAMS_PER_HEAD: tl.constexpr = HALF // PAIRS
    head = tl.program_id(0) // PROGRAMS_PER_HEAD
    first = (tl.program_id(0) % PROGRAMS_PER_HEAD) * PAIRS
    i = first + tl.arange(0, PAIRS)
    # The tile's rows: the PAIRS first halves of the rotation pairs, then their second halves.
    r = tl.arange(0, 2 * PAIRS)
    rows = head * HEAD_DIM + first + r % PAIRS + (r // PAIRS) * HALF
    tokens = tl.arange(0, BLOCK_T)  # every token of the step (BLOCK_T >= T)
    token_ok = tokens < num_tokens
    bias = tl.load(b_ptr + rows)
    wait_for_previous(PDL)
    k_lo, k_hi = split_range(k, k_per_split)
    acc = skinny_dot(x_ptr, stride_xt, w_ptr, stride_wn, rows, tl.minimum(tokens, num_tokens - 1), k_lo, k_hi, BLOCK_K,
                     DOT)
    last, acc = reduce_splits(acc, part_ptr, count_ptr, SPLITS, 2 * PAIRS, BLOCK_T)
    if last:
        _rope_store_tile(acc, bias, tokens, token_ok, head, i, out_ptr, stride_ot, pos_ptr, cos_ptr, sin_ptr,
                         num_positions, stride_cs, kc_ptr, vc_ptr, slot_ptr, stride_cb, stride_co, stride_ch, H, HKV,
                         HEAD_DIM, PAIRS, BLOCK_T, BLOCK_SIZE)


@triton.jit
def _rope_store_tile(acc, bias, tokens, token_ok, head, i, out_ptr, stride_ot, pos_ptr, cos_ptr, sin_ptr, num_positions,
                     stride_cs, kc_ptr, vc_ptr, slot_ptr, stride_cb, stride_co, stride_ch, H: tl.constexpr,
                     HKV: tl.constexpr, HEAD_DIM: tl.constexpr, PAIRS: tl.constexpr, BLOCK_T: tl.constexpr,
                     BLOCK_SIZE: tl.constexpr):
    """The epilogue of one row tile: bias, rounding, rotation, stores to qkv and the cache."""
    HALF: tl.constexpr = HEAD_DIM // 2
    pos = tl.load(pos_ptr + tokens, mask=token_ok, other=-1).to(tl.int64)
    slots = tl.load(slot_ptr + tokens, mask=token_ok, other=-1)
    live = (pos >= 0) & (pos < num_positions) & (head < H + HKV)  # V heads are not rotated
    pos = tl.where(live, pos, 0)
    c = tl.load(cos_ptr + pos[None, :] * stride_cs + i[:, None])
    s = tl.load(sin_ptr + pos[None, :] * stride_cs + i[:, None])
    y = (acc + bias.to(tl.float32)[:, None]).to(out_ptr.dtype.element_ty)  # what the unfused rope reads
    y1, y2 = tl.split(tl.permute(tl.reshape(y, (2, PAIRS, BLOCK_T)), (1, 2, 0)))
    a = y1.to(tl.float32)
    b = y2.to(tl.float32)
    y1 = tl.where(live[None, :], (a * c - b * s).to(y.dtype), y1)
    y2 = tl.where(live[None, :], (b * c + a * s).to(y.dtype), y2)
    mask = token_ok[None, :]
    dst = out_ptr + tokens.to(tl.int64)[None, :] * stride_ot + (head * HEAD_DIM + i)[:, None]
    tl.store(dst, y1, mask=mask)
    tl.store(dst + HALF, y2, mask=mask)
    is_k = (head >= H) & (head < H + HKV)
    is_v = head >= H + HKV
    # store_token_heads broadcasts: the tokens' slots along columns, the head's dims along rows.
    slots = slots[None, :]
    store_token_heads(kc_ptr, slots, head - H, i[:, None], y1, mask & is_k, stride_cb, stride_co, stride_ch, BLOCK_SIZE)
    store_token_heads(kc_ptr, slots, head - H, (i + HALF)[:, None], y2, mask & is_k, stride_cb, stride_co, stride_ch,
                      BLOCK_SIZE)
    store_token_heads(vc_ptr, slots, head - H - HKV, i[:, None], y1, mask & is_v, stride_cb, stride_co, stride_ch,
                      BLOCK_SIZE)
    store_token_heads(vc_ptr, slots, head - H - HKV, (i + HALF)[:, None], y2, mask & is_v, stride_cb, stride_co,
                      stride_ch, BLOCK_SIZE)


def supports_qkv_rope_tokens(head_dim: int) -> bool:
    """Whether `qkv_rope_store_tokens` takes heads of head_dim: its tiles hold >= 8 rotation pairs
    (tl.dot's 16 rows), so D/2 must be a multiple of 8."""
    return head_dim % 2 == 0 and (head_dim // 2) % (MIN_BLOCK // 2) == 0


def _tile_pairs(half: int, tiles: SkinnyTiles) -> int:
    """Rotation pairs per program: half the tile's rows, at most a head's D/2 and a divisor of it."""
    pairs = min(max(tiles.block_n // 2, MIN_BLOCK // 2), half)
    while half % pairs:
        pairs //= 2
    return pairs


def qkv_rope_store_tokens(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, positions: torch.Tensor,
                          cos: torch.Tensor, sin: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
                          k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                          out: torch.Tensor | None = None, tiles: SkinnyTiles | None = None,
                          scratch: SkinnyScratch | None = None) -> torch.Tensor:
    """Decode tokens x [T, K], T <= 64: qkv = skinny_linear(x, weight, bias) -> [T, (H + 2 Hkv) D] in
    x.dtype, then apply_rope_qkv(qkv, positions, cos, sin, H, Hkv, D, (k_cache, v_cache, slots)), in
    one launch. D/2 must be a multiple of 8 (`supports_qkv_rope_tokens`)."""
    if not supports_qkv_rope_tokens(head_dim):
        raise ValueError(f"the few-token qkv projection needs D/2 a multiple of 8, got D = {head_dim}")
    out = _check_args(x, weight, bias, positions, cos, sin, num_heads, num_kv_heads, head_dim, k_cache, v_cache,
                      slots, out, few_tokens=True)
    tiles = tiles or default_tiles()
    (t, k), n = x.shape, weight.shape[0]
    pairs = _tile_pairs(head_dim // 2, tiles)
    launch = plan_launch(x, n // (2 * pairs), 2 * pairs, tiles, scratch)
    cos, sin = cos.contiguous(), sin.contiguous()
    _qkv_rope_tokens_kernel[launch.grid](
        x, weight, bias, out, launch.scratch.partials, launch.scratch.arrivals, t, k, launch.k_per_split,
        x.stride(0), weight.stride(0), out.stride(0),
        positions, cos, sin, cos.shape[0], cos.stride(0),
        k_cache, v_cache, slots, *k_cache.stride()[:3],
        H=num_heads, HKV=num_kv_heads, HEAD_DIM=head_dim, PAIRS=pairs, BLOCK_SIZE=k_cache.shape[1],
        **launch.constexprs,
    )  # fmt: skip
    return out
