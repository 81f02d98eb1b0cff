"""An emulator of one warp running inline PTX on the CPU: 32 lanes in lockstep, including the
warp-collective mma.sync m16n8k16 and shfl.sync.idx, for the tensor-core MoE steps' asm
(moe_gemv_mma.py; test_gemv_mma_asm.py, test_group_mma_asm.py), and the packed layout that asm reads.

Fragment layouts and shuffle semantics follow the PTX ISA's description, not the asm under test.
It also checks what ptxas or the hardware would reject or leave undefined: undeclared or
redeclared registers, operand widths (against the kernels' constraint strings), writes to input
operands, reads of unwritten registers, outputs not written on every lane, misaligned or
out-of-bounds loads, and any instruction it does not know.
"""

import re

import numpy as np

LANES = 32
MASK = {1: 1, 32: 0xFFFFFFFF, 64: 0xFFFFFFFFFFFFFFFF}
REG_BITS = {"pred": 1, "b32": 32, "f32": 32, "u32": 32, "s32": 32, "b64": 64, "u64": 64, "s64": 64}
CONSTRAINT_BITS = {"r": 32, "f": 32, "l": 64}


# --- bit conversions on lane vectors (uint64 arrays holding the registers' bit patterns) ---

def f32(bits: np.ndarray) -> np.ndarray:
    return bits.astype(np.uint32).view(np.float32)


def f32_bits(values: np.ndarray) -> np.ndarray:
    return np.asarray(values, dtype=np.float32).view(np.uint32).astype(np.uint64)


def f16_halves(bits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(low half, high half) of f16x2 registers as float64; numpy's float16 has exact subnormals."""
    lo = (bits & 0xFFFF).astype(np.uint16).view(np.float16)
    hi = ((bits >> 16) & 0xFFFF).astype(np.uint16).view(np.float16)
    return lo.astype(np.float64), hi.astype(np.float64)


def f16_bits(values) -> np.ndarray:
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
    return (f16_bits(f32(hi)) << 16) | f16_bits(f32(lo))


def _fma_f32(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    # the fp32 product is exact in float64; rounding the float64 sum to fp32 stands in for fma.rn's
    # single rounding (a double rounding differs only in rare ties, far inside the tolerance)
    return f32_bits(f32(a).astype(np.float64) * f32(b) + f32(c))


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
SHFL = "shfl.sync.idx.b32"


def _mma_m16n8k16(a: list, b: list, c: list) -> list:
    """D = A @ B + C for the whole warp, fragments as in the PTX ISA (lane l: g = l // 4, t = l % 4).
    Products and sums in float64, one rounding to fp32 (the tensor cores' order differs)."""
    lane = np.arange(LANES)
    g, t = lane // 4, lane % 4
    A, B, C = np.full((16, 16), np.nan), np.full((16, 8), np.nan), np.full((16, 8), np.nan)
    for reg, row, col in zip(a, (g, g + 8, g, g + 8), (2 * t, 2 * t, 2 * t + 8, 2 * t + 8)):
        A[row, col], A[row, col + 1] = f16_halves(reg)
    for reg, k in zip(b, (2 * t, 2 * t + 8)):
        B[k, g], B[k + 1, g] = f16_halves(reg)
    c_at = list(zip((g, g, g + 8, g + 8), (2 * t, 2 * t + 1, 2 * t, 2 * t + 1)))
    for reg, (row, col) in zip(c, c_at):
        C[row, col] = f32(reg)
    assert not (np.isnan(A).any() or np.isnan(B).any() or np.isnan(C).any()), "fragment map leaves a hole"
    D = A @ B + C
    return [f32_bits(D[row, col]) for row, col in c_at]


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
        elif op == SHFL:
            # warp-collective: lane l reads `a` of lane (l & segmask) | (b & ~segmask), c = segmask << 8 | clamp
            assert self.lanes == LANES and pred is None, "shfl.sync needs the whole warp"
            d, a, b, c, mask = ops
            assert int(mask, 0) == 0xFFFFFFFF, "shfl.sync over part of the warp"
            seg = (int(c, 0) >> 8) & 31
            assert int(c, 0) & 31 == 31 and int(c, 0) >> 13 == 0, f"shfl clamp {c}"
            lane = np.arange(LANES)
            src = (lane & seg) | (self.read(b, 32, active).astype(np.int64) & ~seg & 31)
            assert (src <= (lane & seg) | (31 & ~seg)).all(), "shfl source past the segment"
            self.write(d, 32, self.read(a, 32, active)[src], active)
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


def run(asm: str, mem: np.ndarray, operands: dict, lanes: int = LANES) -> dict:
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


def constraint_bits(constraints: str) -> list[tuple[int, bool]]:
    """(width, is_input) of $0, $1, ... from a constraint string of moe_gemv_mma.asm_step, so the emulator
    checks the asm against the operand types the kernel really binds."""
    return [(CONSTRAINT_BITS[c.lstrip("=")], not c.startswith("=")) for c in constraints.split(",")]


def bind(constraints: str, values: dict) -> dict:
    """The operands of run: inputs take values[n] (each must be given), outputs start unwritten."""
    bits = constraint_bits(constraints)
    assert {i for i, (_, is_input) in enumerate(bits) if is_input} == set(values), "inputs and values differ"
    return {f"${i}": (b, values.get(i), is_input) for i, (b, is_input) in enumerate(bits)}



# --- the packed layout the tensor-core asm reads (moe_gemv_mma docstring, MoeWeights.row_group 16) ---

def bf16_values(rng: np.random.Generator, n: int) -> np.ndarray:
    """bf16-representable values that are also normal fp16 (exponents -6..3), a few exact zeros."""
    mant = 1.0 + rng.integers(0, 128, n) / 128.0
    values = rng.choice([-1.0, 1.0], n) * mant * 2.0 ** rng.integers(-6, 4, n)
    values[rng.random(n) < 0.05] = 0.0
    return values


def packed_layout(rng: np.random.Generator, gb: int, tokens: int = 1) -> dict:
    """Two tiles of 16 rows x gb block columns (FP4 codes, scale bytes) and `tokens` rows of x
    [tokens, gb, 32] x_stride bytes apart, packed into one buffer."""
    codes = rng.integers(0, 16, (2, 16, gb, 32))  # [tile, row, block column, value]
    scales = rng.integers(120, 131, (2, 16, gb))
    x = bf16_values(rng, tokens * gb * 32).reshape(tokens, gb, 32)
    tile_stride = 256 * gb + 4 * int(rng.integers(0, 64))  # word aligned, tiles do not overlap
    scale_stride = 32 + int(rng.integers(0, 9))  # 32 rows per block column here, then any padding
    x_stride = 64 * gb + 16 * int(rng.integers(0, 4))  # 16-byte aligned rows
    w0 = 64  # nonzero, so a lane that dropped its base would read elsewhere
    s0 = w0 + tile_stride + 256 * gb + 8
    x0 = (s0 + scale_stride * gb + 31) // 16 * 16  # 16-byte aligned for ld.v4
    # garbage everywhere the layout does not define, so a stray read changes the result
    mem = rng.integers(0, 256, x0 + x_stride * tokens + 64).astype(np.uint8)
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)  # byte j: values 2j, 2j + 1
    for tile in range(2):
        for c in range(gb):
            start = w0 + tile * tile_stride + 256 * c  # block column c: 256 bytes, row i at 16 i
            mem[start:start + 256] = packed[tile, :, c].reshape(-1)
            mem[s0 + c * scale_stride + 16 * tile:][:16] = scales[tile, :, c]
    x_bits = (np.asarray(x, np.float32).view(np.uint32) >> 16).astype(np.uint16)  # exact: 7 mantissa bits
    for i in range(tokens):
        mem[x0 + i * x_stride:][:64 * gb] = x_bits[i].reshape(-1).view(np.uint8)
    return {"codes": codes, "scales": scales, "x": x, "mem": mem, "w0": w0, "s0": s0, "x0": x0,
            "tile_stride": tile_stride, "scale_stride": scale_stride, "x_stride": x_stride}


def load_operands(lay: dict, n_out: int) -> dict:
    """moe_gemv_mma._load_asm's inputs for packed_layout's tiles, after its n_out outputs."""
    lane = np.arange(LANES)
    r, t = lane // 4, lane % 4
    return {
        n_out: lay["w0"] + 4 * lane,  # word l of tile 0's first block column = row r, values 8t .. 8t + 7
        n_out + 1: lay["tile_stride"],
        n_out + 2: lay["s0"] + r + 8 * t,  # the scale byte of the pair's row r + 8t at block column 0
        n_out + 3: lay["scale_stride"],
    }
