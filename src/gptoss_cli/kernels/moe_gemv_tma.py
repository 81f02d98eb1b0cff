"""gemv1's tensor-core K loop fed by tensor-memory copies (MoeConfig.gemv_tma): the weights' words
and scale bytes of each K step reach shared memory by TMA, several steps ahead, instead of
through registers loaded two steps ahead (moe_gemv_mma._k_loop).

Why: at batch 1 gemv1 streams ~35 MB per layer at ~2 TB/s. Nsight Compute (session 25) found its
warps waiting on their weight loads with two K steps (4 KB per program) in flight, and a third
step ahead in registers cost occupancy and lost (session 23). Bytes in shared memory cost no
registers: bench_weight_stream.py --ring read gemv1's tiles through TMA with 2-4 steps in flight
at 77-81 % of copy bandwidth, against 74 % for plain blocked loads (H200, session 33).

How: one host-side descriptor over the packed words viewed as int32 [E, N / 16, K / 32, 64] (row
group, block column, word: MoeWeights.row_group 16) and one over the scales [E, K / 32, N] bytes.
A K step is a box of the pair of tiles' 8 block columns (4 KB) and one of their 32 rows' scales
for those columns (256 B); Triton's pipeliner (tl.range num_stages) keeps num_stages - 1 steps of
both in flight. _step_operands then hands each lane exactly the registers moe_gemv_mma._load_asm
would have loaded, and the same math asm (_math_asm) runs on them. The last step is moved back to
end at K, as in _k_loop; boxes never pass K.

Only the batch-1 shape of gemv1 (one pair of tiles per program, 2 block columns per warp and
step); the kernels fall back to _k_loop elsewhere (tma_fits).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .moe_gemv_mma import FP16_SHIFT, ROW_GROUP, TILES, _math_step

WORDS = 64  # int32 words per 16-row block column (256 bytes)
GB = tl.constexpr(2)  # block columns per warp and K step: the only shape _step_operands unpacks


@triton.jit
def _step_operands(words, scales, KS: tl.constexpr):
    """One K step's boxes -> _load_asm's registers as [KS, 1, 32] tensors, block column g at 5 g:
    the words of (tile 0 row r, tile 0 row r + 8, tile 1 row r, tile 1 row r + 8) of lane (r, t),
    then the scale byte of the pair's row r + 8t. words [1, 2, KS * GB, 64] (tile, block column,
    word; word l is row r's of lane l, l + 32 row r + 8's), scales [1, KS * GB, 32] (block column,
    row of the pair); warp split s takes block columns GB s .. GB s + GB - 1."""
    w = tl.reshape(words, (2, KS, GB, 2, 32))  # tile m, split s, column g, half h, lane
    w = tl.reshape(tl.permute(w, (1, 4, 2, 0, 3)), (KS, 1, 32, GB, 2, 2))  # [s, 1, lane, g, m, h]
    h0, h1 = tl.split(w)
    m0h0, m1h0 = tl.split(h0)
    m0h1, m1h1 = tl.split(h1)
    s = tl.reshape(scales, (KS, GB, 4, 8))  # row of the pair = 8 t + r
    s = tl.reshape(tl.permute(s, (0, 3, 2, 1)), (KS, 1, 32, GB)).to(tl.int32)  # lane 4 r + t
    a0, b0 = tl.split(m0h0)
    a1, b1 = tl.split(m0h1)
    a2, b2 = tl.split(m1h0)
    a3, b3 = tl.split(m1h1)
    sa, sb = tl.split(s)
    return a0, a1, a2, a3, sa, b0, b1, b2, b3, sb


@triton.jit
def _tma_rows(x_row, w_desc, s_desc, expert, first_tile, K, T: tl.constexpr, KS: tl.constexpr,
              STAGES: tl.constexpr):
    """moe_gemv_mma._mma_rows for one pair of tiles (T = 2) with the K loop's bytes from TMA boxes
    (module docstring): [32] fp32 = W[16 first_tile .. + 32, :K] @ x[:K] in row order; NaN/inf where
    an activation overflowed fp16."""
    tl.static_assert(T == TILES, "the TMA K loop takes one pair of tiles per program")
    lane = tl.arange(0, 32)[None, None, :]
    split = tl.arange(0, KS)[:, None, None]
    full = split * 0 + lane * 0  # [KS, 1, 32], the asm operands' shape
    lane_t = lane % 4 + full
    own = split * GB + full  # this split's first block column within a step
    x_ptrs = x_row + lane_t * 8 + own * 32  # every B column holds the token
    no_skip = full - own
    expert = expert.to(tl.int32)
    per_step: tl.constexpr = KS * GB
    n_blocks = K // 32
    last = n_blocks - per_step  # the last step is moved back to end at K
    acc = tl.zeros((KS, 1, 32), dtype=tl.float32)
    for kb in tl.range(0, n_blocks, per_step, num_stages=STAGES):
        first = tl.minimum(kb, last)
        words = w_desc.load([expert, first_tile, first, 0])
        scales = s_desc.load([expert, first, first_tile * 16])
        loaded = _step_operands(words, scales, KS)
        # Block columns the moved-back step repeats count as x = 0: the step before counted them.
        acc = _math_step(GB, acc, loaded, (x_ptrs + first * 32).to(tl.int64), no_skip + (kb - first), lane_t)
    rows = tl.reshape(tl.sum(acc, axis=0), (1, 8, 4))  # lane (r, t): row r + 8t of the pair
    return tl.reshape(tl.permute(rows, (0, 2, 1)), (T * 16,)) * FP16_SHIFT


def tma_fits(row_group: int, rows: int, block_k: int, num_warps: int, k: int) -> bool:
    """Whether a gemv1 launch suits _tma_rows: 16-row groups, one pair of tiles per program, K split
    over the warps in GB block columns each, K at least one step."""
    return (row_group == ROW_GROUP and rows == 16 * TILES.value and block_k == 32 * GB.value * num_warps
            and k >= block_k)


def descriptors(blocks: torch.Tensor, scales: torch.Tensor, block_k: int):
    """Host-side TMA descriptors of one expert stack (MoeWeights.w1_blocks [E, N / 16, K / 32 * 256]
    uint8, w1_scales [E, K / 32, N]) for K steps of block_k values: boxes of 2 row groups x the step's
    block columns x 64 words, and of the step's block columns x 32 rows' scale bytes."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    e, groups, n = scales.shape
    words = blocks.view(torch.int32).view(e, blocks.shape[1], groups, WORDS)
    step = block_k // 32
    return (TensorDescriptor.from_tensor(words, [1, TILES.value, step, WORDS]),
            TensorDescriptor.from_tensor(scales, [1, step, 16 * TILES.value]))
