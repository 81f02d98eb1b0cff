"""Paged / ring KV-cache layout: addressing helpers and the kernel that stores new K/V rows.

Cache per layer: k_cache, v_cache [num_blocks, BLOCK_SIZE, Hkv, D] (same shape and strides, D
contiguous). Flat slot = block * BLOCK_SIZE + offset. Position p of sequence b lives at
  block = block_table[b, j], offset = p % BLOCK_SIZE,  j = p // BLOCK_SIZE        (plain paging)
                                                      j = (p // BLOCK_SIZE) % R   (ring of R blocks)
A ring (sliding layers) keeps the last R * BLOCK_SIZE positions; ring_blocks = 0 means plain paging.
This module owns that formula (host: `cache_slots`, device: `kv_cache_location` / `load_kv_tile` /
`store_token_heads`) and `kv_store`, which writes row t of k/v to slot_mapping[t] (-1 = padding,
skipped); kernels.rope stores decode K/V through `store_token_heads` as it rotates them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .interpreter import is_interpreted


def cache_geometry(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int, int]:
    """Validate a K/V cache pair and return (BLOCK_SIZE, Hkv, D)."""
    if k_cache.dim() != 4:
        raise ValueError(f"k_cache must be [num_blocks, BLOCK_SIZE, Hkv, D], got shape {tuple(k_cache.shape)}")
    if v_cache.shape != k_cache.shape or v_cache.stride() != k_cache.stride():
        raise ValueError("k_cache and v_cache must have the same shape and strides")
    if v_cache.dtype != k_cache.dtype or v_cache.device != k_cache.device:
        raise ValueError("k_cache and v_cache must have the same dtype and device")
    if k_cache.stride(-1) != 1:
        raise ValueError("the head dimension of the KV cache must be contiguous")
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    if block_size < 1 or block_size & (block_size - 1):
        raise ValueError(f"BLOCK_SIZE must be a power of two, got {block_size}")
    return block_size, num_kv_heads, head_dim


def cache_slots(block_table: torch.Tensor, seq_ids: torch.Tensor, positions: torch.Tensor,
                block_size: int, ring_blocks: int = 0) -> torch.Tensor:
    """Flat int64 slots of (sequence, position) pairs, e.g. the slot_mapping for `kv_store`."""
    logical = positions.long() // block_size
    if ring_blocks > 0:
        logical = logical % ring_blocks
    blocks = block_table[seq_ids.long(), logical].long()
    return blocks * block_size + positions.long() % block_size


@triton.jit
def kv_cache_location(bt_row_ptr, pos, valid, ring_blocks, BLOCK_SIZE: tl.constexpr):
    """(block [int64], offset) of positions `pos` of one sequence; masked lanes read no table entry."""
    logical = pos // BLOCK_SIZE
    # tl.maximum keeps the modulo defined when ring_blocks == 0 (the result is then discarded).
    logical = tl.where(ring_blocks > 0, logical % tl.maximum(ring_blocks, 1), logical)
    block = tl.load(bt_row_ptr + logical, mask=valid, other=0)
    return block.to(tl.int64), pos % BLOCK_SIZE


@triton.jit
def load_kv_tile(kc_ptr, vc_ptr, bt_row_ptr, pos, valid, kv_head, ring_blocks,
                 stride_cb, stride_co, stride_ch,
                 BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr):
    """K and V rows [len(pos), HEAD_DIM] of one KV head from the paged/ring cache (0 where invalid)."""
    block, offset = kv_cache_location(bt_row_ptr, pos, valid, ring_blocks, BLOCK_SIZE)
    row = block * stride_cb + offset * stride_co + kv_head * stride_ch
    offs_d = tl.arange(0, HEAD_DIM)
    ptrs = row[:, None] + offs_d[None, :]
    k = tl.load(kc_ptr + ptrs, mask=valid[:, None], other=0.0)
    v = tl.load(vc_ptr + ptrs, mask=valid[:, None], other=0.0)
    return k, v


@triton.jit
def store_token_heads(c_ptr, slot, heads, dims, values, mask, stride_cb, stride_co, stride_ch,
                      BLOCK_SIZE: tl.constexpr):
    """Write values [heads x dims tile] of one token into cache slot `slot` (-1: nothing written).
    `slot` may also be a tile of several tokens' slots that broadcasts against heads and dims."""
    slot = slot.to(tl.int64)
    dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_co + heads * stride_ch + dims
    tl.store(c_ptr + dst, values.to(c_ptr.dtype.element_ty), mask=mask & (slot >= 0))


@triton.jit
def _kv_store_kernel(
    k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, num_tokens,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_co, stride_ch,
    BLOCK_SIZE: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
):
    # One program stores BLOCK_T token rows; a row is the Hkv * D values of one token, flattened.
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_c = tl.arange(0, BLOCK_C)
    head, dim = offs_c // HEAD_DIM, offs_c % HEAD_DIM
    slot = tl.load(slot_ptr + offs_t, mask=offs_t < num_tokens, other=-1).to(tl.int64)
    keep = (slot >= 0)[:, None] & (offs_c < NUM_KV_HEADS * HEAD_DIM)[None, :]
    block, offset = slot // BLOCK_SIZE, slot % BLOCK_SIZE
    dst = (block * stride_cb + offset * stride_co)[:, None] + (head * stride_ch + dim)[None, :]
    src_t = offs_t.to(tl.int64)[:, None]
    k = tl.load(k_ptr + src_t * stride_kt + (head * stride_kh + dim)[None, :], mask=keep)
    v = tl.load(v_ptr + src_t * stride_vt + (head * stride_vh + dim)[None, :], mask=keep)
    tl.store(kc_ptr + dst, k.to(kc_ptr.dtype.element_ty), mask=keep)
    tl.store(vc_ptr + dst, v.to(vc_ptr.dtype.element_ty), mask=keep)


def _check_store_args(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, slot_mapping: torch.Tensor,
                      num_kv_heads: int, head_dim: int) -> None:
    if k.dim() != 3 or k.shape != v.shape or k.shape[1:] != (num_kv_heads, head_dim):
        raise ValueError(f"k, v must be [T, {num_kv_heads}, {head_dim}], got {tuple(k.shape)} and {tuple(v.shape)}")
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("k and v must be contiguous in the head dimension")
    if slot_mapping.shape != (k.shape[0],) or slot_mapping.dtype != torch.int64:
        raise TypeError(f"slot_mapping must be int64 [{k.shape[0]}], "
                        f"got {slot_mapping.dtype} {tuple(slot_mapping.shape)}")
    for name, t in (("v", v), ("k_cache", k_cache), ("slot_mapping", slot_mapping)):
        if t.device != k.device:
            raise ValueError(f"{name} is on {t.device}, k is on {k.device}")


def kv_store(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write k[t], v[t] ([T, Hkv, D], any row stride) into cache slot slot_mapping[t]; -1 skips the row."""
    block_size, num_kv_heads, head_dim = cache_geometry(k_cache, v_cache)
    _check_store_args(k, v, k_cache, slot_mapping, num_kv_heads, head_dim)
    num_tokens = k.shape[0]
    if num_tokens == 0:
        return
    # Interpreted programs cost ~0.4 ms each, so the CPU path takes bigger row groups.
    block_t = 16 if is_interpreted() else 4
    grid = (triton.cdiv(num_tokens, block_t),)
    _kv_store_kernel[grid](
        k, v, k_cache, v_cache, slot_mapping, num_tokens,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        BLOCK_SIZE=block_size, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_T=block_t, BLOCK_C=triton.next_power_of_2(num_kv_heads * head_dim), num_warps=4,
    )


def kv_store_ref(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
    """Twin of `kv_store` (in place); needs caches contiguous in (block, offset)."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    num_kv_heads, head_dim = k_cache.shape[2:]
    k_cache.view(-1, num_kv_heads, head_dim)[slots] = k[keep].to(k_cache.dtype)
    v_cache.view(-1, num_kv_heads, head_dim)[slots] = v[keep].to(v_cache.dtype)
