"""The inline PTX of the grouped tensor-core step (moe_gemv_mma._load_asm, then _group_math_asm: 8
tokens per mma B operand, moe_group_mma.py), run on the CPU by ptx_warp's emulator of one warp.

The tests lay out two 16-row tiles of packed weights, their scales and several bf16 activation
rows, give each B column a token row (in any order, some repeated, as the kernels' clamped
columns are), run the load asm and the math asm as _group_rows does
(`acc + loaded + x addresses + (skip,)`), and compare every lane's 8 accumulators per group with a
float64 reference of (tile m, row r + 8 (j // 2), token column 2t + j % 2).
"""

import numpy as np
import pytest
from ptx_warp import LANES, MASK, bind, f32, f32_bits, load_operands, packed_layout, run

from gptoss_cli.kernels.moe_gemv_mma import LOADED, _group_math_asm, asm_step
from gptoss_cli.kernels.mxfp4 import FP4_VALUES

FP16_SHIFT = 2.0**-14  # the asm's fp16 pairs hold FP4 values times 2**-14


def _step(gb: int, groups: int, lay: dict, columns: np.ndarray, acc_in: np.ndarray, skip: int, math_asm=None):
    """One K step on the emulator: columns [8 * groups] = the x row of each B column, acc_in
    [8 * groups, lanes] fp32. Returns the math asm's registers."""
    load_text, load_cons, _ = asm_step("load", gb)
    math_text, math_cons, math_types = asm_step("group", gb, groups)
    n_loaded, n = LOADED * gb, 8 * groups
    assert len(math_types) == n == math_cons.count("=f"), "accumulators and constraints disagree"
    loaded = run(load_text, lay["mem"], bind(load_cons, load_operands(lay, n_loaded)))
    lane = np.arange(LANES)
    r, t = lane // 4, lane % 4
    x_addr = [lay["x0"] + columns[8 * q + r] * lay["x_stride"] + 16 * t for q in range(groups)]
    values = [f32_bits(a) for a in acc_in] + [loaded[f"${i}"] for i in range(n_loaded)] + x_addr \
        + [np.int64(skip) & MASK[32]]
    return run(math_asm or math_text, lay["mem"], bind(math_cons, dict(enumerate(values, start=n))))


def _expected(lay: dict, columns: np.ndarray, skip: int) -> tuple[np.ndarray, np.ndarray]:
    """[tile, row, column]: sum over block columns c >= skip of 2**(s - 127) * 2**-14 * dot(W, x of the
    column's row), and the sum of the terms' magnitudes (for the tolerance)."""
    fp4 = np.asarray(FP4_VALUES)[lay["codes"]]  # [tile, row, c, 32]
    gb = fp4.shape[2]
    keep = (np.arange(gb) >= skip).astype(float)
    scale = 2.0 ** (lay["scales"] - 127.0) * FP16_SHIFT * keep  # [tile, row, c]
    x = lay["x"][columns]  # [column, c, 32]
    prod = fp4[:, :, None] * x[None, None]  # [tile, row, column, c, 32]
    return ((scale[:, :, None] * prod.sum(-1)).sum(-1), (scale[:, :, None] * np.abs(prod).sum(-1)).sum(-1))


def _check(gb: int, groups: int, skip: int, seed: int, math_asm=None) -> None:
    rng = np.random.default_rng(1000 * seed + 100 * groups + 10 * gb + skip)
    tokens = 11
    lay = packed_layout(rng, gb, tokens)
    columns = rng.integers(0, tokens, 8 * groups)
    columns[-3:] = columns[-4]  # the kernels repeat a tile's last row in the columns past it
    acc_in = (rng.standard_normal((8 * groups, LANES)) * 2.0**-10).astype(np.float32)
    regs = _step(gb, groups, lay, columns, acc_in, skip, math_asm)
    want, size = _expected(lay, columns, skip)
    lane = np.arange(LANES)
    r, t = lane // 4, lane % 4
    for q in range(groups):
        for m in range(2):
            for j in range(4):
                i = 8 * q + 4 * m + j
                row, col = r + 8 * (j // 2), 8 * q + 2 * t + j % 2
                got = f32(regs[f"${i}"]).astype(np.float64)
                ref = acc_in[i].astype(np.float64) + want[m, row, col]
                tol = 1e-5 * (np.abs(acc_in[i]) + size[m, row, col]) + 1e-30
                bad = np.flatnonzero(np.abs(got - ref) > tol)
                assert bad.size == 0, (f"accumulator {i} (group {q}, tile {m}, D register {j}), lanes {bad.tolist()}: "
                                       f"got {got[bad].tolist()}, want {ref[bad].tolist()}")
                if skip >= gb:
                    assert (regs[f"${i}"] == f32_bits(acc_in[i])).all(), "skipped blocks changed acc"


CASES = [(1, 0), (2, 0), (2, 1), (4, 0), (4, 3), (4, -4), (4, 4)]


@pytest.mark.parametrize("gb,skip", CASES)
@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("seed", range(2))
def test_group_step_matches_reference(gb, skip, groups, seed):
    """_load_asm then _group_math_asm: every lane's accumulators = acc_in + the scaled block dot
    products of its rows and token columns; skip < 0 (a later K split) and skip >= gb (a split
    wholly repeated) occur in _k_loop."""
    _check(gb, groups, skip, seed)


X_ADDR = f"${16 + LOADED * 2}"  # _group_math_asm(2, 1)'s x address: after 8 + 8 accumulators and the loads


@pytest.mark.parametrize("original,altered", [("0x1c1f", "0x1f"), ("d2, s1", "d2, s0"),
                                              (f"[{X_ADDR}+64]", f"[{X_ADDR}+0]")],
                         ids=["shuffle-whole-warp", "scale-of-row-r", "x-block-column"])
def test_group_step_catches_a_wrong_asm(original, altered):
    """The reference fails altered asm: a shuffle over the whole warp (each quad must read its own
    lanes' scale bytes), row r + 8's D registers scaled by row r's scale, the second block column
    reading the first one's activations."""
    text = _group_math_asm(2, 1)
    assert original in text, f"{original!r} not in the asm: the test's premise changed"
    with pytest.raises(AssertionError, match="accumulator"):
        _check(2, 1, 0, 0, text.replace(original, altered))
