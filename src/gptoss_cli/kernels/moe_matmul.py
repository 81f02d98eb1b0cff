"""Grouped MXFP4 matmuls of the MoE, straight from the packed expert bytes (gpt-oss-model.md §2.5, §3.1).

For each sorted row r (one token slot, see moe_routing.py) routed to expert e:
  gemm1:   act[r]      = swiglu(x[token(r)] @ W1_e^T + b1_e)      [S, I] in x.dtype, sorted order
  gemm2:   y[slot(r)]  = w_slot * (act[r] @ W2_e^T + b2_e)         [S, C] fp32 (x.dtype with
                                                                   MoeConfig.round_slots), slot order
  combine: out[t]      = sum_k y[t*K + k]                          [T, C] in x.dtype
A program owns one tile of BLOCK_M sorted rows of one expert (from the routing tile table) and
BLOCK_N output columns, so each packed weight tile is read once per tile, not once per token.

Weight layout (prepare_moe_weights, a one-time re-layout, nothing dequantised):
  blocks [E, N/R, (K/32)*R*16] u8: the checkpoint's 16-byte blocks (byte b of a block holds its
                          elements 2b in the low nibble and 2b+1 in the high one), R = row_group
                          rows at a time: for each group of R rows, block column 0 of those R rows
                          (R*16 contiguous bytes), then block column 1, ... So a kernel's K step
                          over R rows reads one contiguous piece instead of R pieces a row apart
                          (H200, load-only, gemv1's programs: 56-59 -> 65-67 % of copy bandwidth,
                          78 % with 16-row, 512-byte steps; benchmarks/bench_weight_stream.py).
                          R = 1 is the checkpoint's row-major order;
  scales [E, K/32, N] u8: transposed so one 32-group's scales for a run of rows are contiguous;
  w1_scales_frag [E, C/64, 2I, 2] u8, w2_scales_frag [E, I/64, C, 2] u8 (optional,
                          prepare_moe_weights(frag_scales=True)): the scales again, each row's two
                          32-groups of a 64-wide K step side by side, so one int32 word holds rows
                          2q, 2q + 1 x both groups: exactly one thread's scales in a prefill tile
                          (MoeConfig.scale_unpack / scale_unpack2 "frag");
  biases [E, N] fp32;
  w1_split, w2_split (optional, prepare_moe_weights(split_copy=True)): the blocks again with each
                          32-bit word's bits in the split-word order (mxfp4_split.py), which the
                          decode tiles read (MoeConfig.split_words).
Dequantisation in registers (the portable path): nibble s|e1 e0|m moved to fp16 bits 15 and
11..9 is exactly FP4_VALUES[nibble] * 2**-14 (e = 0 lands on fp16 subnormals, which GPUs keep),
and an E8M0 byte shifted into an fp32 exponent is exactly 2**(s - 127); folding the 2**14 into it
keeps every value exact for 1 <= s <= 240 (s = 0 reads as 0 instead of 2**-127; real checkpoints
use scales near 2**-6). On the GPU `use_dot_scaled` hands the bytes to tl.dot_scaled instead.

Regimes (moe_config.pick_config, chosen on the host from T, which is static inside a CUDA graph):
  decode:  few rows per expert, bandwidth-bound: BLOCK_M 16 (tl.dot's minimum), narrow column
           blocks so the ~53 MB of a token's 4 experts (real shapes) spread over hundreds of programs;
  prefill: many rows per expert, tensor-core bound: BLOCK_M grows with rows per expert to 256
           (gemm1 in slices of at most 128), the weight tile as wgmma's register operand; a
           tile (slice) that holds fewer rows runs a copy of the body at half or a quarter of
           the height, gemm2's just over half full as two dots (MoeConfig.short_tiles, pair_tiles).
Dimension legend: T tokens, C hidden, I intermediate, E experts, K experts per token, S = T*K.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .interpreter import dot_dtype, is_interpreted
from .moe_config import MoeConfig
from .moe_routing import MoeRouting
from .mxfp4 import BYTES_PER_BLOCK, VALUES_PER_BLOCK, dequantize_mxfp4
from .mxfp4_split import SPLIT_TO_BF16_ASM, SPLIT_TO_BF16_FOLDED_ASM, split_words
from .pdl import pdl_enabled, pdl_launch, wait_for_previous
from .rmsnorm import normalize_rows

# Largest E8M0 byte the folded asm takes: its scale operand 2**(s - 1) must be a bf16 normal.
FOLD_MAX_SCALE = 128
# Rows per contiguous group of the packed expert bytes (MoeWeights.row_group). H200, per layer
# (bench_moe, session 12), row-major / 8 / 16 / 32: 20b T=1 moe_forward 35.3 / 33.9 / 33.5 / 33.5
# us, T=64 265.9 / 269.5 / 269.2 / 278.1, 120b T=64 548.5 / 531.9 / 532.1 / 533.9; engine 20b
# batch 64 8,034 / 7,917 / 7,914 / 7,713 tok/s. 16 keeps the batch-1 gain at the least batch-64 cost.
ROW_GROUP = 16
BLOCK_BYTES = tl.constexpr(BYTES_PER_BLOCK)  # the kernels' name for it
COMBINE_BLOCK = 256  # columns per combine program
COMBINE_TOKENS = 16  # tokens per combine program


@dataclass
class MoeWeights:
    """Expert weights as the kernels read them (layout in the module docstring).

    w1_blocks [E, 2I/R, C/2*R] u8, w1_scales [E, C/32, 2I] u8, w1_bias [E, 2I] fp32 (gate/up interleaved rows)
    w2_blocks [E, C/R, I/2*R] u8,  w2_scales [E, I/32, C] u8,  w2_bias [E, C] fp32
    R = row_group: the blocks' rows come in groups of R (module docstring); 1 = row-major.
    """

    w1_blocks: torch.Tensor
    w1_scales: torch.Tensor
    w1_bias: torch.Tensor
    w2_blocks: torch.Tensor
    w2_scales: torch.Tensor
    w2_bias: torch.Tensor
    # Every scale byte <= FOLD_MAX_SCALE, so the asm may fold 2**126 into the scale (_fp4_pairs_bf16).
    fold_scales: bool = False
    row_group: int = 1
    w1_scales_frag: torch.Tensor | None = None  # [E, ceil(C/64), 2I, 2] u8 (module docstring)
    w2_scales_frag: torch.Tensor | None = None  # [E, ceil(I/64), C, 2] u8
    w1_split: torch.Tensor | None = None  # w1_blocks in the split-word order (mxfp4_split.py)
    w2_split: torch.Tensor | None = None  # w2_blocks likewise

    @property
    def has_frag_scales(self) -> bool:
        """Both fragment-order copies are there (prepare_moe_weights builds them together)."""
        return self.w1_scales_frag is not None and self.w2_scales_frag is not None

    @property
    def num_experts(self) -> int:
        return self.w1_scales.shape[0]

    @property
    def hidden(self) -> int:
        return self.w2_scales.shape[2]

    @property
    def intermediate(self) -> int:
        return self.w1_scales.shape[2] // 2


def _packed_layout(blocks: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor, name: str, shape: tuple,
                   row_group: int):
    """Checkpoint [E, N, K/32, 16] + [E, N, K/32] + [E, N] -> kernel layout, after checking shapes."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise TypeError(f"{name} blocks/scales must be uint8, got {blocks.dtype}/{scales.dtype}")
    e, n, groups = shape
    if tuple(blocks.shape) != (e, n, groups, BYTES_PER_BLOCK) or tuple(scales.shape) != (e, n, groups):
        raise ValueError(
            f"{name}: expected blocks {(e, n, groups, BYTES_PER_BLOCK)} and scales {(e, n, groups)}, "
            f"got {tuple(blocks.shape)} and {tuple(scales.shape)}"
        )
    if tuple(bias.shape) != (e, n):
        raise ValueError(f"{name} bias: expected {(e, n)}, got {tuple(bias.shape)}")
    packed = blocks.reshape(e, n // row_group, row_group, groups, BYTES_PER_BLOCK).transpose(2, 3)
    packed = packed.reshape(e, n // row_group, groups * row_group * BYTES_PER_BLOCK).contiguous()  # a copy if R > 1
    return packed, scales.transpose(1, 2).contiguous(), bias.float().contiguous()


def prepare_moe_weights(
    w1_blocks: torch.Tensor,
    w1_scales: torch.Tensor,
    w1_bias: torch.Tensor,
    w2_blocks: torch.Tensor,
    w2_scales: torch.Tensor,
    w2_bias: torch.Tensor,
    row_group: int = ROW_GROUP,
    frag_scales: bool = False,
    split_copy: bool = False,
) -> MoeWeights:
    """Checkpoint tensors (gpt-oss-model.md §3.1) -> MoeWeights. Blocks keep their bytes, in groups
    of `row_group` rows (module docstring; 1 keeps the checkpoint order, a view when contiguous;
    a row count it does not divide falls back to 1), scales are transposed, biases become fp32.
    frag_scales: also the scales in fragment order (w1_scales_frag, w2_scales_frag: 1/32 of the
    experts' bytes). split_copy: also the blocks in the split-word order (w1_split, w2_split: as many
    bytes again), which the decode tiles then read."""
    if w1_blocks.dim() != 4 or w2_blocks.dim() != 4:
        shapes = f"{tuple(w1_blocks.shape)}, {tuple(w2_blocks.shape)}"
        raise ValueError(f"expert blocks must be [E, N, K/32, 16], got {shapes}")
    experts, two_inter, hidden_groups = w1_blocks.shape[:3]
    hidden, inter = hidden_groups * VALUES_PER_BLOCK, two_inter // 2
    if two_inter % 2 or inter % VALUES_PER_BLOCK:
        raise ValueError(f"gate_up rows must be 2*I with I a multiple of {VALUES_PER_BLOCK}, got {two_inter}")
    devices = {t.device for t in (w1_blocks, w1_scales, w1_bias, w2_blocks, w2_scales, w2_bias)}
    if len(devices) != 1:
        raise ValueError(f"expert tensors are on several devices: {sorted(map(str, devices))}")
    if row_group < 1 or row_group & (row_group - 1):
        raise ValueError(f"row_group must be a power of two, got {row_group}")
    if two_inter % row_group or hidden % row_group:
        row_group = 1
    w1 = _packed_layout(w1_blocks, w1_scales, w1_bias, "gate_up", (experts, two_inter, hidden // VALUES_PER_BLOCK),
                        row_group)
    w2 = _packed_layout(w2_blocks, w2_scales, w2_bias, "down", (experts, hidden, inter // VALUES_PER_BLOCK), row_group)
    # One host sync per layer, at load: real scales sit far below the bound (weights under 12).
    fold = max(int(w1_scales.max()), int(w2_scales.max())) <= FOLD_MAX_SCALE if w1_scales.numel() else True
    frag = (_fragment_scales(w1_scales), _fragment_scales(w2_scales)) if frag_scales else (None, None)
    split = (split_words(w1[0]), split_words(w2[0])) if split_copy else (None, None)
    return MoeWeights(*w1, *w2, fold_scales=fold, row_group=row_group, w1_scales_frag=frag[0], w2_scales_frag=frag[1],
                      w1_split=split[0], w2_split=split[1])


def _fragment_scales(scales: torch.Tensor) -> torch.Tensor:
    """Checkpoint scales [E, N, K/32] -> [E, ceil(K/64), N, 2]: the two 32-groups of each 64-wide K
    step side by side per row (an odd last group gets a zero partner, whose K range the kernels mask)."""
    e, n, groups = scales.shape
    padded = torch.zeros(e, n, groups + groups % 2, dtype=scales.dtype, device=scales.device)
    padded[:, :, :groups] = scales
    return padded.view(e, n, -1, 2).permute(0, 2, 1, 3).contiguous()


def _dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs get full-precision dots (not TF32): fp32 is the exactness reference."""
    return "ieee" if dot_dtype(dtype) == tl.float32 else "tf32"  # tf32 has no effect on 16-bit inputs


def _register_cap(maxnreg: int) -> dict:
    """The launch's maxnreg option where the config caps registers (0: no cap)."""
    return {"maxnreg": maxnreg} if maxnreg else {}


def _scale_mode(config: MoeConfig, block_rows: int, unpack: str) -> str:
    """SCALES of a tiled kernel whose programs take `block_rows` weight rows: words unpacked the
    config's way (`unpack`) for the swapped prefill tiles when those come in whole quads, else
    bytes. Weight row counts are hidden or 2 * intermediate, both multiples of 32 (each is some
    matmul's K), so every quad's scale word is 4-byte aligned."""
    return unpack if config.scale_words and config.swap_ab and block_rows % 4 == 0 else "bytes"


def _dot_scaled_format(config: MoeConfig, dtype: torch.dtype, fold_scales: bool = False) -> str:
    """The A_FORMAT of _mx_dot: tl.dot_scaled's name for the activation type, "asm" for the packed
    bf16 dequantisation ("asm-folded" where the weights' scales allow one multiply), or "" where
    the portable path must run (interpreter, fp32, fp16)."""
    if is_interpreted():
        return ""
    if config.use_dot_scaled:
        return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, "")
    if not (config.asm_dequant and dtype == torch.bfloat16):
        return ""
    return "asm-folded" if config.fold_scales and fold_scales else "asm"


def _weight_bytes(config: MoeConfig, blocks: torch.Tensor, split: torch.Tensor | None, dtype: torch.dtype,
                  fold_scales: bool) -> tuple[torch.Tensor, str]:
    """(packed bytes, A_FORMAT) of a tiled kernel: the split-word copy (mxfp4_split.py) where the
    weights have one, MoeConfig.split_words allows it and the tiles are the decode ones (even/odd
    operands, asm dequantisation: their packs of 4 bytes are aligned words), else the blocks."""
    fmt = _dot_scaled_format(config, dtype, fold_scales)
    if split is not None and config.split_words and config.operands == "even_odd" and fmt in ("asm", "asm-folded"):
        return split, fmt.replace("asm", "asm-split")
    return blocks, fmt


@triton.jit
def _tile_coords(pid, num_tiles, num_n, GROUP_M: tl.constexpr):
    """Program -> (tile, column block): GROUP_M consecutive tiles sweep the column blocks
    together so their weight tiles and activation rows are shared through L2."""
    per_group = GROUP_M * num_n
    first = (pid // per_group) * GROUP_M
    size = tl.minimum(num_tiles - first, GROUP_M)
    local = pid % per_group
    return first + local % size, local // size


@triton.jit
def _k_range(K, SPLIT_K: tl.constexpr, BLOCK_K: tl.constexpr):
    """(first K index, length) of this program's K chunk (axis 1 of the grid), whole BLOCK_K steps."""
    if SPLIT_K == 1:
        return 0, K
    chunk = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
    k_lo = tl.program_id(1) * chunk
    return k_lo, tl.maximum(tl.minimum(chunk, K - k_lo), 0)


@triton.jit
def _fp4_bits(blk):
    """[..., 16] u8 -> fp16 bit patterns (low nibbles, high nibbles) as u16: FP4_VALUES[nibble] * 2**-14.
    Straight from the byte, two shifts and an and-or per value (one LOP3 on the GPU)."""
    b = blk.to(tl.uint16)
    lo = ((b << 9) & 0x0E00) | ((b << 12) & 0x8000)
    hi = ((b << 5) & 0x0E00) | ((b << 8) & 0x8000)
    return lo, hi


@triton.jit
def _scale_fp32(scl):
    """E8M0 bytes -> fp32 2**(s-127) * 2**14 (the 2**14 undoes _fp4_bits' fp16 offset)."""
    return (scl.to(tl.int32) << 23).to(tl.float32, bitcast=True) * 16384.0


@triton.jit
def _dequant_mxfp4(blk, scl, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """[BLOCK_N, G, 16] u8 + [BLOCK_N, G] u8 -> [BLOCK_N, BLOCK_K] fp32, exact (module docstring)."""
    lo, hi = _dequant_mxfp4_halves(blk, scl)
    return tl.reshape(tl.interleave(lo, hi), (BLOCK_N, BLOCK_K))  # element 2i from the low nibble of byte i


@triton.jit
def _dequant_mxfp4_halves(blk, scl):
    """[R, G, 16] u8 + [R, G] u8 -> (low-nibble, high-nibble) values [R, G, 16] fp32, exact."""
    lo, hi = _fp4_bits(blk)
    scale = _scale_fp32(scl)[:, :, None]  # undoes the 2**-14 of FP4_VALUES[nibble] * 2**-14
    return (lo.to(tl.float16, bitcast=True).to(tl.float32) * scale,
            hi.to(tl.float16, bitcast=True).to(tl.float32) * scale)


# Four packed bytes (eight FP4 values) per instance, $4; their four bf16 scales in $5, $6 (two per
# register). Bytes are spread into 16-bit lanes (prmt); a nibble n in a lane, masked, times
# 2**6 + 2**12 (or 2**2 + 2**8 for the high nibble, already 4 bits up) lands its e1 e0 m bits on
# bf16 bits 8..6 and its sign on bit 15 with no overlap, so one and, one multiply and one and give
# FP4 * 2**-126 in both lanes (e = 0 lands on bf16 subnormals); then two exact packed multiplies:
# by 2**126 and by the scale. Out: low nibbles in $0, $1, high nibbles in $2, $3.
_FP4_TO_BF16_ASM = tl.constexpr("""
{
.reg .b32 t<2>, x, c, z, zero;
mov.b32 c, 0x7E807E80;
mov.b32 z, 0x80008000;
mov.b32 zero, 0;
prmt.b32 t0, $4, zero, 0x4140;
prmt.b32 t1, $4, zero, 0x4342;
and.b32 x, t0, 0x000F000F; mul.lo.u32 x, x, 0x1040; and.b32 x, x, 0x81C081C0;
fma.rn.bf16x2 x, x, c, z; fma.rn.bf16x2 $0, x, $5, z;
and.b32 x, t1, 0x000F000F; mul.lo.u32 x, x, 0x1040; and.b32 x, x, 0x81C081C0;
fma.rn.bf16x2 x, x, c, z; fma.rn.bf16x2 $1, x, $6, z;
and.b32 x, t0, 0x00F000F0; mul.lo.u32 x, x, 0x104; and.b32 x, x, 0x81C081C0;
fma.rn.bf16x2 x, x, c, z; fma.rn.bf16x2 $2, x, $5, z;
and.b32 x, t1, 0x00F000F0; mul.lo.u32 x, x, 0x104; and.b32 x, x, 0x81C081C0;
fma.rn.bf16x2 x, x, c, z; fma.rn.bf16x2 $3, x, $6, z;
}
""")
# The same with 2**126 folded into the scales ($5, $6 hold 2**(s - 1), a bf16 normal for s <= 128): one
# packed multiply per register. Exact for 1 <= s <= 128 as above; s = 0 gives FP4 * 2**-127 here.
_FP4_TO_BF16_FOLDED_ASM = tl.constexpr("""
{
.reg .b32 t<2>, x, z, zero;
mov.b32 z, 0x80008000;
mov.b32 zero, 0;
prmt.b32 t0, $4, zero, 0x4140;
prmt.b32 t1, $4, zero, 0x4342;
and.b32 x, t0, 0x000F000F; mul.lo.u32 x, x, 0x1040; and.b32 x, x, 0x81C081C0; fma.rn.bf16x2 $0, x, $5, z;
and.b32 x, t1, 0x000F000F; mul.lo.u32 x, x, 0x1040; and.b32 x, x, 0x81C081C0; fma.rn.bf16x2 $1, x, $6, z;
and.b32 x, t0, 0x00F000F0; mul.lo.u32 x, x, 0x104; and.b32 x, x, 0x81C081C0; fma.rn.bf16x2 $2, x, $5, z;
and.b32 x, t1, 0x00F000F0; mul.lo.u32 x, x, 0x104; and.b32 x, x, 0x81C081C0; fma.rn.bf16x2 $3, x, $6, z;
}
""")


@triton.constexpr_function
def _asm_format(a_format) -> bool:
    """The A_FORMATs dequantised by _fp4_pairs_bf16: "asm", "asm-folded" (MoeWeights.fold_scales) and
    their "-split" twins (the bytes in the split-word order, mxfp4_split.py)."""
    return a_format in ("asm", "asm-folded", "asm-split", "asm-split-folded")


@triton.constexpr_function
def _asm_folded(a_format) -> bool:
    return a_format in ("asm-folded", "asm-split-folded")


@triton.constexpr_function
def _asm_split(a_format) -> bool:
    return a_format in ("asm-split", "asm-split-folded")


@triton.jit
def _fp4_pairs_bf16(blk, scl, FOLDED: tl.constexpr, SPLIT: tl.constexpr = False):
    """[R, G, 16] u8 + [R, G] u8 -> (low-nibble, high-nibble) values, bf16, scaled; GPU only.
    Exact: the E8M0 byte shifted into a bf16 exponent is 2**(s - 127) for 1 <= s <= 254, and
    FOLDED (every s <= FOLD_MAX_SCALE) shifts s + 126 there instead, 2**(s - 1). SPLIT: blk holds
    split-word bytes and each pack of 4 is one aligned word of them (the decode tiles' loads).
    tests/kernels/test_mxfp4_asm.py runs the PTX text through an instruction-level emulator on
    the CPU; the H200 tests check the hardware."""
    if FOLDED:
        scale = ((scl.to(tl.uint16) + 126) << 7).to(tl.bfloat16, bitcast=True)
    else:
        scale = (scl.to(tl.uint16) << 7).to(tl.bfloat16, bitcast=True)
    scale = tl.broadcast_to(scale[:, :, None], blk.shape)
    return tl.inline_asm_elementwise(
        (SPLIT_TO_BF16_FOLDED_ASM if FOLDED else SPLIT_TO_BF16_ASM) if SPLIT else
        (_FP4_TO_BF16_FOLDED_ASM if FOLDED else _FP4_TO_BF16_ASM),
        "=r,=r,=r,=r,r,r,r", [blk, scale], dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4,
    )  # fmt: skip


@triton.jit
def _dequant_mxfp4_bf16(blk, scl, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FOLDED: tl.constexpr,
                        SPLIT: tl.constexpr = False):
    """GPU-only twin of _dequant_mxfp4 with bf16 out and no fp32 round trip: the decode kernels'
    SASS loop bodies shrink by about a third (docs/optimizations.md), and decode time is spent on
    these instructions more than on bytes."""
    lo, hi = _fp4_pairs_bf16(blk, scl, FOLDED, SPLIT)
    return tl.reshape(tl.interleave(lo, hi), (BLOCK_N, BLOCK_K))


@triton.jit
def _dequant_tile(blk, scl, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_DTYPE: tl.constexpr,
                  A_FORMAT: tl.constexpr):
    """W_tile [BLOCK_N, BLOCK_K] in the dot's dtype: packed bf16 by the asm, else via fp32."""
    if _asm_format(A_FORMAT):
        return _dequant_mxfp4_bf16(blk, scl, BLOCK_N, BLOCK_K, _asm_folded(A_FORMAT), _asm_split(A_FORMAT))
    return _dequant_mxfp4(blk, scl, BLOCK_N, BLOCK_K).to(DOT_DTYPE)


@triton.jit
def _mx_dot(
    acc, a, blk, scl, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr, A_FORMAT: tl.constexpr, FAST_MATH: tl.constexpr, OPERANDS: tl.constexpr,
):  # fmt: skip
    """acc [BLOCK_M, BLOCK_N] += a [BLOCK_M, BLOCK_K] @ W_tile^T, or with OPERANDS "swapped" acc
    [BLOCK_N, BLOCK_M] += W_tile @ a^T (MoeConfig.operands); A_FORMAT "" = dequantise by hand in
    fp32, "asm" / "asm-folded" (and "-split" on split-word bytes) = by hand in packed bf16,
    otherwise tl.dot_scaled's name for the activation type (only "interleaved")."""
    ASM: tl.constexpr = _asm_format(A_FORMAT)
    if ASM or A_FORMAT == "":
        dt = tl.bfloat16 if ASM else DOT_DTYPE
        if OPERANDS == "even_odd":
            if ASM:
                lo, hi = _fp4_pairs_bf16(blk, scl, _asm_folded(A_FORMAT), _asm_split(A_FORMAT))
            else:
                lo, hi = _dequant_mxfp4_halves(blk, scl)
            lo = tl.reshape(lo.to(dt), (BLOCK_N, BLOCK_K // 2))  # W[:, 0::2]
            hi = tl.reshape(hi.to(dt), (BLOCK_N, BLOCK_K // 2))  # W[:, 1::2]
            a_even, a_odd = tl.split(tl.reshape(a.to(dt), (a.shape[0], BLOCK_K // 2, 2)))
            acc = tl.dot(a_even, tl.trans(lo), acc, input_precision=DOT_PRECISION)
            acc = tl.dot(a_odd, tl.trans(hi), acc, input_precision=DOT_PRECISION)
        else:
            w = _dequant_tile(blk, scl, BLOCK_N, BLOCK_K, DOT_DTYPE, A_FORMAT)
            if OPERANDS == "swapped":
                acc = tl.dot(w, tl.trans(a.to(dt)), acc, input_precision=DOT_PRECISION)
            else:
                acc = tl.dot(a.to(dt), tl.trans(w), acc, input_precision=DOT_PRECISION)
    else:
        packed = tl.reshape(blk, (BLOCK_N, BLOCK_K // 2))  # packed along K, low nibble first
        acc = tl.dot_scaled(a, None, A_FORMAT, tl.trans(packed), scl, "e2m1", acc, fast_math=FAST_MATH)
    return acc


@triton.jit
def _swiglu(gate, up, limit, alpha):
    """Clamped SwiGLU of gpt-oss: upper clamp on the gate, both-sided clamp and +1 on the linear part."""
    gate = tl.minimum(gate, limit)
    up = tl.minimum(tl.maximum(up, -limit), limit)
    return gate * tl.sigmoid(alpha * gate) * (up + 1.0)


@triton.jit
def _row_offsets(wrows, stride_wn, ROW_GROUP: tl.constexpr, UNIT: tl.constexpr = 1):
    """Offset of block column 0 of each weight row, in elements of UNIT bytes (stride_wn: bytes
    per group of ROW_GROUP rows); block column g of a row sits g * 16 * ROW_GROUP bytes further
    (module docstring). Dividing the stride (not the sum) keeps the launcher's divisibility hint
    visible to the compiler, so 16-byte vector loads survive a UNIT of 4 (offline sm_90)."""
    return (wrows // ROW_GROUP).to(tl.int64) * (stride_wn // UNIT) + (wrows % ROW_GROUP) * (BLOCK_BYTES // UNIT)


@triton.jit
def _frag_rows(first, BLOCK_N: tl.constexpr):
    """Weight row of each dot row for "frag" scales: dot row 16a + 8h + i <-> weight row
    16a + 2i + h, so a thread's two rows of a 16-row wgmma fragment (i and i + 8) are the adjacent
    rows whose scales share one fragment-order word."""
    d = tl.arange(0, BLOCK_N)
    return first + (d // 16) * 16 + 2 * (d % 8) + (d % 16) // 8


@triton.jit
def _frag_unpermute(acc, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """[BLOCK_M, BLOCK_N] columns in _frag_rows' dot order -> weight-row order: [a, h, i] -> [a, i, h]."""
    acc = tl.reshape(acc, (BLOCK_M, BLOCK_N // 16, 2, 8))
    return tl.reshape(tl.permute(acc, (0, 1, 3, 2)), (BLOCK_M, BLOCK_N))


@triton.jit
def _scale_pointers(s_base, wrows, wrow_ok, g, stride_sg, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    SCALES: tl.constexpr):
    """(pointers, advance per K step, mask) of the first K step's scales of `wrows`: one per byte for
    "bytes", one per aligned int32 word for the word modes (_scale_mode): per row for "gather", per
    quad of rows (wrows run in aligned quads) for "join" and "shift", per pair of rows for "frag"
    (s_base / stride_sg then address w1_scales_frag; wrows are _frag_rows of a block starting at a
    multiple of 16)."""
    if SCALES == "frag":
        first = tl.min(wrows, axis=0)
        ptrs = (s_base + 2 * first).to(tl.pointer_type(tl.int32)) + tl.arange(0, BLOCK_N // 2)
        step = stride_sg // 4
        # word q = 8a + i holds rows 2q, 2q + 1: dot rows 16a + i and 16a + 8 + i (_frag_rows)
        ok = tl.max(tl.reshape(wrow_ok.to(tl.int32), (BLOCK_N // 16, 2, 8)), axis=1)
        ok = tl.reshape(ok, (BLOCK_N // 2,)) > 0
    elif SCALES == "bytes":
        ptrs = s_base + g[None, :] * stride_sg + wrows[:, None]
        step = (BLOCK_K // 32) * stride_sg
        ok = wrow_ok
    elif SCALES == "gather":
        ptrs = (s_base + g[None, :] * stride_sg + (wrows // 4 * 4)[:, None]).to(tl.pointer_type(tl.int32))
        step = (BLOCK_K // 32) * (stride_sg // 4)
        ok = wrow_ok
    else:
        quad = tl.min(tl.reshape(wrows, (BLOCK_N // 4, 4)), axis=1)  # first row of each quad
        ok = tl.max(tl.reshape(wrow_ok.to(tl.int32), (BLOCK_N // 4, 4)), axis=1) > 0
        ptrs = (s_base + g[None, :] * stride_sg + quad[:, None]).to(tl.pointer_type(tl.int32))
        step = (BLOCK_K // 32) * (stride_sg // 4)
    return ptrs, step, ok


@triton.jit
def _word_bytes(words):
    """The 4 bytes of each int32 word as two trailing dims [..., 2, 2]: byte 2s + t at [..., t, s].
    Constant shifts and joins only, which Triton's layout pass carries through (_scale_tile)."""
    low = tl.join(words & 0xFF, (words >> 8) & 0xFF)
    high = tl.join((words >> 16) & 0xFF, (words >> 24) & 0xFF)
    return tl.join(low, high)


@triton.jit
def _scale_tile(ptrs, ok, g_ok, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SCALES: tl.constexpr):
    """One K step's scales [BLOCK_N, BLOCK_K // 32] u8 from _scale_pointers' pointers. The word modes
    give the same bytes; they differ in the layouts Triton's layout pass then picks (offline sm_90,
    docs/optimizations.md, session 15): with "join" (constant shifts, joined) the dequantised weights
    reach wgmma without a trip through shared memory and the 4 wgmmas of a step overlap; any shift by
    a range tensor ("shift", "gather") makes the pass convert the dequantised tile instead."""
    if SCALES == "bytes":
        tile = tl.load(ptrs, mask=ok[:, None] & g_ok[None, :], other=0)
    elif SCALES == "frag":  # both groups of the step are in the (padded) array: only rows mask
        words = tl.load(ptrs, mask=ok, other=0)  # [BLOCK_N // 2]; bytes 2h + group: row 2q + h
        quads = tl.reshape(_word_bytes(words), (BLOCK_N // 16, 8, 2, 2))  # [a, i, group, h]
        tile = tl.reshape(tl.permute(quads, (0, 3, 1, 2)), (BLOCK_N, BLOCK_K // 32)).to(tl.uint8)
    else:
        words = tl.load(ptrs, mask=ok[:, None] & g_ok[None, :], other=0)
        if SCALES == "gather":  # wrows start at a multiple of 4
            tile = ((words >> (8 * (tl.arange(0, BLOCK_N) % 4))[:, None]) & 0xFF).to(tl.uint8)
        elif SCALES == "shift":
            shifts = (8 * tl.arange(0, 4))[None, :, None]
            tile = tl.reshape((words[:, None, :] >> shifts) & 0xFF, (BLOCK_N, BLOCK_K // 32)).to(tl.uint8)
        else:  # [quad, group, t, s]: row 4 * quad + 2s + t
            tile = tl.reshape(tl.permute(_word_bytes(words), (0, 3, 2, 1)), (BLOCK_N, BLOCK_K // 32)).to(tl.uint8)
    return tile


@triton.jit
def _mx_matmul(
    a_ptrs, a_row_ok, w_base, s_base, wrows, wrow_ok, K, stride_wn, stride_sg,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr, A_FORMAT: tl.constexpr, FAST_MATH: tl.constexpr, OPERANDS: tl.constexpr,
    SCALES: tl.constexpr, ROW_GROUP: tl.constexpr, EVEN_K: tl.constexpr,
):  # fmt: skip
    """[BLOCK_M, BLOCK_N] fp32 = A[:, :K] @ W[wrows, :K]^T with W packed MXFP4 (module docstring).
    "swapped" OPERANDS accumulate the transpose (MoeConfig.swap_ab), transposed back at the end.

    a_ptrs [BLOCK_M, BLOCK_K] point at A[:, 0:BLOCK_K]; K is a multiple of 32, so the masks at
    32-group granularity are exact. Out-of-range rows and columns read as 0. SCALES: _scale_mode;
    EVEN_K: K is a multiple of BLOCK_K, so no step needs a K mask.

    The callers tell the compiler K > 0 (tl.assume) where it holds: otherwise LLVM may give the
    no-iteration path its own block that zeroes the accumulator's registers, and ptxas, seeing
    non-wgmma writes to them while wgmmas are in flight (C7515), serialises every wgmma of the
    loop (offline sm_90: gemm2 at every tile height, gemm1 at 64 rows; session 16).
    """
    blk_ptrs, scl_ptrs, scl_step, scl_ok = _weight_pointers(w_base, s_base, wrows, wrow_ok, stride_wn, stride_sg,
                                                            BLOCK_N, BLOCK_K, SCALES, ROW_GROUP)
    if OPERANDS == "swapped":
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        left = BLOCK_K if EVEN_K else K - k0  # EVEN_K: the loads' predicates stay loop-invariant
        a = _activation_step(a_ptrs, a_row_ok, left, BLOCK_K)
        blk, scl = _weight_step(blk_ptrs, scl_ptrs, scl_ok, wrow_ok, left, BLOCK_N, BLOCK_K, SCALES)
        acc = _mx_dot(acc, a, blk, scl, BLOCK_N, BLOCK_K, DOT_DTYPE, DOT_PRECISION, A_FORMAT, FAST_MATH, OPERANDS)
        a_ptrs += BLOCK_K
        blk_ptrs += (BLOCK_K // 32) * BLOCK_BYTES * ROW_GROUP
        scl_ptrs += scl_step
    if OPERANDS == "swapped":
        acc = tl.trans(acc)
    return acc


@triton.jit
def _mx_matmul_pair(
    a_ptrs, a_row_ok, a2_ptrs, a2_row_ok, w_base, s_base, wrows, wrow_ok, K, stride_wn, stride_sg,
    BLOCK_M: tl.constexpr, BLOCK_M2: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr, A_FORMAT: tl.constexpr, SCALES: tl.constexpr,
    ROW_GROUP: tl.constexpr, EVEN_K: tl.constexpr,
):  # fmt: skip
    """_mx_matmul ("swapped" only) for two activation tiles of BLOCK_M and BLOCK_M2 rows that share
    each dequantised weight tile: two dots per K step, so a tile of BLOCK_M + BLOCK_M2 rows (not a
    power of two) costs that many rows of wgmma (MoeConfig.pair_tiles). Returns both products."""
    blk_ptrs, scl_ptrs, scl_step, scl_ok = _weight_pointers(w_base, s_base, wrows, wrow_ok, stride_wn, stride_sg,
                                                            BLOCK_N, BLOCK_K, SCALES, ROW_GROUP)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_N, BLOCK_M2), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        left = BLOCK_K if EVEN_K else K - k0
        a = _activation_step(a_ptrs, a_row_ok, left, BLOCK_K)
        a2 = _activation_step(a2_ptrs, a2_row_ok, left, BLOCK_K)
        blk, scl = _weight_step(blk_ptrs, scl_ptrs, scl_ok, wrow_ok, left, BLOCK_N, BLOCK_K, SCALES)
        w = _dequant_tile(blk, scl, BLOCK_N, BLOCK_K, DOT_DTYPE, A_FORMAT)
        acc = tl.dot(w, tl.trans(a.to(w.dtype)), acc, input_precision=DOT_PRECISION)
        acc2 = tl.dot(w, tl.trans(a2.to(w.dtype)), acc2, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K
        a2_ptrs += BLOCK_K
        blk_ptrs += (BLOCK_K // 32) * BLOCK_BYTES * ROW_GROUP
        scl_ptrs += scl_step
    return tl.trans(acc), tl.trans(acc2)


@triton.jit
def _weight_pointers(w_base, s_base, wrows, wrow_ok, stride_wn, stride_sg, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, SCALES: tl.constexpr, ROW_GROUP: tl.constexpr):
    """The first K step's packed-byte pointers [BLOCK_N, BLOCK_K // 32, 16] and _scale_pointers'
    (pointers, advance per step, mask), built once and advanced: the loop does no index math."""
    g = tl.arange(0, BLOCK_K // 32)
    blk_ptrs = (w_base + _row_offsets(wrows, stride_wn, ROW_GROUP)[:, None, None]
                + g[None, :, None] * (BLOCK_BYTES * ROW_GROUP) + tl.arange(0, 16)[None, None, :])
    scl_ptrs, scl_step, scl_ok = _scale_pointers(s_base, wrows, wrow_ok, g, stride_sg, BLOCK_N, BLOCK_K, SCALES)
    return blk_ptrs, scl_ptrs, scl_step, scl_ok


@triton.jit
def _activation_step(a_ptrs, a_row_ok, left, BLOCK_K: tl.constexpr):
    """One K step's activation tile; `left` = K values from this step on."""
    return tl.load(a_ptrs, mask=a_row_ok[:, None] & (tl.arange(0, BLOCK_K) < left)[None, :], other=0.0)


@triton.jit
def _weight_step(blk_ptrs, scl_ptrs, scl_ok, wrow_ok, left, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 SCALES: tl.constexpr):
    """One K step's packed bytes and scale tile (_scale_tile); `left` as in _activation_step."""
    g_ok = tl.arange(0, BLOCK_K // 32) < left // 32
    blk = tl.load(blk_ptrs, mask=wrow_ok[:, None, None] & g_ok[None, :, None], other=0)
    return blk, _scale_tile(scl_ptrs, scl_ok, g_ok, BLOCK_N, BLOCK_K, SCALES)


# Counts that vary with the step are not specialised (= 1, divisible by 16): each new
# combination would be a Triton compile in the middle of serving (runtime/gpu/warmup.py).
@triton.jit(do_not_specialize=["num_tiles"])
def _gemm1_swiglu_kernel(
    x_ptr, stride_xt, w_ptr, stride_we, stride_wn, s_ptr, stride_se, stride_sg, bias_ptr,
    act_ptr, stride_at, sorted_slots_ptr, tile_expert_ptr, tile_start_ptr, offsets_ptr,
    num_tiles, hidden, inter, limit, alpha,
    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr, A_FORMAT: tl.constexpr,
    FAST_MATH: tl.constexpr, OPERANDS: tl.constexpr, SUB_M: tl.constexpr, SCALES: tl.constexpr,
    ROW_GROUP: tl.constexpr, EVEN_K: tl.constexpr, SHORT_M: tl.constexpr = 0, TINY_M: tl.constexpr = 0,
):  # fmt: skip
    # SUB_M programs share each routing tile of SUB_M * BLOCK_M rows, one BLOCK_M slice each.
    slice_id, nb = _tile_coords(tl.program_id(0), num_tiles * SUB_M, tl.cdiv(inter, BLOCK_N), GROUP_M)
    tile = slice_id // SUB_M
    expert = tl.load(tile_expert_ptr + tile)
    if expert < 0:
        return
    start = tl.load(tile_start_ptr + tile) + (slice_id % SUB_M) * BLOCK_M
    end = tl.load(offsets_ptr + expert + 1)  # the expert's rows end here
    if SUB_M > 1:
        if start >= end:
            return  # a slice past its expert's last row
    w_base, s_base = w_ptr + expert.to(tl.int64) * stride_we, s_ptr + expert.to(tl.int64) * stride_se
    bias_base = bias_ptr + expert * (2 * inter)
    # MoeConfig.short_tiles: the body is inlined once per tile height, the choice made per program.
    if SHORT_M > 0:
        if TINY_M > 0:
            if end - start <= TINY_M:
                _gemm1_rows(x_ptr, stride_xt, w_base, stride_wn, s_base, stride_sg, bias_base, act_ptr, stride_at,
                            sorted_slots_ptr, start, end, nb, hidden, inter, limit, alpha, TINY_M, TOP_K, BLOCK_N,
                            BLOCK_K, DOT_DTYPE, DOT_PRECISION, A_FORMAT, FAST_MATH, OPERANDS, SCALES, ROW_GROUP, EVEN_K)
                return
        if end - start <= SHORT_M:
            _gemm1_rows(x_ptr, stride_xt, w_base, stride_wn, s_base, stride_sg, bias_base, act_ptr, stride_at,
                        sorted_slots_ptr, start, end, nb, hidden, inter, limit, alpha, SHORT_M, TOP_K, BLOCK_N,
                        BLOCK_K, DOT_DTYPE, DOT_PRECISION, A_FORMAT, FAST_MATH, OPERANDS, SCALES, ROW_GROUP, EVEN_K)
            return
    _gemm1_rows(x_ptr, stride_xt, w_base, stride_wn, s_base, stride_sg, bias_base, act_ptr, stride_at,
                sorted_slots_ptr, start, end, nb, hidden, inter, limit, alpha, BLOCK_M, TOP_K, BLOCK_N,
                BLOCK_K, DOT_DTYPE, DOT_PRECISION, A_FORMAT, FAST_MATH, OPERANDS, SCALES, ROW_GROUP, EVEN_K)


@triton.jit
def _gemm1_rows(
    x_ptr, stride_xt, w_base, stride_wn, s_base, stride_sg, bias_base, act_ptr, stride_at, sorted_slots_ptr,
    start, end, nb, hidden, inter, limit, alpha, BLOCK_M: tl.constexpr, TOP_K: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    A_FORMAT: tl.constexpr, FAST_MATH: tl.constexpr, OPERANDS: tl.constexpr, SCALES: tl.constexpr,
    ROW_GROUP: tl.constexpr, EVEN_K: tl.constexpr,
):  # fmt: skip
    """gemm1 + SwiGLU of sorted rows [start, min(start + BLOCK_M, end)) of one expert, column block nb."""
    rows = start + tl.arange(0, BLOCK_M)
    row_ok = rows < end
    tl.assume(hidden > 0)  # _mx_matmul's note on tl.assume
    tokens = tl.load(sorted_slots_ptr + rows, mask=row_ok, other=0) // TOP_K
    a_ptrs = x_ptr + tokens[:, None].to(tl.int64) * stride_xt + tl.arange(0, BLOCK_K)[None, :]
    # 2*BLOCK_N consecutive W1 rows = BLOCK_N (gate, up) pairs: one dot, split in the epilogue.
    if SCALES == "frag":
        wrows = _frag_rows(nb * 2 * BLOCK_N, 2 * BLOCK_N)
    else:
        wrows = nb * 2 * BLOCK_N + tl.arange(0, 2 * BLOCK_N)
    acc = _mx_matmul(
        a_ptrs, row_ok, w_base, s_base, wrows, wrows < 2 * inter, hidden, stride_wn, stride_sg,
        BLOCK_M, 2 * BLOCK_N, BLOCK_K, DOT_DTYPE, DOT_PRECISION, A_FORMAT, FAST_MATH, OPERANDS, SCALES,
        ROW_GROUP, EVEN_K,
    )  # fmt: skip
    acc += tl.load(bias_base + wrows, mask=wrows < 2 * inter, other=0.0)[None, :]
    if SCALES == "frag":
        acc = _frag_unpermute(acc, BLOCK_M, 2 * BLOCK_N)
    gate, up = tl.split(tl.reshape(acc, (BLOCK_M, BLOCK_N, 2)))
    cols = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    out = _swiglu(gate, up, limit, alpha)
    act_ptrs = act_ptr + rows[:, None].to(tl.int64) * stride_at + cols[None, :]
    tl.store(act_ptrs, out.to(act_ptr.dtype.element_ty), mask=row_ok[:, None] & (cols < inter)[None, :])


# Counts that vary with the step are not specialised (= 1, divisible by 16): each new
# combination would be a Triton compile in the middle of serving (runtime/gpu/warmup.py).
@triton.jit(do_not_specialize=["num_tiles", "num_rows"])
def _gemm2_kernel(
    act_ptr, stride_at, w_ptr, stride_we, stride_wn, s_ptr, stride_se, stride_sg, bias_ptr,
    y_ptr, stride_yt, gamma_ptr, sorted_slots_ptr, tile_expert_ptr, tile_start_ptr, offsets_ptr,
    num_tiles, num_rows, hidden, inter,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr, A_FORMAT: tl.constexpr, FAST_MATH: tl.constexpr,
    SPLIT_K: tl.constexpr, OPERANDS: tl.constexpr, SCALES: tl.constexpr, ROW_GROUP: tl.constexpr,
    EVEN_K: tl.constexpr, SHORT_M: tl.constexpr = 0, TINY_M: tl.constexpr = 0, PAIR_M: tl.constexpr = 0,
):  # fmt: skip
    tile, nb = _tile_coords(tl.program_id(0), num_tiles, tl.cdiv(hidden, BLOCK_N), GROUP_M)
    expert = tl.load(tile_expert_ptr + tile)
    if expert < 0:
        return
    start = tl.load(tile_start_ptr + tile)
    end = tl.load(offsets_ptr + expert + 1)  # the expert's rows end here
    k_lo, k_len = _k_range(inter, SPLIT_K, BLOCK_K)
    if SPLIT_K == 1:
        tl.assume(k_len > 0)  # _mx_matmul's note on tl.assume
    a_base = act_ptr + k_lo
    w_base = w_ptr + expert.to(tl.int64) * stride_we + (k_lo // 32) * BLOCK_BYTES * ROW_GROUP
    s_base = s_ptr + expert.to(tl.int64) * stride_se + (k_lo // (64 if SCALES == "frag" else 32)) * stride_sg
    y_base = y_ptr + tl.program_id(1).to(tl.int64) * num_rows * stride_yt  # split-K slab
    bias_base = bias_ptr + expert * hidden
    # MoeConfig.short_tiles / pair_tiles: the body is inlined once per tile height, the choice made
    # per program from the rows the tile holds.
    if SHORT_M > 0:
        if TINY_M > 0:
            if end - start <= TINY_M:
                _gemm2_rows(a_base, stride_at, w_base, stride_wn, s_base, stride_sg, bias_base, y_base, stride_yt,
                            gamma_ptr, sorted_slots_ptr, start, end, nb, k_len, hidden, TINY_M, BLOCK_N, BLOCK_K,
                            DOT_DTYPE, DOT_PRECISION, A_FORMAT, FAST_MATH, OPERANDS, SCALES, ROW_GROUP, EVEN_K)
                return
        if end - start <= SHORT_M:
            _gemm2_rows(a_base, stride_at, w_base, stride_wn, s_base, stride_sg, bias_base, y_base, stride_yt,
                        gamma_ptr, sorted_slots_ptr, start, end, nb, k_len, hidden, SHORT_M, BLOCK_N, BLOCK_K,
                        DOT_DTYPE, DOT_PRECISION, A_FORMAT, FAST_MATH, OPERANDS, SCALES, ROW_GROUP, EVEN_K)
            return
        if PAIR_M > 0:
            if end - start <= SHORT_M + PAIR_M:
                _gemm2_rows(a_base, stride_at, w_base, stride_wn, s_base, stride_sg, bias_base, y_base, stride_yt,
                            gamma_ptr, sorted_slots_ptr, start, end, nb, k_len, hidden, SHORT_M, BLOCK_N, BLOCK_K,
                            DOT_DTYPE, DOT_PRECISION, A_FORMAT, FAST_MATH, OPERANDS, SCALES, ROW_GROUP, EVEN_K, PAIR_M)
                return
            if end - start <= SHORT_M + TINY_M:  # PAIR_M is half of TINY_M (_tile_heights)
                _gemm2_rows(a_base, stride_at, w_base, stride_wn, s_base, stride_sg, bias_base, y_base, stride_yt,
                            gamma_ptr, sorted_slots_ptr, start, end, nb, k_len, hidden, SHORT_M, BLOCK_N, BLOCK_K,
                            DOT_DTYPE, DOT_PRECISION, A_FORMAT, FAST_MATH, OPERANDS, SCALES, ROW_GROUP, EVEN_K, TINY_M)
                return
    _gemm2_rows(a_base, stride_at, w_base, stride_wn, s_base, stride_sg, bias_base, y_base, stride_yt,
                gamma_ptr, sorted_slots_ptr, start, end, nb, k_len, hidden, BLOCK_M, BLOCK_N, BLOCK_K,
                DOT_DTYPE, DOT_PRECISION, A_FORMAT, FAST_MATH, OPERANDS, SCALES, ROW_GROUP, EVEN_K)


@triton.jit
def _gemm2_rows(
    act_ptr, stride_at, w_base, stride_wn, s_base, stride_sg, bias_base, y_base, stride_yt, gamma_ptr,
    sorted_slots_ptr, start, end, nb, k_len, hidden, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr, A_FORMAT: tl.constexpr,
    FAST_MATH: tl.constexpr, OPERANDS: tl.constexpr, SCALES: tl.constexpr, ROW_GROUP: tl.constexpr,
    EVEN_K: tl.constexpr, BLOCK_M2: tl.constexpr = 0,
):  # fmt: skip
    """gemm2 of sorted rows [start, min(start + BLOCK_M + BLOCK_M2, end)) of one expert, output column
    block nb, over the K chunk act_ptr / w_base / s_base start at (k_len long); stores into y_base's
    slab. BLOCK_M2 > 0: the rows past BLOCK_M as a second dot on the same weight tiles (pair_tiles)."""
    rows = start + tl.arange(0, BLOCK_M)
    row_ok = rows < end
    cols = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    wrows = _frag_rows(nb * BLOCK_N, BLOCK_N) if SCALES == "frag" else cols
    a_ptrs = act_ptr + rows[:, None].to(tl.int64) * stride_at + tl.arange(0, BLOCK_K)[None, :]
    if BLOCK_M2 > 0:
        rows2 = start + BLOCK_M + tl.arange(0, BLOCK_M2)
        row_ok2 = rows2 < end
        a2_ptrs = act_ptr + rows2[:, None].to(tl.int64) * stride_at + tl.arange(0, BLOCK_K)[None, :]
        acc, acc2 = _mx_matmul_pair(
            a_ptrs, row_ok, a2_ptrs, row_ok2, w_base, s_base, wrows, wrows < hidden, k_len, stride_wn, stride_sg,
            BLOCK_M, BLOCK_M2, BLOCK_N, BLOCK_K, DOT_DTYPE, DOT_PRECISION, A_FORMAT, SCALES, ROW_GROUP, EVEN_K,
        )  # fmt: skip
        _gemm2_store(acc2, rows2, row_ok2, cols, hidden, bias_base, gamma_ptr, sorted_slots_ptr, y_base, stride_yt,
                     BLOCK_M2, BLOCK_N, SCALES)
    else:
        acc = _mx_matmul(
            a_ptrs, row_ok, w_base, s_base, wrows, wrows < hidden, k_len, stride_wn, stride_sg,
            BLOCK_M, BLOCK_N, BLOCK_K, DOT_DTYPE, DOT_PRECISION, A_FORMAT, FAST_MATH, OPERANDS, SCALES,
            ROW_GROUP, EVEN_K,
        )  # fmt: skip
    _gemm2_store(acc, rows, row_ok, cols, hidden, bias_base, gamma_ptr, sorted_slots_ptr, y_base, stride_yt,
                 BLOCK_M, BLOCK_N, SCALES)


@triton.jit
def _gemm2_store(acc, rows, row_ok, cols, hidden, bias_base, gamma_ptr, sorted_slots_ptr, y_base, stride_yt,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SCALES: tl.constexpr):
    """gemm2's epilogue for acc [BLOCK_M, BLOCK_N] of sorted `rows`: bias, routing weight, store."""
    if SCALES == "frag":
        acc = _frag_unpermute(acc, BLOCK_M, BLOCK_N)
    col_ok = cols < hidden
    slots = tl.load(sorted_slots_ptr + rows, mask=row_ok, other=0)
    gamma = tl.load(gamma_ptr + slots, mask=row_ok, other=0.0)
    # The routing weight scales the bias too (gpt-oss-model.md §2.5 step 4); split 0 adds it.
    bias = tl.load(bias_base + cols, mask=col_ok & (tl.program_id(1) == 0), other=0.0)
    y = (acc + bias[None, :]) * gamma[:, None]
    # With SPLIT_K > 1, y holds SPLIT_K slabs of [S, C]: moe_combine sums them.
    y_ptrs = y_base + slots[:, None].to(tl.int64) * stride_yt + cols[None, :]
    tl.store(y_ptrs, y.to(y_base.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _combine_kernel(
    y_ptr, out_ptr, num_tokens, hidden, TOP_K: tl.constexpr, SPLITS: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
):  # fmt: skip
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    ok = (tokens < num_tokens)[:, None] & (cols < hidden)[None, :]
    y_ptrs = y_ptr + tokens[:, None].to(tl.int64) * (TOP_K * hidden) + cols[None, :]  # slot t*K + 0
    # tl.cast, not .to: the launcher turns an int argument equal to 1 into a Python constant.
    slab = tl.cast(num_tokens, tl.int64) * TOP_K * hidden
    acc = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    for s in tl.static_range(SPLITS):  # fixed order: the sum is deterministic
        for k in tl.static_range(TOP_K):
            acc += tl.load(y_ptrs + s * slab + k * hidden, mask=ok, other=0.0)
    out_ptrs = out_ptr + tokens[:, None].to(tl.int64) * hidden + cols[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _combined_h(y_ptr, res_ptr, h_ptr, token, cols, ok, num_tokens, hidden, TOP_K: tl.constexpr,
                SPLITS: tl.constexpr, dtype: tl.constexpr):
    """The combine of one token's columns `cols` (any shape, `ok` its mask) plus its residual, rounded
    to `dtype` as rms_norm rounds its residual sum, stored to h and returned: the combine-norm
    kernels' shared first half."""
    slab = tl.cast(num_tokens, tl.int64) * TOP_K * hidden
    acc = tl.zeros(cols.shape, dtype=tl.float32)
    for s in tl.static_range(SPLITS):  # the order of _combine_kernel: the same sum
        for k in tl.static_range(TOP_K):
            acc += tl.load(y_ptr + s * slab + (token * TOP_K + k) * hidden + cols, mask=ok, other=0.0)
    r = tl.load(res_ptr + token * hidden + cols, mask=ok, other=0.0)
    h = (acc.to(dtype).to(tl.float32) + r.to(tl.float32)).to(dtype)  # acc.to(dtype): what moe_forward returns
    tl.store(h_ptr + token * hidden + cols, h, mask=ok)
    return h


@triton.jit
def _combine_norm_kernel(
    y_ptr, res_ptr, w_ptr, out_ptr, h_ptr, num_tokens, hidden, eps, TOP_K: tl.constexpr, SPLITS: tl.constexpr,
    BLOCK_C: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    # One program per token, whole rows: the combine, then rms_norm(combined, w, eps, residual).
    wait_for_previous(PDL)
    token = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_C)
    ok = cols < hidden
    h = _combined_h(y_ptr, res_ptr, h_ptr, token, cols[None, :], ok[None, :], num_tokens, hidden, TOP_K, SPLITS,
                    out_ptr.dtype.element_ty)
    y = normalize_rows(h, w_ptr, cols, ok, hidden, eps)
    tl.store(out_ptr + token * hidden + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=ok[None, :])


@triton.jit
def _combine_norm_blocks_kernel(
    y_ptr, res_ptr, w_ptr, out_ptr, h_ptr, arrivals_ptr, num_tokens, hidden, eps, TOP_K: tl.constexpr,
    SPLITS: tl.constexpr, BLOCK: tl.constexpr, BLOCK_C: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    # Program (token, column block): the combine of BLOCK columns and their h; the token's last
    # program to arrive normalizes the whole row from h (through L2), so that no one program reads
    # all the slabs.
    wait_for_previous(PDL)
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    dtype = out_ptr.dtype.element_ty
    _combined_h(y_ptr, res_ptr, h_ptr, token, cols, cols < hidden, num_tokens, hidden, TOP_K, SPLITS, dtype)
    # Every thread's stores precede the arrival (barrier), which releases them at GPU scope; the last
    # program's acquire then sees the whole row. Its loads bypass L1 (.cg).
    tl.debug_barrier()
    arrived = tl.atomic_add(arrivals_ptr + token, 1, sem="acq_rel", scope="gpu")
    if arrived == tl.num_programs(1) - 1:
        row = tl.arange(0, BLOCK_C)
        row_ok = row < hidden
        whole = tl.load(h_ptr + token * hidden + row[None, :], mask=row_ok[None, :], other=0.0, cache_modifier=".cg")
        y = normalize_rows(whole, w_ptr, row, row_ok, hidden, eps)
        tl.store(out_ptr + token * hidden + row[None, :], y.to(dtype), mask=row_ok[None, :])
        tl.atomic_xchg(arrivals_ptr + token, 0, sem="relaxed", scope="gpu")


def moe_combine_norm(y: torch.Tensor, top_k: int, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                     splits: int = 1, num_warps: int | None = None, block: int = 0,
                     arrivals: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """rms_norm(moe_combine(y, top_k, residual.dtype, splits=splits), weight, eps, residual) in one
    launch: (normed [T, C], new residual [T, C]). One program per token over the whole row, or with
    `block` (MoeConfig.combine_block) programs of `block` columns whose last arrival per token
    normalizes the row; `arrivals` is then their int32 counters, >= T of them, zero between launches
    (the last arrival resets its own; allocated when not given)."""
    _check_slots(y, top_k, splits)
    tokens, hidden = y.shape[0] // (top_k * splits), y.shape[1]
    if residual.shape != (tokens, hidden) or not residual.is_contiguous() or weight.shape != (hidden,):
        raise ValueError(f"residual {tuple(residual.shape)} / weight {tuple(weight.shape)} do not match y's "
                         f"{tokens} tokens x {hidden}")
    out, h = torch.empty_like(residual), torch.empty_like(residual)
    if not tokens:
        return out, h
    block_c = triton.next_power_of_2(hidden)
    if block:
        if arrivals is None:
            arrivals = torch.zeros(tokens, dtype=torch.int32, device=y.device)
        if arrivals.dtype != torch.int32 or arrivals.numel() < tokens:
            raise ValueError(f"arrivals must hold >= {tokens} int32 counters")
        _combine_norm_blocks_kernel[(tokens, triton.cdiv(hidden, block))](
            y, residual, weight.contiguous(), out, h, arrivals, tokens, hidden, float(eps), TOP_K=top_k,
            SPLITS=splits, BLOCK=block, BLOCK_C=block_c, num_warps=num_warps or max(1, min(4, block // 64)),
            **pdl_launch(pdl_enabled(y)))
        return out, h
    _combine_norm_kernel[(tokens,)](y, residual, weight.contiguous(), out, h, tokens, hidden, float(eps),
                                    TOP_K=top_k, SPLITS=splits, BLOCK_C=block_c,
                                    num_warps=num_warps or max(1, min(8, block_c // 512)),
                                    **pdl_launch(pdl_enabled(y)))
    return out, h


def _check_activation(a: torch.Tensor, rows: int, cols: int, name: str) -> None:
    if a.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"{name} must be bf16, fp16 or fp32, got {a.dtype}")
    if tuple(a.shape) != (rows, cols) or a.stride(-1) != 1:
        raise ValueError(f"{name} must be a row-major [{rows}, {cols}] tensor, got {tuple(a.shape)}")


def _out_buffer(out: torch.Tensor | None, shape: tuple, dtype: torch.dtype, like: torch.Tensor) -> torch.Tensor:
    if out is None:
        return torch.empty(shape, dtype=dtype, device=like.device)
    if tuple(out.shape) != shape or out.dtype != dtype or not out.is_contiguous():
        raise ValueError(f"output buffer must be a contiguous {dtype} tensor of shape {shape}")
    return out


def _grid(routing: MoeRouting, columns: int, block_n: int, slices: int = 1) -> tuple[int]:
    return (routing.max_tiles * slices * triton.cdiv(columns, block_n),)


def _tile_heights(config: MoeConfig, rows: int, pairs: bool = False) -> dict:
    """SHORT_M and TINY_M of a kernel whose programs take `rows` sorted rows: the half- and
    quarter-height bodies' rows (MoeConfig.short_tiles), 0 where off or below the 16 rows a tile
    needs; with `pairs` (gemm2) also PAIR_M, the eighth-height second dot (MoeConfig.pair_tiles)."""
    short = rows // 2 if config.short_tiles >= 1 and rows >= 32 else 0
    tiny = rows // 4 if config.short_tiles >= 2 and rows >= 64 else 0
    heights = {"SHORT_M": short, "TINY_M": tiny}
    if pairs:
        heights["PAIR_M"] = rows // 8 if config.pair_tiles and config.swap_ab and tiny and rows >= 128 else 0
    return heights


def _checked_frag_scales(scales: torch.Tensor | None, block_rows: int) -> torch.Tensor:
    """The fragment-order scales a "frag" tile of `block_rows` weight rows reads, after checking it can."""
    if scales is None or block_rows % 16:
        raise ValueError("MoeConfig scale unpack 'frag' needs prepare_moe_weights(frag_scales=True) and "
                         "tiles of whole 16-row blocks (block_n1 % 8 == 0, block_n2 % 16 == 0)")
    return scales


def moe_gemm1_swiglu(
    x: torch.Tensor,
    routing: MoeRouting,
    w: MoeWeights,
    limit: float,
    alpha: float,
    config: MoeConfig,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [T, C] -> act [S, I] in x.dtype, row r for sorted row r (slot routing.sorted_slots[r])."""
    _check_activation(x, routing.num_tokens, w.hidden, "x")
    if routing.block_m != config.block_m:
        raise ValueError(f"routing tiles have {routing.block_m} rows, config wants {config.block_m}")
    slots = routing.num_tokens * routing.top_k
    act = _out_buffer(out, (slots, w.intermediate), x.dtype, x)
    if routing.max_tiles == 0:
        return act
    slices = config.block_m // config.gemm1_rows
    scales_mode = _scale_mode(config, 2 * config.block_n1, config.scale_unpack)
    scales = _checked_frag_scales(w.w1_scales_frag, 2 * config.block_n1) if scales_mode == "frag" else w.w1_scales
    blocks, a_format = _weight_bytes(config, w.w1_blocks, w.w1_split, x.dtype, w.fold_scales)
    _gemm1_swiglu_kernel[_grid(routing, w.intermediate, config.block_n1, slices)](
        x, x.stride(0), blocks, blocks.stride(0), blocks.stride(1),
        scales, scales.stride(0), scales.stride(1), w.w1_bias,
        act, act.stride(0), routing.sorted_slots, routing.tile_expert, routing.tile_row_start,
        routing.expert_offsets, routing.max_tiles, w.hidden, w.intermediate, float(limit), float(alpha),
        TOP_K=routing.top_k, BLOCK_M=config.gemm1_rows, BLOCK_N=config.block_n1, BLOCK_K=config.block_k,
        GROUP_M=config.group_m, DOT_DTYPE=dot_dtype(x.dtype), DOT_PRECISION=_dot_precision(x.dtype),
        A_FORMAT=a_format, FAST_MATH=config.fast_math, OPERANDS=config.operands, SCALES=scales_mode,
        SUB_M=slices, ROW_GROUP=w.row_group, EVEN_K=config.even_k and w.hidden % config.block_k == 0,
        **_tile_heights(config, config.gemm1_rows),
        num_warps=config.num_warps, num_stages=config.num_stages,
        **_register_cap(config.maxnreg),
    )  # fmt: skip
    return act


def moe_gemm2(
    act: torch.Tensor, routing: MoeRouting, w: MoeWeights, config: MoeConfig, out: torch.Tensor | None = None
) -> torch.Tensor:
    """act [S, I] (sorted rows) -> y [S, C] fp32 (act's dtype with config.round_slots) in slot order,
    scaled by the routing weights. With config.split_k = P > 1: y [P*S, C], P slabs of partial sums
    (moe_combine(splits=P) adds them)."""
    slots = routing.num_tokens * routing.top_k
    _check_activation(act, slots, w.intermediate, "act")
    if routing.block_m != config.block_m:
        raise ValueError(f"routing tiles have {routing.block_m} rows, config wants {config.block_m}")
    y = _out_buffer(out, (config.split_k * slots, w.hidden), slot_dtype(config, act.dtype), act)
    if routing.max_tiles == 0:
        return y
    scales_mode = _scale_mode(config, config.block_n2, config.gemm2_scale_unpack)
    scales = _checked_frag_scales(w.w2_scales_frag, config.block_n2) if scales_mode == "frag" else w.w2_scales
    blocks, a_format = _weight_bytes(config, w.w2_blocks, w.w2_split, act.dtype, w.fold_scales)
    _gemm2_kernel[(_grid(routing, w.hidden, config.block_n2)[0], config.split_k)](
        act, act.stride(0), blocks, blocks.stride(0), blocks.stride(1),
        scales, scales.stride(0), scales.stride(1), w.w2_bias,
        y, y.stride(0), routing.topk_weights, routing.sorted_slots, routing.tile_expert, routing.tile_row_start,
        routing.expert_offsets, routing.max_tiles, slots, w.hidden, w.intermediate,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n2, BLOCK_K=config.gemm2_block_k, GROUP_M=config.group_m,
        DOT_DTYPE=dot_dtype(act.dtype), DOT_PRECISION=_dot_precision(act.dtype),
        A_FORMAT=a_format, FAST_MATH=config.fast_math, SPLIT_K=config.split_k, SCALES=scales_mode,
        ROW_GROUP=w.row_group, EVEN_K=config.even_k and w.intermediate % config.gemm2_block_k == 0,
        **_tile_heights(config, config.block_m, pairs=True),
        OPERANDS=config.operands, num_warps=config.num_warps, num_stages=config.num_stages,
        **_register_cap(config.gemm2_maxnreg),
    )  # fmt: skip
    return y


def slot_dtype(config: MoeConfig, dtype: torch.dtype) -> torch.dtype:
    """The dtype of gemm2's per-slot outputs for activations of `dtype` (MoeConfig.round_slots)."""
    return dtype if config.round_slots else torch.float32


def _check_slots(y: torch.Tensor, top_k: int, splits: int) -> None:
    if y.dtype not in (torch.float32, torch.bfloat16, torch.float16) or y.dim() != 2 or not y.is_contiguous() \
            or y.shape[0] % (top_k * splits):
        raise ValueError(f"y must be a contiguous fp32 / bf16 / fp16 [{splits}*T*{top_k}, C] tensor, "
                         f"got {y.dtype} {tuple(y.shape)}")


def moe_combine(
    y: torch.Tensor, top_k: int, dtype: torch.dtype, out: torch.Tensor | None = None, splits: int = 1
) -> torch.Tensor:
    """y [P*T*K, C] (P = splits slabs, slot order; summed in fp32) -> [T, C] in `dtype`: the sum
    over each token's K slots and the P slabs."""
    _check_slots(y, top_k, splits)
    tokens, hidden = y.shape[0] // (top_k * splits), y.shape[1]
    res = _out_buffer(out, (tokens, hidden), dtype, y)
    if tokens:
        block_t = min(COMBINE_TOKENS, triton.next_power_of_2(tokens))
        grid = (triton.cdiv(tokens, block_t), triton.cdiv(hidden, COMBINE_BLOCK))
        _combine_kernel[grid](y, res, tokens, hidden, TOP_K=top_k, SPLITS=splits, BLOCK_T=block_t,
                              BLOCK_C=COMBINE_BLOCK)
    return res


def expert_weight(blocks: torch.Tensor, scales: torch.Tensor, expert: int) -> torch.Tensor:
    """One expert of a MoeWeights matrix, dequantised: [N, K] fp32 (for twins and tests)."""
    return dequantize_mxfp4(checkpoint_blocks(blocks, scales, expert), scales[expert].T)


def checkpoint_blocks(blocks: torch.Tensor, scales: torch.Tensor, expert: int) -> torch.Tensor:
    """One expert's packed bytes of a MoeWeights matrix back in the checkpoint's [N, K/32, 16]
    order (the row group follows from the shapes: scales are [E, K/32, N])."""
    groups, n = scales.shape[1:]
    row_group = n // blocks.shape[1]
    grouped = blocks[expert].view(n // row_group, groups, row_group, BYTES_PER_BLOCK)
    return grouped.transpose(1, 2).reshape(n, groups, BYTES_PER_BLOCK)


def _rows_by_expert(routing: MoeRouting):
    """(expert, sorted rows of that expert) for each expert with work."""
    expert_of_row = routing.topk_ids.reshape(-1).long()[routing.sorted_slots.long()]
    for e in expert_of_row.unique().tolist():
        yield e, torch.nonzero(expert_of_row == e).flatten()


def moe_gemm1_swiglu_ref(
    x: torch.Tensor, routing: MoeRouting, w: MoeWeights, limit: float, alpha: float
) -> torch.Tensor:
    """Twin of moe_gemm1_swiglu: fp32 math, result rounded to x.dtype."""
    act = torch.zeros(routing.sorted_slots.shape[0], w.intermediate, dtype=x.dtype, device=x.device)
    for e, rows in _rows_by_expert(routing):
        tokens = routing.sorted_slots.long()[rows] // routing.top_k
        h = x[tokens].float() @ expert_weight(w.w1_blocks, w.w1_scales, e).T + w.w1_bias[e]
        gate = h[:, 0::2].clamp(max=limit)
        up = h[:, 1::2].clamp(-limit, limit)
        act[rows] = (gate * torch.sigmoid(alpha * gate) * (up + 1)).to(x.dtype)
    return act


def moe_gemm2_ref(act: torch.Tensor, routing: MoeRouting, w: MoeWeights) -> torch.Tensor:
    """Twin of moe_gemm2: fp32 [S, C] in slot order."""
    y = torch.zeros(act.shape[0], w.hidden, dtype=torch.float32, device=act.device)
    gamma = routing.topk_weights.reshape(-1)
    for e, rows in _rows_by_expert(routing):
        slots = routing.sorted_slots.long()[rows]
        out = act[rows].float() @ expert_weight(w.w2_blocks, w.w2_scales, e).T + w.w2_bias[e]
        y[slots] = out * gamma[slots, None]
    return y


def moe_combine_ref(y: torch.Tensor, top_k: int, dtype: torch.dtype, splits: int = 1) -> torch.Tensor:
    """Twin of moe_combine."""
    return y.view(splits, -1, top_k, y.shape[1]).sum(dim=(0, 2)).to(dtype)
