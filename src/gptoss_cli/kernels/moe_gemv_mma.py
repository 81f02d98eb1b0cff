"""MoE K loops on the tensor cores: mma.sync fed straight from the packed bytes.

_mma_rows is the K loop of moe_gemv.py's batch-1 kernels when MoeConfig.gemv_mma is set, and
_group_rows that of moe_group_mma.py's decode kernels (MoeConfig.group_mma), where B's 8 columns
are 8 of an expert's rows instead of one token (GPU, bf16 activations, MoeWeights.row_group 16).
The kernels, their epilogues and the fp32 fallback are in those modules; both loops are _k_loop
over the same load step and a math step of their own. What follows describes the batch-1 form;
_group_math_asm's docstring what the grouped one does differently.

Why: the packed-fp16 gemv spends ~8 SASS instructions per weight byte (dequantise, then 16
dependent fp16 FMAs per block), about the bandwidth floor's time in issue alone
(docs/optimizations.md, session 21). Here the FMAs go to the tensor cores and each lane's
registers already are its part of an m16n8k16 A fragment, so nothing passes through shared
memory: ~41-44 instructions per 8 weight bytes per lane (offline sm_90 SASS, session 23).

Fragments (PTX ISA, mma.m16n8k16 with .f16 A/B, .f32 C/D). Lane l = 4r + t (r = l // 4, t = l % 4)
holds A rows r and r + 8 at K labels (2t, 2t + 1, 2t + 8, 2t + 9), B column r at those labels,
and D[r][2t], D[r][2t + 1], D[r + 8][2t], D[r + 8][2t + 1]. The dot product does not care which
true K position a label stands for, so each lane loads one 32-bit word (8 FP4 values, K positions
8t .. 8t + 7 of a 32-value block) of row r and one of row r + 8; with MoeWeights.row_group 16 a
block column of 16 rows is 256 contiguous bytes and those are the lane's words l and l + 32.
Pair i of a word = (value i, value i + 4). Each value becomes the high byte of an fp16 whose low
byte is 0: sign to bit 7, exponent and mantissa to bits 3..1 (_high_bytes: 7 instructions for
the word's 8 values), and one prmt per pair picks two such bytes next to zero bytes. That is the
FP4 value times 2**-14 exactly (e = 0 lands on fp16 subnormals, which the tensor cores take as they
are); the 2**14 is put back after the K loop. Two mmas cover a block column: pairs 0, 1 then
2, 3, with B = the activations' matching pairs in fp16. Every B column holds the token (so lanes
load x without a mask), and so every lane (r, t) ends with D rows r and r + 8 of both tiles of its
pair: it keeps row r + 8t (tile t // 2, row r + 8 (t % 2)), scales it by that row's E8M0 scale in
fp32 and accumulates it, so the 32 lanes hold the pair's 32 rows and each loads one scale byte
(32 contiguous bytes per warp). One asm instance takes TILES = 2 tiles (sharing the activation
pairs) and GB block columns. Its loads (_load_asm) and its mmas (_math_asm) are two pieces of asm,
software-pipelined AHEAD (1 or 2) K steps apart through loop-carried tuples: with the loads inside
the mmas' asm, ptxas sank each load down to its use and kept two or three in flight per warp
(session 22). The weights travel AHEAD steps through the loop-carried registers (5 per block
column: 4 words and a scale byte; session 23: the pipelined registers are the bytes in flight, and
two steps ahead fit in 94 registers; three ahead, 135 registers, were slower in the engine); the
activation words (_x_load_asm, 4 per block column) one step: read at the top of the step that
uses them, their L1/L2 round trip held up each step's first mma (Nsight Compute, session 36: a
third of gemv1's stall samples on that one instruction; one step ahead, 20b batch 1 -0.7 %, 120b
-2.5 %). The grouped kernels still read theirs inside the math step.

Layout: all memory goes through the inline asm, and every tensor handed to it is
[KS, pairs, 32] built from aranges, whose default Triton layout puts the 32 lanes on the last
dimension: nothing in Triton can choose another (a tl.load could: the coalescing pass orders
dimensions by contiguity and puts lanes on the tile dimension; the grouped kernels' first token
gather did exactly that, session 24, so it reads the slots by inline asm). The warps hold the
pairs of tiles, then K splits (KS): each K step is KS * GB block columns.

Numerics: FP4 values are exact in fp16; a bf16 activation is exact in fp16 down to 2**-14 (and to
the nearest 2**-24 below), and overflows beyond 65504, which makes the program redo its rows in
fp32 (_mx_gemv). Products and sums are the tensor cores' fp32, more exact than the packed-fp16
path's fp16 block sums. The x loads are in a non-pure asm so that they stay after the PDL wait.

B pairs (MoeConfig.gemv_pairs): the B registers depend only on the token's row, yet every warp of
every program rebuilds them in every K step (_x_pairs, ~20 % of gemv1's K loop). fp16_pairs is
that form of a whole row (the same cvt.rn values), written once by the row's producer (the
router's norm for gemv1, in pairs_order; gemv1's epilogue for gemv2's act, through pairs_index);
"math-pairs" then loads the four B words directly (offline sm_90: gemv1's loop 181 -> 157 SASS
instructions, gemv2's 350 -> 306).
"""

from __future__ import annotations

import hashlib

import torch
import triton
import triton.language as tl

from .pdl import wait_for_previous

ROW_GROUP = 16  # the packed layout these kernels read (MoeWeights.row_group)
FP16_SHIFT = tl.constexpr(16384.0)  # 2**14: the pairs hold FP4 values times 2**-14


def _high_bytes(word: str) -> str:
    """PTX: the fp16 high byte of each of `word`'s 8 values times 2**-14 (sign to bit 7, exponent and
    mantissa to bits 3..1; the low byte is 0): values 0, 2, 4, 6 (low nibbles) as the bytes of hl,
    values 1, 3, 5, 7 as those of hh."""
    return (f"\nshl.b32 u, {word}, 1; and.b32 u, u, 0x0E0E0E0E; shl.b32 q, {word}, 4; and.b32 q, q, 0x80808080;"
            f" or.b32 hl, q, u;"
            f"\nshr.b32 u, {word}, 3; and.b32 u, u, 0x0E0E0E0E; and.b32 q, {word}, 0x80808080; or.b32 hh, q, u;")


def _pairs(regs: tuple[str, str, str, str]) -> str:
    """PTX: the word's pairs (value i, value i + 4), i = 0..3, as fp16x2 (value times 2**-14) from
    hl / hh: one prmt each, the low bytes taken from a zero register."""
    p0, p1, p2, p3 = regs
    return (f"\nprmt.b32 {p0}, hl, 0, 0x2404; prmt.b32 {p2}, hl, 0, 0x3414;"
            f" prmt.b32 {p1}, hh, 0, 0x2404; prmt.b32 {p3}, hh, 0, 0x3414;")


def _x_pairs(words: list[str], pairs: tuple[str, str, str, str] | list[str]) -> str:
    """PTX: the fp16x2 B registers `pairs` from 4 words of bf16 activations (x[8t + 2j], x[8t + 2j + 1]
    in word j): pair i = (x_i, x_(i + 4)), from words i // 2 and i // 2 + 2, x_i in the low half."""
    out = []
    for i in range(4):
        lo, hi = words[i // 2], words[i // 2 + 2]
        if i % 2 == 0:
            out.append(f"\nshl.b32 fl, {lo}, 16; shl.b32 fh, {hi}, 16;")
        else:
            out.append(f"\nand.b32 fl, {lo}, 0xFFFF0000; and.b32 fh, {hi}, 0xFFFF0000;")
        out.append(f" cvt.rn.f16x2.f32 {pairs[i]}, fh, fl;")
    return "".join(out)


TILES = tl.constexpr(2)  # 16-row tiles per asm instance (one pair): they share its activation pairs
# Registers one block column loads per lane ahead of its mmas: the words of rows r and r + 8 of
# both tiles, and the scale byte of the row the lane accumulates. (The activations are a step of
# their own: _x_load_asm.)
LOADED = 2 * TILES.value + 1


def _load_asm(gb: int, nc: bool = True) -> str:
    """Loads of one K step of gb block columns for a pair of tiles, per lane (r, t); outputs, block
    column g at $(5 g) on: the words of (tile 0 row r, tile 0 row r + 8, tile 1 row r, tile 1 row
    r + 8), then the scale byte of the pair's row r + 8t. Inputs after the 5 gb outputs: the first
    word's address at the step's first block column (row r + 8: + 128 bytes; block column g:
    + 256 g; tile 1: + the second input's bytes); the scale byte's there (block column g: + g * the
    fourth input). The addresses are always valid (the caller clamps them). Without `nc`, plain
    loads instead of the read-only path: ptxas moves a PDL wait (griddepcontrol.wait) above .nc
    loads, not above plain ones (offline sm_90), and loads issued before the wait are the point
    of _k_loop's WAIT."""
    w0, wt, s0, sb = (f"${LOADED * gb + i}" for i in range(4))
    ld = "ld.global.nc" if nc else "ld.global"
    out = []
    for g in range(gb):
        base = LOADED * g
        out.extend(f" {ld}.b32 ${base + k}, [{w0 if k < 2 else 'w1'}+{256 * g + 128 * (k % 2)}];"
                   for k in range(2 * TILES.value))
        out.append(f"\n{ld}.u8 ${base + 2 * TILES.value}, [sp];" + ("\nadd.s64 sp, sp, sg;" if g + 1 < gb else ""))
    return ("{\n.reg .b64 w1, sp, sg;"
            f"\nadd.s64 w1, {w0}, {wt}; mov.b64 sp, {s0}; cvt.u64.u32 sg, {sb};\n" + "".join(out) + "\n}")


def _x_load_asm(gb: int) -> str:
    """The activation words of one K step's gb block columns for lane (r, t): outputs $0 ..
    $(4 gb - 1), block column g's four words at $(4 g) (x[8t .. 8t + 7] of that block column, bf16 or
    fp16_pairs); inputs: their address at the step's first block column (block column g: + 64 g
    bytes), then skip: block columns g < skip read as zeros (the last step is moved back to end at
    K, and the block columns it repeats must count as x = 0). Plain loads: x is the previous
    launch's output, read after the PDL wait."""
    addr, skip = f"${4 * gb}", f"${4 * gb + 1}"
    out = []
    for g in range(gb):
        words = [f"${4 * g + i}" for i in range(4)]
        out.append("\n" + "".join(f" mov.b32 {r}, 0;" for r in words)
                   + f" setp.le.s32 p, {skip}, {g}; @p ld.global.v4.b32 {{{', '.join(words)}}}, [{addr}+{64 * g}];")
    return "{\n.reg .pred p;" + "".join(out) + "\n}"


def _math_asm(gb: int, pairs: bool = False) -> str:
    """The mmas of one K step (_load_asm's registers): $0 = $1 + the scaled dot products of lane
    (r, t)'s row r + 8t of the pair; block column g's loaded registers at $(2 + 5 g) on, in
    _load_asm's order; then the step's activation words (_x_load_asm's outputs, loaded a step
    earlier), then t. Lane (r, t) holds D rows r and r + 8 of both tiles' mmas (every B column is the
    token) and keeps the one of row r + 8t: tile t // 2, row r + 8 (t % 2). `pairs`: x is already in
    B's form (fp16_pairs), so the four words are the B registers and the step converts nothing."""
    n = 2 * TILES.value
    x0 = 2 + LOADED * gb
    xs = [[f"${x0 + 4 * g + i}" for i in range(4)] for g in range(gb)]
    lane_t = f"${x0 + 4 * gb}"
    math = [f"\nand.b32 q, {lane_t}, 1; setp.ne.s32 odd, q, 0; and.b32 q, {lane_t}, 2; setp.ne.s32 second, q, 0;"]
    for g in range(gb):
        base = 2 + LOADED * g
        words, scale = [f"${base + k}" for k in range(n)], f"${base + n}"
        if pairs:
            b = xs[g]
        else:
            b = ("b0", "b1", "b2", "b3")
            math.append(_x_pairs(xs[g], b))
        for m in range(TILES.value):
            math.append(_high_bytes(words[2 * m]) + _pairs(("a0", "a2", "a4", "a6")))
            math.append(_high_bytes(words[2 * m + 1]) + _pairs(("a1", "a3", "a5", "a7")))
            math.append(
                "\nmma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {d0, d1, d2, d3}, {a0, a1, a2, a3},"
                f" {{{b[0]}, {b[1]}}}, {{z, z, z, z}};"
                "\nmma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {d0, d1, d2, d3}, {a4, a5, a6, a7},"
                f" {{{b[2]}, {b[3]}}}, {{d0, d1, d2, d3}};\nselp.f32 v{m}, d2, d0, odd;")
        acc = "$0" if g else "$1"
        math.append(f"\nselp.f32 v0, v1, v0, second; shl.b32 u, {scale}, 23; mov.b32 fs, u; fma.rn.f32 $0, v0, fs, {acc};")
    return (
        "{\n.reg .pred odd, second;\n.reg .b32 q, u, hl, hh, a0, a1, a2, a3, a4, a5, a6, a7"
        + ("" if pairs else ", b0, b1, b2, b3") + ";"
        "\n.reg .f32 d0, d1, d2, d3, z, fs" + ("" if pairs else ", fl, fh") + ", v0, v1;\nmov.f32 z, 0f00000000;"
        + "".join(math) + "\n}"
    )


def _group_math_asm(gb: int, groups: int) -> str:
    """The mmas of one K step for 8 * groups tokens (moe_group_mma.py): B's column r is token
    8q + r of group q, so lane (r, t) reads that token's x[8t ..] and ends each mma with D rows r and
    r + 8, tokens 2t and 2t + 1 (module docstring). Outputs $0 .. $(n - 1), n = 8 * groups: the
    accumulators, index 8q + 4m + j for group q, tile m and D register j (row r + 8 (j // 2), token
    2t + j % 2 of the group); then the same accumulators in; then _load_asm's registers; then per
    group the address of its lane's token's x[8t] at the step's first block column (block column g:
    + 64 g bytes); then skip, as in _math_asm. Each A fragment is unpacked once for all groups, and
    each row's scale, D's rows r and r + 8, comes from the quad lane that loaded it (lane (r, 2m)
    holds tile m's row r, lane (r, 2m + 1) its row r + 8)."""
    n = 8 * groups
    loaded0 = 2 * n
    x0 = [f"${loaded0 + LOADED * gb + q}" for q in range(groups)]
    skip = f"${loaded0 + LOADED * gb + groups}"
    xs = [[[f"x{g}_{q}_{i}" for i in range(4)] for q in range(groups)] for g in range(gb)]
    bs = [[f"b{q}_{i}" for i in range(4)] for q in range(groups)]
    math = []
    for g in range(gb):  # all of the step's activation loads first: their latency overlaps the unpacking
        math.append(f"\nsetp.le.s32 p, {skip}, {g};")
        for q in range(groups):
            math.append("\n" + "".join(f" mov.b32 {r}, 0;" for r in xs[g][q])
                        + f" @p ld.global.v4.b32 {{{', '.join(xs[g][q])}}}, [{x0[q]}+{64 * g}];")
    for g in range(gb):
        base = loaded0 + LOADED * g
        words, scale = [f"${base + k}" for k in range(2 * TILES.value)], f"${base + 2 * TILES.value}"
        # segment of 4 lanes (c = 0x1c1f): source lane j of the lane's own quad
        math.append("\n" + " ".join(f"shfl.sync.idx.b32 u, {scale}, {j}, 0x1c1f, 0xffffffff; shl.b32 u, u, 23;"
                                     f" mov.b32 s{j}, u;" for j in range(4)))
        math.extend(_x_pairs(xs[g][q], bs[q]) for q in range(groups))
        for m in range(TILES.value):
            math.append(_high_bytes(words[2 * m]) + _pairs(("a0", "a2", "a4", "a6")))
            math.append(_high_bytes(words[2 * m + 1]) + _pairs(("a1", "a3", "a5", "a7")))
            for q in range(groups):
                b = bs[q]
                math.append(
                    "\nmma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {d0, d1, d2, d3}, {a0, a1, a2, a3},"
                    f" {{{b[0]}, {b[1]}}}, {{z, z, z, z}};"
                    "\nmma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {d0, d1, d2, d3}, {a4, a5, a6, a7},"
                    f" {{{b[2]}, {b[3]}}}, {{d0, d1, d2, d3}};\n")
                for j in range(4):
                    out = 8 * q + 4 * m + j
                    acc = f"${out}" if g else f"${n + out}"
                    math.append(f" fma.rn.f32 ${out}, d{j}, s{2 * m + j // 2}, {acc};")
    regs = [r for g in xs for q in g for r in q] + [r for b in bs for r in b]
    return (
        "{\n.reg .pred p;\n.reg .b32 q, u, hl, hh, a0, a1, a2, a3, a4, a5, a6, a7, " + ", ".join(regs) + ";"
        "\n.reg .f32 d0, d1, d2, d3, z, fl, fh, s0, s1, s2, s3;\nmov.f32 z, 0f00000000;" + "".join(math) + "\n}"
    )


def asm_step(kind: str, gb: int, groups: int = 0) -> tuple[str, str, tuple]:
    """(text, constraints, result types) of one asm step over gb block columns: "load"
    (_load_asm), "load-early" (its plain-load form), "x" (_x_load_asm), "math" (_math_asm), "math-pairs"
    (its form on fp16_pairs activations) or "group" (_group_math_asm over `groups` groups of 8 tokens)."""
    loads = LOADED * gb
    if kind in ("load", "load-early"):
        return _load_asm(gb, kind == "load"), "=r," * loads + "l,l,l,r", (tl.int32,) * loads
    if kind == "x":
        return _x_load_asm(gb), "=r," * (4 * gb) + "l,r", (tl.int32,) * (4 * gb)
    if kind in ("math", "math-pairs"):
        return _math_asm(gb, kind == "math-pairs"), "=f,f" + ",r" * (loads + 4 * gb) + ",r", (tl.float32,)
    n = 8 * groups
    return (_group_math_asm(gb, groups), "=f," * n + "f," * n + "r," * loads + "l," * groups + "r",
            (tl.float32,) * n)


# Every step the kernels take, built once: a constexpr function may read a dict but not call a
# plain Python function.
_ASM_STEPS = {(kind, gb, groups): asm_step(kind, gb, groups)
              for kind, groups in (("load", 0), ("load-early", 0), ("x", 0), ("math", 0), ("math-pairs", 0),
                                   ("group", 1), ("group", 2))
              for gb in (1, 2, 4)}
# Triton's cache key covers a kernel's source and the values of the constexpr globals it reads, not
# other globals such as the dict above: without this digest (read by _asm_call), a changed asm text
# would compile to a new kernel only with an empty cache, and an upgraded install would keep running
# the kernels ~/.triton/cache holds from the old texts (seen offline, session 37).
def asm_digest(steps: dict) -> str:
    """sha256 of every step's text, constraints and result types."""
    return hashlib.sha256(repr(sorted((k, v[0], v[1], str(v[2])) for k, v in steps.items())).encode()).hexdigest()


_ASM_DIGEST = tl.constexpr(asm_digest(_ASM_STEPS))


@triton.constexpr_function
def _asm_text(kind: str, gb: int, groups: int):
    return _ASM_STEPS[(kind, gb, groups)][0]


@triton.constexpr_function
def _asm_constraints(kind: str, gb: int, groups: int):
    return _ASM_STEPS[(kind, gb, groups)][1]


@triton.constexpr_function
def _asm_types(kind: str, gb: int, groups: int):
    return _ASM_STEPS[(kind, gb, groups)][2]


@triton.jit
def _asm_call(KIND: tl.constexpr, GB: tl.constexpr, GROUPS: tl.constexpr, args):
    """asm_step(KIND, GB, GROUPS) on `args` ([KS, P, 32] operands). Not pure: the loads must stay
    where the K loop's software pipelining puts them, and the math steps' activation loads after
    the PDL wait, like any read of a launch's output."""
    tl.static_assert(GB == 1 or GB == 2 or GB == 4, "the tensor-core steps take 1, 2 or 4 block columns per asm")
    tl.static_assert(_ASM_DIGEST != "", "the asm texts' digest (part of the cache key)")
    return tl.inline_asm_elementwise(_asm_text(KIND, GB, GROUPS), _asm_constraints(KIND, GB, GROUPS), args,
                                     dtype=_asm_types(KIND, GB, GROUPS), is_pure=False, pack=1)


@triton.jit
def _load_step(GB: tl.constexpr, w_addr, w_tile, s_addr, s_block, EARLY: tl.constexpr = False):
    """_load_asm(GB) on [KS, P, 32] operands (EARLY: plain loads, "load-early"): a tuple of
    LOADED * GB int32 tensors."""
    if EARLY:
        out = _asm_call("load-early", GB, 0, (w_addr, w_tile, s_addr, s_block))
    else:
        out = _asm_call("load", GB, 0, (w_addr, w_tile, s_addr, s_block))
    return out


@triton.jit
def _x_step(GB: tl.constexpr, x_addr, skip):
    """_x_load_asm(GB): the 4 * GB activation words of one K step (block columns below skip: 0)."""
    return _asm_call("x", GB, 0, (x_addr, skip))


@triton.jit
def _math_step(GB: tl.constexpr, acc, loaded, xs, lane_t, PAIRS: tl.constexpr = False):
    """_math_asm(GB, PAIRS): the accumulator after one K step of `loaded` (_load_step's tuple) and
    `xs` (_x_step's)."""
    if PAIRS:
        out = _asm_call("math-pairs", GB, 0, (acc,) + loaded + xs + (lane_t,))[0]
    else:
        out = _asm_call("math", GB, 0, (acc,) + loaded + xs + (lane_t,))[0]
    return out


@triton.jit
def _group_math_step(GB: tl.constexpr, GROUPS: tl.constexpr, acc, loaded, x_ptrs, kb, skip):
    """_group_math_asm(GB, GROUPS) at block column kb: the tuple of 8 * GROUPS accumulators after
    one K step; x_ptrs holds each group's lane x pointers at block column 0."""
    if GROUPS == 1:
        xs = ((x_ptrs[0] + kb * 32).to(tl.int64),)
    else:
        tl.static_assert(GROUPS == 2, "the grouped mma takes 1 or 2 groups of 8 tokens")
        xs = ((x_ptrs[0] + kb * 32).to(tl.int64), (x_ptrs[1] + kb * 32).to(tl.int64))
    return _asm_call("group", GB, GROUPS, acc + loaded + xs + (skip,))


@triton.jit
def _x_at(GB: tl.constexpr, GROUPS: tl.constexpr, x_ptrs, kb, skip):
    """The batch-1 step's activation words at block column kb (_x_step), or for the grouped step,
    which loads its own, a placeholder."""
    if GROUPS == 0:
        out = _x_step(GB, (x_ptrs + kb * 32).to(tl.int64), skip)
    else:
        out = (skip,)
    return out


@triton.jit
def _math_at(GB: tl.constexpr, GROUPS: tl.constexpr, acc, loaded, x_ptrs, kb, skip, lane_t, xs,
             PAIRS: tl.constexpr = False):
    """One K step's mmas: the batch-1 step (GROUPS 0: one accumulator; PAIRS: x in fp16_pairs form)
    on its activation words `xs` (_x_at, loaded a step before), or the grouped one (tuples of
    accumulators and x pointers), which reads its own at block column kb."""
    if GROUPS == 0:
        out = _math_step(GB, acc, loaded, xs, lane_t, PAIRS)
    else:
        out = _group_math_step(GB, GROUPS, acc, loaded, x_ptrs, kb, skip)
    return out


@triton.jit
def _lanes(w_base, s_base, first_tile, n_tiles, stride_wn, stride_sg, P: tl.constexpr, GB: tl.constexpr,
           KS: tl.constexpr):
    """The asm's per-lane operands on [KS, P, 32] (K split, pair of tiles, lane): the first word's and
    the scale byte's addresses at block column 0, the tile and block-column strides, lane % 4, this
    split's first block column within a step, and a zero that broadcasts scalars."""
    lane = tl.arange(0, 32)[None, None, :]
    split = tl.arange(0, KS)[:, None, None]
    # Clamped: the asm reads every tile it is given; rows of tiles past the end are masked later.
    tile = tl.minimum(first_tile + tl.arange(0, P)[None, :, None] * TILES, n_tiles - TILES)
    own = split * GB
    full = split * 0 + tile * 0 + lane * 0
    lane_t = lane % 4 + full
    # Lane l's word of row r at block column 0 is word l of the tile's first 256 bytes (row + 8: + 128 bytes).
    w_ptrs = w_base + tile.to(tl.int64) * stride_wn + lane * 4 + own * 256
    s_ptrs = s_base + tile * 16 + lane // 4 + lane_t * 8 + own * stride_sg  # row r + 8t of the pair
    return w_ptrs, s_ptrs, (stride_wn + full).to(tl.int64), stride_sg + full, lane_t, own, full


@triton.jit
def _k_loop(acc, x_ptrs, w_ptrs, w_tile, s_ptrs, s_block, stride_sg, no_skip, lane_t, n_blocks,
            GB: tl.constexpr, KS: tl.constexpr, AHEAD: tl.constexpr, GROUPS: tl.constexpr,
            WAIT: tl.constexpr = False, PAIRS: tl.constexpr = False):
    """acc after the whole K loop (_math_at's accumulators). Each K step covers KS * GB block
    columns; the weight loads run AHEAD (1 or 2; at most K's steps) K steps before their mmas, the
    batch-1 step's activation loads one step before theirs.
    Software-pipelined: the loads of the next AHEAD steps are in flight while a step's mmas run.
    WAIT: the PDL wait (pdl.py) comes here, after the first AHEAD steps' weight loads and before
    the first activation load, for a kernel that knows its expert before the wait. PAIRS: the
    batch-1 step's activations are in fp16_pairs form."""
    per_step = KS * GB
    last = n_blocks - per_step  # the last step is moved back to end at K
    final = (n_blocks - 1) // per_step * per_step  # the last step's place before the move
    moved = tl.minimum(final, last)
    # The block columns the moved-back last step repeats count as x = 0: the step before counted them.
    moved_skip = (final - moved) + no_skip
    loaded = _load_at(GB, w_ptrs, w_tile, s_ptrs, s_block, stride_sg, 0, last, WAIT)
    # Each step issues the next step's activation loads before its own mmas (_x_at), so that their
    # latency runs under them.
    if AHEAD == 2:
        second = _load_at(GB, w_ptrs, w_tile, s_ptrs, s_block, stride_sg, per_step, last, WAIT)
        wait_for_previous(WAIT)
        xs = _x_at(GB, GROUPS, x_ptrs, 0, no_skip)
        for kb in range(2 * per_step, n_blocks, per_step):
            ahead = _load_at(GB, w_ptrs, w_tile, s_ptrs, s_block, stride_sg, kb, last)
            nxt = _x_at(GB, GROUPS, x_ptrs, kb - per_step, no_skip)
            acc = _math_at(GB, GROUPS, acc, loaded, x_ptrs, kb - 2 * per_step, no_skip, lane_t, xs, PAIRS)
            loaded = second
            second = ahead
            xs = nxt
        nxt = _x_at(GB, GROUPS, x_ptrs, moved, moved_skip)
        acc = _math_at(GB, GROUPS, acc, loaded, x_ptrs, final - per_step, no_skip, lane_t, xs, PAIRS)
        loaded = second
        xs = nxt
    else:
        wait_for_previous(WAIT)
        xs = _x_at(GB, GROUPS, x_ptrs, 0, no_skip)
        for kb in range(per_step, n_blocks, per_step):
            ahead = _load_at(GB, w_ptrs, w_tile, s_ptrs, s_block, stride_sg, kb, last)
            # the next step is kb, or the moved-back last one where kb is the last step's place
            nearest = tl.minimum(kb, last)
            nxt = _x_at(GB, GROUPS, x_ptrs, nearest, (kb - nearest) + no_skip)
            acc = _math_at(GB, GROUPS, acc, loaded, x_ptrs, kb - per_step, no_skip, lane_t, xs, PAIRS)
            loaded = ahead
            xs = nxt
    return _math_at(GB, GROUPS, acc, loaded, x_ptrs, moved, moved_skip, lane_t, xs, PAIRS)


@triton.jit
def _mma_rows(x_row, w_base, s_base, first_tile, n_tiles, K, stride_wn, stride_sg,
              T: tl.constexpr, GB: tl.constexpr, KS: tl.constexpr, AHEAD: tl.constexpr, WAIT: tl.constexpr = False,
              PAIRS: tl.constexpr = False):
    """[T * 16] fp32 = W[16 first_tile .. + 16 T, :K] @ x[:K] in row order (tiles past n_tiles:
    garbage, to be masked by the caller); NaN/inf where an activation overflowed fp16. WAIT: the
    PDL wait after the first weight loads (_k_loop). PAIRS: x_row is the row in fp16_pairs form.
    Tensors are [KS, T // TILES, 32] (K split, pair of tiles, lane): _k_loop's steps.
    All memory goes through the inline asm, so no layout choice of Triton's can move the lanes
    off the last dimension."""
    P: tl.constexpr = T // TILES
    w_ptrs, s_ptrs, w_tile, s_block, lane_t, own, full = _lanes(w_base, s_base, first_tile, n_tiles, stride_wn,
                                                                stride_sg, P, GB, KS)
    x_ptrs = x_row + lane_t * 8 + own * 32  # every B column holds the token
    acc = _k_loop(tl.zeros((KS, P, 32), dtype=tl.float32), x_ptrs, w_ptrs, w_tile, s_ptrs, s_block, stride_sg,
                  full - own, lane_t, K // 32, GB, KS, AHEAD, 0, WAIT, PAIRS)
    rows = tl.reshape(tl.sum(acc, axis=0), (P, 8, 4))  # lane (r, t): row r + 8t of pair p
    return tl.reshape(tl.permute(rows, (0, 2, 1)), (T * 16,)) * FP16_SHIFT


@triton.jit
def _group_rows(x_ptr, stride_xt, slots_ptr, start, count, w_base, s_base, first_tile, n_tiles, K, stride_wn,
                stride_sg, T: tl.constexpr, GB: tl.constexpr, KS: tl.constexpr, AHEAD: tl.constexpr,
                GROUPS: tl.constexpr, TOP_K: tl.constexpr, GATHER: tl.constexpr):
    """[T * 16, 8 * GROUPS] fp32 = W[16 first_tile .. + 16 T, :K] @ X^T for the `count` sorted rows
    from `start` (columns past count and tiles past n_tiles: garbage, to be masked by the caller);
    NaN/inf where an activation overflowed fp16. X's row of sorted row i is x's row i, or with
    GATHER its token, slots_ptr[i] // TOP_K. B's column r of group q is sorted row start + 8q + r,
    clamped to the last one."""
    P: tl.constexpr = T // TILES
    w_ptrs, s_ptrs, w_tile, s_block, lane_t, own, full = _lanes(w_base, s_base, first_tile, n_tiles, stride_wn,
                                                                stride_sg, P, GB, KS)
    r = tl.arange(0, 32)[None, None, :] // 4 + full
    x_ptrs = (_x_lanes(x_ptr, stride_xt, slots_ptr, start + tl.minimum(r, count - 1), TOP_K, GATHER)
              + lane_t * 8 + own * 32,)
    zero = tl.zeros((KS, P, 32), dtype=tl.float32)
    acc = (zero, zero, zero, zero, zero, zero, zero, zero)
    if GROUPS == 2:
        x_ptrs = x_ptrs + (_x_lanes(x_ptr, stride_xt, slots_ptr, start + tl.minimum(r + 8, count - 1), TOP_K,
                                    GATHER) + lane_t * 8 + own * 32,)
        acc = acc + acc
    acc = _k_loop(acc, x_ptrs, w_ptrs, w_tile, s_ptrs, s_block, stride_sg, full - own, lane_t, K // 32, GB, KS,
                  AHEAD, GROUPS)
    if GROUPS == 1:
        out = _group_cols(acc, 0, P)
    else:  # [rows, 8, group] -> token 8q + r
        both = tl.join(_group_cols(acc, 0, P), _group_cols(acc, 1, P))
        out = tl.reshape(tl.permute(both, (0, 2, 1)), (T * 16, 16))
    return out * FP16_SHIFT


@triton.jit
def _x_lanes(x_ptr, stride_xt, slots_ptr, rows, TOP_K: tl.constexpr, GATHER: tl.constexpr):
    """x's row of each lane's sorted row: itself, or with GATHER its slot's token. The slot is read
    by inline asm: a tl.load here would anchor the layout of every [KS, P, 32] operand of the
    asm steps and move the lanes off the last dimension (offline sm_90 TTGIR, session 24)."""
    if GATHER:
        slots = tl.inline_asm_elementwise("ld.global.b32 $0, [$1];", "=r,l", [(slots_ptr + rows).to(tl.int64)],
                                          dtype=tl.int32, is_pure=False, pack=1)
        rows = slots // TOP_K
    return x_ptr + rows.to(tl.int64) * stride_xt


@triton.jit
def _d_columns(a, b, P: tl.constexpr):
    """Two D registers of tokens 2t and 2t + 1 ([KS, P, 32], summed over K splits) -> [P, 8 r, 8 tokens]."""
    return tl.reshape(tl.join(tl.sum(a, axis=0), tl.sum(b, axis=0)), (P, 8, 8))


@triton.jit
def _group_cols(acc, Q: tl.constexpr, P: tl.constexpr):
    """Group Q's accumulators (_group_math_asm's order) -> [P * 32 rows, 8 tokens]: row 32p + 16m +
    8h + r of D register 2h + c of tile m, token 2t + c."""
    b: tl.constexpr = 8 * Q
    t0 = tl.join(_d_columns(acc[b], acc[b + 1], P), _d_columns(acc[b + 2], acc[b + 3], P))  # [P, r, tok, h]
    t1 = tl.join(_d_columns(acc[b + 4], acc[b + 5], P), _d_columns(acc[b + 6], acc[b + 7], P))
    return tl.reshape(tl.permute(tl.join(t0, t1), (0, 4, 3, 1, 2)), (P * 32, 8))


@triton.jit
def _load_at(GB: tl.constexpr, w_ptrs, w_tile, s_ptrs, s_block, stride_sg, kb, last, EARLY: tl.constexpr = False):
    """_load_step for the K step at block column kb, moved back to `last` if it would pass K."""
    first = tl.minimum(kb, last)
    return _load_step(GB, (w_ptrs + first * 256).to(tl.int64), w_tile, (s_ptrs + first * stride_sg).to(tl.int64),
                      s_block, EARLY)


@triton.jit
def pairs_index(cols):
    """Where fp16_pairs puts activation column `cols`: value i of each 8 at 2 i, value i + 4 at
    2 i + 1 (i < 4). For producers whose threads hold single values (gemv1's act: one value per
    thread, nothing to vectorise); pairs_order for those that hold whole groups."""
    j = cols % 8
    return cols - j + (j % 4) * 2 + j // 4


@triton.jit
def pairs_order(v):
    """Rows v [R, C] (C a multiple of 8, each row's first column at a multiple of 8) in fp16_pairs'
    order: stored at contiguous columns, each value lands where fp16_pairs puts it, so a producer
    writes whole 16-byte groups (one vector store each) instead of scattering 2-byte values."""
    R: tl.constexpr = v.shape[0]
    C: tl.constexpr = v.shape[1]
    tl.static_assert(C % 8 == 0, "fp16_pairs groups values by 8")
    return tl.reshape(tl.permute(tl.reshape(v, [R, C // 8, 2, 4]), (0, 1, 3, 2)), [R, C])


def fp16_pairs(x: torch.Tensor) -> torch.Tensor:
    """Activations [T, K] (K a multiple of 8) -> [T, K] fp16 in the batch-1 math step's B form: in
    each 8 values x_0 .. x_7, the pairs (x_i, x_(i + 4)), i = 0 .. 3, x_i in the low half, as
    _x_pairs builds them from bf16 in every K step of every program (cvt.rn: round to nearest, and
    inf beyond fp16's range, which sends the gemv to its fp32 redo as before)."""
    t, k = x.shape
    if k % 8:
        raise ValueError(f"fp16_pairs: K must be a multiple of 8, got {k}")
    return x.reshape(t, k // 8, 2, 4).transpose(2, 3).reshape(t, k).to(torch.float16)


def mma_splits(rows: int, block_k: int, num_warps: int) -> int:
    """K splits of a program of `rows` rows on `num_warps` warps (one warp per pair of tiles and
    split); raises unless the shape fits: whole pairs of tiles, 1, 2 or 4 block columns per asm step."""
    pairs = rows // (16 * TILES.value)
    splits = max(1, num_warps // max(pairs, 1))
    per_asm = block_k // 32 // splits
    if rows % (16 * TILES.value) or pairs * splits not in (num_warps, pairs) or per_asm not in (1, 2, 4) \
            or per_asm * splits * 32 != block_k:
        raise ValueError(f"gemv_mma: {rows} rows per program, K step {block_k} and {num_warps} warps do not fit "
                         f"(pairs of 16-row tiles, {TILES.value * 16 * num_warps} rows or K splits over the warps, "
                         "1, 2 or 4 block columns per split)")
    return splits


def mma_plan(row_group: int, n: int, k: int, rows: int, block_k: int, num_warps: int, ahead: int) -> tuple[int, int]:
    """(K splits, steps ahead) of a launch on these kernels (mma_splits), or (0, 1) where it does
    not suit them and the packed-fp16 path runs: weights (`n` x `k`) not in the 16-row groups they
    read, not whole pairs of tiles (a pair would straddle the end), programs of part of a pair, or
    K shorter than a K step (the last step is moved back to end at K). Loads run `ahead` steps
    before their mmas, or as many as K has steps. A program shape that cannot split its K step
    over the warps is an error (mma_splits)."""
    if row_group != ROW_GROUP or n % (16 * TILES.value) or rows % (16 * TILES.value):
        return 0, 1
    splits = mma_splits(rows, block_k, num_warps)
    if k < block_k:
        return 0, 1
    return splits, min(ahead, -(-k // block_k))
