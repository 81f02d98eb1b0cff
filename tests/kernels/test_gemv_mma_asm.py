"""The inline PTX of the tensor-core gemv step (moe_gemv_mma._load_asm and _x_load_asm, then _math_asm), run on the
CPU by ptx_warp's emulator of one warp: 32 lanes in lockstep, including the warp-collective
mma.sync m16n8k16.

CI has no GPU, and the step's correctness rests on things a GPU run only shows as wrong numbers:
which lane loads which word, scale byte and activations, how the nibbles become fp16 pairs, and
how those registers line up with the mma's A/B/C/D fragments (PTX ISA layout, emulated here from
the ISA's description, not from the asm). The tests lay out two 16-row tiles of packed weights,
their scales and a bf16 activation vector as moe_gemv_mma's docstring says, run the load asms, hand
their registers to the math asm as _k_loop does (`(acc,) + loaded + xs + (t,)`), and compare the load registers
with the layout and each lane's accumulated row with a float64 reference; the emulator checks
operand widths against the constraint strings of asm_step.
"""

import numpy as np
import pytest
import torch
from ptx_warp import (
    LANES,
    MASK,
    bind,
    f16_bits,
    f32,
    f32_bits,
    load_operands,
    packed_layout,
    run,
)

from gptoss_cli.kernels.moe_gemv_mma import LOADED, _high_bytes, _pairs, asm_step, fp16_pairs
from gptoss_cli.kernels.mxfp4 import FP4_VALUES

FP16_SHIFT = 2.0**-14  # the asm's fp16 pairs hold FP4 values times 2**-14



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
    prod = fp4 * lay["x"][0][None, None]
    return (scale * prod.sum(-1)).sum(-1), (scale * np.abs(prod).sum(-1)).sum(-1)


def _step(gb: int, lay: dict, acc_in: np.ndarray, skip: int, load_asm=None, math_asm=None):
    """One K step on the emulator: the load asm's outputs, the x load asm's (x[8t]'s address and
    `skip`), then the math asm's outputs when fed acc_in (one float32 per lane), those registers and
    t as _k_loop does. The texts default to asm_step's (a test may pass altered ones)."""
    load_text, load_cons, load_types = asm_step("load", gb)
    x_text, x_cons, x_types = asm_step("x", gb)
    math_text, math_cons, _ = asm_step("math", gb)
    n_out = LOADED * gb
    assert len(load_types) == n_out == load_cons.count("=r"), "load results and constraints disagree"
    assert len(x_types) == 4 * gb == x_cons.count("=r"), "x load results and constraints disagree"
    loaded = run(load_asm or load_text, lay["mem"], bind(load_cons, load_operands(lay, n_out)))
    t = np.arange(LANES) % 4
    x_addr = lay["x0"] + 16 * t  # x[8t]: every lane reads the token, so every B column holds it
    xs = run(x_text, lay["mem"], bind(x_cons, {4 * gb: x_addr, 4 * gb + 1: np.int64(skip) & MASK[32]}))
    # _math_step's operands are `(acc,) + loaded + xs + (t,)`: $1, then the loads' $0.. in order
    math_in = dict(enumerate([f32_bits(acc_in)] + [loaded[f"${i}"] for i in range(n_out)]
                             + [xs[f"${i}"] for i in range(4 * gb)] + [t], start=1))
    out = run(math_asm or math_text, lay["mem"], bind(math_cons, math_in))
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
    lay = packed_layout(rng, gb)
    acc_in = (rng.standard_normal(LANES) * 2.0**-10).astype(np.float32)  # lane (r, t): row r + 8t's sum so far
    loaded, regs = _step(gb, lay, acc_in, skip, load_asm, math_asm)
    _check_loaded(loaded, lay, gb)
    want, size = _expected(lay, skip)
    tile, row = _lane_row()
    got = f32(regs["$0"]).astype(np.float64)
    ref = acc_in.astype(np.float64) + want[tile, row]
    tol = 1e-5 * (np.abs(acc_in) + size[tile, row]) + 1e-30
    bad = np.flatnonzero(np.abs(got - ref) > tol)
    assert bad.size == 0, f"lanes {bad.tolist()}: got {got[bad].tolist()}, want {ref[bad].tolist()}"
    if skip >= gb:
        assert (regs["$0"] == f32_bits(acc_in)).all(), "skipped blocks changed acc"


@pytest.mark.parametrize("gb,skip", STEP_CASES)
@pytest.mark.parametrize("seed", range(3))
def test_mma_step_matches_reference(gb, skip, seed):
    """_load_asm then _math_asm: the load registers match the layout, and every lane's accumulator
    = acc_in + the scaled block dot products of its row; skip < 0 (a later K split)
    and skip >= gb (a split wholly repeated) occur in _mma_rows."""
    _check_step(gb, skip, seed)


@pytest.mark.parametrize("gb,skip", STEP_CASES)
def test_math_step_on_fp16_pairs_equals_the_converting_step(gb, skip):
    """"math-pairs" reading fp16_pairs(x) in place of x ends with the same accumulator bits as
    "math" on the bf16 activations: the loaded words are exactly the B registers _x_pairs builds."""
    rng = np.random.default_rng(500 + 10 * gb + skip)
    lay = packed_layout(rng, gb)
    acc_in = (rng.standard_normal(LANES) * 2.0**-10).astype(np.float32)
    _, want = _step(gb, lay, acc_in, skip)
    pairs = fp16_pairs(torch.from_numpy(np.asarray(lay["x"][0], np.float32)).reshape(1, -1).to(torch.bfloat16))
    mem = lay["mem"].copy()
    mem[lay["x0"]:][:64 * gb] = pairs.view(torch.uint8).numpy().reshape(-1)
    _, got = _step(gb, lay | {"mem": mem}, acc_in, skip, math_asm=asm_step("math-pairs", gb)[0])
    assert (got["$0"] == want["$0"]).all()
    assert "cvt" not in asm_step("math-pairs", gb)[0]


def test_asm_texts_are_part_of_the_kernels_cache_key(monkeypatch):
    """Triton hashes the constexpr globals a kernel reads, not the dict of asm texts: _ASM_DIGEST
    (read by _asm_call) must be the digest of every text, and its value must move _asm_call's cache
    key, or a changed asm would keep running from ~/.triton/cache (session 37 saw that offline)."""
    import triton.language as tl
    from triton.runtime.jit import JITFunction

    from gptoss_cli.kernels import moe_gemv_mma as m

    want = m.asm_digest(m._ASM_STEPS)
    assert m._ASM_DIGEST.value == want
    assert set(m._ASM_STEPS) >= {("x", 2, 0), ("math-pairs", 4, 0), ("group", 2, 2)}
    for key in (("x", 2, 0), ("group", 1, 1)):  # one changed character of one text moves the digest
        text, cons, types = m._ASM_STEPS[key]
        assert m.asm_digest(m._ASM_STEPS | {key: (text.replace(";", " ;", 1), cons, types)}) != want

    def key():  # a fresh JITFunction each time (the key is memoised; the interpreter's has none)
        return JITFunction(m._asm_call.fn).cache_key

    before = key()
    monkeypatch.setattr(m, "_ASM_DIGEST", tl.constexpr(want[::-1]))
    changed = key()
    monkeypatch.undo()
    assert changed != before and key() == before


def test_fp16_pairs_layout():
    x = torch.arange(16, dtype=torch.float32).reshape(1, 16).to(torch.bfloat16)
    assert fp16_pairs(x).float().tolist() == [[0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15]]
    assert torch.isinf(fp16_pairs(torch.full((1, 8), 1e5, dtype=torch.bfloat16))).all()  # the fp32 redo's trigger


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
    regs = run(asm, np.zeros(0, np.uint8), {"$0": (32, words, True)}, lanes=len(cases))
    fp16 = f16_bits(np.asarray(FP4_VALUES)[codes] * FP16_SHIFT)  # [lane, value]; code 8 is -0.0
    for i in range(4):
        got = regs[f"p{i}"]
        assert ((got & 0xFFFF) == fp16[:, i]).all(), f"pair {i} low half is not value {i}"
        assert ((got >> 16) == fp16[:, i + 4]).all(), f"pair {i} high half is not value {i + 4}"


def test_emulator_rejects_unknown_instruction():
    asm = "{\n.reg .b32 a;\nmov.b32 a, 1; popc.b32 a, a;\n}"
    with pytest.raises(AssertionError, match="does not know 'popc.b32'"):
        run(asm, np.zeros(0, np.uint8), {}, lanes=1)


def test_emulator_rejects_unwritten_and_undeclared_registers():
    with pytest.raises(AssertionError, match="read before it is written"):
        run("{\n.reg .b32 a, b;\nmov.b32 a, b;\n}", np.zeros(0, np.uint8), {}, lanes=1)
    with pytest.raises(AssertionError, match="not declared"):
        run("{\n.reg .b32 a;\nmov.b32 c, 1;\n}", np.zeros(0, np.uint8), {}, lanes=1)
