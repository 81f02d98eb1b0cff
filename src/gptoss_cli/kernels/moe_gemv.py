"""Matrix-vector MoE kernels for about one row per expert (batch-1 decode), from the packed bytes.

Same contract as moe_gemm1_swiglu / moe_gemm2 (moe_matmul.py): act in sorted-row order, y in slot
order and scaled by the routing weight. The tiled kernels pad each expert's rows to a 16-row
tensor-core tile and pass every dequantised weight through shared memory into mma; with one real
row that is 15/16 wasted work and a shared-memory round trip per K step. Here a program owns one
sorted row and BLOCK_R weight rows and keeps everything in registers: each thread dequantises
whole 16-byte blocks (32 values of one row, one scale), multiplies them with the matching x values
and sums them in place; the rows' dot products are reduced across threads once, after the K loop.
Rows of one expert are neighbouring programs, so a weight tile read twice mostly comes from L2.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .moe_matmul import (
    MoeConfig,
    MoeWeights,
    _check_activation,
    _dot_scaled_format,
    _fp4_bits,
    _fp4_pairs_bf16,
    _out_buffer,
    _scale_fp32,
    _swiglu,
)
from .moe_routing import MoeRouting


@triton.jit
def _fp4_pairs(blk, scl, ASM: tl.constexpr):
    """[R, G, 16] u8 + [R, G] u8 -> (low-nibble, high-nibble) values in fp32, scaled, exact."""
    if ASM:
        lo, hi = _fp4_pairs_bf16(blk, scl)
        return lo.to(tl.float32), hi.to(tl.float32)
    lo, hi = _fp4_bits(blk)
    scale = _scale_fp32(scl)[:, :, None]
    return (lo.to(tl.float16, bitcast=True).to(tl.float32) * scale,
            hi.to(tl.float16, bitcast=True).to(tl.float32) * scale)


@triton.jit
def _gemv_loads(x_ptrs, blk_ptrs, scl_ptrs, wrow_ok, g, left):
    """One K step's activations [G, 16, 2] (fp32), packed bytes [R, G, 16] and scales [R, G];
    `left` = K values from this step on (<= 0: everything masked, nothing read)."""
    g_ok = g < left // 32
    x = tl.load(x_ptrs, mask=g_ok[:, None, None], other=0.0).to(tl.float32)
    blk = tl.load(blk_ptrs, mask=wrow_ok[:, None, None] & g_ok[None, :, None], other=0)
    scl = tl.load(scl_ptrs, mask=wrow_ok[:, None] & g_ok[None, :], other=0)
    return x, blk, scl


@triton.jit
def _gemv_step(acc, x, blk, scl, ASM: tl.constexpr):
    """acc [R, G] += per-32-block dot products of one K step."""
    x_even, x_odd = tl.split(x)
    lo, hi = _fp4_pairs(blk, scl, ASM)
    return acc + tl.sum(lo * x_even[None, :, :] + hi * x_odd[None, :, :], axis=2)


@triton.jit
def _mx_gemv(
    x_row, w_base, s_base, wrows, wrow_ok, K, stride_wn, stride_sg,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, ASM: tl.constexpr, PREFETCH: tl.constexpr,
):  # fmt: skip
    """[BLOCK_R] fp32 = W[wrows, :K] @ x[:K]; x_row points at x[0], W is packed MXFP4 (K a multiple of 32).

    PREFETCH issues the next K step's loads before this step's arithmetic. Triton software-
    pipelines only loops around tl.dot, so without it each warp waits for its loads every step."""
    G: tl.constexpr = BLOCK_K // 32
    g = tl.arange(0, G)
    j = tl.arange(0, 16)
    blk_ptrs = w_base + wrows[:, None, None] * stride_wn + g[None, :, None] * 16 + j[None, None, :]
    scl_ptrs = s_base + g[None, :] * stride_sg + wrows[:, None]
    # x as [G, 16, 2]: byte j of block g holds elements 32g + 2j (low nibble) and 32g + 2j + 1.
    x_ptrs = x_row + g[:, None, None] * 32 + j[None, :, None] * 2 + tl.arange(0, 2)[None, None, :]
    acc = tl.zeros((BLOCK_R, G), dtype=tl.float32)
    if PREFETCH:
        x, blk, scl = _gemv_loads(x_ptrs, blk_ptrs, scl_ptrs, wrow_ok, g, K)
        for k0 in range(0, K, BLOCK_K):
            x_ptrs += BLOCK_K
            blk_ptrs += BLOCK_K // 2
            scl_ptrs += G * stride_sg
            nx, nblk, nscl = _gemv_loads(x_ptrs, blk_ptrs, scl_ptrs, wrow_ok, g, K - k0 - BLOCK_K)
            acc = _gemv_step(acc, x, blk, scl, ASM)
            x, blk, scl = nx, nblk, nscl
    else:
        for k0 in range(0, K, BLOCK_K):
            x, blk, scl = _gemv_loads(x_ptrs, blk_ptrs, scl_ptrs, wrow_ok, g, K - k0)
            acc = _gemv_step(acc, x, blk, scl, ASM)
            x_ptrs += BLOCK_K
            blk_ptrs += BLOCK_K // 2
            scl_ptrs += G * stride_sg
    return tl.sum(acc, axis=1)


@triton.jit
def _row_expert(sorted_slots_ptr, topk_ids_ptr):
    """(slot, expert) of this program's sorted row (grid axis 0)."""
    slot = tl.load(sorted_slots_ptr + tl.program_id(0))
    return slot, tl.load(topk_ids_ptr + slot).to(tl.int64)


@triton.jit
def _gemv1_swiglu_kernel(
    x_ptr, stride_xt, w_ptr, stride_we, stride_wn, s_ptr, stride_se, stride_sg, bias_ptr,
    act_ptr, stride_at, sorted_slots_ptr, topk_ids_ptr, hidden, inter, limit, alpha,
    TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ASM: tl.constexpr, PREFETCH: tl.constexpr,
):  # fmt: skip
    slot, expert = _row_expert(sorted_slots_ptr, topk_ids_ptr)
    token = slot // TOP_K
    # 2*BLOCK_N consecutive W1 rows = BLOCK_N interleaved (gate, up) pairs.
    wrows = tl.program_id(1) * 2 * BLOCK_N + tl.arange(0, 2 * BLOCK_N)
    wrow_ok = wrows < 2 * inter
    acc = _mx_gemv(x_ptr + token.to(tl.int64) * stride_xt, w_ptr + expert * stride_we, s_ptr + expert * stride_se,
                   wrows, wrow_ok, hidden, stride_wn, stride_sg, 2 * BLOCK_N, BLOCK_K, ASM, PREFETCH)
    acc += tl.load(bias_ptr + expert * (2 * inter) + wrows, mask=wrow_ok, other=0.0)
    gate, up = tl.split(tl.reshape(acc, (BLOCK_N, 2)))
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    out = _swiglu(gate, up, limit, alpha)
    row = tl.program_id(0).to(tl.int64)
    tl.store(act_ptr + row * stride_at + cols, out.to(act_ptr.dtype.element_ty), mask=cols < inter)


@triton.jit
def _gemv2_kernel(
    act_ptr, stride_at, w_ptr, stride_we, stride_wn, s_ptr, stride_se, stride_sg, bias_ptr,
    y_ptr, stride_yt, gamma_ptr, sorted_slots_ptr, topk_ids_ptr, hidden, inter,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ASM: tl.constexpr, PREFETCH: tl.constexpr,
):  # fmt: skip
    slot, expert = _row_expert(sorted_slots_ptr, topk_ids_ptr)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = rows < hidden
    act_row = act_ptr + tl.program_id(0).to(tl.int64) * stride_at
    acc = _mx_gemv(act_row, w_ptr + expert * stride_we, s_ptr + expert * stride_se, rows, ok, inter,
                   stride_wn, stride_sg, BLOCK_N, BLOCK_K, ASM, PREFETCH)
    # The routing weight scales the bias too (gpt-oss-model.md §2.5 step 4).
    y = (acc + tl.load(bias_ptr + expert * hidden + rows, mask=ok, other=0.0)) * tl.load(gamma_ptr + slot)
    tl.store(y_ptr + slot.to(tl.int64) * stride_yt + rows, y, mask=ok)


def _checked_output(config: MoeConfig, routing: MoeRouting, a: torch.Tensor, name: str, shape_in: tuple,
                    cols_out: int, dtype: torch.dtype, out: torch.Tensor | None) -> torch.Tensor:
    """Check a gemv call's config, routing and input `a` (`shape_in`); the [S, cols_out] output."""
    if not config.gemv or config.split_k != 1:
        raise ValueError(f"the gemv kernels need a MoeConfig with gemv=True and no split-K, got {config}")
    if routing.topk_ids.stride(-1) != 1 or routing.topk_weights.stride(-1) != 1:
        raise ValueError("routing top-k tensors must be contiguous")
    _check_activation(a, *shape_in, name)
    return _out_buffer(out, (routing.num_tokens * routing.top_k, cols_out), dtype, a)


def _launch_options(config: MoeConfig, dtype: torch.dtype) -> dict:
    """The launch arguments both gemv kernels take from the config."""
    return {"BLOCK_K": config.block_k, "ASM": _dot_scaled_format(config, dtype) == "asm",
            "PREFETCH": config.gemv_prefetch, "num_warps": config.num_warps, "num_stages": config.num_stages}


def moe_gemv1_swiglu(
    x: torch.Tensor, routing: MoeRouting, w: MoeWeights, limit: float, alpha: float, config: MoeConfig,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [T, C] -> act [S, I] in x.dtype, row r for sorted row r; moe_gemm1_swiglu's contract."""
    act = _checked_output(config, routing, x, "x", (routing.num_tokens, w.hidden), w.intermediate, x.dtype, out)
    if act.shape[0] == 0:
        return act
    _gemv1_swiglu_kernel[(act.shape[0], triton.cdiv(w.intermediate, config.block_n1))](
        x, x.stride(0), w.w1_blocks, w.w1_blocks.stride(0), w.w1_blocks.stride(1),
        w.w1_scales, w.w1_scales.stride(0), w.w1_scales.stride(1), w.w1_bias,
        act, act.stride(0), routing.sorted_slots, routing.topk_ids, w.hidden, w.intermediate,
        float(limit), float(alpha), TOP_K=routing.top_k, BLOCK_N=config.block_n1, **_launch_options(config, x.dtype),
    )  # fmt: skip
    return act


def moe_gemv2(
    act: torch.Tensor, routing: MoeRouting, w: MoeWeights, config: MoeConfig, out: torch.Tensor | None = None
) -> torch.Tensor:
    """act [S, I] (sorted rows) -> y [S, C] fp32 in slot order, scaled by the routing weights."""
    slots = routing.num_tokens * routing.top_k
    y = _checked_output(config, routing, act, "act", (slots, w.intermediate), w.hidden, torch.float32, out)
    if y.shape[0] == 0:
        return y
    _gemv2_kernel[(y.shape[0], triton.cdiv(w.hidden, config.block_n2))](
        act, act.stride(0), w.w2_blocks, w.w2_blocks.stride(0), w.w2_blocks.stride(1),
        w.w2_scales, w.w2_scales.stride(0), w.w2_scales.stride(1), w.w2_bias,
        y, y.stride(0), routing.topk_weights, routing.sorted_slots, routing.topk_ids, w.hidden, w.intermediate,
        BLOCK_N=config.block_n2, **_launch_options(config, act.dtype),
    )  # fmt: skip
    return y
