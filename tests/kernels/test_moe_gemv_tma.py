"""The TMA-fed gemv1 K loop (moe_gemv_tma.py): each lane's registers from a K step's boxes are
exactly those the register-loaded loop's asm would load, derived here from the checkpoint layout
(interpreter or GPU); the kernel itself against its twins is test_moe.py's test_gemv_mma_matches_twins
(GPU)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from gptoss_cli.kernels.moe_gemv_tma import GB, _step_operands, descriptors, tma_fits
from gptoss_cli.kernels.moe_matmul import prepare_moe_weights

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@triton.jit
def _operands_kernel(w_desc, s_desc, out_ptr, expert, first_tile, first, KS: tl.constexpr):
    words = w_desc.load([expert, first_tile, first, 0])
    scales = s_desc.load([expert, first, first_tile * 16])
    ops = _step_operands(words, scales, KS)
    idx = tl.arange(0, KS)[:, None, None] * 32 + tl.arange(0, 32)[None, None, :]
    for i in tl.static_range(5 * GB):
        tl.store(out_ptr + i * KS * 32 + idx, ops[i])


def _expected(blocks: np.ndarray, scales: np.ndarray, expert: int, first_tile: int, first: int, ks: int) -> np.ndarray:
    """[5 GB, KS, 32]: per block column g of split s, lane l = 4 r + t: the little-endian words of
    bytes 4t .. 4t + 3 of (tile 0 row r, tile 0 row r + 8, tile 1 row r, tile 1 row r + 8), then
    the scale byte of the pair's row r + 8t (checkpoint layout: blocks [E, N, K / 32, 16], scales
    [E, N, K / 32])."""
    out = np.zeros((5 * GB.value, ks, 32), dtype=np.int64)
    for s in range(ks):
        for g in range(GB.value):
            col = first + s * GB.value + g
            for lane in range(32):
                r, t = lane // 4, lane % 4
                rows = [16 * (first_tile + m) + r + 8 * h for m in (0, 1) for h in (0, 1)]
                for k, row in enumerate(rows):
                    out[5 * g + k, s, lane] = int.from_bytes(bytes(blocks[expert, row, col, 4 * t:4 * t + 4]),
                                                             "little", signed=True)
                out[5 * g + 4, s, lane] = scales[expert, 16 * first_tile + r + 8 * t, col]
    return out


@pytest.mark.parametrize("hidden,inter,first_tile,first", [(2880, 64, 2, 82), (576, 224, 12, 10), (1024, 64, 0, 0)])
def test_step_operands_match_the_checkpoint_layout(hidden, inter, first_tile, first):
    # 2880: the moved-back last step of 20b (block columns 82 .. 89); 576 = 18 block columns, the
    # last pair of 224's 14 tiles; 1024: the first step.
    ks, block_k, experts = 4, 256, 3
    gen = torch.Generator().manual_seed(hidden + first_tile)
    blocks = torch.randint(0, 256, (experts, 2 * inter, hidden // 32, 16), dtype=torch.uint8, generator=gen)
    scales = torch.randint(100, 140, (experts, 2 * inter, hidden // 32), dtype=torch.uint8, generator=gen)
    w2b = torch.zeros(experts, hidden, inter // 32, 16, dtype=torch.uint8)
    w2s = torch.full((experts, hidden, inter // 32), 127, dtype=torch.uint8)
    w = prepare_moe_weights(blocks.to(DEVICE), scales.to(DEVICE), torch.zeros(experts, 2 * inter, device=DEVICE),
                            w2b.to(DEVICE), w2s.to(DEVICE), torch.zeros(experts, hidden, device=DEVICE), row_group=16)
    assert tma_fits(w.row_group, 32, block_k, ks, hidden)
    w_desc, s_desc = descriptors(w.w1_blocks, w.w1_scales, block_k)
    out = torch.zeros(5 * GB.value, ks, 32, dtype=torch.int32, device=DEVICE)
    expert = 1
    _operands_kernel[(1,)](w_desc, s_desc, out, expert, first_tile, first, KS=ks, num_warps=ks)
    want = _expected(blocks.numpy(), scales.numpy(), expert, first_tile, first, ks)
    got = out.cpu().numpy().astype(np.int64)
    bad = np.argwhere(got != want)
    assert bad.size == 0, f"{len(bad)} wrong registers, first (operand, split, lane) {bad[0].tolist()}"


def test_tma_fits_only_gemv1s_batch_1_shape():
    assert tma_fits(16, 32, 256, 4, 2880)
    assert not tma_fits(1, 32, 256, 4, 2880)  # checkpoint row order
    assert not tma_fits(16, 64, 256, 4, 2880)  # two pairs of tiles per program
    assert not tma_fits(16, 32, 128, 4, 2880)  # one block column per warp and step
    assert not tma_fits(16, 32, 256, 4, 128)  # K shorter than a step
