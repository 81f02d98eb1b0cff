"""Launch parameters of the MoE's grouped matmuls (MoeConfig) and the host heuristics that pick
them from the step's size (pick_config, regime_config): which kernels (matrix-vector at one token,
decode tiles for few rows per expert, prefill tiles for many) and their tile shapes. Each choice
cites the H200 measurement behind it (docs/performance.md, docs/optimizations.md); the kernels
that run them are in moe_matmul.py and moe_gemv.py."""

from __future__ import annotations

import math
from dataclasses import dataclass

import triton

from .interpreter import is_interpreted
from .mxfp4 import VALUES_PER_BLOCK

# Expected rows per expert (T*K/E, uniform routing) up to which the decode regime is used. H200,
# 20b (bench_moe, session 13): at 32 rows per expert (T = 256) the 2-warp decode tiles take 384 us
# per layer against 528 for the prefill tiles; at 16 (T = 128) both 265.
DECODE_MAX_ROWS_PER_EXPERT = 32
# Steps of at most this many tokens x experts take the fused router (MoeConfig.fused_router): one
# program per token and 2 experts, so up to 256 programs. H200, bench_router (session 26, norm
# included, against rms_norm + F.linear + top-k): 20b T=2 / 4 / 16: 5.1 / 4.5 / 5.5 us against
# 9.8 / 10.3 / 10.8, T=64 16-21 against 11.1; 120b T=2 / 4: 5.4 / 6.3 against 12.5 / 11.9, T=16 14
# against 12.2. The engine (profile_decode, session 26): docs/performance.md.
FUSED_ROUTER_SLOTS = 512
SCALE_UNPACKS = ("join", "gather", "shift", "frag")  # MoeConfig.scale_unpack / scale_unpack2


@dataclass(frozen=True)
class MoeConfig:
    """Launch parameters of the grouped matmuls. pick_config's choices come from H200 sweeps
    (docs/optimizations.md); tests force either regime with small blocks."""

    regime: str  # "decode" or "prefill" (reporting only; the numbers below decide)
    block_m: int  # sorted rows per tile; also the routing tile size
    block_n1: int  # activation columns per gemm1 program (it reads 2x that many W1 rows)
    block_n2: int  # output columns per gemm2 program
    block_k: int  # reduction step, a multiple of 32 (one scale per 32 values)
    group_m: int = 8  # tiles that sweep the column blocks together (L2 reuse)
    num_warps: int = 4
    num_stages: int = 3
    # Register cap per thread for the tiled kernels (0 = the compiler's choice): fewer registers,
    # more resident programs per SM.
    maxnreg: int = 0
    use_dot_scaled: bool = False  # GPU only: tl.dot_scaled on the packed bytes (ignored by the interpreter)
    fast_math: bool = False  # tl.dot_scaled's fast_math
    # GPU, bf16 activations, mma.sync tiles (block_m < 64): _dequant_mxfp4_bf16; the interpreter ignores it.
    asm_dequant: bool = False
    # Decode, gemm2 / gemv2 only: cut K into split_k chunks, each its own program, for more loads in
    # flight; the combine adds the partial slabs. H200, 20b T=1: gemm2 25.5 -> 18.8 us with 2
    # splits. (gemm1 was slower split, 34.4 -> 38.8 us, and no longer has the option.)
    split_k: int = 1
    # Matrix-vector kernels (moe_gemv.py) instead of tiles: one program per (slot, column
    # block), no tensor cores; block_n1/block_n2/block_k are then its tile. For ~1 row per expert.
    gemv: bool = False
    # gemv only, with asm_dequant: packed-fp16 block dot products in inline PTX (moe_gemv.py).
    gemv_f16: bool = False
    # gemv_f16 on the tensor cores (moe_gemv_mma.py; weights with row_group 16): mma.sync fed from
    # the packed words in registers, ~5.5 SASS instructions per weight byte instead of ~8. Used by
    # each gemv whose program rows (2 * block_n1, block_n2) are whole pairs of 16-row tiles, over
    # weights of whole pairs and K >= its K step; the other runs packed fp16.
    gemv_mma: bool = False
    # gemv_mma: K steps whose loads are in flight while a step's mmas run (1 or 2; 1 where K is one
    # step long).
    gemv_ahead: int = 1
    # gemv_mma with the fused router's norm (moe_block at T = 1): the router launch also writes the
    # normalised row in fp16_pairs form (the mma's B registers) and gemv1 its act, so that the gemvs'
    # K steps load B instead of converting bf16 in every step of every program (offline sm_90 K
    # loops: gemv1 181 -> 157 SASS instructions, gemv2 350 -> 306).
    gemv_pairs: bool = False
    # Decode tiles of 16 rows (block_m 16, no split-K) on the tensor cores fed from the packed
    # words (moe_group_mma.py; GPU, bf16 activations, weights with row_group 16, shapes as
    # gemv_mma's): B's 8 columns are 8 of an expert's rows, a second group of 8 shares each unpacked
    # weight fragment. block_n1 / block_n2 / block_k / num_warps then describe its programs as they
    # do the gemv's; the tiles run where the shapes do not fit.
    group_mma: bool = False
    # group_mma: K steps whose loads are in flight while a step's mmas run (gemv_ahead's twin; a
    # field of its own so that the two are tuned apart).
    group_ahead: int = 2
    # Router logits inside the top-k launch (moe_router.py) for T <= moe_router.MAX_TOKENS, instead
    # of F.linear + route (the cuBLAS split-K GEMM, its reduce kernel and the top-k kernel).
    fused_router: bool = False
    # Router logits and top-k in one launch of tensor-core tiles split along K (moe_router_tiles.py)
    # for T <= moe_router_tiles.MAX_TOKENS where fused_router is off, instead of F.linear + route.
    # H200 (session 28): bench_router 8.5-8.7 -> ~5.1 us (20b), 10.1-10.3 -> ~6.8 (120b); engine
    # 20b batch 32 5.518 -> 5.403 ms per step, 64 5.991 -> 5.936; 120b batch 8 / 64 -0.7 / -0.4 %.
    router_tiles: bool = False
    # gemv with fused_router (T = 1): the router launch stops at the logits, and every gemv1
    # program takes the top-k and softmax of its token's logits itself (the slot's first program
    # stores them for gemv2), instead of the router's last program doing it after an arrival
    # counter: one serial tail off the step's critical path. pick_config turns it on at T = 1
    # (H200, 20b batch 1: 559.8 -> 565.5 tok/s, session 12).
    gemv_topk: bool = False
    # Decode steps (moe_block's combine with the next norm): 0 = one program per token over the whole
    # row; N = programs of N columns, the token's last to arrive (an atomic counter) normalizing the
    # row from the stored h, so that no single program reads all of the token's slabs.
    combine_block: int = 0
    # With gemv_topk: gemv2 takes the top-k from the same logits too, before its PDL wait (they come
    # from two launches back), and issues its first weight loads while gemv1 still runs (session 30).
    gemv2_topk: bool = False
    # The dequantised weight tile as the left operand (acc^T = W_tile @ A^T): Hopper's wgmma then
    # takes it from registers instead of shared memory, and accepts the asm dequantisation there.
    # For prefill tiles; not with use_dot_scaled.
    swap_ab: bool = False
    # Unswapped tiles: the even and the odd K positions as two dots, so each dequantised register
    # already holds two K-consecutive values of one dot operand (the interleave of low and high
    # nibbles cost Triton ~1 PRMT per register). Offline SASS, batch-64 gemm1 K loop: 355 -> 302.
    even_odd: bool = True
    # The asm with the 2**126 folded into the scale (one packed multiply per pair instead of two)
    # where the weights allow it (MoeWeights.fold_scales). Offline SASS, batch-64 gemm1: 302 -> 270.
    fold_scales: bool = True
    # Decode tiles: read MoeWeights' split-word copy of the blocks where the weights have one
    # (prepare_moe_weights(split_copy=True), mxfp4_split.py): 5 LOP3 and 3 shifts per word instead
    # of 8 LOP3, 2 PRMT and 4 IMAD. Offline SASS, batch-64 gemm1 K loop: 450 -> 354 instructions;
    # H200 (session 38), 20b batch-64 step 5.89-5.93 -> 5.45 ms, batch 32 -8 %.
    split_words: bool = True
    # gemm1 rows per program when smaller than the routing tile (0 = block_m): each gemm1 program
    # takes one block_m1-row slice of a tile, so gemm2 can use taller tiles than gemm1. H200, 20b,
    # T=4096, swapped tiles: gemm2 1,344 -> 1,045 us at 256 rows, gemm1 1,655 -> 2,087 us.
    block_m1: int = 0
    # Swapped tiles: each K step's scales as int32 words of 4 rows, not bytes. A byte per thread is
    # below cp.async's 4-byte minimum, so Triton's pipeliner leaves the scales as a plain load inside
    # the loop; ncu's source view put the prefill gemm2's top stall on it (session 9). With words
    # they join the weights' cp.async ring (offline SASS). pick_config turns it on for prefill
    # tiles (H200, session 11: 20b TTFT 4k 81.7 -> 75.7 ms).
    scale_words: bool = False
    # gemm2's own K step and register cap (0 / None: block_k / maxnreg): the decode tiles' best K
    # step differs between the two matmuls at some step sizes (_decode_tile_changes).
    block_k2: int = 0
    maxnreg2: int | None = None
    # With scale_words, how gemm1 / gemm2 turn the words into bytes (_scale_tile; "" for gemm2: as
    # gemm1): "join", "gather", "shift" or "frag". pick_config's choices per tile height come from H200
    # measurements (session 15, docs/optimizations.md). "frag" (gemm1, K step 64, weights with
    # MoeWeights.w1_scales_frag): one word per thread and step, gemm1's weight rows permuted within
    # each 16-row block to match, so the scale tile needs no conversion either (pick_config with
    # frag_scales). gemm2's "frag" reads MoeWeights.w2_scales_frag the same way (its output
    # columns permuted, and put back before the store). Measured in session 16 (regime_config).
    scale_unpack: str = "shift"
    scale_unpack2: str = ""
    # Skip the K masks where K is a whole number of K steps (real shapes with K step 64): the
    # loads' predicates become loop-invariant. Offline sm_90: prefill gemm1 loop 253 -> 239
    # instructions, decode tiles at T=64 468 -> 446 (gemm1) and 472 -> 444 (gemm2). H200, bench_moe
    # per layer (session 15): decode 1-3 % faster (120b T=64 541.7 -> 526.4 us), prefill ~0-1 %.
    even_k: bool = True
    # gemm2 stores each slot's output rounded to the activation dtype (transformers' experts round
    # theirs too) instead of fp32: half the bytes between gemm2 and the combine, which at T=4096
    # are ~190 MB per layer in fp32. Not with split_k > 1 (partial sums stay fp32).
    round_slots: bool = False
    # Prefill tiles: a tile (gemm1: a slice) holding at most half its height in real rows runs a
    # half-height copy of the kernel's body (1), or a quarter-height one where a quarter holds its
    # rows (2), chosen per program at run time: the wgmmas, activation loads and epilogue scale
    # with the tile height, used or not. At ~128 rows per expert (120b, 4k tokens) about half of
    # gemm2's 256-row tiles and of gemm1's second 128-row slices are such tiles.
    short_tiles: int = 0
    # gemm2, with short_tiles 2 and swap_ab (ignored otherwise): a tile with more than half but at
    # most 5/8 or 3/4 of its height in rows runs as a half-height tile plus an eighth- or
    # quarter-height one, two dots sharing each dequantised weight tile (_mx_matmul_pair). At ~128
    # rows per expert most of the 256-row tiles over half full hold up to ~160 rows. gemm1 keeps its
    # slices: a second accumulator would take it past the 128 registers that fit two programs per SM.
    pair_tiles: bool = False

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n1", "block_n2", "block_k", "group_m"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"MoeConfig.{name} must be a power of two, got {v}")
        if self.block_k < VALUES_PER_BLOCK:
            raise ValueError(f"MoeConfig.block_k must be >= {VALUES_PER_BLOCK}, got {self.block_k}")
        if self.block_k2 and (self.block_k2 < VALUES_PER_BLOCK or self.block_k2 & (self.block_k2 - 1)):
            raise ValueError(f"MoeConfig.block_k2 must be 0 or a power of two >= {VALUES_PER_BLOCK}, "
                             f"got {self.block_k2}")
        if self.gemv_ahead not in (1, 2) or self.group_ahead not in (1, 2):
            raise ValueError(f"MoeConfig.gemv_ahead and group_ahead must be 1 or 2, got {self.gemv_ahead}, "
                             f"{self.group_ahead}")
        if self.split_k < 1:
            raise ValueError(f"MoeConfig.split_k must be >= 1, got {self.split_k}")
        if self.swap_ab and self.use_dot_scaled:
            raise ValueError("MoeConfig.swap_ab does not combine with use_dot_scaled")
        if self.scale_unpack not in SCALE_UNPACKS:
            raise ValueError(f"MoeConfig.scale_unpack must be one of {SCALE_UNPACKS}, got {self.scale_unpack!r}")
        if self.scale_unpack2 not in ("",) + SCALE_UNPACKS:
            raise ValueError(f"MoeConfig.scale_unpack2 must be '' or one of {SCALE_UNPACKS}, got {self.scale_unpack2!r}")
        if self.scale_unpack == "frag" and (self.block_k != 64 or not self.swap_ab):
            raise ValueError("MoeConfig.scale_unpack 'frag' needs swap_ab and block_k 64")
        if self.gemm2_scale_unpack == "frag" and (self.gemm2_block_k != 64 or not self.swap_ab):
            raise ValueError("MoeConfig.scale_unpack2 'frag' needs swap_ab and a gemm2 K step of 64")
        if self.round_slots and self.split_k > 1:
            raise ValueError("MoeConfig.round_slots needs split_k 1: split-K partial sums stay fp32")
        if self.short_tiles not in (0, 1, 2):
            raise ValueError(f"MoeConfig.short_tiles must be 0, 1 or 2, got {self.short_tiles}")
        if self.block_m1 and (self.block_m1 & (self.block_m1 - 1) or self.block_m % self.block_m1):
            raise ValueError(f"MoeConfig.block_m1 must be a power of two dividing block_m, got {self.block_m1}")

    @property
    def operands(self) -> str:
        """The OPERANDS of _mx_dot: "swapped", "even_odd" or "interleaved" (tl.dot_scaled's tiles
        ignore it: they read the packed bytes as they are)."""
        return "swapped" if self.swap_ab else "even_odd" if self.even_odd else "interleaved"

    @property
    def gemm2_block_k(self) -> int:
        return self.block_k2 or self.block_k

    @property
    def gemm2_maxnreg(self) -> int:
        return self.maxnreg if self.maxnreg2 is None else self.maxnreg2

    @property
    def gemm2_scale_unpack(self) -> str:
        """gemm2's unpack: scale_unpack2, else gemm1's."""
        return self.scale_unpack2 or self.scale_unpack

    @property
    def gemm1_rows(self) -> int:
        """Sorted rows per gemm1 program."""
        return self.block_m1 or self.block_m


def pick_config(num_tokens: int, num_experts: int, top_k: int, frag_scales: bool = False) -> MoeConfig:
    """Host-side heuristic: the regime and tile sizes from the expected rows per expert.
    `frag_scales`: the weights hold fragment-order scales (MoeWeights.w1_scales_frag and
    w2_scales_frag), which the prefill tiles then read."""
    per_expert = num_tokens * top_k / num_experts
    if num_tokens == 1:
        # One row per expert: matrix-vector kernels (moe_gemv.py), packed fp16. H200, 20b, per layer
        # (docs/performance.md, session 4): gemm1 19.2 us with 16 columns and K steps of 512 (20.9
        # with 32 columns, 41.2 in fp32). gemm2 with 8 rows per program: the engine's batch-1 step
        # fell from 2.02 to 1.90 ms against 16 rows (4 rows: 2.14; session 6). The top-k in gemv1
        # (gemv_topk): 559.8 -> 565.5 tok/s (session 12). The interpreter runs
        # programs one by one at a fixed cost each, so the CPU engine takes 64-wide blocks (the
        # kernel tests choose their own tiles).
        # gemv1 on the tensor cores (gemv_mma, session 22): 64 rows per program, the K step of 8
        # block columns split over 2 warps per pair of tiles; engine 576.4 -> 590.0 tok/s (120b 387.6
        # -> 391.3). Session 23: each lane keeps one row's sum and loads its scale byte coalesced, and
        # the loads run 2 K steps ahead (94 registers): 590.4 -> 596.8-598.1 tok/s (3 ahead: 594.0).
        # gemv2 on the tensor cores too, with K split in two (session 29): its mma form needs 32-row
        # programs, 360 of them over the whole K cost the engine 7-8 % against packed fp16 on 8 rows
        # (sessions 22-23); split_k 2 gives 720 programs, each K step 512, the combine adding the two
        # slabs. profile_decode, 20b batch 1: 1.731 / 1.736 -> 1.670 ms per step (one call), 1.733 ->
        # 1.674 (another); 120b 2.625 -> 2.539. Split in 3 with K steps of 256: 1.673; 4: 1.699.
        # gemv2 with its own top-k before its PDL wait (gemv2_topk, session 30): 1.692 -> 1.658 ms;
        # with it, gemv1 on 32-row programs (720 of them; 64 registers against 94) 1.665 -> 1.643
        # (without it 32 rows were even, sessions 23 and 30). Both: 20b 1.691 -> 1.644 ms, 120b
        # 2.585 -> 2.462. gemv1 split along K (two 64-row K ranges, the last to arrive running the
        # SwiGLU) was slower: 1.663 -> 1.717. The combine with the next norm over 256-column programs
        # (combine_block, session 32): 1.627 / 1.628 -> 1.617 / 1.621 ms (128: 1.623, 512: 1.623),
        # 120b 2.437 -> 2.426; at batch 64 it lost (5.909 -> 5.969), so only here. The gemvs on B pairs
        # written by their producers (gemv_pairs, session 33): 1.610 / 1.607 -> 1.580 / 1.579 ms (gemv1's
        # critical share 420 -> 379 us per step, the router's 84 -> 97), 120b 2.422 -> 2.403.
        wide = 64 if is_interpreted() else 0
        return MoeConfig("decode", 16, wide or 16, wide or 32, 512 if wide else 256, num_warps=4, num_stages=3,
                         asm_dequant=True, gemv=True, gemv_f16=True, fused_router=True, gemv_topk=True,
                         gemv_mma=True, gemv_ahead=2, block_k2=512, split_k=1 if wide else 2, gemv2_topk=True,
                         combine_block=256, gemv_pairs=True)
    return regime_config("decode" if per_expert <= DECODE_MAX_ROWS_PER_EXPERT else "prefill", num_tokens,
                         num_experts, top_k, frag_scales)


def _decode_tile_changes(per_expert: float, num_experts: int, group: bool = True) -> dict:
    """Where the decode tiles depart from 16 rows, K step 64 and a cap of 128 registers, measured in
    the engine (H200, profile_decode, session 14; the kernel-level wins of bench_moe's earlier,
    bias-skewed routing did not all carry over, docs/optimizations.md). 32 experts only: 120b's
    128 were slower both ways at every step size measured (bench_moe, 2 to 256 tokens).
    - >= 16 rows per expert: 32-row tiles (187 / 213 registers, no spills; 5 / 4 programs per SM),
      so each weight tile is dequantised once per 32 rows. bench_moe, 20b per layer: T=128 267.8 ->
      248.2 us, T=192 317.3 -> 251.8, T=256 386.4 -> 366.3; engine, 256 requests of 1k in / 1k out:
      13,730 -> 14,410 output tok/s.
    - 5 to 7 rows per expert: gemm2 takes K steps of 128 without a cap (142 registers). Engine, 20b
      batch 48: gemm2 74.5 -> 63.9 us per layer, step 6.209 -> 5.929 ms; at batch 64 (8 rows) it was
      2.2 us slower, at batches 8-16 (with gemm1 too) 3-10 % slower.
    - 8 to 15 rows per expert: gemm2 split in two along K. Its 736 programs (32 experts x 23 column
      tiles) are 0.62 of a wave; 1,472 fill more of the SMs. bench_moe, 20b T=64: gemm2 73.0 -> 57.6
      us (session 19); engine, batch 64: 10,153 -> 10,442 tok/s (session 20). At 2-4 rows per expert
      the combine's second slab cost more than it saved (T=16/32 moe_forward +1.7 %).
    - <= 2 rows per expert: the grouped tensor-core kernels (group_mma, moe_group_mma.py; 64 weight
      rows per program on 4 warps, K step 128, no split-K). bench_moe, 20b per layer (session 24):
      moe_forward T=4 100.3 -> 87.7 us, T=8 152.2 -> 141.9, T=16 177.5 -> 164.6; engine, batch 16:
      3,001 -> 3,115 tok/s. At 4 rows per expert they lost (T=32 180.8 -> 210.3), at 8 too (T=64
      184 -> 237), and at 128 experts they did not win (120b T=4 103 -> 114, T=8-32 even)."""
    if num_experts > 32:
        return {}
    if per_expert <= 2 and group:
        return {"group_mma": True, "block_n1": 32, "block_n2": 64, "block_k": 128, "num_warps": 4, "split_k": 1}
    if per_expert >= 16:
        return {"block_m": 32, "maxnreg": 0}
    if 8 <= per_expert < 16:
        return {"split_k": 2}
    if 5 <= per_expert < 8:
        return {"block_k2": 128, "maxnreg2": 0}
    return {}


def regime_config(regime: str, num_tokens: int, num_experts: int, top_k: int, frag_scales: bool = False,
                  group: bool = True) -> MoeConfig:
    """pick_config's tiles of `regime` ("decode" or "prefill") for a step of num_tokens > 1, whether
    or not pick_config would take that regime there (bench_moe compares them); without `group`, the
    decode tiles where pick_config would take the grouped kernels (group_mma)."""
    per_expert = num_tokens * top_k / num_experts
    if regime == "decode":
        # 2 warps per program: a K step's scales (128 weight rows x 2 groups) are then 4 bytes per
        # thread, cp.async's minimum, so they travel in the weights' pipeline ring; with 4 warps
        # they were a 1-2 byte load waited on inside every step (ncu: 42-47 % of the stall
        # samples). gemm2 takes 128 columns for the same reason. H200, per layer (bench_moe,
        # session 13), against session 12's 4-warp tiles: 20b T=64 268 -> 201 us, T=16 169 -> 130,
        # 120b T=64 532 -> 325, T=16 285 -> 202; engine 20b batch 64 7,909 -> 10,003 tok/s.
        # 128 registers: 9 programs per SM, no spills (offline sm_90). At <= 1 row per expert gemm2
        # is split in two along K for more programs in flight (20b T=4: 25.8 -> 21.6 us; 120b T=8:
        # 56.7 -> 39.4).
        tiles = {"block_m": 16, "block_n1": 64, "block_n2": 128, "block_k": 64, "num_warps": 2, "maxnreg": 128,
                 "split_k": 2 if per_expert <= 1 else 1} | _decode_tile_changes(per_expert, num_experts, group)
        fused_router = num_tokens * num_experts <= FUSED_ROUTER_SLOTS
        return MoeConfig("decode", num_stages=3, asm_dequant=True, fused_router=fused_router,
                         router_tiles=not fused_router, **tiles)
    block_m = min(256, max(32, triton.next_power_of_2(math.ceil(per_expert))))
    if per_expert >= 128:
        # At ~128 rows per expert the routing's spread gives many experts a second, nearly empty
        # 128-row tile whose weight tile gemm2 dequantises again; 256-row tiles hold each expert in
        # one. H200, 120b T=4096: gemm2 1,873 -> 1,686 us (20b T=1024: 493 -> 472). At 64 rows per
        # expert twice the tile height is slower (120b T=2048: gemm2 972 -> 1,397 us).
        block_m = 256
    # Weights as wgmma's register operand (swap_ab), dequantised by the asm: Triton 3.6 rejects the
    # asm tile as the shared-memory operand ("Illegal shared layout"), and the swapped K loop is
    # ~28 % shorter in SASS (docs/optimizations.md, session 7). 128 weight rows per tile, so each
    # of the two warpgroups dequantises its own 64. gemm2 gains from 256-row tiles, gemm1 loses,
    # so gemm1 takes them in 128-row slices. Scales as int32 words in the cp.async ring: H200, 20b
    # TTFT of a 4k prompt 81.7 -> 75.7 ms (session 11).
    # How the scale words become bytes (MoeConfig.scale_unpack; H200, bench_moe per layer, session 15),
    # against session 11's shifts: from 128-row tiles gemm1 joins (20b T=4096 1,501 -> 1,454 us, 120b
    # 1,966 -> 1,881) and gemm2 gathers (20b 879 -> 854 us, 120b 1,327 -> 1,274); TTFT of a 4k prompt
    # 20b 76.6 -> 73.0 ms, 120b 150.4 -> 143.8. 64-row tiles keep the shifts (120b T=2048: joins took
    # gemm1 1,432 -> 1,574 us and gemm2 758 -> 833, gathers gemm2 to 790).
    # Where the weights hold fragment-order words, both gemms read those at every tile height (H200,
    # bench_moe per layer, session 16): gemm1 joins -> frag 20b T=4096 1,453 -> 1,358 us, 120b
    # 1,881 -> 1,754 (TTFT of a 4k prompt 75.0 -> 72.2 ms); gemm2 gathers -> frag 20b 761 -> 735 us,
    # 120b 1,136 -> 1,091; 64-row tiles (120b T=2048), shifts -> frag: gemm1 1,358 -> 1,234 us,
    # gemm2 734 -> 656.
    if frag_scales:
        unpack = {"scale_unpack": "frag"}
    else:
        unpack = {"scale_unpack": "join", "scale_unpack2": "gather"} if block_m >= 128 else {}
    # gemm2's per-slot outputs rounded to the activation dtype (round_slots): half of y's ~190 MB
    # per layer at T=4096 between gemm2 and the combine.
    # Tiles (gemm1: slices) at most half / a quarter full run at that height (short_tiles 2). H200,
    # bench_moe moe_forward per layer (session 17): 120b T=4096 2,908 -> 2,638 us (gemm2 1,074 ->
    # 931), 20b T=4096 2,126 -> 2,053, T=1024 746 -> 679; TTFT of a 4k prompt 20b 68.6 -> 65.6 ms,
    # 120b 133.6 -> 118.5. gemm2's tiles up to 5/8 or 3/4 full as two dots (pair_tiles): 120b
    # T=4096 gemm2 904 -> 858 us, TTFT 118.8 -> 117.4 ms; 20b unchanged.
    return MoeConfig(
        "prefill", block_m=block_m, block_n1=64, block_n2=128, block_k=64,
        num_warps=8, num_stages=3, asm_dequant=True, swap_ab=True, block_m1=min(block_m, 128), scale_words=True,
        round_slots=True, short_tiles=2, pair_tiles=True, **unpack,
    )  # fmt: skip
