"""Matrix-vector MoE kernels for about one row per expert (batch-1 decode), from the packed bytes.

Contract of moe_gemm1_swiglu / moe_gemm2 (moe_matmul.py) except for the row order of act: slot
order here, so only the routing's top-k tensors are read and route(sort=False) may skip the sort
kernel (2.9 us per layer at T=1). y is in slot order and scaled by the routing weight.

The tiled kernels pad each expert's rows to a 16-row tensor-core tile and pass every dequantised
weight through shared memory into mma; with one real row that is 15/16 wasted work and a
shared-memory round trip per K step. Here a program owns one slot (token, choice) and BLOCK_R
weight rows and keeps everything in registers: each thread dequantises whole 16-byte blocks (32
values of one row, one scale), multiplies them with the matching x values and sums them in place;
the rows' dot products are reduced across threads once, after the K loop.
Meant for one row per expert: a second row of the same expert re-reads its weights (from L2).

F16 (GPU, bf16 activations): the dot products run in packed fp16 inside one piece of inline PTX
per 32-value block (_FP4_DOT_F16_ASM), about 8 SASS instructions per weight byte instead of ~16
for dequantise-to-fp32-then-FMA. The unscaled FP4 values and bf16 activations are exact in fp16 and
so are their products; the 16 products per half-register are summed in fp16 (relative error
~2**-11 per add, below the bf16 rounding of the output), then in fp32 with the block scale. A
block sum that overflows fp16 (|x| beyond ~680) makes the program redo its rows in fp32.

MMA (MoeConfig.gemv_mma, where the shapes fit): the K loop runs on the tensor cores instead
(moe_gemv_mma.py); the kernels, their epilogues and the fp32 fallback stay the same.

gemv2's own top-k (MoeConfig.gemv2_topk, with gemv1's gemv_topk): gemv2 takes its slot's expert and
routing weight from the router logits too, which come from two launches back, so it may read them
before its PDL wait (pdl.py) and have its first two K steps of weights in flight while gemv1 still
runs, instead of waiting for gemv1 to finish before it can even read which expert it streams.
The mma form's first loads are plain loads (moe_gemv_mma._load_asm): ptxas hoists the wait above
read-only ones. H200, batch-1 step (session 30): 20b 1.692 -> 1.658 ms.

Split K (MoeConfig.split_k, gemv2 only: gemv1's SwiGLU needs whole sums): each program takes one
K range of whole 32-value blocks and writes its slab of y; moe_combine adds the slabs. The mma form
needs 32-row programs, and over the whole K that is 360 programs for 20b's batch-1 gemv2, too few
for a kernel that waits on its loads; two K ranges double them (H200, session 29: 20b batch 1 step
1.733 -> 1.674 ms, 120b 2.625 -> 2.539).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .moe_config import MoeConfig
from .moe_gemv_mma import _mma_rows, mma_plan, pairs_index
from .moe_matmul import (
    BLOCK_BYTES,
    MoeWeights,
    _check_activation,
    _dequant_mxfp4_halves,
    _dot_scaled_format,
    _fp4_pairs_bf16,
    _out_buffer,
    _row_offsets,
    _swiglu,
)
from .moe_routing import MoeRouting, softmax_k, topk_row, topk_row_bf16
from .pdl import pdl_enabled, pdl_launch, wait_for_previous


@triton.jit
def _fp4_pairs(blk, scl, ASM: tl.constexpr):
    """[R, G, 16] u8 + [R, G] u8 -> (low-nibble, high-nibble) values in fp32, scaled, exact."""
    if ASM:
        lo, hi = _fp4_pairs_bf16(blk, scl, False)
        return lo.to(tl.float32), hi.to(tl.float32)
    return _dequant_mxfp4_halves(blk, scl)


# Byte LUT: the high byte of the fp16 encoding of FP4 magnitude m (0, .5, 1, 1.5, 2, 3, 4, 6); the
# low byte is 0 for all of them. prmt picks bytes of {lut_lo, lut_hi} by 4-bit selectors, so a
# selector word with nibbles (0, m_a, 0, m_b) yields the fp16x2 pair (m_a, m_b) in one instruction.
# Per 32-bit weight word w (bytes B0..B3, nibble n_i = value i of the word, low nibble first):
# wp = (B1, B3, B0, B2) puts the magnitudes of n_i and n_(i+4) 8 bits apart for i = 0..3, and the
# sign of n_i sits at bit 4i+3 of w, 16 bits below that of n_(i+4), so one shift lines both up with
# the fp16 sign bits. Operands, one block per call (pack=1, so no layout can split a block across
# threads): $0 = the block's unscaled dot product (fp32), words in $1..$4, pair i of word j
# (x_i, x_(i+4)) in $(5+4i+j). 16 fp16 FMAs accumulate two half sums, added in fp32 at the end.
_FP4_DOT_F16_PAIR = """
{sel} and.b32 s, s, 0x7070; prmt.b32 m, lut_lo, lut_hi, s;
{sign} and.b32 t, t, 0x80008000; or.b32 m, m, t; fma.rn.f16x2 acc, m, {x}, acc;"""


def _fp4_dot_f16_asm() -> str:
    body = []
    for j in range(4):
        w = f"${1 + j}"
        body.append(f"\nprmt.b32 wp, {w}, 0, 0x2031;")
        sels = ["shr.b32 s, wp, 12;", "shr.b32 s, wp, 16;", "shl.b32 s, wp, 4;", "mov.b32 s, wp;"]
        signs = [f"shl.b32 t, {w}, 12;", f"shl.b32 t, {w}, 8;", f"shl.b32 t, {w}, 4;", f"mov.b32 t, {w};"]
        for i in range(4):
            body.append(_FP4_DOT_F16_PAIR.format(sel=sels[i], sign=signs[i], x=f"${5 + 4 * i + j}"))
    return (
        "{\n.reg .b32 wp, s, t, m, acc, lut_lo, lut_hi;\n.reg .b16 h0, h1;\n.reg .f32 f0, f1;\n"
        "mov.b32 lut_lo, 0x3E3C3800; mov.b32 lut_hi, 0x46444240; mov.b32 acc, 0;"
        + "".join(body)
        + "\nmov.b32 {h0, h1}, acc; cvt.f32.f16 f0, h0; cvt.f32.f16 f1, h1; add.f32 f0, f0, f1;"
        "\nmov.b32 $0, f0;\n}"
    )


_FP4_DOT_F16_ASM = tl.constexpr(_fp4_dot_f16_asm())
_FP4_DOT_F16_CONSTRAINTS = tl.constexpr("=r," + ",".join(["r"] * 20))
# (x_i, x_(i+4)) as fp32 -> one fp16x2 register, x_i in the low half (round to nearest: exact for
# bf16 values in fp16's normal range).
_X_PAIR_F16_ASM = tl.constexpr("cvt.rn.f16x2.f32 $0, $2, $1;")


@triton.jit
def _quarters(t):
    """[A, 4] -> its 4 columns, in order."""
    a, b = tl.split(tl.reshape(t, (t.shape[0], 2, 2)))  # column 2u + v: a holds v = 0, b v = 1
    t0, t2 = tl.split(a)
    t1, t3 = tl.split(b)
    return t0, t1, t2, t3


@triton.jit
def _x_pairs_f16(x_ptr, g, left):
    """The activations of G blocks as the asm's fp16x2 pairs: 16 int32 tensors [G], pair i of word j
    (i-major) = (x[32g + 8j + i], x[32g + 8j + i + 4]); `left` as in _gemv_loads."""
    g_ok = g < left // 32
    offs = g[:, None, None] * 32 + tl.arange(0, 4)[None, :, None] + tl.arange(0, 4)[None, None, :] * 8  # [G, i, j]
    lo = tl.load(x_ptr + offs, mask=g_ok[:, None, None], other=0.0).to(tl.float32)
    hi = tl.load(x_ptr + offs + 4, mask=g_ok[:, None, None], other=0.0).to(tl.float32)
    pairs = tl.inline_asm_elementwise(_X_PAIR_F16_ASM, "=r,r,r", [lo, hi], dtype=tl.int32, is_pure=True, pack=1)
    pairs = tl.reshape(pairs, (g.shape[0] * 4, 4))  # [(G, i), j]
    q0, q1, q2, q3 = _quarters(pairs)  # [(G, i)] for j = 0..3
    a0, a1, a2, a3 = _quarters(tl.reshape(q0, (g.shape[0], 4)))  # [G] for i = 0..3, j = 0
    b0, b1, b2, b3 = _quarters(tl.reshape(q1, (g.shape[0], 4)))
    c0, c1, c2, c3 = _quarters(tl.reshape(q2, (g.shape[0], 4)))
    d0, d1, d2, d3 = _quarters(tl.reshape(q3, (g.shape[0], 4)))
    return a0, a1, a2, a3, b0, b1, b2, b3, c0, c1, c2, c3, d0, d1, d2, d3


@triton.jit
def _mx_gemv_f16(x_row, w_base, s_base, wrows, wrow_ok, K, stride_wn, stride_sg, BLOCK_R: tl.constexpr,
                 BLOCK_K: tl.constexpr, ROW_GROUP: tl.constexpr):
    """_mx_gemv with packed-fp16 block dot products (module docstring); NaN/inf where a block
    overflowed fp16."""
    G: tl.constexpr = BLOCK_K // 32
    g = tl.arange(0, G)
    words = w_base.to(tl.pointer_type(tl.int32))
    w_ptrs = (words + _row_offsets(wrows, stride_wn, ROW_GROUP, 4)[:, None, None]
              + g[None, :, None] * (BLOCK_BYTES // 4 * ROW_GROUP) + tl.arange(0, 4)[None, None, :])
    scl_ptrs = s_base + g[None, :] * stride_sg + wrows[:, None]
    acc = tl.zeros((BLOCK_R, G), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        g_ok = g < (K - k0) // 32
        w = tl.load(w_ptrs, mask=wrow_ok[:, None, None] & g_ok[None, :, None], other=0)
        scl = tl.load(scl_ptrs, mask=wrow_ok[:, None] & g_ok[None, :], other=0)
        a0, a1, a2, a3, b0, b1, b2, b3, c0, c1, c2, c3, d0, d1, d2, d3 = _x_pairs_f16(x_row + k0, g, K - k0)
        w0, w1, w2, w3 = _quarters(tl.reshape(w, (BLOCK_R * G, 4)))
        dot = tl.inline_asm_elementwise(
            _FP4_DOT_F16_ASM, _FP4_DOT_F16_CONSTRAINTS,
            [tl.reshape(w0, (BLOCK_R, G)), tl.reshape(w1, (BLOCK_R, G)), tl.reshape(w2, (BLOCK_R, G)),
             tl.reshape(w3, (BLOCK_R, G)),
             a0[None, :], b0[None, :], c0[None, :], d0[None, :], a1[None, :], b1[None, :], c1[None, :], d1[None, :],
             a2[None, :], b2[None, :], c2[None, :], d2[None, :], a3[None, :], b3[None, :], c3[None, :], d3[None, :]],
            dtype=tl.float32, is_pure=True, pack=1,
        )  # fmt: skip
        acc += dot * (scl.to(tl.int32) << 23).to(tl.float32, bitcast=True)
        w_ptrs += G * (BLOCK_BYTES // 4 * ROW_GROUP)
        scl_ptrs += G * stride_sg
    return tl.sum(acc, axis=1)


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
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, ASM: tl.constexpr, ROW_GROUP: tl.constexpr,
):  # fmt: skip
    """[BLOCK_R] fp32 = W[wrows, :K] @ x[:K]; x_row points at x[0], W is packed MXFP4 (K a multiple of 32).
    Dequantise to fp32 (bf16 inline asm when ASM), then FMA: the interpreter's path and the fallback."""
    G: tl.constexpr = BLOCK_K // 32
    g = tl.arange(0, G)
    j = tl.arange(0, 16)
    blk_ptrs = (w_base + _row_offsets(wrows, stride_wn, ROW_GROUP)[:, None, None]
                + g[None, :, None] * (BLOCK_BYTES * ROW_GROUP) + j[None, None, :])
    scl_ptrs = s_base + g[None, :] * stride_sg + wrows[:, None]
    # x as [G, 16, 2]: byte j of block g holds elements 32g + 2j (low nibble) and 32g + 2j + 1.
    x_ptrs = x_row + g[:, None, None] * 32 + j[None, :, None] * 2 + tl.arange(0, 2)[None, None, :]
    acc = tl.zeros((BLOCK_R, G), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        x, blk, scl = _gemv_loads(x_ptrs, blk_ptrs, scl_ptrs, wrow_ok, g, K - k0)
        acc = _gemv_step(acc, x, blk, scl, ASM)
        x_ptrs += BLOCK_K
        blk_ptrs += G * (BLOCK_BYTES * ROW_GROUP)
        scl_ptrs += G * stride_sg
    return tl.sum(acc, axis=1)


@triton.jit
def _row_dots(
    x_row, w_base, s_base, wrows, wrow_ok, K, stride_wn, stride_sg, n_rows,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, ASM: tl.constexpr, F16: tl.constexpr, ROW_GROUP: tl.constexpr,
    MMA: tl.constexpr, MMA_SPLITS: tl.constexpr, MMA_AHEAD: tl.constexpr, WAIT: tl.constexpr = False,
    xp_row=None,
):  # fmt: skip
    """The program's BLOCK_R dot products (rows wrows, n_rows in all): on the tensor cores when MMA
    (moe_gemv_mma.py; only with F16), else packed fp16 when F16; either redone in fp32 if an fp16
    value overflowed. WAIT: the PDL wait is still to come (the mma form issues its first weight
    loads before it). xp_row (mma form): the same row in fp16_pairs form, which the tensor-core
    steps then read instead of converting x_row (the fp32 redo still reads x_row)."""
    if MMA:
        pairs: tl.constexpr = xp_row is not None
        acc = _mma_rows(xp_row if pairs else x_row, w_base, s_base, tl.program_id(1) * (BLOCK_R // 16), n_rows // 16,
                        K, stride_wn, stride_sg, BLOCK_R // 16, BLOCK_K // 32 // MMA_SPLITS, MMA_SPLITS, MMA_AHEAD,
                        WAIT, pairs)
    elif F16:
        wait_for_previous(WAIT)
        acc = _mx_gemv_f16(x_row, w_base, s_base, wrows, wrow_ok, K, stride_wn, stride_sg, BLOCK_R, BLOCK_K,
                           ROW_GROUP)
    else:
        wait_for_previous(WAIT)
        acc = _mx_gemv(x_row, w_base, s_base, wrows, wrow_ok, K, stride_wn, stride_sg, BLOCK_R, BLOCK_K, ASM,
                       ROW_GROUP)
    if F16:
        acc = _fp32_if_overflowed(acc, x_row, w_base, s_base, wrows, wrow_ok, K, stride_wn, stride_sg, BLOCK_R,
                                  ROW_GROUP)
    return acc


@triton.jit
def _fp32_if_overflowed(acc, x_row, w_base, s_base, wrows, wrow_ok, K, stride_wn, stride_sg,
                        BLOCK_R: tl.constexpr, ROW_GROUP: tl.constexpr):
    """acc, or the rows redone in fp32 where an fp16 value overflowed (acc holds inf or NaN)."""
    if tl.sum((acc - acc != 0).to(tl.int32)) > 0:
        # Short K steps: this rare path must not raise the kernel's register count.
        acc = _mx_gemv(x_row, w_base, s_base, wrows, wrow_ok, K, stride_wn, stride_sg, BLOCK_R, 32, False, ROW_GROUP)
    return acc


@triton.jit
def _slot_expert(topk_ids_ptr):
    """(slot, expert) of this program's row (grid axis 0 = slot)."""
    slot = tl.program_id(0)
    return slot, tl.load(topk_ids_ptr + slot).to(tl.int64)


@triton.jit
def _slot_route(logits_ptr, stride_lt, num_experts, TOP_K: tl.constexpr, BLOCK_TK: tl.constexpr,
                BLOCK_E: tl.constexpr, KEYS: tl.constexpr):
    """(slot, expert, the token's top-k logits) of this program's row from its token's router
    logits (grid axis 0 = slot); KEYS: the logits are bf16 values (moe_routing.topk_row_bf16).
    _slot_weight turns the logits into the slot's routing weight, after the K loop: nothing before
    the first weight load waits for the softmax."""
    slot = tl.program_id(0)
    row_ptr = logits_ptr + (slot // TOP_K) * stride_lt
    if KEYS:
        values, expert = topk_row_bf16(row_ptr, num_experts, slot % TOP_K, TOP_K, BLOCK_TK, BLOCK_E)
    else:
        cols = tl.arange(0, BLOCK_E)
        col_ok = cols < num_experts
        # .cg: the same scratch held the previous layer's logits; this SM's L1 may still have them.
        row = tl.load(row_ptr + cols, mask=col_ok, other=float("-inf"), cache_modifier=".cg")
        values, ids = topk_row(row, cols, col_ok, num_experts, TOP_K, BLOCK_TK, BLOCK_E)
        expert = tl.sum(tl.where(tl.arange(0, BLOCK_TK) == slot % TOP_K, ids, 0))
    return slot, expert.to(tl.int64), values


@triton.jit
def _slot_weight(values, slot, TOP_K: tl.constexpr, BLOCK_TK: tl.constexpr):
    """The slot's routing weight: its share of the softmax over its token's top-k logits."""
    mine = tl.arange(0, BLOCK_TK) == slot % TOP_K
    return tl.sum(tl.where(mine, softmax_k(values, TOP_K, BLOCK_TK), 0.0))


@triton.jit
def _gemv1_swiglu_kernel(
    x_ptr, stride_xt, w_ptr, stride_we, stride_wn, s_ptr, stride_se, stride_sg, bias_ptr,
    act_ptr, stride_at, topk_ids_ptr, hidden, inter, limit, alpha,
    logits_ptr, stride_lt, topk_weights_ptr, num_experts,
    TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ASM: tl.constexpr, F16: tl.constexpr,
    PDL: tl.constexpr, ROW_GROUP: tl.constexpr, MMA: tl.constexpr = False, MMA_SPLITS: tl.constexpr = 1,
    MMA_AHEAD: tl.constexpr = 1, LOGITS: tl.constexpr = False,
    BLOCK_TK: tl.constexpr = 1, BLOCK_E: tl.constexpr = 1, KEYS: tl.constexpr = False, xp_ptr=None,
    ap_out_ptr=None,
):  # fmt: skip
    wait_for_previous(PDL)  # the routing (or with LOGITS its logits) comes from the launch just before
    if LOGITS:
        slot, expert, logits = _slot_route(logits_ptr, stride_lt, num_experts, TOP_K, BLOCK_TK, BLOCK_E, KEYS)
    else:
        slot, expert = _slot_expert(topk_ids_ptr)
    token = slot // TOP_K
    # 2*BLOCK_N consecutive W1 rows = BLOCK_N interleaved (gate, up) pairs.
    wrows = tl.program_id(1) * 2 * BLOCK_N + tl.arange(0, 2 * BLOCK_N)
    wrow_ok = wrows < 2 * inter
    xp_row = xp_ptr + token.to(tl.int64) * hidden if xp_ptr is not None else None  # fp16_pairs rows: [T, hidden]
    acc = _row_dots(x_ptr + token.to(tl.int64) * stride_xt, w_ptr + expert * stride_we, s_ptr + expert * stride_se,
                    wrows, wrow_ok, hidden, stride_wn, stride_sg, 2 * inter, 2 * BLOCK_N, BLOCK_K, ASM, F16,
                    ROW_GROUP, MMA, MMA_SPLITS, MMA_AHEAD, False, xp_row)
    acc += tl.load(bias_ptr + expert * (2 * inter) + wrows, mask=wrow_ok, other=0.0)
    gate, up = tl.split(tl.reshape(acc, (BLOCK_N, 2)))
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    out = _swiglu(gate, up, limit, alpha)
    row = tl.program_id(0).to(tl.int64)
    act = out.to(act_ptr.dtype.element_ty)
    tl.store(act_ptr + row * stride_at + cols, act, mask=cols < inter)
    if ap_out_ptr is not None:  # act in fp16_pairs form for gemv2, each column to its place there
        tl.store(ap_out_ptr + row * inter + pairs_index(cols), act.to(tl.float32).to(tl.float16), mask=cols < inter)
    if LOGITS:  # a compile-time branch around the run-time one
        if tl.program_id(1) == 0:  # the slot's first column block stores its routing for the launches after
            tl.store(topk_ids_ptr + slot, expert.to(topk_ids_ptr.dtype.element_ty))
            tl.store(topk_weights_ptr + slot, _slot_weight(logits, slot, TOP_K, BLOCK_TK))


@triton.jit
def _gemv2_kernel(
    act_ptr, stride_at, w_ptr, stride_we, stride_wn, s_ptr, stride_se, stride_sg, bias_ptr,
    y_ptr, stride_yt, gamma_ptr, topk_ids_ptr, hidden, inter, k_chunk, logits_ptr, stride_lt, num_experts,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ASM: tl.constexpr, F16: tl.constexpr, PDL: tl.constexpr,
    ROW_GROUP: tl.constexpr, MMA: tl.constexpr = False, MMA_SPLITS: tl.constexpr = 1, MMA_AHEAD: tl.constexpr = 1,
    LOGITS: tl.constexpr = False, TOP_K: tl.constexpr = 1, BLOCK_TK: tl.constexpr = 1, BLOCK_E: tl.constexpr = 1,
    KEYS: tl.constexpr = False, ap_ptr=None,
):  # fmt: skip
    # LOGITS: the router's logits come from two launches back (gemv1 runs between), which have
    # finished by the time this launch starts (pdl.py): the routing is taken from them before the
    # PDL wait, and the mma form's first weight loads go out while gemv1 still runs.
    if LOGITS:
        slot, expert, logits = _slot_route(logits_ptr, stride_lt, num_experts, TOP_K, BLOCK_TK, BLOCK_E, KEYS)
        gamma = _slot_weight(logits, slot, TOP_K, BLOCK_TK)
        late_wait: tl.constexpr = PDL
    else:
        wait_for_previous(PDL)
        slot, expert = _slot_expert(topk_ids_ptr)
        gamma = tl.load(gamma_ptr + slot)
        late_wait: tl.constexpr = False
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = rows < hidden
    # Split K (grid axis 2, MoeConfig.split_k): k_chunk values per split, a multiple of 32 (whole
    # blocks); split s writes slab s of y, which moe_combine sums.
    split = tl.program_id(2)
    k_lo = split * k_chunk
    act_row = act_ptr + tl.program_id(0).to(tl.int64) * stride_at + k_lo
    w_base = w_ptr + expert * stride_we + (k_lo // 32) * (BLOCK_BYTES * ROW_GROUP)
    s_base = s_ptr + expert * stride_se + (k_lo // 32) * stride_sg
    # fp16_pairs rows of act: [S, inter]; a K range starts at a whole block, so its pairs start there too
    ap_row = ap_ptr + tl.program_id(0).to(tl.int64) * inter + k_lo if ap_ptr is not None else None
    acc = _row_dots(act_row, w_base, s_base, rows, ok, tl.minimum(k_chunk, inter - k_lo), stride_wn, stride_sg,
                    hidden, BLOCK_N, BLOCK_K, ASM, F16, ROW_GROUP, MMA, MMA_SPLITS, MMA_AHEAD, late_wait, ap_row)
    # The routing weight scales the bias too (gpt-oss-model.md §2.5 step 4); split 0 adds it.
    bias = tl.load(bias_ptr + expert * hidden + rows, mask=ok & (split == 0), other=0.0)
    y = (acc + bias) * gamma
    y_row = (split * tl.num_programs(0) + slot).to(tl.int64)
    tl.store(y_ptr + y_row * stride_yt + rows, y, mask=ok)


def _checked_output(config: MoeConfig, routing: MoeRouting, a: torch.Tensor, name: str, shape_in: tuple,
                    cols_out: int, dtype: torch.dtype, out: torch.Tensor | None, slabs: int = 1) -> torch.Tensor:
    """Check a gemv call's config, routing and input `a` (`shape_in`); the [slabs * S, cols_out] output."""
    if not config.gemv:
        raise ValueError(f"the gemv kernels need a MoeConfig with gemv=True, got {config}")
    if routing.topk_ids.stride(-1) != 1 or routing.topk_weights.stride(-1) != 1:
        raise ValueError("routing top-k tensors must be contiguous")
    _check_activation(a, *shape_in, name)
    return _out_buffer(out, (slabs * routing.num_tokens * routing.top_k, cols_out), dtype, a)


def k_chunk(k: int, splits: int) -> int:
    """Values of K per split of gemv2 (whole 32-value blocks); the last split takes what is left."""
    chunk = triton.cdiv(triton.cdiv(k, splits), 32) * 32
    if (splits - 1) * chunk >= k:
        raise ValueError(f"gemv2: K = {k} cannot be split {splits} ways into whole 32-value blocks")
    return chunk


def _launch_options(config: MoeConfig, a: torch.Tensor, w: MoeWeights, rows: int, n: int, block_k: int,
                    k: int | None = None) -> dict:
    """The launch arguments both gemv kernels take from the config, their input `a` (K = its
    width, or k: the shortest K range of a program), the weights, their `rows` per program, `n`
    rows in all and K step."""
    asm = _dot_scaled_format(config, a.dtype) == "asm"
    f16 = asm and config.gemv_f16
    splits, ahead = (mma_plan(w.row_group, n, k or a.shape[1], rows, block_k, config.num_warps, config.gemv_ahead)
                     if f16 and config.gemv_mma else (0, 1))
    return {**pdl_launch(pdl_enabled(a)), "BLOCK_K": block_k, "ASM": asm, "F16": f16, "MMA": splits > 0,
            "MMA_SPLITS": max(splits, 1), "MMA_AHEAD": ahead,
            "ROW_GROUP": w.row_group, "num_warps": config.num_warps, "num_stages": config.num_stages}


def pairs_fit(config: MoeConfig, x: torch.Tensor, w: MoeWeights) -> bool:
    """Whether MoeConfig.gemv_pairs applies to a gemv step on x: gemv1 runs the tensor-core form
    (the only reader of the pairs) and the rows come in whole groups of 8."""
    return (config.gemv and config.gemv_pairs and w.hidden % 8 == 0 and w.intermediate % 8 == 0
            and _launch_options(config, x, w, 2 * config.block_n1, 2 * w.intermediate, config.block_k)["MMA"])


def _checked_pairs(pairs: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """pairs, checked as the fp16_pairs form of activations `a`: contiguous fp16 of a's shape, rows
    of whole groups of 8 (pairs_index maps a partial group past the row)."""
    if pairs.dtype != torch.float16 or pairs.shape != a.shape or not pairs.is_contiguous() or a.shape[-1] % 8:
        raise ValueError(f"activation pairs must be a contiguous fp16 {tuple(a.shape)} tensor (fp16_pairs) with "
                         f"rows of whole groups of 8, got {pairs.dtype} {tuple(pairs.shape)}")
    return pairs


def _pairs_option(pairs: torch.Tensor | None, options: dict, a: torch.Tensor, name: str) -> dict:
    """The kernel argument `name` for activations `a` in fp16_pairs form (_checked_pairs), where the
    launch runs the tensor-core form (options["MMA"]), its only reader; else none."""
    if pairs is None:
        return {}
    return {name: _checked_pairs(pairs, a)} if options["MMA"] else {}


def _logits_options(logits: torch.Tensor | None, routing: MoeRouting, w: MoeWeights, a: torch.Tensor) -> dict:
    """The launch options of a gemv that takes its routing from router logits (None: from routing).
    The router rounds its logits to the activations' dtype, so with bf16 activations `a` they are
    bf16 values and the top-k takes the one-key rounds (KEYS)."""
    if logits is None:
        return {}
    if logits.dtype != torch.float32 or logits.dim() != 2 or logits.shape[0] < routing.num_tokens \
            or logits.shape[1] != w.num_experts or logits.stride(1) != 1:
        raise ValueError(f"logits must be fp32 [>= {routing.num_tokens}, {w.num_experts}], contiguous rows")
    return {"LOGITS": True, "BLOCK_TK": triton.next_power_of_2(routing.top_k),
            "BLOCK_E": triton.next_power_of_2(w.num_experts), "KEYS": a.dtype == torch.bfloat16}


def moe_gemv1_swiglu(
    x: torch.Tensor, routing: MoeRouting, w: MoeWeights, limit: float, alpha: float, config: MoeConfig,
    out: torch.Tensor | None = None, logits: torch.Tensor | None = None, x_pairs: torch.Tensor | None = None,
    act_pairs: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [T, C] -> act [S, I] in x.dtype, row s for slot s (moe_gemm1_swiglu: sorted rows).
    logits [>= T, E] fp32 (router logits as route_tokens(topk=False) leaves them: rounded to x's
    dtype, which with bf16 x the top-k relies on): the top-k and softmax are taken here and stored
    in routing.topk_ids / topk_weights, saving the router launch its arrival counter and serial
    top-k tail. x_pairs: fp16_pairs(x), which the tensor-core form then reads instead of
    converting x in every K step of every program; act_pairs: a contiguous fp16 [S, I] buffer
    that receives fp16_pairs(act) for moe_gemv2."""
    act = _checked_output(config, routing, x, "x", (routing.num_tokens, w.hidden), w.intermediate, x.dtype, out)
    if act.shape[0] == 0:
        return act
    options = _launch_options(config, x, w, 2 * config.block_n1, 2 * w.intermediate, config.block_k)
    extra = _logits_options(logits, routing, w, x) | _pairs_option(x_pairs, options, x, "xp_ptr")
    if act_pairs is not None:
        extra["ap_out_ptr"] = _checked_pairs(act_pairs, act)
    lg = logits if logits is not None else x  # placeholder: not read without LOGITS
    _gemv1_swiglu_kernel[(act.shape[0], triton.cdiv(w.intermediate, config.block_n1))](
        x, x.stride(0), w.w1_blocks, w.w1_blocks.stride(0), w.w1_blocks.stride(1),
        w.w1_scales, w.w1_scales.stride(0), w.w1_scales.stride(1), w.w1_bias,
        act, act.stride(0), routing.topk_ids, w.hidden, w.intermediate, float(limit), float(alpha),
        lg, lg.stride(0), routing.topk_weights, w.num_experts,
        TOP_K=routing.top_k, BLOCK_N=config.block_n1, **options, **extra,
    )  # fmt: skip
    return act


def moe_gemv2(
    act: torch.Tensor, routing: MoeRouting, w: MoeWeights, config: MoeConfig, out: torch.Tensor | None = None,
    logits: torch.Tensor | None = None, act_pairs: torch.Tensor | None = None,
) -> torch.Tensor:
    """act [S, I] (slot order) -> y [S, C] fp32 in slot order, scaled by the routing weights.
    act_pairs: fp16_pairs(act), as moe_gemv1_swiglu's x_pairs. With
    config.split_k = P > 1: y [P*S, C], P slabs of partial sums over K ranges (moe_combine(splits=P)
    adds them), P times the programs for a kernel that runs out of programs per SM at one token.
    logits (as moe_gemv1_swiglu's, which must run between the router's launch and this one): the
    routing is taken from them before the PDL wait instead of from routing's top-k tensors after
    it, so the first weight loads overlap gemv1."""
    slots = routing.num_tokens * routing.top_k
    splits = config.split_k
    y = _checked_output(config, routing, act, "act", (slots, w.intermediate), w.hidden, torch.float32, out, splits)
    if y.shape[0] == 0:
        return y
    chunk = k_chunk(w.intermediate, splits)
    shortest = w.intermediate - (splits - 1) * chunk
    options = _launch_options(config, act, w, config.block_n2, w.hidden, config.gemm2_block_k, shortest)
    extra = _logits_options(logits, routing, w, act) | _pairs_option(act_pairs, options, act, "ap_ptr")
    lg = logits if logits is not None else act  # placeholder: not read without LOGITS
    _gemv2_kernel[(slots, triton.cdiv(w.hidden, config.block_n2), splits)](
        act, act.stride(0), w.w2_blocks, w.w2_blocks.stride(0), w.w2_blocks.stride(1),
        w.w2_scales, w.w2_scales.stride(0), w.w2_scales.stride(1), w.w2_bias,
        y, y.stride(0), routing.topk_weights, routing.topk_ids, w.hidden, w.intermediate, chunk,
        lg, lg.stride(0), w.num_experts, BLOCK_N=config.block_n2, TOP_K=routing.top_k, **options, **extra,
    )  # fmt: skip
    return y
