"""Decode MoE matmuls for up to 16 rows per expert on the tensor cores, fed from the packed bytes.

Contract of moe_gemm1_swiglu / moe_gemm2 (moe_matmul.py): sorted rows, routing tiles of 16 rows
(MoeConfig.group_mma, where group_plan says the shapes fit; the tiles run otherwise).

Why: at a few rows per expert (20b at batch 8-64, 120b at batch 32-256) the decode tiles dequantise
every weight to bf16 and pass it through shared memory into the mma: ~28 SASS instructions per
packed 4-byte word at T=64 (offline sm_90, session 23), whatever the rows. moe_gemv_mma.py's
batch-1 step keeps each lane's packed words as its own A fragment and needs no shared memory; here
B's 8 columns are 8 of the expert's rows instead of one token 8 times, so one unpacked fragment
serves 8 rows, and a second group of 8 columns (an expert's rows 9-16) shares it. Measured (H200,
session 24): faster than the tiles at up to 2 rows per expert on 20b (pick_config's range), slower
from 4: every warp reads its 8 columns' activations itself, as many sectors as its weight words
once the rows are distinct, where the tiles stage them once per program in shared memory.

A program owns one routing tile (at most 16 sorted rows of one expert) and the weight rows of one
column block (gemm1: 2 * block_n1 interleaved gate/up rows; gemm2: block_n2 output columns), as
whole pairs of 16-row weight tiles on the warps, split along K over the rest (mma_splits). A tile
of at most 8 rows runs the one-group body, chosen per program at run time. Lanes of B columns
past the tile's rows read its last row again; their outputs are not stored.

Numerics as moe_gemv_mma.py: exact FP4 and fp16 products, fp32 sums; a program whose products hit
an activation beyond fp16's range redoes its rows with moe_gemv's fp32 loop, one row at a time.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .moe_config import MoeConfig
from .moe_gemv import _mx_gemv
from .moe_gemv_mma import _group_rows, mma_plan
from .moe_matmul import _check_activation, _dot_scaled_format, _out_buffer, _swiglu
from .moe_routing import MoeRouting

ROWS_PER_TILE = 16  # routing tile height the kernels take (two groups of 8 B columns)


@triton.jit
def _tile_rows(tile_expert_ptr, tile_start_ptr, offsets_ptr):
    """(expert, first sorted row, rows) of this program's routing tile; expert < 0: no work."""
    tile = tl.program_id(0)
    expert = tl.load(tile_expert_ptr + tile)
    start = tl.load(tile_start_ptr + tile)
    count = tl.minimum(tl.load(offsets_ptr + tl.maximum(expert, 0) + 1) - start, 16)
    return expert, start, count


@triton.jit
def _redo_if_overflowed(acc, x_ptr, stride_xt, slots_ptr, start, count, w_base, s_base, wrows, wrow_ok, K,
                        stride_wn, stride_sg, TOP_K: tl.constexpr, GATHER: tl.constexpr, ROW_GROUP: tl.constexpr):
    """acc [R, TOK], or its columns redone in fp32 (moe_gemv._mx_gemv, one sorted row at a time)
    where an fp16 value overflowed (acc holds inf or NaN)."""
    if tl.sum((acc - acc != 0).to(tl.int32)) > 0:
        col = tl.arange(0, acc.shape[1])[None, :]
        for i in range(count):
            row = start + i
            if GATHER:
                row = tl.load(slots_ptr + row) // TOP_K
            dots = _mx_gemv(x_ptr + row.to(tl.int64) * stride_xt, w_base, s_base, wrows, wrow_ok, K, stride_wn,
                            stride_sg, acc.shape[0], 32, False, ROW_GROUP)
            acc = tl.where(col == i, dots[:, None], acc)
    return acc


@triton.jit
def _gemm1_group(
    x_ptr, stride_xt, w_base, stride_wn, s_base, stride_sg, bias_base, act_ptr, stride_at, slots_ptr,
    start, count, hidden, inter, limit, alpha,
    GROUPS: tl.constexpr, TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ROW_GROUP: tl.constexpr, KS: tl.constexpr, AHEAD: tl.constexpr,
):  # fmt: skip
    """gemm1 + SwiGLU of sorted rows [start, start + count) (count <= 8 * GROUPS), column block
    program_id(1)."""
    R: tl.constexpr = 2 * BLOCK_N
    TOK: tl.constexpr = 8 * GROUPS
    nb = tl.program_id(1)
    acc = _group_rows(x_ptr, stride_xt, slots_ptr, start, count, w_base, s_base, nb * (R // 16),
                      (2 * inter) // 16, hidden, stride_wn, stride_sg, R // 16, BLOCK_K // 32 // KS, KS, AHEAD,
                      GROUPS, TOP_K, True)
    wrows = nb * R + tl.arange(0, R)
    wrow_ok = wrows < 2 * inter
    acc = _redo_if_overflowed(acc, x_ptr, stride_xt, slots_ptr, start, count, w_base, s_base, wrows, wrow_ok,
                              hidden, stride_wn, stride_sg, TOP_K, True, ROW_GROUP)
    acc += tl.load(bias_base + wrows, mask=wrow_ok, other=0.0)[:, None]
    # 2*BLOCK_N consecutive W1 rows = BLOCK_N interleaved (gate, up) pairs.
    gate, up = tl.split(tl.reshape(tl.trans(acc), (TOK, BLOCK_N, 2)))
    out = _swiglu(gate, up, limit, alpha)
    toks = tl.arange(0, TOK)
    cols = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    ptrs = act_ptr + (start + toks)[:, None].to(tl.int64) * stride_at + cols[None, :]
    tl.store(ptrs, out.to(act_ptr.dtype.element_ty), mask=(toks < count)[:, None] & (cols < inter)[None, :])


@triton.jit
def _group_gemm1_swiglu_kernel(
    x_ptr, stride_xt, w_ptr, stride_we, stride_wn, s_ptr, stride_se, stride_sg, bias_ptr,
    act_ptr, stride_at, sorted_slots_ptr, tile_expert_ptr, tile_start_ptr, offsets_ptr, hidden, inter, limit, alpha,
    TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ROW_GROUP: tl.constexpr,
    KS: tl.constexpr, AHEAD: tl.constexpr,
):  # fmt: skip
    expert, start, count = _tile_rows(tile_expert_ptr, tile_start_ptr, offsets_ptr)
    if expert < 0:
        return
    w_base, s_base = w_ptr + expert.to(tl.int64) * stride_we, s_ptr + expert.to(tl.int64) * stride_se
    bias_base = bias_ptr + expert * (2 * inter)
    if count <= 8:
        _gemm1_group(x_ptr, stride_xt, w_base, stride_wn, s_base, stride_sg, bias_base, act_ptr, stride_at,
                     sorted_slots_ptr, start, count, hidden, inter, limit, alpha, 1, TOP_K, BLOCK_N, BLOCK_K,
                     ROW_GROUP, KS, AHEAD)
    else:
        _gemm1_group(x_ptr, stride_xt, w_base, stride_wn, s_base, stride_sg, bias_base, act_ptr, stride_at,
                     sorted_slots_ptr, start, count, hidden, inter, limit, alpha, 2, TOP_K, BLOCK_N, BLOCK_K,
                     ROW_GROUP, KS, AHEAD)


@triton.jit
def _gemm2_group(
    act_ptr, stride_at, w_base, stride_wn, s_base, stride_sg, bias_base, y_ptr, stride_yt, gamma_ptr, slots_ptr,
    start, count, hidden, inter,
    GROUPS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ROW_GROUP: tl.constexpr,
    KS: tl.constexpr, AHEAD: tl.constexpr,
):  # fmt: skip
    """gemm2 of sorted rows [start, start + count) (count <= 8 * GROUPS), output column block
    program_id(1): bias, routing weight, stored per slot."""
    TOK: tl.constexpr = 8 * GROUPS
    nb = tl.program_id(1)
    acc = _group_rows(act_ptr, stride_at, slots_ptr, start, count, w_base, s_base, nb * (BLOCK_N // 16),
                      hidden // 16, inter, stride_wn, stride_sg, BLOCK_N // 16, BLOCK_K // 32 // KS, KS, AHEAD,
                      GROUPS, 1, False)
    cols = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < hidden
    acc = _redo_if_overflowed(acc, act_ptr, stride_at, slots_ptr, start, count, w_base, s_base, cols, col_ok,
                              inter, stride_wn, stride_sg, 1, False, ROW_GROUP)
    toks = tl.arange(0, TOK)
    tok_ok = toks < count
    slots = tl.load(slots_ptr + start + toks, mask=tok_ok, other=0)
    gamma = tl.load(gamma_ptr + slots, mask=tok_ok, other=0.0)
    # The routing weight scales the bias too (gpt-oss-model.md §2.5 step 4).
    bias = tl.load(bias_base + cols, mask=col_ok, other=0.0)
    y = (tl.trans(acc) + bias[None, :]) * gamma[:, None]
    y_ptrs = y_ptr + slots[:, None].to(tl.int64) * stride_yt + cols[None, :]
    tl.store(y_ptrs, y.to(y_ptr.dtype.element_ty), mask=tok_ok[:, None] & col_ok[None, :])


@triton.jit
def _group_gemm2_kernel(
    act_ptr, stride_at, w_ptr, stride_we, stride_wn, s_ptr, stride_se, stride_sg, bias_ptr,
    y_ptr, stride_yt, gamma_ptr, sorted_slots_ptr, tile_expert_ptr, tile_start_ptr, offsets_ptr, hidden, inter,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ROW_GROUP: tl.constexpr, KS: tl.constexpr, AHEAD: tl.constexpr,
):  # fmt: skip
    expert, start, count = _tile_rows(tile_expert_ptr, tile_start_ptr, offsets_ptr)
    if expert < 0:
        return
    w_base, s_base = w_ptr + expert.to(tl.int64) * stride_we, s_ptr + expert.to(tl.int64) * stride_se
    bias_base = bias_ptr + expert * hidden
    if count <= 8:
        _gemm2_group(act_ptr, stride_at, w_base, stride_wn, s_base, stride_sg, bias_base, y_ptr, stride_yt,
                     gamma_ptr, sorted_slots_ptr, start, count, hidden, inter, 1, BLOCK_N, BLOCK_K, ROW_GROUP, KS,
                     AHEAD)
    else:
        _gemm2_group(act_ptr, stride_at, w_base, stride_wn, s_base, stride_sg, bias_base, y_ptr, stride_yt,
                     gamma_ptr, sorted_slots_ptr, start, count, hidden, inter, 2, BLOCK_N, BLOCK_K, ROW_GROUP, KS,
                     AHEAD)


def group_plan(config: MoeConfig, dtype: torch.dtype, row_group: int, n: int, k: int, rows: int,
               block_k: int) -> tuple[int, int]:
    """(K splits, steps ahead) of one of these kernels over `n` x `k` weights with `dtype` activations
    and `rows` weight rows per program, or (0, 1) where the tiles must run instead: group_mma off,
    routing tiles other than 16 rows, split-K, no asm path (interpreter, activations not bf16), or
    shapes moe_gemv_mma.mma_plan turns down."""
    if not config.group_mma or config.block_m != ROWS_PER_TILE or config.split_k != 1 \
            or _dot_scaled_format(config, dtype) != "asm":
        return 0, 1
    return mma_plan(row_group, n, k, rows, block_k, config.num_warps, config.group_ahead)


def group_fits(config: MoeConfig, dtype: torch.dtype, w) -> bool:
    """Whether both matmuls of a forward with `dtype` activations run here (group_plan)."""
    gemm1 = group_plan(config, dtype, w.row_group, 2 * w.intermediate, w.hidden, 2 * config.block_n1, config.block_k)
    gemm2 = group_plan(config, dtype, w.row_group, w.hidden, w.intermediate, config.block_n2, config.gemm2_block_k)
    return gemm1[0] > 0 and gemm2[0] > 0


def _launch(config: MoeConfig, plan: tuple[int, int], block_k: int, rows: int) -> dict:
    splits, ahead = plan
    if splits == 0:
        raise ValueError(f"MoeConfig {config} does not fit the grouped mma kernels here (group_plan)")
    return {"BLOCK_K": block_k, "KS": splits, "AHEAD": ahead, "num_warps": config.num_warps,
            "num_stages": config.num_stages}


def moe_group_gemm1_swiglu(x: torch.Tensor, routing: MoeRouting, w, limit: float, alpha: float, config: MoeConfig,
                           out: torch.Tensor | None = None) -> torch.Tensor:
    """moe_gemm1_swiglu on these kernels: x [T, C] -> act [S, I] in x.dtype, sorted rows."""
    _check_activation(x, routing.num_tokens, w.hidden, "x")
    if routing.block_m != ROWS_PER_TILE:
        raise ValueError(f"the grouped mma kernels take routing tiles of {ROWS_PER_TILE} rows, got {routing.block_m}")
    act = _out_buffer(out, (routing.num_tokens * routing.top_k, w.intermediate), x.dtype, x)
    rows = 2 * config.block_n1
    plan = group_plan(config, x.dtype, w.row_group, 2 * w.intermediate, w.hidden, rows, config.block_k)
    if routing.max_tiles == 0:
        return act
    _group_gemm1_swiglu_kernel[(routing.max_tiles, triton.cdiv(w.intermediate, config.block_n1))](
        x, x.stride(0), w.w1_blocks, w.w1_blocks.stride(0), w.w1_blocks.stride(1),
        w.w1_scales, w.w1_scales.stride(0), w.w1_scales.stride(1), w.w1_bias,
        act, act.stride(0), routing.sorted_slots, routing.tile_expert, routing.tile_row_start,
        routing.expert_offsets, w.hidden, w.intermediate, float(limit), float(alpha),
        TOP_K=routing.top_k, BLOCK_N=config.block_n1, ROW_GROUP=w.row_group,
        **_launch(config, plan, config.block_k, rows),
    )  # fmt: skip
    return act


def moe_group_gemm2(act: torch.Tensor, routing: MoeRouting, w, config: MoeConfig,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """moe_gemm2 on these kernels: act [S, I] (sorted rows) -> y [S, C] fp32 in slot order, scaled by
    the routing weights."""
    slots = routing.num_tokens * routing.top_k
    _check_activation(act, slots, w.intermediate, "act")
    if routing.block_m != ROWS_PER_TILE:
        raise ValueError(f"the grouped mma kernels take routing tiles of {ROWS_PER_TILE} rows, got {routing.block_m}")
    y = _out_buffer(out, (slots, w.hidden), torch.float32, act)
    plan = group_plan(config, act.dtype, w.row_group, w.hidden, w.intermediate, config.block_n2,
                      config.gemm2_block_k)
    if routing.max_tiles == 0:
        return y
    _group_gemm2_kernel[(routing.max_tiles, triton.cdiv(w.hidden, config.block_n2))](
        act, act.stride(0), w.w2_blocks, w.w2_blocks.stride(0), w.w2_blocks.stride(1),
        w.w2_scales, w.w2_scales.stride(0), w.w2_scales.stride(1), w.w2_bias,
        y, y.stride(0), routing.topk_weights, routing.sorted_slots, routing.tile_expert, routing.tile_row_start,
        routing.expert_offsets, w.hidden, w.intermediate,
        BLOCK_N=config.block_n2, ROW_GROUP=w.row_group, **_launch(config, plan, config.gemm2_block_k, config.block_n2),
    )  # fmt: skip
    return y
