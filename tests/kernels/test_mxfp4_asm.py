"""The inline PTX of the MoE kernels, run on the CPU by a small emulator of the instructions it uses:
the MXFP4 -> bf16 dequantisation (moe_matmul._FP4_TO_BF16_ASM) for every byte value and a range of
scales, and the packed-fp16 block dot product of the gemv kernels (moe_gemv._FP4_DOT_F16_ASM,
_X_PAIR_F16_ASM). The GPU tests (test_moe.py) check the hardware; these check the bit logic where
CI runs, and fail on any instruction the emulator does not know."""

import random
import re

import numpy as np
import pytest
import torch

from gptoss_cli.kernels.moe_gemv import _FP4_DOT_F16_ASM, _X_PAIR_F16_ASM
from gptoss_cli.kernels.moe_matmul import _FP4_TO_BF16_ASM, _FP4_TO_BF16_FOLDED_ASM, FOLD_MAX_SCALE
from gptoss_cli.kernels.mxfp4 import FP4_VALUES
from gptoss_cli.kernels.mxfp4_split import SPLIT_TO_BF16_ASM, SPLIT_TO_BF16_FOLDED_ASM, split_words

MASK = 0xFFFFFFFF


def _bf16(bits: int) -> float:
    signed = bits - 0x10000 if bits & 0x8000 else bits
    return torch.tensor([signed], dtype=torch.int16).view(torch.bfloat16).float().item()


def _bits(value: float) -> int:
    return torch.tensor([value], dtype=torch.float32).to(torch.bfloat16).view(torch.int16).item() & 0xFFFF


def _fma_bf16x2(a: int, b: int, c: int) -> int:
    out = 0
    for half in (0, 16):
        x, y, z = ((v >> half) & 0xFFFF for v in (a, b, c))
        # products of bf16 values are exact in fp64 and the addend here is -0: one rounding, as fma.rn
        out |= _bits(_bf16(x) * _bf16(y) + _bf16(z)) << half
    return out


def _prmt(a: int, b: int, sel: int) -> int:
    pool = a | (b << 32)
    out = 0
    for i in range(4):
        nib = (sel >> (4 * i)) & 15
        byte = (pool >> (8 * (nib & 7))) & 0xFF
        out |= ((0xFF if byte & 0x80 else 0) if nib & 8 else byte) << (8 * i)  # bit 3: replicate the sign
    return out


def _f16(bits: int) -> float:
    return float(np.array([bits], dtype=np.uint16).view(np.float16)[0])


def _f16_bits(value: float) -> int:
    return int(np.array([value], dtype=np.float16).view(np.uint16)[0])  # round to nearest even


def _f32(bits: int) -> float:
    return float(np.array([bits], dtype=np.uint32).view(np.float32)[0])


def _f32_bits(value: float) -> int:
    return int(np.array([value], dtype=np.float32).view(np.uint32)[0])


def _fma_f16x2(a: int, b: int, c: int) -> int:
    out = 0
    for half in (0, 16):
        x, y, z = (_f16((v >> half) & 0xFFFF) for v in (a, b, c))
        out |= _f16_bits(x * y + z) << half  # fp16 operands: product and sum exact in fp64, one rounding
    return out


def _run(asm: str, inputs: dict[str, int]) -> dict[str, int]:
    regs = dict(inputs)

    def val(tok: str) -> int:
        return int(tok, 0) if re.fullmatch(r"-?(0x[0-9a-fA-F]+|\d+)", tok) else regs[tok]

    for stmt in asm.replace("\n", " ").split(";"):
        stmt = stmt.strip(" {}")
        if not stmt or stmt.startswith(".reg"):
            continue
        unpack64 = re.fullmatch(r"mov\.b64 \{(\w+), (\w+)\}, (\w+)", stmt)
        if unpack64:
            lo, hi, src = unpack64.groups()
            regs[lo], regs[hi] = regs[src] & MASK, regs[src] >> 32
            continue
        unpack = re.fullmatch(r"mov\.b32 \{(\w+), (\w+)\}, (\w+)", stmt)
        if unpack:
            lo, hi, src = unpack.groups()
            regs[lo], regs[hi] = regs[src] & 0xFFFF, regs[src] >> 16
            continue
        op, args = stmt.split(None, 1)
        dst, *src = [a.strip() for a in args.split(",")]
        v = [val(t) for t in src]
        if op == "mov.b32":
            regs[dst] = v[0] & MASK
        elif op == "prmt.b32":
            regs[dst] = _prmt(*v)
        elif op == "shl.b32":
            regs[dst] = (v[0] << v[1]) & MASK
        elif op == "shr.b32":
            regs[dst] = v[0] >> v[1]
        elif op == "fma.rn.f16x2":
            regs[dst] = _fma_f16x2(*v)
        elif op == "cvt.f32.f16":
            regs[dst] = _f32_bits(_f16(v[0]))
        elif op == "add.f32":
            regs[dst] = _f32_bits(np.float32(_f32(v[0])) + np.float32(_f32(v[1])))
        elif op == "cvt.rn.f16x2.f32":
            regs[dst] = (_f16_bits(_f32(v[0])) << 16) | _f16_bits(_f32(v[1]))
        elif op == "and.b32":
            regs[dst] = v[0] & v[1]
        elif op == "mul.lo.u32":
            regs[dst] = (v[0] * v[1]) & MASK
        elif op == "mul.wide.u32":
            regs[dst] = (v[0] & MASK) * (v[1] & MASK)  # the 64-bit product
        elif op == "or.b32":
            regs[dst] = v[0] | v[1]
        elif op == "fma.rn.bf16x2":
            regs[dst] = _fma_bf16x2(*v)
        else:
            raise AssertionError(f"emulator does not know {op!r}")
    return regs


@pytest.mark.parametrize("folded,scale_byte", [(False, s) for s in (1, 2, 100, 119, 121, 127, 128, 200, 240)]
                         + [(True, s) for s in (1, 2, 100, 119, 121, 127, FOLD_MAX_SCALE)])
def test_asm_dequantises_every_byte_exactly(folded, scale_byte):
    scale = 2.0 ** (scale_byte - 127)
    # the kernel's bf16 scale: the E8M0 byte in the exponent field (+ 126 when 2**126 is folded in)
    scale_bits = (scale_byte + 126 if folded else scale_byte) << 7
    pair = scale_bits | (scale_bits << 16)
    asm = _FP4_TO_BF16_FOLDED_ASM if folded else _FP4_TO_BF16_ASM
    for first in range(0, 256, 4):
        packed = sum((first + i) << (8 * i) for i in range(4))
        regs = _run(str(asm.value), {"$4": packed, "$5": pair, "$6": pair})
        lo = [regs["$0"] & 0xFFFF, regs["$0"] >> 16, regs["$1"] & 0xFFFF, regs["$1"] >> 16]
        hi = [regs["$2"] & 0xFFFF, regs["$2"] >> 16, regs["$3"] & 0xFFFF, regs["$3"] >> 16]
        for i in range(4):
            byte = first + i
            assert _bf16(lo[i]) == FP4_VALUES[byte & 15] * scale, (byte, scale_byte, "low nibble")
            assert _bf16(hi[i]) == FP4_VALUES[byte >> 4] * scale, (byte, scale_byte, "high nibble")


def _split_word(word: int) -> int:
    """A checkpoint word in the split-word order (mxfp4_split.split_words on its 4 bytes)."""
    raw = torch.tensor(list(word.to_bytes(4, "little")), dtype=torch.uint8)
    return int.from_bytes(bytes(split_words(raw).tolist()), "little")


@pytest.mark.parametrize("folded,scale_byte", [(False, s) for s in (1, 2, 119, 121, 128, 200, 240)]
                         + [(True, s) for s in (1, 2, 119, 121, FOLD_MAX_SCALE)])
def test_split_asm_dequantises_every_code_in_every_position(folded, scale_byte):
    # Same contract as the checkpoint-order asm, per virtual byte i = values 2i, 2i + 1 of the word:
    # $0 / $1 the values 0, 2 / 4, 6, $2 / $3 the values 1, 3 / 5, 7; every code in every position,
    # then random words (a bit of one value leaking into another's would show in either).
    scale = 2.0 ** (scale_byte - 127)
    scale_bits = (scale_byte + 126 if folded else scale_byte) << 7
    pair = scale_bits | (scale_bits << 16)
    asm = SPLIT_TO_BF16_FOLDED_ASM if folded else SPLIT_TO_BF16_ASM
    rng = random.Random(scale_byte)
    words = [sum(((code + 3 * j) % 16) << (4 * j) for j in range(8)) for code in range(16)]
    words += [rng.getrandbits(32) for _ in range(64)]
    for word in words:
        regs = _run(str(asm.value), {"$4": _split_word(word), "$5": pair, "$6": pair})
        got = [regs["$0"] & 0xFFFF, regs["$2"] & 0xFFFF, regs["$0"] >> 16, regs["$2"] >> 16,
               regs["$1"] & 0xFFFF, regs["$3"] & 0xFFFF, regs["$1"] >> 16, regs["$3"] >> 16]
        for j in range(8):
            code = (word >> (4 * j)) & 15
            assert _bf16(got[j]) == FP4_VALUES[code] * scale, (hex(word), j, scale_byte)


def test_split_asm_reads_split_words_not_checkpoint_words():
    # The check above must be able to fail: on checkpoint-order words the split asm is wrong.
    pair = (121 + 126) << 7 | ((121 + 126) << 23)
    word = 0x9ABCDEF1
    regs = _run(str(SPLIT_TO_BF16_FOLDED_ASM.value), {"$4": word, "$5": pair, "$6": pair})
    lo = regs["$0"] & 0xFFFF
    assert _bf16(lo) != FP4_VALUES[word & 15] * 2.0 ** (121 - 127)


def _word(nibbles: list[int]) -> int:
    """8 FP4 codes (value i of the word first) -> the little-endian 32-bit word of 4 packed bytes."""
    return sum(n << (4 * i) for i, n in enumerate(nibbles))


def _f16_pair(lo: float, hi: float) -> int:
    return _f16_bits(lo) | (_f16_bits(hi) << 16)


@pytest.mark.parametrize("seed", range(6))
def test_f16_block_dot_is_exact_on_representable_sums(seed):
    """Integer activations in [-4, 4]: every product and partial sum is exact in fp16, so the asm must
    return the exact dot product; any wrong nibble, sign or pairing changes it."""
    rng = random.Random(seed)
    codes = [rng.randrange(16) for _ in range(32)]
    x = [float(rng.randint(-4, 4)) for _ in range(32)]
    regs = {f"${1 + j}": _word(codes[8 * j:8 * j + 8]) for j in range(4)}
    for j in range(4):
        for i in range(4):
            regs[f"${5 + 4 * i + j}"] = _f16_pair(x[8 * j + i], x[8 * j + i + 4])
    got = _f32(_run(str(_FP4_DOT_F16_ASM.value), regs)["$0"])
    assert got == sum(FP4_VALUES[c] * v for c, v in zip(codes, x))


def test_f16_block_dot_covers_every_code_in_every_position():
    """One code in one position at a time, the others zero: the result is that value times its x."""
    for pos in range(32):
        for code in range(16):
            codes = [0] * 32
            codes[pos] = code
            regs = {f"${1 + j}": _word(codes[8 * j:8 * j + 8]) for j in range(4)}
            for j in range(4):
                for i in range(4):
                    regs[f"${5 + 4 * i + j}"] = _f16_pair(1.0 + 8 * j + i, 1.0 + 8 * j + i + 4)
            got = _f32(_run(str(_FP4_DOT_F16_ASM.value), regs)["$0"])
            assert got == FP4_VALUES[code] * (1.0 + pos), (pos, code)


def test_x_pair_conversion_packs_fp16_low_half_first():
    for lo, hi in [(1.0, -2.5), (3.140625, 60000.0), (1e-3, -7e-6), (0.0, -0.0)]:
        out = _run(str(_X_PAIR_F16_ASM.value), {"$1": _f32_bits(lo), "$2": _f32_bits(hi)})["$0"]
        assert (_f16(out & 0xFFFF), _f16(out >> 16)) == (float(np.float16(lo)), float(np.float16(hi)))
