"""The decode graph's bookkeeping around the forward pass, in two launches instead of ~16.

Before the forward, each row of the batch needs its block-table rows (a copy per row, as the
attention kernels take one table row per sequence), the flat cache slot of its new token in
the full and the sliding pool, and its key count. After sampling, the ids go to the host buffer
and become the next inputs, positions and sampling offsets advance, and (repetition penalty)
the ids join their rows' seen sets. As torch ops these were 16 small kernels per step, each a
full launch in the graph's dependency chain (H200, 20b batch 1: 36 us of kernel time per step,
plus a launch gap each; session 11).

Twins: `decode_slots_ref`, `advance_decode_ref` (the torch ops they replace). Rows with active
= 0 are padding: they keep their position and offset and get 0 keys.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .penalty import mark_bits, mark_seen_ref

TABLE_BLOCK = 1024  # table entries copied per loop step


@dataclass
class DecodeSlots:
    """Per-row step metadata: table rows [B, MAXB] int32 (full, sliding), new-token slots [B]
    int64 (full, sliding), keys per row [B] int32."""

    full_tables: torch.Tensor
    slide_tables: torch.Tensor
    full_slots: torch.Tensor
    slide_slots: torch.Tensor
    seq_lens: torch.Tensor


def decode_slots_ref(positions: torch.Tensor, rows: torch.Tensor, active: torch.Tensor, full_table: torch.Tensor,
                     slide_table: torch.Tensor, block_size: int) -> DecodeSlots:
    ft = full_table.index_select(0, rows)
    st = slide_table.index_select(0, rows)
    blk = (positions // block_size)[:, None]
    full_slots = ft.gather(1, blk).squeeze(1).long() * block_size + positions % block_size
    slide_slots = st.gather(1, blk).squeeze(1).long() * block_size + positions % block_size
    return DecodeSlots(ft, st, full_slots, slide_slots, ((positions + 1) * active).to(torch.int32))


@triton.jit
def _copy_row(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
    for c0 in range(0, n, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        tl.store(dst_ptr + cols, tl.load(src_ptr + cols, mask=cols < n), mask=cols < n)


@triton.jit
def _decode_slots_kernel(
    pos_ptr, rows_ptr, active_ptr, full_ptr, slide_ptr, stride_full, stride_slide, max_blocks,
    ft_ptr, st_ptr, full_slots_ptr, slide_slots_ptr, seq_lens_ptr, BLOCK_SIZE: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    pos = tl.load(pos_ptr + b)
    row = tl.load(rows_ptr + b)
    full_row, slide_row = full_ptr + row * stride_full, slide_ptr + row * stride_slide
    _copy_row(full_row, ft_ptr + b * max_blocks, max_blocks, BLOCK)
    _copy_row(slide_row, st_ptr + b * max_blocks, max_blocks, BLOCK)
    blk, off = pos // BLOCK_SIZE, pos % BLOCK_SIZE
    tl.store(full_slots_ptr + b, tl.load(full_row + blk).to(tl.int64) * BLOCK_SIZE + off)
    tl.store(slide_slots_ptr + b, tl.load(slide_row + blk).to(tl.int64) * BLOCK_SIZE + off)
    tl.store(seq_lens_ptr + b, ((pos + 1) * tl.load(active_ptr + b)).to(tl.int32))


def _check_rows(name: str, t: torch.Tensor, n: int, dtype: torch.dtype) -> None:
    if t.shape != (n,) or t.dtype != dtype or not t.is_contiguous():
        raise ValueError(f"{name} must be a contiguous {dtype} [{n}] tensor, got {t.dtype} {tuple(t.shape)}")


def decode_slots(positions: torch.Tensor, rows: torch.Tensor, active: torch.Tensor, full_table: torch.Tensor,
                 slide_table: torch.Tensor, block_size: int) -> DecodeSlots:
    """`decode_slots_ref` in one launch: positions, rows (table rows), active [B] int64; tables
    [R, MAXB] int32 with unit column stride. Positions must lie inside the tables' blocks."""
    n = positions.shape[0]
    for name, t in (("positions", positions), ("rows", rows), ("active", active)):
        _check_rows(name, t, n, torch.int64)
    if full_table.shape[1] != slide_table.shape[1] or full_table.dtype != torch.int32 \
            or slide_table.dtype != torch.int32 or full_table.stride(1) != 1 or slide_table.stride(1) != 1:
        raise ValueError("the block tables must be int32 [R, MAXB] alike, contiguous along MAXB")
    max_blocks = full_table.shape[1]
    dev = positions.device
    out = DecodeSlots(torch.empty((n, max_blocks), dtype=torch.int32, device=dev),
                      torch.empty((n, max_blocks), dtype=torch.int32, device=dev),
                      torch.empty(n, dtype=torch.int64, device=dev), torch.empty(n, dtype=torch.int64, device=dev),
                      torch.empty(n, dtype=torch.int32, device=dev))
    if n:
        _decode_slots_kernel[(n,)](
            positions, rows, active, full_table, slide_table, full_table.stride(0), slide_table.stride(0), max_blocks,
            out.full_tables, out.slide_tables, out.full_slots, out.slide_slots, out.seq_lens,
            BLOCK_SIZE=block_size, BLOCK=min(TABLE_BLOCK, triton.next_power_of_2(max_blocks)), num_warps=4,
        )  # fmt: skip
    return out


@dataclass
class SeenSets:
    """The repetition penalty's seen-set bits [rows, W] int32 and, per batch row, its table row
    [B] int64 and penalty [B] float32 (kernels.penalty)."""

    bits: torch.Tensor
    rows: torch.Tensor
    penalty: torch.Tensor


def advance_decode_ref(sampled: torch.Tensor, out: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
                       offsets: torch.Tensor, active: torch.Tensor, seen: SeenSets | None = None) -> None:
    out.copy_(sampled)
    tokens.copy_(sampled)
    positions.add_(active)
    offsets.add_(active)
    if seen is not None:
        mark_seen_ref(seen.bits, seen.rows, sampled, seen.penalty)


@triton.jit
def _advance_kernel(sampled_ptr, out_ptr, tokens_ptr, pos_ptr, offsets_ptr, active_ptr, n, seen_ptr, width,
                    rows_ptr, pen_ptr, BLOCK: tl.constexpr, SEEN: tl.constexpr):
    i = tl.arange(0, BLOCK)
    ok = i < n
    ids = tl.load(sampled_ptr + i, mask=ok)
    act = tl.load(active_ptr + i, mask=ok)
    tl.store(out_ptr + i, ids, mask=ok)
    tl.store(tokens_ptr + i, ids, mask=ok)
    tl.store(pos_ptr + i, tl.load(pos_ptr + i, mask=ok) + act, mask=ok)
    tl.store(offsets_ptr + i, tl.load(offsets_ptr + i, mask=ok) + act, mask=ok)
    if SEEN:
        rows = tl.load(rows_ptr + i, mask=ok, other=0)
        mark_bits(seen_ptr, width, rows, ids, tl.load(pen_ptr + i, mask=ok, other=1.0), ok)


def advance_decode(sampled: torch.Tensor, out: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
                   offsets: torch.Tensor, active: torch.Tensor, seen: SeenSets | None = None) -> None:
    """`advance_decode_ref` in one launch: the sampled ids [B] into `out` (the host copy's source)
    and `tokens` (the next inputs); positions and sampling offsets += active. All int64 [B].
    With `seen`, the sampled ids also join their rows' seen sets (rows whose penalty is not 1)."""
    n = sampled.shape[0]
    for name, t in (("sampled", sampled), ("out", out), ("tokens", tokens), ("positions", positions),
                    ("offsets", offsets), ("active", active)):
        _check_rows(name, t, n, torch.int64)
    if seen is not None:
        _check_rows("seen.rows", seen.rows, n, torch.int64)
        _check_rows("seen.penalty", seen.penalty, n, torch.float32)
        if seen.bits.dim() != 2 or seen.bits.dtype != torch.int32 or not seen.bits.is_contiguous():
            raise ValueError("seen.bits must be a contiguous int32 [rows, W] tensor")
    if n:
        bits = (seen.bits, seen.bits.shape[1], seen.rows, seen.penalty) if seen else (sampled, 0, sampled, sampled)
        _advance_kernel[(1,)](sampled, out, tokens, positions, offsets, active, n, *bits,
                              BLOCK=triton.next_power_of_2(n), SEEN=seen is not None, num_warps=1)
