"""The split-word copy of the packed expert bytes: each 32-bit word's FP4 bits moved so that the
decode tiles dequantise it in 5 LOP3 + 3 shifts instead of 8 LOP3 + 2 PRMT + 4 IMAD.

Why: at batch 64 the decode tiles (moe_matmul, even/odd operands) are bound by the integer ALU of
the dequantisation (Nsight Compute, docs/optimizations.md session 36), not by bytes. A bf16 pair
needs each value's sign on bit 15 (31) and its e1 e0 m bits on bits 8..6 (24..22); in checkpoint
order sign and e1 e0 m move by different amounts, so every pair costs an and, a multiply and an
and, after a prmt spreads the bytes. This layout puts the bits where one mask (or one shift and a
mask) reaches them. It is a one-time bit permutation of the bytes (split_words, no value changes,
no bf16 copy); unsplit_words undoes it.

Word layout. Value j of a checkpoint word is nibble j (bits 4j..4j+3: m, e0, e1, s); the asm's
outputs keep moe_matmul._FP4_TO_BF16_ASM's contract, per "virtual byte" i = values 2i, 2i + 1:
    $0 = (v0, v2)   bits at P = {6, 7, 8, 15, 22, 23, 24, 31}: w & P
    $1 = (v4, v6)   at P - 3:                             (w << 3) & P
    $2 = (v1, v3)   at P - 6:                             (w << 6) & P
    $3 = (v5, v7)   at the 8 bits left {10, 11, 13, 14, 26, 27, 29, 30}: isolated, then one wide
                    multiply by 2**2 + 2**24 + 2**29 moves the signs up 2 (low word) and the
                    exponent and mantissa bits down 3 and 8 (high word) with no two copies on the
                    same bit, so (low | high) & P is the pair.
Only 3 of the 4 pairs can be plain shifts of P (no 4 translates of P tile 32 bits), hence the
multiply for the last. Each masked pair is FP4 * 2**-126 in bf16 (e = 0 on bf16 subnormals), the
same as the checkpoint-order asm's before its multiplies, which follow unchanged.

Which kernels read it: only the decode tiles, whose dequantisation packs are aligned 4-byte words
of the blocks (an H200 test compares them bit for bit with the checkpoint-order path). The prefill
tiles hand the asm four bytes from different words (the wgmma operand layout), and the batch-1 and
grouped kernels decode checkpoint words in their own asm, so the copy sits beside the checkpoint
order (MoeWeights.w1_split / w2_split, as many bytes again) instead of replacing it.
"""

from __future__ import annotations

import torch
import triton.language as tl

# New bit position of bit b (0 m, 1 e0, 2 e1, 3 s) of value j of a checkpoint word.
SPLIT_POSITIONS = (
    (6, 7, 8, 15),      # v0: $0 low half
    (0, 1, 2, 9),       # v1: $2 low half (P - 6)
    (22, 23, 24, 31),   # v2: $0 high half
    (16, 17, 18, 25),   # v3: $2 high half (P - 6)
    (3, 4, 5, 12),      # v4: $1 low half (P - 3)
    (14, 10, 11, 13),   # v5: $3 low half (m down 8, e1 e0 down 3, s up 2)
    (19, 20, 21, 28),   # v6: $1 high half (P - 3)
    (30, 26, 27, 29),   # v7: $3 high half
)
_CHUNK_WORDS = 1 << 24  # words permuted at a time: bounds the int64 temporaries to ~256 MB


def _moved(words: torch.Tensor, moves: list[tuple[int, int]]) -> torch.Tensor:
    """int64 words (0 <= w < 2**32) with bit src moved to bit dst for each (src, dst) in `moves`: one
    mask and shift per distinct distance (17 for split_words' 32 bits), not one per bit."""
    by_shift: dict[int, int] = {}
    for src, dst in moves:
        by_shift[dst - src] = by_shift.get(dst - src, 0) | (1 << src)
    out = torch.zeros_like(words)
    for shift, mask in by_shift.items():
        part = words & mask
        out |= part << shift if shift >= 0 else part >> -shift
    return out


def _permute(blocks: torch.Tensor, moves: list[tuple[int, int]]) -> torch.Tensor:
    if blocks.dtype != torch.uint8 or blocks.shape[-1] % 4:
        raise ValueError(f"expected uint8 bytes in whole 32-bit words, got {blocks.dtype} {tuple(blocks.shape)}")
    flat = blocks.contiguous().view(torch.int32).reshape(-1)
    out = torch.empty_like(flat)
    for lo in range(0, flat.numel(), _CHUNK_WORDS):
        words = flat[lo:lo + _CHUNK_WORDS].to(torch.int64) & 0xFFFFFFFF
        moved = _moved(words, moves)
        out[lo:lo + _CHUNK_WORDS] = torch.where(moved >= 2**31, moved - 2**32, moved).to(torch.int32)
    return out.view(torch.uint8).reshape(blocks.shape)


def _moves() -> list[tuple[int, int]]:
    return [(4 * j + b, pos) for j, bits in enumerate(SPLIT_POSITIONS) for b, pos in enumerate(bits)]


def split_words(blocks: torch.Tensor) -> torch.Tensor:
    """uint8 packed bytes (last dim a multiple of 4, words little-endian) -> the split-word layout."""
    return _permute(blocks, _moves())


def unsplit_words(blocks: torch.Tensor) -> torch.Tensor:
    """The inverse of split_words."""
    return _permute(blocks, [(dst, src) for src, dst in _moves()])


# The split-word twins of moe_matmul._FP4_TO_BF16_ASM / _FP4_TO_BF16_FOLDED_ASM: same operands
# ($4 the word, $5 / $6 the bf16 scales of $0, $2 / $1, $3), same outputs.
_SPLIT_PAIRS = """
and.b32 x0, $4, 0x81C081C0;
shl.b32 x1, $4, 3; and.b32 x1, x1, 0x81C081C0;
shl.b32 x2, $4, 6; and.b32 x2, x2, 0x81C081C0;
and.b32 x3, $4, 0x6C006C00; mul.wide.u32 d, x3, 0x21000004; mov.b64 {lo, hi}, d; or.b32 x3, lo, hi;
and.b32 x3, x3, 0x81C081C0;"""
SPLIT_TO_BF16_ASM = tl.constexpr("""
{
.reg .b32 x0, x1, x2, x3, lo, hi, c, z;
.reg .b64 d;
mov.b32 c, 0x7E807E80;
mov.b32 z, 0x80008000;""" + _SPLIT_PAIRS + """
fma.rn.bf16x2 x0, x0, c, z; fma.rn.bf16x2 $0, x0, $5, z;
fma.rn.bf16x2 x1, x1, c, z; fma.rn.bf16x2 $1, x1, $6, z;
fma.rn.bf16x2 x2, x2, c, z; fma.rn.bf16x2 $2, x2, $5, z;
fma.rn.bf16x2 x3, x3, c, z; fma.rn.bf16x2 $3, x3, $6, z;
}
""")
SPLIT_TO_BF16_FOLDED_ASM = tl.constexpr("""
{
.reg .b32 x0, x1, x2, x3, lo, hi, z;
.reg .b64 d;
mov.b32 z, 0x80008000;""" + _SPLIT_PAIRS + """
fma.rn.bf16x2 $0, x0, $5, z; fma.rn.bf16x2 $1, x1, $6, z;
fma.rn.bf16x2 $2, x2, $5, z; fma.rn.bf16x2 $3, x3, $6, z;
}
""")
