"""The inline PTX of the tensor-core gemv step (moe_gemv_mma._load_asm, then _math_asm), run on the
CPU by an emulator of one warp: 32 lanes in lockstep, including the warp-collective mma.sync m16n8k16.

CI has no GPU, and the step's correctness rests on things a GPU run only shows as wrong numbers:
which lane loads which word, scale byte and activations, how the nibbles become fp16 pairs, and
how those registers line up with the mma's A/B/C/D fragments (PTX ISA layout, emulated here from
the ISA's description, not from the asm). The tests lay out two 16-row tiles of packed weights,
their scales and a bf16 activation vector as moe_gemv_mma's docstring says, run the load asm, hand
its registers to the math asm as _mma_rows does (`(acc,) + loaded + (x, skip, t)`), and compare the load registers
with the layout and each lane's accumulated row with a float64 reference. The emulator also checks
what ptxas or the hardware would reject or leave undefined: undeclared or redeclared registers,
operand widths (against the constraint strings of _asm_constants), writes to input operands,
reads of unwritten registers, outputs not written on every lane, misaligned or out-of-bounds
loads, and any instruction it does not know.
"""

import re

import numpy as np
import pytest

from gptoss_cli.kernels.moe_gemv_mma import LOADED, _asm_constants, _high_bytes, _pairs
from gptoss_cli.kernels.mxfp4 import FP4_VALUES

LANES = 32
MASK = {1: 1, 32: 0xFFFFFFFF, 64: 0xFFFFFFFFFFFFFFFF}
REG_BITS = {"pred": 1, "b32": 32, "f32": 32, "u32": 32, "s32": 32, "b64": 64, "u64": 64, "s64": 64}
CONSTRAINT_BITS = {"r": 32, "f": 32, "l": 64}
FP16_SHIFT = 2.0**-14  # the asm's fp16 pairs hold FP4 values times 2**-14


# --- bit conversions on lane vectors (uint64 arrays holding the registers' bit patterns) ---

def _f32(bits: np.ndarray) -> np.ndarray:
    return bits.astype(np.uint32).view(np.float32)


def _f32_bits(values: np.ndarray) -> np.ndarray:
    return np.asarray(values, dtype=np.float32).view(np.uint32).astype(np.uint64)


def _f16_halves(bits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(low half, high half) of f16x2 registers as float64; numpy's float16 has exact subnormals."""
    lo = (bits & 0xFFFF).astype(np.uint16).view(np.float16)
    hi = ((bits >> 16) & 0xFFFF).astype(np.uint16).view(np.float16)
    return lo.astype(np.float64), hi.astype(np.float64)


def _f16_bits(values) -> np.ndarray:
    return np.asarray(values, dtype=np.float16).view(np.uint16).astype(np.uint64)


def _s32(bits: np.ndarray) -> np.ndarray:
    return bits.astype(np.uint32).view(np.int32)


def _shift(a: np.ndarray, n: np.ndarray, left: bool) -> np.ndarray:
    # PTX clamps shift amounts: 32 or more gives 0 for .b32 (numpy's behaviour there is undefined)
    n = np.broadcast_to(n, a.shape)
    small = np.minimum(n, 31)
    out = (a << small) & MASK[32] if left else a >> small
    return np.where(n < 32, out, 0).astype(np.uint64)


def _prmt(a: np.ndarray, b: np.ndarray, sel: np.ndarray) -> np.ndarray:
    """prmt.b32 default mode: byte i of the result is byte (nibble i of sel) & 7 of {b, a}; with
    the nibble's bit 3 set, that byte's sign replicated instead."""
    pool = a | (b << 32)
    out = np.zeros_like(a)
    for i in range(4):
        nib = (sel >> (4 * i)) & 15
        byte = (pool >> (8 * (nib & 7))) & 0xFF
        byte = np.where(nib & 8, np.where(byte & 0x80, 0xFF, 0), byte).astype(np.uint64)
        out |= byte << (8 * i)
    return out


def _cvt_f16x2(hi: np.ndarray, lo: np.ndarray) -> np.ndarray:
    # cvt.rn.f16x2.f32 d, a, b: d.hi = f16(a), d.lo = f16(b); numpy rounds to nearest even
    return (_f16_bits(_f32(hi)) << 16) | _f16_bits(_f32(lo))


def _fma_f32(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    # the fp32 product is exact in float64; rounding the float64 sum to fp32 stands in for fma.rn's
    # single rounding (a double rounding differs only in rare ties, far inside the tolerance)
    return _f32_bits(_f32(a).astype(np.float64) * _f32(b) + _f32(c))


# op: (destination widths, source widths, function of the source lane vectors)
ALU = {
    "mov.b64": ((64,), (64,), lambda a: a),
    "add.s64": ((64,), (64, 64), lambda a, b: a + b),  # uint64 arithmetic wraps like the hardware
    "cvt.u64.u32": ((64,), (32,), lambda a: a),
    "mov.b32": ((32,), (32,), lambda a: a),
    "mov.f32": ((32,), (32,), lambda a: a),
    "shl.b32": ((32,), (32, 32), lambda a, n: _shift(a, n, True)),
    "shr.b32": ((32,), (32, 32), lambda a, n: _shift(a, n, False)),
    "and.b32": ((32,), (32, 32), lambda a, b: a & b),
    "or.b32": ((32,), (32, 32), lambda a, b: a | b),
    "prmt.b32": ((32,), (32, 32, 32), _prmt),
    "setp.le.s32": ((1,), (32, 32), lambda a, b: (_s32(a) <= _s32(b)).astype(np.uint64)),
    "setp.ne.s32": ((1,), (32, 32), lambda a, b: (_s32(a) != _s32(b)).astype(np.uint64)),
    "selp.f32": ((32,), (32, 32, 1), lambda a, b, p: np.where(p.astype(bool), a, b).astype(np.uint64)),
    "cvt.rn.f16x2.f32": ((32,), (32, 32), _cvt_f16x2),
    "fma.rn.f32": ((32,), (32, 32, 32), _fma_f32),
}
LOADS = {"ld.global.nc.b32": (1, 4), "ld.global.nc.u8": (1, 1), "ld.global.v4.b32": (4, 4)}  # (regs, bytes each)
MMA = "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32"


def _mma_m16n8k16(a: list, b: list, c: list) -> list:
    """D = A @ B + C for the whole warp, fragments as in the PTX ISA (lane l: g = l // 4, t = l % 4).
    Products and sums in float64, one rounding to fp32 (the tensor cores' order differs)."""
    lane = np.arange(LANES)
    g, t = lane // 4, lane % 4
    A, B, C = np.full((16, 16), np.nan), np.full((16, 8), np.nan), np.full((16, 8), np.nan)
    for reg, row, col in zip(a, (g, g + 8, g, g + 8), (2 * t, 2 * t, 2 * t + 8, 2 * t + 8)):
        A[row, col], A[row, col + 1] = _f16_halves(reg)
    for reg, k in zip(b, (2 * t, 2 * t + 8)):
        B[k, g], B[k + 1, g] = _f16_halves(reg)
    c_at = list(zip((g, g, g + 8, g + 8), (2 * t, 2 * t + 1, 2 * t, 2 * t + 1)))
    for reg, (row, col) in zip(c, c_at):
        C[row, col] = _f32(reg)
    assert not (np.isnan(A).any() or np.isnan(B).any() or np.isnan(C).any()), "fragment map leaves a hole"
    D = A @ B + C
    return [_f32_bits(D[row, col]) for row, col in c_at]


def _operands(args: str) -> list:
    """Top-level operands: '{a, b}' -> [a, b], '[base+imm]' -> ('addr', base, imm), else the token."""
    out = []
    for tok in re.findall(r"\{[^}]*\}|\[[^\]]*\]|[^,\s]+", args):
        if tok.startswith("{"):
            out.append([r.strip() for r in tok[1:-1].split(",")])
        elif tok.startswith("["):
            base, _, imm = tok[1:-1].partition("+")
            out.append(("addr", base.strip(), int(imm or "0", 0)))
        else:
            out.append(tok)
    return out


def _statements(asm: str):
    """(predicate, negated, opcode, operands) per statement; scope braces and ';' separate them."""
    for stmt in asm.split(";"):
        stmt = stmt.strip().lstrip("{}").strip()  # a statement never starts with an operand brace
        if not stmt:
            continue
        m = re.fullmatch(r"(?:@(!?)(\w+)\s+)?([\w.]+)\s*(.*)", stmt, re.DOTALL)
        assert m, f"cannot parse {stmt!r}"
        neg, pred, op, args = m.groups()
        yield pred, neg == "!", op, args


class Warp:
    """Registers as uint64 lane vectors plus a per-lane 'written' mask; memory is a uint8 buffer
    whose offsets are the addresses."""

    def __init__(self, mem: np.ndarray, operands: dict, lanes: int = LANES):
        self.mem, self.lanes = mem, lanes
        self.bits, self.regs, self.valid, self.inputs = {}, {}, {}, set()
        for name, (bits, value, is_input) in operands.items():
            self.bits[name] = bits
            if is_input:
                self.inputs.add(name)
                self.regs[name] = np.broadcast_to(np.asarray(value, dtype=np.uint64) & MASK[bits], (lanes,)).copy()
                self.valid[name] = np.ones(lanes, bool)

    def read(self, tok: str, bits: int, active: np.ndarray) -> np.ndarray:
        hex_f32 = re.fullmatch(r"0[fF]([0-9a-fA-F]{8})", tok)  # PTX's fp32 literal: 0f + its bits in hex
        if hex_f32:
            return np.full(self.lanes, int(hex_f32.group(1), 16), np.uint64)
        if re.fullmatch(r"-?(0[xX][0-9a-fA-F]+|\d+)", tok):
            return np.full(self.lanes, int(tok, 0) & MASK[bits], np.uint64)
        assert tok in self.bits, f"register {tok} is not declared"
        assert self.bits[tok] == bits, f"{tok} is {self.bits[tok]}-bit, used as {bits}-bit"
        assert tok in self.valid and self.valid[tok][active].all(), f"{tok} read before it is written"
        return self.regs[tok]

    def write(self, name: str, bits: int, value: np.ndarray, active: np.ndarray) -> None:
        assert name in self.bits, f"register {name} is not declared"
        assert name not in self.inputs, f"input operand {name} written"
        assert self.bits[name] == bits, f"{name} is {self.bits[name]}-bit, written as {bits}-bit"
        old = self.regs.get(name, np.zeros(self.lanes, np.uint64))
        self.regs[name] = np.where(active, value & MASK[bits], old).astype(np.uint64)
        self.valid[name] = self.valid.get(name, np.zeros(self.lanes, bool)) | active

    def load(self, base: str, imm: int, nbytes: int, count: int, active: np.ndarray) -> list:
        addr = self.read(base, 64, active).astype(np.int64) + imm
        span = nbytes * count
        used = addr[active]
        assert (used % span == 0).all(), f"misaligned {span}-byte load from {base}+{imm}"  # faults on the GPU
        assert (used >= 0).all() and (used + span <= self.mem.size).all(), f"load out of bounds: {base}+{imm}"
        addr = np.where(active, addr, 0)
        raw = self.mem[addr[:, None] + np.arange(span)].astype(np.uint64)  # [lanes, span], little endian
        return [sum(raw[:, nbytes * i + j] << (8 * j) for j in range(nbytes)) for i in range(count)]

    def step(self, pred, negated, op, args) -> None:
        active = np.ones(self.lanes, bool)
        if pred:
            active = self.read(pred, 1, active).astype(bool) ^ negated
        ops = _operands(args)
        if op == ".reg":
            kind, names = re.fullmatch(r"\.(\w+)\s+(.*)", args, re.DOTALL).groups()
            for name in (n.strip() for n in names.split(",")):
                assert name not in self.bits, f"register {name} declared twice"
                self.bits[name] = REG_BITS[kind]
        elif op in ALU:
            dst_bits, src_bits, fn = ALU[op]
            assert len(ops) == len(dst_bits) + len(src_bits), f"operand count of {op} {args}"
            v = [self.read(tok, b, active) for tok, b in zip(ops[1:], src_bits)]
            self.write(ops[0], dst_bits[0], fn(*v), active)
        elif op in LOADS:
            count, nbytes = LOADS[op]
            dsts, (kind, base, imm) = ops[0] if count > 1 else [ops[0]], ops[1]
            assert kind == "addr" and len(dsts) == count and len(ops) == 2, f"{op} {args}"
            for dst, value in zip(dsts, self.load(base, imm, nbytes, count, active)):
                self.write(dst, 32, value, active)
        elif op == MMA:
            # warp-collective: all 32 lanes must take part, unpredicated
            assert self.lanes == LANES and pred is None, "mma.sync needs the whole warp"
            d, a, b, c = ops
            assert (len(d), len(a), len(b), len(c)) == (4, 4, 2, 4), f"{op} {args}"
            out = _mma_m16n8k16(*([self.read(r, 32, active) for r in regs] for regs in (a, b, c)))
            for name, value in zip(d, out):
                self.write(name, 32, value, active)
        else:
            raise AssertionError(f"emulator does not know {op!r}")


def _run(asm: str, mem: np.ndarray, operands: dict, lanes: int = LANES) -> dict:
    """Executes `asm` on `lanes` lanes; operands: '$n' -> (bits, lane values or None, is_input).
    Returns the registers' final lane vectors; every output operand must be written on every lane
    (Triton would get whatever the register held)."""
    warp = Warp(mem, operands, lanes)
    for stmt in _statements(asm):
        warp.step(*stmt)
    for name, (_, _, is_input) in operands.items():
        if not is_input:
            assert name in warp.valid and warp.valid[name].all(), f"output {name} not written on every lane"
    return warp.regs


def _constraint_bits(constraints: str) -> list[tuple[int, bool]]:
    """(width, is_input) of $0, $1, ... from a constraint string of _asm_constants, so the emulator
    checks the asm against the operand types the kernel really binds."""
    return [(CONSTRAINT_BITS[c.lstrip("=")], not c.startswith("=")) for c in constraints.split(",")]


def _bind(constraints: str, values: dict) -> dict:
    """The operands of _run: inputs take values[n] (each must be given), outputs start unwritten."""
    bits = _constraint_bits(constraints)
    assert {i for i, (_, is_input) in enumerate(bits) if is_input} == set(values), "inputs and values differ"
    return {f"${i}": (b, values.get(i), is_input) for i, (b, is_input) in enumerate(bits)}


# --- the packed layout (moe_gemv_mma docstring, MoeWeights.row_group 16) ---

def _bf16_values(rng: np.random.Generator, n: int) -> np.ndarray:
    """bf16-representable values that are also normal fp16 (exponents -6..3), a few exact zeros."""
    mant = 1.0 + rng.integers(0, 128, n) / 128.0
    values = rng.choice([-1.0, 1.0], n) * mant * 2.0 ** rng.integers(-6, 4, n)
    values[rng.random(n) < 0.05] = 0.0
    return values


def _layout(rng: np.random.Generator, gb: int) -> dict:
    """Two tiles of 16 rows x gb block columns: FP4 codes, scale bytes and x, packed into one buffer."""
    codes = rng.integers(0, 16, (2, 16, gb, 32))  # [tile, row, block column, value]
    scales = rng.integers(120, 131, (2, 16, gb))
    x = _bf16_values(rng, gb * 32).reshape(gb, 32)
    tile_stride = 256 * gb + 4 * int(rng.integers(0, 64))  # word aligned, tiles do not overlap
    scale_stride = 32 + int(rng.integers(0, 9))  # 32 rows per block column here, then any padding
    w0 = 64  # nonzero, so a lane that dropped its base would read elsewhere
    s0 = w0 + tile_stride + 256 * gb + 8
    x0 = (s0 + scale_stride * gb + 31) // 16 * 16  # 16-byte aligned for ld.v4
    # garbage everywhere the layout does not define, so a stray read changes the result
    mem = rng.integers(0, 256, x0 + 64 * gb + 64).astype(np.uint8)
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)  # byte j: values 2j, 2j + 1
    for tile in range(2):
        for c in range(gb):
            start = w0 + tile * tile_stride + 256 * c  # block column c: 256 bytes, row i at 16 i
            mem[start:start + 256] = packed[tile, :, c].reshape(-1)
            mem[s0 + c * scale_stride + 16 * tile:][:16] = scales[tile, :, c]
    x_bits = (np.asarray(x, np.float32).view(np.uint32) >> 16).astype(np.uint16)  # exact: 7 mantissa bits
    mem[x0:x0 + 64 * gb] = x_bits.reshape(-1).view(np.uint8)
    return {"codes": codes, "scales": scales, "x": x, "mem": mem, "w0": w0, "s0": s0, "x0": x0,
            "tile_stride": tile_stride, "scale_stride": scale_stride}


def _lane_row() -> tuple[np.ndarray, np.ndarray]:
    """(tile, row in the tile) each lane (r, t) accumulates: row r + 8t of the pair of tiles."""
    lane = np.arange(LANES)
    row = lane // 4 + 8 * (lane % 4)
    return row // 16, row % 16


def _expected(lay: dict, skip: int) -> tuple[np.ndarray, np.ndarray]:
    """Per (tile, row): sum over block columns c >= skip of 2**(s - 127) * 2**-14 * dot(W, x), and
    the sum of the terms' magnitudes (for the tolerance)."""
    fp4 = np.asarray(FP4_VALUES)[lay["codes"]]  # [tile, row, c, 32]
    gb = fp4.shape[2]
    keep = (np.arange(gb) >= skip).astype(float)
    scale = 2.0 ** (lay["scales"] - 127.0) * FP16_SHIFT * keep
    prod = fp4 * lay["x"][None, None]
    return (scale * prod.sum(-1)).sum(-1), (scale * np.abs(prod).sum(-1)).sum(-1)


def _load_inputs(lay: dict, n_out: int) -> dict:
    """_load_asm's inputs, after its n_out outputs."""
    lane = np.arange(LANES)
    r, t = lane // 4, lane % 4
    return {
        n_out: lay["w0"] + 4 * lane,  # word l of tile 0's first block column = row r, values 8t .. 8t + 7
        n_out + 1: lay["tile_stride"],
        n_out + 2: lay["s0"] + r + 8 * t,  # the scale byte of the pair's row r + 8t at block column 0
        n_out + 3: lay["scale_stride"],
    }


def _step(gb: int, lay: dict, acc_in: np.ndarray, skip: int, load_asm=None, math_asm=None):
    """One K step on the emulator: the load asm's outputs, then the math asm's outputs when fed
    acc_in (one float32 per lane), those registers, x[8t]'s address, `skip` and t as _mma_rows
    does. The texts default to _asm_constants(gb)'s (a test may pass altered ones)."""
    load_text, load_cons, load_types, math_text, math_cons = (c.value for c in _asm_constants(gb))
    n_out = LOADED * gb
    assert len(load_types) == n_out == load_cons.count("=r"), "load results and constraints disagree"
    loaded = _run(load_asm or load_text, lay["mem"], _bind(load_cons, _load_inputs(lay, n_out)))
    t = np.arange(LANES) % 4
    x_addr = lay["x0"] + 16 * t  # x[8t]: every lane reads the token, so every B column holds it
    # _math_step's operands are `(acc,) + loaded + (x address, skip, t)`: $1, then the load's $0.. in order
    math_in = dict(enumerate([_f32_bits(acc_in)] + [loaded[f"${i}"] for i in range(n_out)]
                             + [x_addr, np.int64(skip) & MASK[32], t], start=1))
    out = _run(math_asm or math_text, lay["mem"], _bind(math_cons, math_in))
    return loaded, out


def _check_loaded(loaded: dict, lay: dict, gb: int) -> None:
    """The load registers hold what _load_asm's docstring says, per lane and block column."""
    lane = np.arange(LANES)
    r, t = lane // 4, lane % 4
    codes = lay["codes"]  # [tile, row, c, value]
    scale_tile, scale_row = _lane_row()
    for g in range(gb):
        for k, (tile, half) in enumerate([(0, 0), (0, 1), (1, 0), (1, 1)]):
            vals = codes[tile, r + 8 * half, g]  # [lane, 32]: row r (+ 8) of this lane
            word = (vals[lane[:, None], 8 * t[:, None] + np.arange(8)] << (4 * np.arange(8))).sum(-1)  # values 8t ..
            got = loaded[f"${LOADED * g + k}"]
            assert (got == word.astype(np.uint64)).all(), f"block column {g}: word {k} is not tile {tile} row r+{8 * half}"
        want = lay["scales"][scale_tile, scale_row, g].astype(np.uint64)
        assert (loaded[f"${LOADED * g + 4}"] == want).all(), f"block column {g}: scale is not row r + 8t's"


STEP_CASES = [(1, 0), (1, -1), (2, 0), (2, 1), (2, 2), (4, 0), (4, 1), (4, 3), (4, -4)]


def _check_step(gb: int, skip: int, seed: int, load_asm=None, math_asm=None) -> None:
    rng = np.random.default_rng(1000 * seed + 10 * gb + skip)
    lay = _layout(rng, gb)
    acc_in = (rng.standard_normal(LANES) * 2.0**-10).astype(np.float32)  # lane (r, t): row r + 8t's sum so far
    loaded, regs = _step(gb, lay, acc_in, skip, load_asm, math_asm)
    _check_loaded(loaded, lay, gb)
    want, size = _expected(lay, skip)
    tile, row = _lane_row()
    got = _f32(regs["$0"]).astype(np.float64)
    ref = acc_in.astype(np.float64) + want[tile, row]
    tol = 1e-5 * (np.abs(acc_in) + size[tile, row]) + 1e-30
    bad = np.flatnonzero(np.abs(got - ref) > tol)
    assert bad.size == 0, f"lanes {bad.tolist()}: got {got[bad].tolist()}, want {ref[bad].tolist()}"
    if skip >= gb:
        assert (regs["$0"] == _f32_bits(acc_in)).all(), "skipped blocks changed acc"


@pytest.mark.parametrize("gb,skip", STEP_CASES)
@pytest.mark.parametrize("seed", range(3))
def test_mma_step_matches_reference(gb, skip, seed):
    """_load_asm then _math_asm: the load registers match the layout, and every lane's accumulator
    = acc_in + the scaled block dot products of its row; skip < 0 (a later K split)
    and skip >= gb (a split wholly repeated) occur in _mma_rows."""
    _check_step(gb, skip, seed)


def test_pairs_decode_every_code_in_every_position():
    """_high_bytes + _pairs on one word per lane (no mma): pair i = (value i, value i + 4), low half
    first, each FP4 value times 2**-14 exactly, for all 16 codes at all 8 nibble positions (the
    other nibbles random, so every pair is checked every time)."""
    rng = np.random.default_rng(7)
    cases = [(pos, code) for pos in range(8) for code in range(16)]
    codes = rng.integers(0, 16, (len(cases), 8))
    for lane, (pos, code) in enumerate(cases):
        codes[lane, pos] = code
    words = (codes << (4 * np.arange(8))).sum(-1).astype(np.uint64)  # value i at bits 4i .. 4i + 3
    asm = "{\n.reg .b32 q, u, hl, hh, p0, p1, p2, p3;" + _high_bytes("$0") + _pairs(("p0", "p1", "p2", "p3")) + "\n}"
    regs = _run(asm, np.zeros(0, np.uint8), {"$0": (32, words, True)}, lanes=len(cases))
    fp16 = _f16_bits(np.asarray(FP4_VALUES)[codes] * FP16_SHIFT)  # [lane, value]; code 8 is -0.0
    for i in range(4):
        got = regs[f"p{i}"]
        assert ((got & 0xFFFF) == fp16[:, i]).all(), f"pair {i} low half is not value {i}"
        assert ((got >> 16) == fp16[:, i + 4]).all(), f"pair {i} high half is not value {i + 4}"


def test_emulator_rejects_unknown_instruction():
    asm = "{\n.reg .b32 a;\nmov.b32 a, 1; popc.b32 a, a;\n}"
    with pytest.raises(AssertionError, match="does not know 'popc.b32'"):
        _run(asm, np.zeros(0, np.uint8), {}, lanes=1)


def test_emulator_rejects_unwritten_and_undeclared_registers():
    with pytest.raises(AssertionError, match="read before it is written"):
        _run("{\n.reg .b32 a, b;\nmov.b32 a, b;\n}", np.zeros(0, np.uint8), {}, lanes=1)
    with pytest.raises(AssertionError, match="not declared"):
        _run("{\n.reg .b32 a;\nmov.b32 c, 1;\n}", np.zeros(0, np.uint8), {}, lanes=1)
