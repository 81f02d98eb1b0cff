"""The inline PTX that dequantises MXFP4 to bf16 (moe_matmul._FP4_TO_BF16_ASM), run on the CPU by a
small emulator of the instructions it uses, for every byte value and a range of scales. The GPU
test (test_moe.py::test_bf16_dequantisation_is_exact_over_the_scale_range) checks the hardware;
this one checks the bit logic where CI runs, and fails on any instruction it does not know."""

import re

import pytest
import torch

from gptoss_cli.kernels.moe_matmul import _FP4_TO_BF16_ASM
from gptoss_cli.kernels.mxfp4 import FP4_VALUES

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
    return sum(((pool >> (8 * ((sel >> (4 * i)) & 7))) & 0xFF) << (8 * i) for i in range(4))


def _run(asm: str, inputs: dict[str, int]) -> dict[str, int]:
    regs = dict(inputs)

    def val(tok: str) -> int:
        return int(tok, 0) if re.fullmatch(r"-?(0x[0-9a-fA-F]+|\d+)", tok) else regs[tok]

    for stmt in asm.replace("\n", " ").split(";"):
        stmt = stmt.strip(" {}")
        if not stmt or stmt.startswith(".reg"):
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
        elif op == "and.b32":
            regs[dst] = v[0] & v[1]
        elif op == "or.b32":
            regs[dst] = v[0] | v[1]
        elif op == "fma.rn.bf16x2":
            regs[dst] = _fma_bf16x2(*v)
        else:
            raise AssertionError(f"emulator does not know {op!r}")
    return regs


@pytest.mark.parametrize("scale_byte", [1, 2, 100, 119, 121, 127, 128, 200, 240])
def test_asm_dequantises_every_byte_exactly(scale_byte):
    scale = 2.0 ** (scale_byte - 127)
    scale_bits = scale_byte << 7  # the kernel's bf16 scale: the E8M0 byte in the exponent field
    pair = scale_bits | (scale_bits << 16)
    for first in range(0, 256, 4):
        packed = sum((first + i) << (8 * i) for i in range(4))
        regs = _run(str(_FP4_TO_BF16_ASM.value), {"$4": packed, "$5": pair, "$6": pair})
        lo = [regs["$0"] & 0xFFFF, regs["$0"] >> 16, regs["$1"] & 0xFFFF, regs["$1"] >> 16]
        hi = [regs["$2"] & 0xFFFF, regs["$2"] >> 16, regs["$3"] & 0xFFFF, regs["$3"] >> 16]
        for i in range(4):
            byte = first + i
            assert _bf16(lo[i]) == FP4_VALUES[byte & 15] * scale, (byte, scale_byte, "low nibble")
            assert _bf16(hi[i]) == FP4_VALUES[byte >> 4] * scale, (byte, scale_byte, "high nibble")
