"""MXFP4 MoE kernels vs their twins: routing (exact), gemm1+SwiGLU, gemm2, combine, and the whole
forward pass vs moe_ref, in both regimes, on odd and block-boundary shapes; real shapes on the GPU."""

import dataclasses
import functools
import importlib.util
import sys
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl
from helpers import assert_close, rel_err

from gptoss_cli.kernels import moe_matmul, moe_router, moe_routing
from gptoss_cli.kernels.moe import (
    MoeConfig,
    MoeWorkspace,
    moe_block,
    moe_forward,
    moe_ref,
    pick_config,
    prepare_moe_weights,
    route_ref,
    router_logits,
)
from gptoss_cli.kernels.moe_config import regime_config
from gptoss_cli.kernels.moe_gemv import moe_gemv1_swiglu, moe_gemv2
from gptoss_cli.kernels.moe_gemv_mma import fp16_pairs, mma_plan
from gptoss_cli.kernels.moe_matmul import (
    FOLD_MAX_SCALE,
    _tile_heights,
    checkpoint_blocks,
    expert_weight,
    moe_combine,
    moe_combine_norm,
    moe_combine_ref,
    moe_gemm1_swiglu,
    moe_gemm1_swiglu_ref,
    moe_gemm2,
    moe_gemm2_ref,
)
from gptoss_cli.kernels.moe_routing import route, route_metadata_ref, topk_row_bf16
from gptoss_cli.kernels.mxfp4 import dequantize_mxfp4, quantize_mxfp4
from gptoss_cli.kernels.mxfp4_split import SPLIT_POSITIONS, split_words, unsplit_words
from gptoss_cli.kernels.rmsnorm import rms_norm, rms_norm_ref

requires_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# Small blocks so CPU shapes cross tile, column and K boundaries (C, I in {64, 96}).
DECODE = MoeConfig("decode", block_m=16, block_n1=32, block_n2=64, block_k=64)
GEMV = MoeConfig("decode", block_m=16, block_n1=16, block_n2=32, block_k=64, gemv=True)
PREFILL = MoeConfig("prefill", block_m=32, block_n1=64, block_n2=32, block_k=32, num_warps=4)
PREFILL_SWAPPED = dataclasses.replace(PREFILL, swap_ab=True)  # the interpreter runs it with the fp32 dequantisation
PREFILL_SLICED = dataclasses.replace(PREFILL_SWAPPED, block_m1=16)  # gemm1 in two slices per routing tile
DECODE_INTERLEAVED = dataclasses.replace(DECODE, even_odd=False)  # one dot over interleaved K (before session 7)
# Both gemms reading MoeWeights.w1_scales_frag / w2_scales_frag (K step 64, 128 / 32 weight rows per program)
PREFILL_FRAG = dataclasses.replace(PREFILL_SWAPPED, block_k=64, scale_words=True, scale_unpack="frag",
                                   scale_unpack2="frag")
PREFILL_4096 = pick_config(4096, 32, 4)  # the GPU's prefill tiles at real shapes (joined / gathered scale words)
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
GPU_TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}  # fp32: other summation orders, no TF32


def _raw_weights(experts, hidden, inter, device, scale_lo=120, scale_hi=126):
    """Checkpoint-layout tensors: random packed bytes, scales around 2**-4 (values O(0.1-1))."""
    def mx(n, k):
        blocks = torch.randint(0, 256, (experts, n, k // 32, 16), dtype=torch.uint8, device=device)
        scales = torch.randint(scale_lo, scale_hi, (experts, n, k // 32), dtype=torch.uint8, device=device)
        return blocks, scales

    b1, s1 = mx(2 * inter, hidden)
    b2, s2 = mx(hidden, inter)
    c1, c2 = 0.5 * torch.randn(experts, 2 * inter, device=device), 0.5 * torch.randn(experts, hidden, device=device)
    return b1, s1, c1, b2, s2, c2


def _inputs(tokens, experts, hidden, top_k, dtype, device, seed=0):
    """x and a router whose logits have no tie at the top-k boundary (CPU torch.topk breaks ties
    arbitrarily; the tie rule has its own test)."""
    gen = torch.Generator().manual_seed(seed)
    for _ in range(100):
        x = torch.randn(tokens, hidden, generator=gen).to(dtype).to(device)
        rw = (torch.randn(experts, hidden, generator=gen) / hidden**0.5).to(dtype).to(device)
        rb = torch.randn(experts, generator=gen).to(dtype).to(device)
        logits = (x @ rw.T + rb).float()
        top = logits.topk(min(top_k + 1, experts), dim=-1).values
        if top_k == experts or bool((top[:, top_k - 1] > top[:, top_k]).all()):
            return x, rw, rb
    raise AssertionError("could not draw tie-free router logits")


def _tol(dtype, device):
    return (GPU_TOL if device == "cuda" else TOL)[dtype]


# --- routing -----------------------------------------------------------------------------------


def _check_route(logits, top_k, block_m):
    device, experts = logits.device, logits.shape[1]
    r = route(logits, top_k, block_m)
    want_w, want_ids = route_ref(logits, top_k)
    assert torch.equal(r.topk_ids.long(), want_ids)
    assert_close(r.topk_weights, want_w, 1e-6, "routing weights")
    want = route_metadata_ref(r.topk_ids, experts, block_m)
    for name, value in want.items():
        assert torch.equal(getattr(r, name).long(), value.to(device)), name


@pytest.mark.parametrize(
    "tokens,experts,top_k,block_m",
    [(1, 4, 4, 16), (3, 8, 2, 16), (17, 6, 3, 32), (67, 8, 4, 16), (130, 128, 4, 64), (300, 32, 4, 128)],
)
def test_route_matches_ref(device, tokens, experts, top_k, block_m):
    _check_route(torch.randn(tokens, experts, device=device), top_k, block_m)


def test_route_with_short_loop_steps(device, monkeypatch):
    # Several histogram chunks and tile-table chunks per program, which real shapes need only at large T.
    monkeypatch.setattr(moe_routing, "HIST_ROWS_PER_STEP", 2)
    monkeypatch.setattr(moe_routing, "TILE_ENTRIES_PER_STEP", 4)
    _check_route(torch.randn(130, 8, device=device), 4, 16)


def test_route_metadata_is_consistent(device):
    tokens, experts, top_k, block_m = 45, 8, 4, 16
    r = route(torch.randn(tokens, experts, device=device), top_k, block_m)
    counts, offsets = r.expert_counts.long(), r.expert_offsets.long()
    assert int(counts.sum()) == tokens * top_k and int(offsets[-1]) == tokens * top_k
    assert torch.equal(offsets[1:] - offsets[:-1], counts)
    sorted_slots, slot_rows = r.sorted_slots.long(), r.slot_rows.long()
    assert torch.equal(torch.sort(sorted_slots).values, torch.arange(tokens * top_k, device=device))
    assert torch.equal(slot_rows[sorted_slots], torch.arange(tokens * top_k, device=device))
    experts_of_rows = r.topk_ids.reshape(-1).long()[sorted_slots]
    assert bool((experts_of_rows[1:] >= experts_of_rows[:-1]).all())  # grouped by expert
    for tile in range(r.max_tiles):
        e, start = int(r.tile_expert[tile]), int(r.tile_row_start[tile])
        if e >= 0:
            assert offsets[e] <= start < offsets[e + 1] and (start - offsets[e]) % block_m == 0
    used = r.tile_expert >= 0
    assert int(used.sum()) == int(((counts + block_m - 1) // block_m).sum())
    assert not bool(used[int(used.sum()):].any())  # idle entries are all at the end


def test_route_ties_pick_lowest_index(device):
    # Integer logits: many ties, inside the top-k and at its boundary.
    logits = torch.randint(0, 4, (100, 16), device=device).float()
    top_k = 4
    r = route(logits, top_k, 16)
    ids = r.topk_ids.long()
    kth = logits.sort(dim=-1, descending=True).values[:, top_k - 1 : top_k]
    above = logits > kth
    tie_rank = torch.cumsum(logits == kth, dim=-1)  # 1-based rank among the tied columns
    want = above | ((logits == kth) & (tie_rank <= top_k - above.sum(-1, keepdim=True)))
    got = torch.zeros_like(want).scatter_(1, ids, True)
    assert torch.equal(got, want)
    chosen = logits.gather(1, ids)
    assert bool((chosen[:, 1:] <= chosen[:, :-1]).all())  # largest first
    ties_first = (chosen[:, 1:] == chosen[:, :-1]) <= (ids[:, 1:] > ids[:, :-1])
    assert bool(ties_first.all())  # equal logits in index order
    assert_close(r.topk_weights, torch.softmax(chosen, dim=-1), 1e-6, "tied weights")


@requires_gpu
def test_route_tie_set_matches_cuda_topk():
    logits = torch.randint(0, 4, (1000, 32), device="cuda").to(torch.bfloat16)
    ids = route(logits, 4, 16).topk_ids.long()
    _, want = route_ref(logits, 4)
    assert torch.equal(ids.sort(dim=-1).values, want.sort(dim=-1).values)


def test_route_rejects_bad_arguments():
    with pytest.raises(ValueError, match="top_k"):
        route(torch.randn(3, 4), 5, 16)
    with pytest.raises(ValueError, match="power of two"):
        route(torch.randn(3, 4), 2, 24)
    with pytest.raises(TypeError):
        route(torch.zeros(3, 4, dtype=torch.int32), 2, 16)


# --- weights and matmul stages -------------------------------------------------------------------


@pytest.mark.parametrize("row_group", [1, 8, 32])
def test_prepare_keeps_the_packed_bytes(device, row_group):
    raw = _raw_weights(3, 64, 96, device, scale_lo=1, scale_hi=241)
    w = prepare_moe_weights(*raw, row_group=row_group)
    assert w.row_group == row_group
    assert w.w1_blocks.dtype == torch.uint8 and w.w1_blocks.numel() == raw[0].numel()
    assert (w.num_experts, w.hidden, w.intermediate) == (3, 64, 96)
    for e in range(3):
        assert torch.equal(checkpoint_blocks(w.w1_blocks, w.w1_scales, e), raw[0][e])
        assert torch.equal(checkpoint_blocks(w.w2_blocks, w.w2_scales, e), raw[3][e])
        assert torch.equal(expert_weight(w.w1_blocks, w.w1_scales, e), dequantize_mxfp4(raw[0][e], raw[1][e]))
        assert torch.equal(expert_weight(w.w2_blocks, w.w2_scales, e), dequantize_mxfp4(raw[3][e], raw[4][e]))
    if row_group > 1:  # block column 1 of row 0 follows block column 0 of the group's last row
        assert torch.equal(w.w2_blocks[0, 0, row_group * 16:(row_group + 1) * 16], raw[3][0, 0, 1])


def test_prepare_row_group_falls_back_and_checks():
    raw = _raw_weights(2, 96, 32, "cpu")  # 96 hidden rows: a multiple of 32 (as every K is), not of 64
    assert prepare_moe_weights(*raw).row_group == moe_matmul.ROW_GROUP
    assert prepare_moe_weights(*raw, row_group=32).row_group == 32
    assert prepare_moe_weights(*raw, row_group=64).row_group == 1
    with pytest.raises(ValueError, match="power of two"):
        prepare_moe_weights(*raw, row_group=3)


@pytest.mark.parametrize("config", [DECODE, dataclasses.replace(DECODE, split_k=2), PREFILL_SWAPPED, PREFILL_SLICED,
                                    GEMV],
                         ids=["decode", "decode-split-k", "prefill-swapped", "prefill-sliced", "gemv"])
def test_row_groups_give_the_same_outputs(device, config):
    # The grouping moves bytes, not arithmetic: every layout must give the row-major result bit for bit.
    tokens, experts, hidden, inter, top_k = (1 if config.gemv else 9), 4, 96, 64, 4
    raw = _raw_weights(experts, hidden, inter, device)
    x, rw, rb = _inputs(tokens, experts, hidden, top_k, torch.float32, device)
    want = moe_forward(x, rw, rb, prepare_moe_weights(*raw, row_group=1), top_k, config=config)
    for row_group in (8, 16, 32):
        got = moe_forward(x, rw, rb, prepare_moe_weights(*raw, row_group=row_group), top_k, config=config)
        assert torch.equal(got, want), f"row_group={row_group}"


@pytest.mark.parametrize("high,fold", [(FOLD_MAX_SCALE, True), (FOLD_MAX_SCALE + 1, False)])
def test_prepare_marks_foldable_scales(device, high, fold):
    raw = list(_raw_weights(2, 64, 64, device, scale_lo=1, scale_hi=100))
    raw[4][1, 3, 0] = high  # one down-projection scale decides
    assert prepare_moe_weights(*raw).fold_scales is fold


def test_asm_format_follows_config_and_weights(monkeypatch):
    monkeypatch.setattr(moe_matmul, "is_interpreted", lambda: False)  # the GPU's choice, on any machine
    asm = dataclasses.replace(DECODE, asm_dequant=True)
    assert moe_matmul._dot_scaled_format(asm, torch.bfloat16, True) == "asm-folded"
    assert moe_matmul._dot_scaled_format(asm, torch.bfloat16, False) == "asm"
    assert moe_matmul._dot_scaled_format(dataclasses.replace(asm, fold_scales=False), torch.bfloat16, True) == "asm"
    assert moe_matmul._dot_scaled_format(asm, torch.float32, True) == ""


def test_split_words_is_a_bit_permutation_and_its_inverse(device):
    assert sorted(p for bits in SPLIT_POSITIONS for p in bits) == list(range(32))
    raw = torch.randint(0, 256, (3, 5, 64), dtype=torch.uint8, device=device)
    split = split_words(raw)
    assert split.shape == raw.shape and not torch.equal(split, raw)
    assert torch.equal(unsplit_words(split), raw)
    # per word: value 0's four bits land on bits 6, 7, 8 and 15 (mxfp4_split's table)
    word = torch.tensor([0xF, 0, 0, 0], dtype=torch.uint8, device=device)
    assert int.from_bytes(bytes(split_words(word).tolist()), "little") == (1 << 6) | (1 << 7) | (1 << 8) | (1 << 15)
    with pytest.raises(ValueError, match="whole 32-bit words"):
        split_words(raw[..., :6])


def test_prepare_split_copy(device):
    raw = _raw_weights(3, 64, 96, device)
    w = prepare_moe_weights(*raw)
    assert w.w1_split is None and w.w2_split is None
    w = prepare_moe_weights(*raw, split_copy=True)
    assert torch.equal(w.w1_split, split_words(w.w1_blocks)) and torch.equal(w.w2_split, split_words(w.w2_blocks))
    assert torch.equal(unsplit_words(w.w2_split), w.w2_blocks)


def test_split_copy_is_read_by_the_decode_tiles_only(monkeypatch):
    monkeypatch.setattr(moe_matmul, "is_interpreted", lambda: False)  # the GPU's choice, on any machine
    blocks, split = torch.zeros(4, dtype=torch.uint8), torch.ones(4, dtype=torch.uint8)
    tiles = dataclasses.replace(DECODE, asm_dequant=True)
    pick = moe_matmul._weight_bytes
    assert pick(tiles, blocks, split, torch.bfloat16, True) == (split, "asm-split-folded")
    assert pick(tiles, blocks, split, torch.bfloat16, False) == (split, "asm-split")
    assert pick(tiles, blocks, None, torch.bfloat16, True) == (blocks, "asm-folded")
    # switched off, or tiles whose packs are not aligned words (prefill's wgmma operand, one interleaved dot)
    for change in ({"split_words": False}, {"swap_ab": True}, {"even_odd": False}):
        assert pick(dataclasses.replace(tiles, **change), blocks, split, torch.bfloat16, True) == (blocks, "asm-folded")
    assert pick(tiles, blocks, split, torch.float32, True) == (blocks, "")
    monkeypatch.setattr(moe_matmul, "is_interpreted", lambda: True)
    assert pick(tiles, blocks, split, torch.bfloat16, True) == (blocks, "")


def test_fragment_scales_layout():
    # w1_scales_frag[e, j, n] = (scale of row n, group 2j; group 2j + 1), an odd last group paired with 0
    b1, s1, c1, b2, s2, c2 = _raw_weights(2, 96, 64, "cpu")  # 3 groups of 32 along gate_up's K, 2 along down's
    w = prepare_moe_weights(b1, s1, c1, b2, s2, c2, frag_scales=True)
    frag = w.w1_scales_frag
    assert frag.shape == (2, 2, 128, 2) and frag.is_contiguous()
    assert torch.equal(frag[:, 0], s1[:, :, 0:2]) and torch.equal(frag[:, 1, :, 0], s1[:, :, 2])
    assert not frag[:, 1, :, 1].any()
    assert w.w2_scales_frag.shape == (2, 1, 96, 2) and torch.equal(w.w2_scales_frag[:, 0], s2)
    plain = prepare_moe_weights(b1, s1, c1, b2, s2, c2)
    assert plain.w1_scales_frag is None and plain.w2_scales_frag is None


@pytest.mark.parametrize(
    "tokens,experts,hidden,inter,top_k,dtype",
    [(3, 4, 96, 64, 4, torch.float32), (17, 6, 64, 96, 3, torch.bfloat16), (33, 8, 128, 96, 4, torch.float32)],
)
def test_fragment_scales_match_twin(device, tokens, experts, hidden, inter, top_k, dtype):
    # Both gemms reading fragment-order scales with their weight rows permuted inside 16-row blocks;
    # hidden 96 leaves gemm1's last K step half padding, inter 96 gemm1 a half-empty second column
    # block and gemm2's last K step half padding.
    r = route(torch.randn(tokens, experts, device=device), top_k, PREFILL_FRAG.block_m)
    w, x, _, want, _ = _gemms_match_twins(device, PREFILL_FRAG, r, hidden, inter, dtype)
    with pytest.raises(ValueError, match="frag_scales"):
        moe_gemm1_swiglu(x, r, dataclasses.replace(w, w1_scales_frag=None), 3.0, 1.702, PREFILL_FRAG)
    with pytest.raises(ValueError, match="frag_scales"):
        moe_gemm2(want, r, dataclasses.replace(w, w2_scales_frag=None), PREFILL_FRAG)


def _routing_by_choice(choices: list[list[int]], experts: int, block_m: int, device):
    """Routing where choice c of token t is expert choices[c][t] (logits 3, 2, 1, ... in that order)."""
    tokens = len(choices[0])
    logits = 0.1 * torch.randn(tokens, experts)
    for c, picks in enumerate(choices):
        logits[torch.arange(tokens), torch.tensor(picks)] = 3.0 - c
    return route(logits.to(device), len(choices), block_m)


def _gemms_match_twins(device, config, r, hidden, inter, dtype):
    """gemm1 and gemm2 of `config` (on weights with fragment-order scales) against their twins, on
    routing r; returns (weights, x, act, the twin's act that gemm2 took, y)."""
    w = prepare_moe_weights(*_raw_weights(r.num_experts, hidden, inter, device), frag_scales=True)
    x = torch.randn(r.num_tokens, hidden, device=device).to(dtype)
    act = moe_gemm1_swiglu(x, r, w, 3.0, 1.702, config)  # a low limit so both clamps bite
    want = moe_gemm1_swiglu_ref(x, r, w, 3.0, 1.702)
    assert_close(act.float(), want.float(), _tol(dtype, device), "gemm1")
    y = moe_gemm2(want, r, w, config)
    assert_close(y.float(), moe_gemm2_ref(want, r, w), _tol(dtype, device), "gemm2")
    return w, x, act, want, y


def _check_tiles(device, config, r, hidden, inter, dtype):
    """_gemms_match_twins, and the same results as the tiles at full height."""
    w, x, act, want, y = _gemms_match_twins(device, config, r, hidden, inter, dtype)
    full = dataclasses.replace(config, short_tiles=0, pair_tiles=False)
    assert_close(act.float(), moe_gemm1_swiglu(x, r, w, 3.0, 1.702, full).float(), 1e-6, "gemm1 vs full tiles")
    assert_close(y.float(), moe_gemm2(want, r, w, full).float(), 1e-6, "gemm2 vs full tiles")


@pytest.mark.parametrize("base", [PREFILL_SWAPPED, PREFILL_FRAG], ids=["bytes", "frag"])
@pytest.mark.parametrize("short,block_m1", [(1, 32), (2, 0)], ids=["half", "half-and-quarter"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_short_tiles_match_twins(device, base, short, block_m1, dtype):
    # 64-row routing tiles of experts with 70, 40, 20 and 10 rows: gemm2's tiles hold 64 + 6 | 40 |
    # 20 | 10 rows, so with short_tiles 1 it runs the last three of them at 32 rows, and with 2 the
    # 6- and 10-row tiles at 16. gemm1 in 32-row slices (short_tiles 1: 32 + 32 + 6 | 32 + 8 | 20 |
    # 10, the 6, 8 and 10 at 16 rows) or in whole tiles like gemm2 (short_tiles 2).
    config = dataclasses.replace(base, block_m=64, block_m1=block_m1, short_tiles=short)
    r = _routing_by_choice([[0] * 70, [1] * 40 + [2] * 20 + [3] * 10], 4, config.block_m, device)
    assert r.expert_offsets.diff().tolist() == [70, 40, 20, 10]
    _check_tiles(device, config, r, 64, 96, dtype)


@pytest.mark.parametrize("base", [PREFILL_SWAPPED, PREFILL_FRAG], ids=["bytes", "frag"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pair_tiles_match_twins(device, base, dtype):
    # 128-row tiles with short_tiles 2 and pair_tiles: gemm2 runs <= 32 rows at 32, <= 64 at 64,
    # <= 80 as 64 + 16 and <= 96 as 64 + 32 (two dots on each weight tile), more at 128. Experts of
    # 168, 110, 96, 80, 30 and 20 rows hold tiles of 128 + 40 | 110 | 96 | 80 | 30 | 20: every
    # height, the pairs filled to their last row.
    config = dataclasses.replace(base, block_m=128, block_m1=0, short_tiles=2, pair_tiles=True)
    first, second, third = [0] * 168, [1] * 110 + [2] * 58, [2] * 38 + [3] * 80 + [4] * 30 + [5] * 20
    r = _routing_by_choice([first, second, third], 6, config.block_m, device)
    assert r.expert_offsets.diff().tolist() == [168, 110, 96, 80, 30, 20]
    _check_tiles(device, config, r, 64, 96, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_round_slots_stores_slot_outputs_in_the_activation_dtype(device, dtype):
    # MoeConfig.round_slots: gemm2's y in x's dtype (the twin's fp32 rounded once), the combine sums
    # it in fp32; moe_forward through a workspace (y reusing the fp32 buffer's bytes) and without agree.
    experts, hidden, inter, top_k, tokens = 4, 64, 96, 2, 37
    config = dataclasses.replace(PREFILL_SWAPPED, round_slots=True)
    w = prepare_moe_weights(*_raw_weights(experts, hidden, inter, device))
    act = torch.randn(tokens * top_k, inter, device=device).to(dtype)
    r = route(torch.randn(tokens, experts, device=device), top_k, config.block_m)
    y = moe_gemm2(act, r, w, config)
    assert y.dtype == dtype
    assert_close(y.float(), moe_gemm2_ref(act, r, w).to(dtype).float(), _tol(dtype, device), "rounded y")
    x = torch.randn(tokens, hidden, device=device).to(dtype)
    rw, rb = torch.randn(experts, hidden, device=device).to(dtype), torch.zeros(experts, device=device).to(dtype)
    ws = MoeWorkspace.allocate(64, w, top_k, dtype, device)
    got = moe_forward(x, rw, rb, w, top_k, workspace=ws, config=config)
    assert torch.equal(got, moe_forward(x, rw, rb, w, top_k, config=config))
    assert_close(got, moe_forward(x, rw, rb, w, top_k, config=PREFILL_SWAPPED), _tol(dtype, device), "vs fp32 y")
    with pytest.raises(ValueError, match="split_k 1"):
        dataclasses.replace(config, split_k=2)


def test_prepare_rejects_bad_weights():
    b1, s1, c1, b2, s2, c2 = _raw_weights(2, 64, 64, "cpu")
    with pytest.raises(TypeError):
        prepare_moe_weights(b1.int(), s1, c1, b2, s2, c2)
    with pytest.raises(ValueError, match="down"):
        prepare_moe_weights(b1, s1, c1, b2[:, :32], s2, c2)
    with pytest.raises(ValueError, match="bias"):
        prepare_moe_weights(b1, s1, c1[:, :3], b2, s2, c2)


@pytest.mark.parametrize("config", [DECODE, DECODE_INTERLEAVED, PREFILL, PREFILL_SWAPPED, PREFILL_SLICED,
                                    dataclasses.replace(PREFILL_SWAPPED, scale_words=True),
                                    dataclasses.replace(PREFILL_SWAPPED, scale_words=True, scale_unpack="join",
                                                        scale_unpack2="gather"),
                                    dataclasses.replace(PREFILL_SWAPPED, scale_words=True, scale_unpack="gather"),
                                    dataclasses.replace(DECODE, block_k=32, block_k2=64)],
                         ids=["decode", "decode-interleaved", "prefill", "prefill-swapped", "prefill-sliced",
                              "prefill-swapped-scale-words", "prefill-swapped-scale-join-gather",
                              "prefill-swapped-scale-gather", "decode-gemm2-own-k-step"])
@pytest.mark.parametrize(
    "tokens,experts,hidden,inter,top_k,dtype",
    [(3, 4, 96, 64, 4, torch.float32), (17, 6, 64, 96, 3, torch.bfloat16), (33, 8, 96, 96, 4, torch.float32)],
)
def test_stages_match_twins(device, config, tokens, experts, hidden, inter, top_k, dtype):
    w = prepare_moe_weights(*_raw_weights(experts, hidden, inter, device))
    x = torch.randn(tokens, hidden, device=device).to(dtype)
    r = route(torch.randn(tokens, experts, device=device), top_k, config.block_m)
    limit, alpha = 3.0, 1.702  # a low limit so both clamps bite
    act = moe_gemm1_swiglu(x, r, w, limit, alpha, config)
    want_act = moe_gemm1_swiglu_ref(x, r, w, limit, alpha)
    assert_close(act.float(), want_act.float(), _tol(dtype, device), "gemm1+swiglu")
    y = moe_gemm2(want_act, r, w, config)
    assert_close(y, moe_gemm2_ref(want_act, r, w), _tol(dtype, device), "gemm2")
    out = moe_combine(y, top_k, dtype)
    combine_tol = 1e-6 if dtype == torch.float32 else 1e-2
    assert_close(out.float(), moe_combine_ref(y, top_k, dtype).float(), combine_tol, "combine")


# split_k 3 with K = 96 and 64-wide K steps leaves one split empty; block_k2 32: gemm2's own K step.
@pytest.mark.parametrize("split_k,block_k2", [(2, 0), (3, 0), (2, 32)])
@pytest.mark.parametrize("tokens,experts,hidden,inter,top_k,dtype",
                         [(1, 4, 96, 96, 4, torch.float32), (5, 6, 64, 96, 3, torch.bfloat16)])
def test_split_k_matches_twins(device, split_k, block_k2, tokens, experts, hidden, inter, top_k, dtype):
    config = dataclasses.replace(DECODE, split_k=split_k, block_k2=block_k2)
    w = prepare_moe_weights(*_raw_weights(experts, hidden, inter, device))
    x = torch.randn(tokens, hidden, device=device).to(dtype)
    r = route(torch.randn(tokens, experts, device=device), top_k, config.block_m)
    limit, alpha = 3.0, 1.702
    act = moe_gemm1_swiglu(x, r, w, limit, alpha, config)
    assert_close(act.float(), moe_gemm1_swiglu_ref(x, r, w, limit, alpha).float(), _tol(dtype, device), "gemm1")
    want_act = moe_gemm1_swiglu_ref(x, r, w, limit, alpha)
    y = moe_gemm2(want_act, r, w, config)
    slots = tokens * top_k
    assert y.shape == (split_k * slots, hidden)
    assert_close(y.view(split_k, slots, hidden).sum(0), moe_gemm2_ref(want_act, r, w), _tol(dtype, device), "gemm2")
    out = moe_combine(y, top_k, dtype, splits=split_k)
    combine_tol = 1e-6 if dtype == torch.float32 else 1e-2  # bf16: one rounding of a differently ordered sum
    assert_close(out.float(), moe_combine_ref(y, top_k, dtype, splits=split_k).float(), combine_tol, "combine")
    rw, rb = torch.randn(experts, hidden, device=device).to(dtype), torch.randn(experts, device=device).to(dtype)
    got = moe_forward(x, rw, rb, w, top_k, limit=limit, config=config)
    plain = moe_forward(x, rw, rb, w, top_k, limit=limit, config=DECODE)
    assert_close(got.float(), plain.float(), _tol(dtype, device), "split-K forward vs unsplit")


@pytest.mark.parametrize("config", [GEMV, dataclasses.replace(GEMV, asm_dequant=True, gemv_f16=True)],
                         ids=["plain", "f16"])  # the interpreter runs f16 configs in fp32
@pytest.mark.parametrize("tokens,experts,hidden,inter,top_k,dtype",
                         [(1, 4, 96, 96, 4, torch.float32), (3, 4, 64, 96, 4, torch.bfloat16),
                          (2, 6, 96, 64, 3, torch.float32)])
def test_gemv_stages_match_twins(device, config, tokens, experts, hidden, inter, top_k, dtype):
    # K = 96 with 64-wide K steps: the second step is half masked. 3 tokens over 4 experts with
    # top-4: every expert has 3 rows (the kernels re-read its weights per row).
    w = prepare_moe_weights(*_raw_weights(experts, hidden, inter, device))
    x = torch.randn(tokens, hidden, device=device).to(dtype)
    r = route(torch.randn(tokens, experts, device=device), top_k, config.block_m)
    limit, alpha = 3.0, 1.702
    want_act = moe_gemm1_swiglu_ref(x, r, w, limit, alpha)  # sorted rows; the gemv kernels use slot order
    in_slot_order = want_act[r.slot_rows.long()]
    act_pairs = torch.full((tokens * top_k, inter), float("nan"), dtype=torch.float16, device=device)
    act = moe_gemv1_swiglu(x, r, w, limit, alpha, config, act_pairs=act_pairs)
    assert_close(act.float(), in_slot_order.float(), _tol(dtype, device), "gemv1+swiglu")
    assert torch.equal(act_pairs, fp16_pairs(act))  # MoeConfig.gemv_pairs' second producer
    assert_close(moe_gemv2(in_slot_order, r, w, config), moe_gemm2_ref(want_act, r, w), _tol(dtype, device),
                 "gemv2")


def test_gemv_pairs_buffers_are_checked(device):
    w = prepare_moe_weights(*_raw_weights(4, 64, 96, device))
    x = torch.randn(1, 64, device=device)
    r = route(torch.randn(1, 4, device=device), 2, GEMV.block_m)
    for bad in (torch.empty(2, 96, device=device), torch.empty(2, 64, dtype=torch.float16, device=device)):
        with pytest.raises(ValueError, match="activation pairs"):
            moe_gemv1_swiglu(x, r, w, 7.0, 1.702, GEMV, act_pairs=bad)
    norm = moe_router.RouterNorm(x, torch.ones(64, device=device), 1e-5, torch.empty_like(x), torch.empty_like(x),
                                 torch.empty(1, 64, device=device))  # fp32: not the pairs' dtype
    with pytest.raises(ValueError, match="norm.pairs"):
        moe_router.route_tokens(x, torch.randn(4, 64, device=device), torch.randn(4, device=device), 2, 16,
                                sort=False, norm=norm)


@pytest.mark.parametrize("config", [GEMV, dataclasses.replace(GEMV, asm_dequant=True, gemv_f16=True)],
                         ids=["plain", "f16"])
@pytest.mark.parametrize("inter,split_k", [(96, 2), (96, 3), (160, 3), (224, 4)])
def test_gemv2_split_k_slabs_sum_to_the_twin(device, config, inter, split_k):
    # MoeConfig.split_k for gemv2: K in whole 32-value blocks per split (160 / 3: 64, 64, 32; 96 / 2:
    # 64 and a half-masked K step of 32), bias added once; the slabs sum to gemm2's twin, the combine
    # adds them, and the whole forward equals moe_ref.
    experts, hidden, top_k, tokens = 4, 96, 4, 2
    raw = _raw_weights(experts, hidden, inter, device)
    w = prepare_moe_weights(*raw)
    config = dataclasses.replace(config, split_k=split_k)
    r = route(torch.randn(tokens, experts, device=device), top_k, config.block_m)
    act = moe_gemm1_swiglu_ref(torch.randn(tokens, hidden, device=device), r, w, 7.0, 1.702)
    y = moe_gemv2(act[r.slot_rows.long()], r, w, config)
    slots = tokens * top_k
    assert y.shape == (split_k * slots, hidden)
    assert_close(y.view(split_k, slots, hidden).sum(0), moe_gemm2_ref(act, r, w), _tol(torch.float32, device),
                 "gemv2 slabs")
    x = torch.randn(tokens, hidden, device=device)
    rw, rb = torch.randn(experts, hidden, device=device), torch.randn(experts, device=device)
    got = moe_forward(x, rw, rb, w, top_k, config=config)
    assert_close(got, moe_ref(x, rw, rb, *raw, top_k), _tol(torch.float32, device), "split gemv2 forward vs moe_ref")


def test_gemv2_split_k_needs_a_block_per_split(device):
    w = prepare_moe_weights(*_raw_weights(4, 64, 64, device))
    r = route(torch.randn(1, 4, device=device), 4, 16)
    with pytest.raises(ValueError, match="cannot be split 3 ways"):
        moe_gemv2(torch.randn(4, 64, device=device), r, w, dataclasses.replace(GEMV, split_k=3))


@pytest.mark.parametrize("tokens,experts,hidden,top_k", [(1, 32, 300, 4), (2, 5, 64, 2), (3, 8, 520, 3),
                                                        (4, 128, 96, 4), (4, 32, 2500, 4), (13, 6, 136, 2),
                                                        (64, 32, 160, 4)])
@pytest.mark.parametrize("sort", [True, False], ids=["sort", "no-sort"])
def test_fused_router_matches_linear_then_route(device, tokens, experts, hidden, top_k, sort):
    # 5 experts: the last program of two has one masked expert; hidden 300 / 520 / 96 are not
    # powers of two (masked columns); 4 tokens x 2500 columns take the multi-step column loop;
    # 13 tokens: two token blocks, the second part-full; 64: eight full token blocks.
    x = torch.randn(tokens, hidden, device=device)
    rw, rb = torch.randn(experts, hidden, device=device), torch.randn(experts, device=device)
    got = moe_router.route_tokens(x, rw, rb, top_k, 16, sort=sort)
    want = route(router_logits(x, rw, rb), top_k, 16)
    assert torch.equal(got.topk_ids, want.topk_ids)
    assert_close(got.topk_weights, want.topk_weights, 1e-5, "routing weights")
    if sort:
        for name in ("expert_counts", "expert_offsets", "sorted_slots", "slot_rows", "tile_expert", "tile_row_start"):
            assert torch.equal(getattr(got, name), getattr(want, name)), name


def test_fused_router_scratch_is_reusable(device):
    # The last program resets the arrival counter: launch after launch on one scratch stays right.
    experts, hidden = 8, 64
    scratch = moe_router.RouterScratch.allocate(experts, device)
    rw, rb = torch.randn(experts, hidden, device=device), torch.randn(experts, device=device)
    for tokens in (1, 4, 2, 11, 1):
        x = torch.randn(tokens, hidden, device=device)
        got = moe_router.route_tokens(x, rw, rb, 2, 16, sort=False, scratch=scratch)
        assert torch.equal(got.topk_ids, route(router_logits(x, rw, rb), 2, 16).topk_ids)
        assert scratch.arrivals.item() == 0


def test_fused_router_forward_matches_moe_ref(device):
    experts, hidden, inter, top_k = 4, 64, 96, 2
    raw = _raw_weights(experts, hidden, inter, device)
    w = prepare_moe_weights(*raw)
    x = torch.randn(3, hidden, device=device)
    rw, rb = torch.randn(experts, hidden, device=device), torch.randn(experts, device=device)
    for config in (dataclasses.replace(DECODE, fused_router=True), dataclasses.replace(GEMV, fused_router=True)):
        got = moe_forward(x, rw, rb, w, top_k, config=config)
        assert_close(got, moe_ref(x, rw, rb, *raw, top_k), _tol(torch.float32, device), f"fused router {config}")


def test_fused_router_rejects_prefill_sizes(device):
    x = torch.randn(moe_router.MAX_TOKENS + 1, 32, device=device)
    with pytest.raises(ValueError, match="at most"):
        moe_router.route_tokens(x, torch.randn(4, 32, device=device), torch.randn(4, device=device), 2, 16)


def test_gemv_forward_skips_the_sort(device):
    # route(sort=False) fills only the top-k tensors; moe_forward's gemv path must not need the rest.
    experts, hidden, inter, top_k = 4, 64, 64, 2
    raw = _raw_weights(experts, hidden, inter, device)
    x = torch.randn(1, hidden, device=device)
    rw, rb = torch.randn(experts, hidden, device=device), torch.randn(experts, device=device)
    r = moe_routing.MoeRouting.allocate(1, experts, top_k, GEMV.block_m, x.device).narrow(1, GEMV.block_m)
    r.sorted_slots.fill_(-7)
    logits = x @ rw.T + rb
    route(logits, top_k, GEMV.block_m, out=r, sort=False)
    assert torch.equal(r.topk_ids.long(), route_ref(logits, top_k)[1])
    assert (r.sorted_slots == -7).all()
    got = moe_forward(x, rw, rb, prepare_moe_weights(*raw), top_k, config=GEMV)
    assert_close(got, moe_ref(x, rw, rb, *raw, top_k), _tol(torch.float32, device), "gemv forward vs moe_ref")


@triton.jit
def _topk_bf16_probe(logits_ptr, num_experts, values_ptr, ids_ptr, TOP_K: tl.constexpr, BLOCK_K: tl.constexpr,
                     BLOCK_E: tl.constexpr):
    """Row program_id(0), choice program_id(1): topk_row_bf16's values and the id of that choice."""
    row, rank = tl.program_id(0), tl.program_id(1)
    values, chosen = topk_row_bf16(logits_ptr + row * num_experts, num_experts, rank, TOP_K, BLOCK_K, BLOCK_E)
    tl.store(ids_ptr + row * TOP_K + rank, chosen)
    ks = tl.arange(0, BLOCK_K)
    tl.store(values_ptr + (row * TOP_K + rank) * TOP_K + ks, values, mask=ks < TOP_K)


@pytest.mark.parametrize("experts,top_k", [(4, 4), (5, 2), (32, 4), (64, 4), (128, 4), (200, 4)])
def test_topk_keys_match_torch_topk_on_bf16_logits(device, experts, top_k):
    # The gemvs' top-k on bf16-valued logits (one integer key per logit and column): torch.topk's
    # values, and its ties (many here: small integers, -0 beside +0, -inf) to the lowest column; a row
    # of negative values only.
    # 200 experts read 4 chunks of 64 columns; 5 a single chunk with padding.
    gen = torch.Generator().manual_seed(experts)
    rows = [torch.randint(-3, 3, (experts,), generator=gen).float(), torch.randn(experts, generator=gen) * 8,
            torch.full((experts,), -0.0), torch.randn(experts, generator=gen) * 1e30,
            -1 - torch.randn(experts, generator=gen).abs()]
    rows[0][::3] = -0.0
    rows[2][1::2] = 0.0
    rows[3][:2] = float("-inf")
    logits = torch.stack(rows).bfloat16().float().to(device)
    values = torch.empty(len(rows), top_k, top_k, device=device)
    ids = torch.empty(len(rows), top_k, dtype=torch.int32, device=device)
    _topk_bf16_probe[(len(rows), top_k)](logits, experts, values, ids, TOP_K=top_k,
                                         BLOCK_K=triton.next_power_of_2(top_k), BLOCK_E=triton.next_power_of_2(experts))
    order = torch.sort(-logits.cpu(), dim=1, stable=True).indices[:, :top_k]  # -0 == +0: the lower column first
    assert torch.equal(ids.cpu().long(), order), (ids.cpu(), order)
    want = logits.cpu().gather(1, order)
    assert (values.cpu() == want[:, None, :]).all()  # every program holds all top-k values


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,experts,top_k", [(1, 32, 4), (3, 5, 2), (4, 128, 4)])
def test_gemv_topk_in_gemv1_equals_the_routers(device, tokens, experts, top_k, dtype):
    # MoeConfig.gemv_topk: the router launch stops at the logits and gemv1 takes the top-k. The
    # experts must be the router's own; the weights bit for bit under the interpreter, and on a GPU
    # within the last bit (the two kernels may sum the 4 exponentials in another order). bf16: the
    # router rounds its logits to bf16, and the gemvs take the integer-key rounds (topk_row_bf16).
    hidden, inter = 64, 96
    raw = _raw_weights(experts, hidden, inter, device)
    w = prepare_moe_weights(*raw)
    x, rw, rb = _inputs(tokens, experts, hidden, top_k, dtype, device)
    config = dataclasses.replace(GEMV, fused_router=True)
    want_r = moe_router.route_tokens(x, rw, rb, top_k, config.block_m, sort=False)
    scratch = moe_router.RouterScratch.allocate(experts, device)
    got_r = moe_router.route_tokens(x, rw, rb, top_k, config.block_m, sort=False, scratch=scratch, topk=False)
    got_r.topk_ids.fill_(-1)
    act = moe_gemv1_swiglu(x, got_r, w, 7.0, 1.702, config, logits=scratch.logits)
    exact = device == "cpu"
    assert torch.equal(got_r.topk_ids, want_r.topk_ids)
    assert torch.equal(act, moe_gemv1_swiglu(x, want_r, w, 7.0, 1.702, config))
    late = moe_forward(x, rw, rb, w, top_k, config=dataclasses.replace(config, gemv_topk=True))
    early = moe_forward(x, rw, rb, w, top_k, config=config)
    if exact:
        assert torch.equal(got_r.topk_weights, want_r.topk_weights) and torch.equal(late, early)
    else:
        assert_close(got_r.topk_weights, want_r.topk_weights, 1e-6, "routing weights")
        assert_close(late, early, 1e-6, "late vs early top-k")
    assert_close(late, moe_ref(x, rw, rb, *raw, top_k), _tol(dtype, device), "late top-k vs moe_ref")
    # MoeConfig.gemv2_topk: gemv2 takes the same top-k from the logits (before its PDL wait on a GPU).
    want_y = moe_gemv2(act, want_r, w, config)
    got_r.topk_ids.fill_(-1)
    got_r.topk_weights.fill_(float("nan"))
    got_y = moe_gemv2(act, got_r, w, config, logits=scratch.logits)
    both = moe_forward(x, rw, rb, w, top_k, config=dataclasses.replace(config, gemv_topk=True, gemv2_topk=True))
    if exact:
        assert torch.equal(got_y, want_y) and torch.equal(both, late)
    else:  # the router's top-k and the gemv's may round a weight differently in the last bit
        assert_close(got_y, want_y, 1e-6, "gemv2 top-k from logits")
        assert_close(both, late, 1e-6, "both gemvs' top-k from logits")


def test_gemv_topk_arguments_are_checked(device):
    x = torch.randn(1, 32, device=device)
    with pytest.raises(ValueError, match="nothing to sort"):
        moe_router.route_tokens(x, torch.randn(4, 32, device=device), torch.randn(4, device=device), 2, 16, topk=False)
    w = prepare_moe_weights(*_raw_weights(4, 64, 64, device))
    r = route(torch.randn(1, 4, device=device), 2, 16, sort=False)
    with pytest.raises(ValueError, match="logits"):
        moe_gemv1_swiglu(torch.randn(1, 64, device=device), r, w, 7.0, 1.702, GEMV,
                         logits=torch.randn(1, 5, device=device))


def test_gemv_rejects_a_tiled_config(device):
    w = prepare_moe_weights(*_raw_weights(4, 64, 64, device))
    r = route(torch.randn(1, 4, device=device), 2, 16)
    with pytest.raises(ValueError, match="gemv"):
        moe_gemv1_swiglu(torch.randn(1, 64, device=device), r, w, 7.0, 1.702, DECODE)


def test_dequantisation_is_exact_over_the_scale_range(device):
    # One expert, one token, identity-like activations: gemm2 returns weight columns exactly.
    inter, hidden = 64, 64
    b1, s1, c1, b2, s2, c2 = _raw_weights(1, hidden, inter, device)
    # Every E8M0 scale the kernel promises to be exact for (1..240, module docstring).
    s2 = torch.randint(1, 241, s2.shape, dtype=torch.uint8, device=device)
    w = prepare_moe_weights(b1, s1, c1, b2, s2, torch.zeros_like(c2))
    r = route(torch.zeros(inter, 1, device=device), 1, 16)
    act = torch.eye(inter, device=device)  # row j picks column j of W2
    y = moe_gemm2(act, r, w, DECODE)
    assert torch.equal(y, dequantize_mxfp4(b2[0], s2[0]).T.contiguous())


# --- the whole forward pass ------------------------------------------------------------------------


@pytest.mark.parametrize("config", [DECODE, PREFILL, PREFILL_SWAPPED, PREFILL_SLICED, GEMV],
                         ids=["decode", "prefill", "prefill-swapped", "prefill-sliced", "gemv"])
@pytest.mark.parametrize(
    "tokens,experts,hidden,inter,top_k,dtype",
    [
        (1, 4, 64, 64, 4, torch.float32),
        (1, 8, 96, 64, 2, torch.bfloat16),
        (3, 5, 64, 96, 3, torch.bfloat16),
        (17, 8, 96, 64, 4, torch.float32),
        (67, 8, 64, 96, 4, torch.bfloat16),
    ],
)
def test_forward_matches_moe_ref(device, config, tokens, experts, hidden, inter, top_k, dtype):
    raw = _raw_weights(experts, hidden, inter, device)
    x, rw, rb = _inputs(tokens, experts, hidden, top_k, dtype, device)
    limit = 4.0
    want = moe_ref(x, rw, rb, *raw, top_k, limit=limit)
    got = moe_forward(x, rw, rb, prepare_moe_weights(*raw), top_k, limit=limit, config=config)
    assert got.dtype == dtype
    # bf16: moe_ref rounds h and y to bf16, the kernels keep them in fp32.
    assert rel_err(got, want) < (_tol(dtype, device) if dtype == torch.float32 else 1e-2)
    assert_close(got.float(), want.float(), _tol(dtype, device) if dtype == torch.float32 else 3e-2, "moe_forward")


def test_forward_with_workspace_is_identical(device):
    experts, hidden, inter, top_k = 6, 64, 64, 2
    raw = _raw_weights(experts, hidden, inter, device)
    w = prepare_moe_weights(*raw)
    ws = MoeWorkspace.allocate(12, w, top_k, torch.float32, device)
    for tokens, config in [(12, PREFILL), (5, DECODE)]:
        x, rw, rb = _inputs(tokens, experts, hidden, top_k, torch.float32, device, seed=tokens)
        plain = moe_forward(x, rw, rb, w, top_k, config=config)
        assert torch.equal(moe_forward(x, rw, rb, w, top_k, workspace=ws, config=config), plain)
    with pytest.raises(ValueError, match="workspace"):
        moe_forward(torch.randn(13, hidden, device=device), rw, rb, w, top_k, workspace=ws)


def test_forward_rejects_bad_arguments():
    raw = _raw_weights(4, 64, 64, "cpu")
    w = prepare_moe_weights(*raw)
    x, rw, rb = torch.randn(2, 64), torch.randn(4, 64), torch.randn(4)
    with pytest.raises(ValueError, match="x must be"):
        moe_forward(torch.randn(2, 32), rw, rb, w, 2)
    with pytest.raises(ValueError, match="top_k"):
        moe_forward(x, rw, rb, w, 5)
    with pytest.raises(ValueError, match="router"):
        moe_forward(x, rw[:3], rb, w, 2)
    with pytest.raises(TypeError):
        moe_forward(x.double(), rw, rb, w, 2)


def test_forward_with_no_tokens(device):
    w = prepare_moe_weights(*_raw_weights(4, 64, 64, device))
    x, rw, rb = torch.randn(0, 64, device=device), torch.randn(4, 64, device=device), torch.randn(4, device=device)
    out = moe_forward(x, rw, rb, w, 2)
    assert out.shape == (0, 64)


def test_pick_config_regimes():
    assert pick_config(1, 32, 4).regime == "decode" and pick_config(1, 32, 4).asm_dequant
    assert pick_config(1, 32, 4).gemv and not pick_config(2, 32, 4).gemv
    # Prefill: the asm dequantisation, with the weights as wgmma's register operand (Triton rejects
    # the asm tile as the shared-memory one).
    assert pick_config(4096, 32, 4).asm_dequant and pick_config(4096, 32, 4).swap_ab
    assert pick_config(4096, 32, 4).scale_words and not pick_config(64, 32, 4).scale_words
    assert not pick_config(64, 32, 4).swap_ab
    # gemm2 in 256-row tiles, gemm1 in 128-row slices of them
    assert (pick_config(4096, 32, 4).block_m, pick_config(4096, 32, 4).gemm1_rows) == (256, 128)
    # ~128 rows per expert take 256-row tiles too (one tile per expert despite the spread); 64 do not
    assert (pick_config(4096, 128, 4).block_m, pick_config(4096, 128, 4).gemm1_rows) == (256, 128)
    assert pick_config(2048, 128, 4).block_m == 64
    # The scale words: joined in gemm1 and gathered in gemm2 from 128-row tiles, shifted below
    big, small = pick_config(4096, 32, 4), pick_config(2048, 128, 4)
    assert (big.scale_unpack, big.gemm2_scale_unpack) == ("join", "gather")
    assert (small.scale_unpack, small.gemm2_scale_unpack) == ("shift", "shift")
    # Weights with fragment-order words: both gemms read those at every tile height; nothing else changes
    frag = {"scale_unpack": "frag", "scale_unpack2": ""}
    assert pick_config(4096, 32, 4, frag_scales=True) == dataclasses.replace(big, **frag)
    assert pick_config(2048, 128, 4, frag_scales=True) == dataclasses.replace(small, **frag)
    assert pick_config(4096, 32, 4, frag_scales=True).gemm2_scale_unpack == "frag"
    assert pick_config(64, 32, 4, frag_scales=True) == pick_config(64, 32, 4)
    with pytest.raises(ValueError, match="scale_unpack"):
        dataclasses.replace(big, scale_unpack="bytes")
    # The fused router up to 512 tokens x experts (FUSED_ROUTER_SLOTS): 20b 16 tokens, 120b 4
    assert [t for t in range(1, 65) if pick_config(t, 32, 4).fused_router] == list(range(1, 17))
    assert [t for t in range(1, 65) if pick_config(t, 128, 4).fused_router] == list(range(1, 5))
    with pytest.raises(ValueError, match="scale_unpack2"):
        dataclasses.replace(big, scale_unpack2="bytes")
    with pytest.raises(ValueError, match="gemm2 K step of 64"):
        dataclasses.replace(big, scale_unpack2="frag", block_k2=128)
    with pytest.raises(ValueError, match="gemm2 K step of 64"):  # gemm2 follows gemm1's "frag" too
        dataclasses.replace(big, scale_unpack="frag", scale_unpack2="", block_k2=128)
    with pytest.raises(ValueError, match="block_k 64"):
        dataclasses.replace(big, scale_unpack="frag", block_k=128)
    assert dataclasses.replace(big, scale_unpack="frag", scale_unpack2="").gemm2_scale_unpack == "frag"
    assert dataclasses.replace(big, scale_unpack="frag", scale_unpack2="gather").gemm2_scale_unpack == "gather"
    # Tiles (gemm1: slices) at most half or a quarter full run at that height; not in the decode tiles
    assert big.short_tiles == small.short_tiles == 2 and pick_config(64, 32, 4).short_tiles == 0
    assert big.pair_tiles and not pick_config(64, 32, 4).pair_tiles  # gemm2's half + eighth / quarter
    with pytest.raises(ValueError, match="short_tiles"):
        dataclasses.replace(big, short_tiles=3)
    # pair_tiles only where the quarter-height body exists and the tiles are swapped
    assert _tile_heights(big, 256, pairs=True) == {"SHORT_M": 128, "TINY_M": 64, "PAIR_M": 32}
    assert _tile_heights(dataclasses.replace(big, short_tiles=1), 256, pairs=True)["PAIR_M"] == 0
    assert _tile_heights(dataclasses.replace(big, swap_ab=False), 256, pairs=True)["PAIR_M"] == 0
    assert _tile_heights(big, 128) == {"SHORT_M": 64, "TINY_M": 32}  # gemm1: no pairs
    with pytest.raises(ValueError, match="block_m1"):
        MoeConfig("prefill", block_m=32, block_n1=32, block_n2=32, block_k=32, block_m1=48)
    with pytest.raises(ValueError, match="swap_ab"):
        MoeConfig("prefill", block_m=32, block_n1=32, block_n2=32, block_k=32, swap_ab=True, use_dot_scaled=True)
    assert pick_config(64, 128, 4).regime == "decode"
    small, large = pick_config(512, 32, 4), pick_config(4096, 32, 4)
    assert small.regime == large.regime == "prefill"
    assert small.block_m < large.block_m == 256  # tiles grow with rows per expert
    with pytest.raises(ValueError):
        MoeConfig("decode", block_m=16, block_n1=32, block_n2=32, block_k=16)
    with pytest.raises(ValueError, match="block_k2"):
        MoeConfig("decode", block_m=16, block_n1=32, block_n2=32, block_k=32, block_k2=48)


def test_pick_config_decode_tile_changes():
    # 32 experts: gemm2 alone takes K steps of 128 without a register cap at 5-7 rows per expert, is
    # split in two along K at 8-15, and
    # from 16 rows per expert both take 32-row tiles without a cap; elsewhere (and at 128 experts)
    # 16-row tiles, K steps of 64, a cap of 128.
    def tiles(tokens, experts):
        c = pick_config(tokens, experts, 4)
        return c.block_m, (c.block_k, c.maxnreg), (c.gemm2_block_k, c.gemm2_maxnreg)

    short, long = (64, 128), (128, 0)
    for tokens in (32, 64, 96):
        assert tiles(tokens, 32) == (16, short, short), tokens
    # Up to 2 rows per expert (32 experts) the grouped tensor-core kernels, else the tiles above.
    assert [pick_config(t, 32, 4).group_mma for t in (2, 8, 16, 17, 64)] == [True, True, True, False, False]
    assert not any(pick_config(t, 128, 4).group_mma for t in (2, 16, 64))
    for tokens in (2, 8, 16):
        tiles_only = regime_config("decode", tokens, 32, 4, group=False)
        assert not tiles_only.group_mma and (tiles_only.block_k, tiles_only.maxnreg, tiles_only.num_warps) == (64, 128, 2)
        assert tiles_only.split_k == (2 if tokens <= 8 else 1)
    assert tiles(48, 32) == (16, short, long)
    # gemm2 split along K at 8-15 rows per expert (32 experts) and only there.
    assert [pick_config(t, 32, 4).split_k for t in (32, 48, 64, 96, 120, 128)] == [1, 1, 2, 2, 2, 1]
    assert pick_config(64, 128, 4).split_k == 1
    assert tiles(128, 32) == tiles(256, 32) == (32, (64, 0), (64, 0))
    assert all(tiles(t, 128) == (16, short, short) for t in (2, 8, 16, 32, 48, 64, 256))
    plain = pick_config(64, 32, 4)
    assert plain.block_k2 == 0 and plain.maxnreg2 is None  # variants that set block_k reach both gemms


def test_quantised_weights_round_trip(device):
    # Weights made by quantize_mxfp4 (not random bytes): the engine layout still dequantises to them.
    experts, hidden, inter, top_k = 4, 64, 64, 2
    b1, s1 = quantize_mxfp4(0.1 * torch.randn(experts, 2 * inter, hidden, device=device))
    b2, s2 = quantize_mxfp4(0.1 * torch.randn(experts, hidden, inter, device=device))
    raw = (b1, s1, torch.zeros(experts, 2 * inter, device=device), b2, s2, torch.zeros(experts, hidden, device=device))
    x, rw, rb = _inputs(9, experts, hidden, top_k, torch.float32, device)
    got = moe_forward(x, rw, rb, prepare_moe_weights(*raw), top_k, config=DECODE)
    assert_close(got, moe_ref(x, rw, rb, *raw, top_k), _tol(torch.float32, device), "quantised weights")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the smoke run is the interpreter path; the GPU runs the real benchmark")
def test_benchmark_smoke(monkeypatch):
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_moe.py"
    spec = importlib.util.spec_from_file_location("bench_moe_smoke", path)
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, bench)  # dataclasses look their module up there
    spec.loader.exec_module(bench)
    rows = bench.bench(device="cpu", smoke=True)
    bench.print_table(rows)
    assert rows and all("error" not in r and r["ms"] > 0 for r in rows)
    assert {"gemm1+swiglu", "gemm2", "moe_forward", "route", "combine"} == {r["kernel"] for r in rows}
    assert {1, 3} == {r["tokens"] for r in rows}  # T=1: gemv1 taking its top-k from the logits


# --- GPU: real gpt-oss-20b shapes in bf16 ----------------------------------------------------------


@requires_gpu
@pytest.mark.parametrize("variant", [{}, {"asm_dequant": False}, {"use_dot_scaled": True, "swap_ab": False},
                                     {"gemv_f16": False}, {"swap_ab": False, "asm_dequant": False},
                                     {"even_odd": False}],
                         ids=["default", "fp32deq", "dot_scaled", "gemv_fp32", "unswapped", "interleaved"])
@pytest.mark.parametrize("tokens", [1, 64, 512])
def test_real_shapes_bf16(tokens, variant):
    _check_real_shapes_bf16(tokens, variant)


@requires_gpu
@pytest.mark.parametrize("variant", [{}, {"split_k": 2}, {"num_warps": 1, "maxnreg": 0, "block_k2": 0, "maxnreg2": None},
                                     {"num_warps": 4, "block_n2": 64, "maxnreg": 80, "block_k2": 0, "maxnreg2": None},
                                     {"block_k": 128, "maxnreg": 0, "block_k2": 0, "maxnreg2": None}],
                         ids=["default", "split-k", "1-warp", "4-warps", "k128"])
@pytest.mark.parametrize("tokens", [2, 16, 48, 64, 128, 256])
def test_real_shapes_bf16_decode_tiles(tokens, variant):
    # pick_config's 2-warp tiles and their neighbours (bench_moe variants), a few rows per expert.
    _check_real_shapes_bf16(tokens, variant)


@requires_gpu
@pytest.mark.parametrize("variant", [{}, {"block_m1": 0}, {"block_m": 128, "block_m1": 0}, {"scale_words": False},
                                     {"scale_unpack": "gather", "scale_unpack2": ""},
                                     {"scale_unpack": "shift", "scale_unpack2": ""}, {"even_k": False},
                                     {"scale_unpack": "join", "scale_unpack2": ""},
                                     {"scale_unpack": "frag", "scale_unpack2": "frag"},
                                     {"short_tiles": 1, "pair_tiles": False}, {"short_tiles": 0, "pair_tiles": False}],
                         ids=["sliced-gemm1", "256-row-gemm1", "128-row-tiles", "byte-scales", "scale-gather",
                              "scale-shift", "masked-k", "scale-join", "scale-frag", "half-short-tiles", "full-tiles"])
def test_real_shapes_bf16_prefill_tiles(variant):
    _check_real_shapes_bf16(4096, variant)  # ~512 rows per expert: 256-row tiles


@requires_gpu
@pytest.mark.parametrize("variant", [{}, {"pair_tiles": False}, {"short_tiles": 0, "pair_tiles": False}],
                         ids=["default", "no-pairs", "full-tiles"])
def test_real_shapes_bf16_prefill_tiles_128_experts(variant):
    # 120b's expert count at 4k tokens: ~128 rows per expert on average, 256-row tiles; this router's
    # bias (std 1) spreads the counts far around that, so tiles of every height and the pairs run.
    _check_real_shapes_bf16(4096, variant, experts=128)


@requires_gpu
@pytest.mark.parametrize("row_group", [16, 32])
@pytest.mark.parametrize("tokens", [1, 8, 64, 4096])
def test_real_shapes_row_groups_agree(tokens, row_group):
    # Same kernels and arithmetic on both layouts (MoeWeights.row_group): bit for bit on the GPU too.
    # The tensor-core kernels (gemv_mma, group_mma) read 16-row groups only, so they are off here.
    experts, hidden, inter, top_k = 32, 2880, 2880, 4
    raw = _raw_weights(experts, hidden, inter, "cuda", scale_lo=119, scale_hi=123)
    x = torch.randn(tokens, hidden, device="cuda").to(torch.bfloat16)
    rw = (torch.randn(experts, hidden, device="cuda") / hidden**0.5).to(torch.bfloat16)
    rb = torch.randn(experts, device="cuda").to(torch.bfloat16)
    config = dataclasses.replace(pick_config(tokens, experts, top_k), gemv_mma=False, group_mma=False)
    want = moe_forward(x, rw, rb, prepare_moe_weights(*raw, row_group=1), top_k, config=config)
    got = moe_forward(x, rw, rb, prepare_moe_weights(*raw, row_group=row_group), top_k, config=config)
    assert torch.equal(got, want)


@requires_gpu
@pytest.mark.parametrize("tokens,experts,variant", [
    (1, 32, {}), (8, 32, {}), (17, 32, {}), (32, 32, {}), (48, 32, {}), (64, 32, {}), (128, 32, {}), (256, 32, {}),
    (4096, 32, {}), (64, 128, {}), (256, 128, {}), (64, 32, {"split_k": 2}), (48, 32, {"num_warps": 4, "block_n2": 64}),
    (64, 32, {"block_k": 128, "maxnreg": 0, "block_k2": 0, "maxnreg2": None}), (64, 32, {"fold_scales": False}),
])
def test_real_shapes_split_copy_is_bit_identical(tokens, experts, variant):
    # The split-word copy changes which bits hold a value, not the values or the arithmetic: every
    # step size gives the checkpoint-order result bit for bit (decode tiles read the copy, the other
    # kernels ignore it). A copy the tiles did not read would pass that too, so the same launch on a
    # copy left in checkpoint order must come out different wherever the tiles run.
    hidden, inter, top_k = 2880, 2880, 4
    raw = _raw_weights(experts, hidden, inter, "cuda", scale_lo=119, scale_hi=123)
    x = torch.randn(tokens, hidden, device="cuda").to(torch.bfloat16)
    rw = (torch.randn(experts, hidden, device="cuda") / hidden**0.5).to(torch.bfloat16)
    rb = torch.randn(experts, device="cuda").to(torch.bfloat16)
    config = dataclasses.replace(pick_config(tokens, experts, top_k, frag_scales=True), **variant)
    plain = prepare_moe_weights(*raw, frag_scales=True)
    split = prepare_moe_weights(*raw, frag_scales=True, split_copy=True)
    want = moe_forward(x, rw, rb, plain, top_k, config=config)
    assert torch.equal(moe_forward(x, rw, rb, split, top_k, config=config), want)
    tiles = moe_matmul._weight_bytes(config, plain.w1_blocks, split.w1_split, x.dtype, plain.fold_scales)[1]
    if "split" in tiles and not (config.gemv or config.group_mma):
        split.w1_split, split.w2_split = plain.w1_blocks, plain.w2_blocks
        assert not torch.equal(moe_forward(x, rw, rb, split, top_k, config=config), want)


def _check_real_shapes_bf16(tokens: int, variant: dict, experts: int = 32) -> None:
    hidden, inter, top_k = 2880, 2880, 4
    raw = _raw_weights(experts, hidden, inter, "cuda", scale_lo=119, scale_hi=123)
    x = torch.randn(tokens, hidden, device="cuda").to(torch.bfloat16)
    rw = (torch.randn(experts, hidden, device="cuda") / hidden**0.5).to(torch.bfloat16)
    rb = torch.randn(experts, device="cuda").to(torch.bfloat16)
    # The engine's weights: with fragment-order scales, which pick_config then chooses where it does
    # (only for wgmma's register operand: unswapped variants read bytes, whatever the unpack says)
    if variant.get("swap_ab") is False:
        variant = {"scale_unpack": "shift", "scale_unpack2": ""} | variant
    config = dataclasses.replace(pick_config(tokens, experts, top_k, frag_scales=True), **variant)
    got = moe_forward(x, rw, rb, prepare_moe_weights(*raw, frag_scales=True), top_k, config=config)
    want = moe_ref(x, rw, rb, *raw, top_k)
    assert rel_err(got, want) < 1e-2


@requires_gpu
@pytest.mark.parametrize("config", [dataclasses.replace(DECODE, asm_dequant=True), DECODE,
                                    dataclasses.replace(DECODE_INTERLEAVED, asm_dequant=True),
                                    dataclasses.replace(GEMV, asm_dequant=True), GEMV,
                                    dataclasses.replace(GEMV, asm_dequant=True, gemv_f16=True),
                                    PREFILL_4096,
                                    dataclasses.replace(PREFILL_4096, scale_words=False),
                                    dataclasses.replace(PREFILL_4096, scale_unpack="gather", scale_unpack2=""),
                                    dataclasses.replace(PREFILL_4096, scale_unpack="shift", scale_unpack2="")],
                         ids=["asm", "fp32deq", "asm-interleaved", "gemv-asm", "gemv-fp32deq", "gemv-f16",
                              "prefill-swapped-asm-scale-words", "prefill-swapped-asm-byte-scales",
                              "prefill-swapped-asm-scale-gather", "prefill-swapped-asm-scale-shift"])
@pytest.mark.parametrize("max_scale", [240, FOLD_MAX_SCALE], ids=["two-multiplies", "folded"])
def test_bf16_dequantisation_is_exact_over_the_scale_range(config, max_scale):
    # The packed-bf16 (inline asm) path: one-hot bf16 activations return weight columns exactly.
    # Scales up to FOLD_MAX_SCALE take the asm with 2**126 folded into the scale.
    inter, hidden = 128, 192
    b1, s1, c1, b2, s2, c2 = _raw_weights(1, hidden, inter, "cuda", scale_lo=1, scale_hi=min(max_scale, 129))
    s2 = torch.randint(1, max_scale + 1, s2.shape, dtype=torch.uint8, device="cuda")
    w = prepare_moe_weights(b1, s1, c1, b2, s2, torch.zeros_like(c2))
    assert w.fold_scales == (max_scale <= FOLD_MAX_SCALE)
    r = route(torch.zeros(inter, 1, device="cuda"), 1, config.block_m)
    act = torch.eye(inter, device="cuda", dtype=torch.bfloat16)
    y = (moe_gemv2 if config.gemv else moe_gemm2)(act, r, w, config)
    assert torch.equal(y.float(), dequantize_mxfp4(b2[0], s2[0]).T.contiguous())  # bf16 with round_slots: exact too


@requires_gpu
@pytest.mark.parametrize("x_scale", [1.0, 30000.0], ids=["normal", "fp16-overflow"])
@pytest.mark.parametrize("change", [{}, {"block_n2": 32, "split_k": 4, "block_k2": 256},
                                    {"block_n2": 8, "split_k": 1, "block_n1": 32}],
                         ids=["default", "mma-split-4", "packed-fp16-64-rows"])
def test_gemv_f16_matches_twin_and_falls_back_on_overflow(x_scale, change):
    # |x| ~ 30000 overflows fp16 (x itself beyond 65504, block sums of 16 products up to 6|x|): the program
    # must redo its rows in fp32 and still match the twin. Both gemvs as pick_config runs them (tensor
    # cores, 32-row programs; gemv2's K split in two), gemv2 split in four (2,880 = 736 x 3 + 672
    # values) and in its packed fp16 form on 8 rows over the whole K (the default until session 29)
    # with gemv1 on 64-row programs (the default until session 30).
    experts, hidden, inter, top_k = 32, 2880, 2880, 4
    w = prepare_moe_weights(*_raw_weights(experts, hidden, inter, "cuda", scale_lo=119, scale_hi=123))
    config = dataclasses.replace(pick_config(1, experts, top_k), **change)
    assert config.gemv and config.gemv_f16
    x = (torch.randn(1, hidden, device="cuda") * x_scale).to(torch.bfloat16)
    r = route(torch.randn(1, experts, device="cuda"), top_k, config.block_m)
    act = moe_gemv1_swiglu(x, r, w, 7.0, 1.702, config)
    want = moe_gemm1_swiglu_ref(x, r, w, 7.0, 1.702)  # sorted rows; gemv: slot order
    assert torch.isfinite(act.float()).all()
    assert rel_err(act, want[r.slot_rows.long()]) < 1e-2
    y = moe_gemv2(want[r.slot_rows.long()], r, w, config)
    assert rel_err(y.view(config.split_k, -1, hidden).sum(0), moe_gemm2_ref(want, r, w)) < 1e-2


@requires_gpu
@pytest.mark.parametrize("tokens,experts", [(1, 32), (4, 32), (1, 128), (20, 32), (64, 32), (64, 128)])
def test_fused_router_bf16_real_shapes(tokens, experts):
    # bf16 logits: both paths round an fp32 sum once; the sums differ in order only, so the chosen
    # experts agree except at exact ties after rounding (none in random data of this size).
    x = torch.randn(tokens, 2880, device="cuda").to(torch.bfloat16)
    rw = (torch.randn(experts, 2880, device="cuda") / 2880**0.5).to(torch.bfloat16)
    rb = torch.randn(experts, device="cuda").to(torch.bfloat16)
    got = moe_router.route_tokens(x, rw, rb, 4, 16)
    want = route(router_logits(x, rw, rb), 4, 16)
    assert torch.equal(got.topk_ids, want.topk_ids)
    assert_close(got.topk_weights, want.topk_weights, 2e-2, "routing weights")


@requires_gpu
def test_fused_router_graph_replays_see_every_program():
    # The last-arriving program reads the other programs' logits: replayed many times in a CUDA
    # graph with new inputs (stale L1 lines or a missed arrival would show as wrong experts).
    experts, hidden = 128, 2880
    rw = (torch.randn(experts, hidden, device="cuda") / hidden**0.5).to(torch.bfloat16)
    rb = torch.zeros(experts, device="cuda").to(torch.bfloat16)
    x = torch.randn(1, hidden, device="cuda").to(torch.bfloat16)
    scratch = moe_router.RouterScratch.allocate(experts, "cuda")
    out = moe_router.route_tokens(x, rw, rb, 4, 16, sort=False, scratch=scratch)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(4):  # back-to-back launches on one scratch, as in consecutive layers
            moe_router.route_tokens(x, rw, rb, 4, 16, out=out, sort=False, scratch=scratch)
    bad = 0
    for _ in range(200):
        x.copy_(torch.randn(1, hidden, device="cuda"))
        graph.replay()
        bad += not torch.equal(out.topk_ids, route(router_logits(x, rw, rb), 4, 16).topk_ids)
    assert bad == 0 and scratch.arrivals.item() == 0


@requires_gpu
def test_cuda_graph_replay_matches_eager():
    experts, hidden, inter, top_k, tokens = 32, 2880, 2880, 4, 8
    w = prepare_moe_weights(*_raw_weights(experts, hidden, inter, "cuda", scale_lo=119, scale_hi=123))
    rw = (torch.randn(experts, hidden, device="cuda") / hidden**0.5).to(torch.bfloat16)
    rb = torch.randn(experts, device="cuda").to(torch.bfloat16)
    ws = MoeWorkspace.allocate(tokens, w, top_k, torch.bfloat16, "cuda")
    x = torch.randn(tokens, hidden, device="cuda").to(torch.bfloat16)
    moe_forward(x, rw, rb, w, top_k, workspace=ws)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe_forward(x, rw, rb, w, top_k, workspace=ws)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, moe_forward(x.clone(), rw, rb, w, top_k))


@requires_gpu
@pytest.mark.parametrize("gemv2_topk", [True, False], ids=["gemv2-topk", "gemv2-topk-off"])
def test_one_token_moe_graph_replays_match_eager(gemv2_topk):
    # gemv2 with its own top-k (MoeConfig.gemv2_topk) reads the router's logits and issues its first
    # weight loads before its PDL wait: replayed in a CUDA graph with new inputs, every replay must
    # give eager's bits (the same kernels in the same order).
    experts, hidden, inter, top_k = 32, 2880, 2880, 4
    w = prepare_moe_weights(*_raw_weights(experts, hidden, inter, "cuda", scale_lo=119, scale_hi=123))
    rw = (torch.randn(experts, hidden, device="cuda") / hidden**0.5).to(torch.bfloat16)
    rb = torch.randn(experts, device="cuda").to(torch.bfloat16)
    config = dataclasses.replace(pick_config(1, experts, top_k), gemv2_topk=gemv2_topk)
    ws = MoeWorkspace.allocate(1, w, top_k, torch.bfloat16, "cuda")
    x = torch.randn(1, hidden, device="cuda").to(torch.bfloat16)
    moe_forward(x, rw, rb, w, top_k, workspace=ws, config=config)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe_forward(x, rw, rb, w, top_k, workspace=ws, config=config)
    bad = 0
    for _ in range(50):
        x.copy_(torch.randn_like(x))
        graph.replay()
        bad += not torch.equal(out, moe_forward(x.clone(), rw, rb, w, top_k, config=config))
    assert bad == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,hidden,splits", [(1, 2880, 1), (3, 100, 2), (4, 64, 1)])
def test_combine_norm_equals_combine_then_rms_norm(device, dtype, tokens, hidden, splits):
    # The fused launch must give the same bits as the two launches it replaces (same sum order,
    # same roundings, the same normalize_rows code).
    top_k = 4
    y = torch.randn(splits * tokens * top_k, hidden, device=device)
    residual = torch.randn(tokens, hidden, device=device).to(dtype)
    weight = torch.rand(hidden, device=device).to(dtype)
    got, got_h = moe_combine_norm(y, top_k, residual, weight, 1e-5, splits=splits)
    want, want_h = rms_norm(moe_combine(y, top_k, dtype, splits=splits), weight, 1e-5, residual)
    assert got.dtype == dtype and torch.equal(got_h, want_h)
    # On the GPU the two kernels could contract h * rstd * w into different FMAs: 1 ulp at most.
    assert torch.equal(got, want) if device == "cpu" else rel_err(got.float(), want.float()) < 4e-3


@pytest.mark.parametrize("tokens,hidden,splits,block", [(1, 2880, 2, 256), (3, 100, 2, 32), (5, 64, 1, 16)])
def test_combine_norm_blocks_equals_one_program_per_token(device, tokens, hidden, splits, block):
    # Column-block programs whose last arrival normalizes: the same h bits (the same sum order), the
    # same normed row up to the order of the row's sum of squares; twice over the same counters,
    # which the last arrivals must have reset (a counter left at n would skip the second norm).
    top_k, dtype = 4, torch.bfloat16
    arrivals = torch.zeros(tokens + 1, dtype=torch.int32, device=device)
    weight = torch.rand(hidden, device=device).to(dtype)
    for _ in range(2):
        y = torch.randn(splits * tokens * top_k, hidden, device=device)
        residual = torch.randn(tokens, hidden, device=device).to(dtype)
        got, got_h = moe_combine_norm(y, top_k, residual, weight, 1e-5, splits=splits, block=block, arrivals=arrivals)
        want, want_h = moe_combine_norm(y, top_k, residual, weight, 1e-5, splits=splits)
        assert torch.equal(got_h, want_h)
        assert rel_err(got.float(), want.float()) < 4e-3
        assert not arrivals.any()


@pytest.mark.parametrize("tokens", [1, 4, 5, 40, 70])
def test_moe_block_matches_norm_moe_norm(device, tokens):
    # 1 and 4 tokens: both norms fused (router and combine launches); 5 and 40 (pick_config's
    # router: F.linear and route): the block's norm its own launch, the next one still inside the
    # combine; 70 (a prompt step): the three steps as written.
    experts, hidden, inter, top_k = 4, 64, 96, 2
    raw = _raw_weights(experts, hidden, inter, device)
    w = prepare_moe_weights(*raw)
    x, residual = torch.randn(tokens, hidden, device=device), torch.randn(tokens, hidden, device=device)
    norm_w, next_w = torch.rand(hidden, device=device) + 0.5, torch.rand(hidden, device=device) + 0.5
    rw, rb = torch.randn(experts, hidden, device=device), torch.randn(experts, device=device)
    before = (x.clone(), residual.clone())
    got, got_r = moe_block(x, residual, norm_w, next_w, 1e-5, rw, rb, w, top_k)
    h, r = rms_norm_ref(x, norm_w, 1e-5, residual)
    want, want_r = rms_norm_ref(moe_ref(h, rw, rb, *raw, top_k), next_w, 1e-5, r)
    assert_close(got_r, want_r, _tol(torch.float32, device), "residual")
    assert_close(got, want, _tol(torch.float32, device), "normed")
    assert torch.equal(x, before[0]) and torch.equal(residual, before[1])  # inputs untouched


# (4, 2500): several column steps; (12, 300): two token blocks, the second part-full; one token per
# program: whole rows in one step, a program per token.
@pytest.mark.parametrize("tokens,hidden,per_program", [(1, 2880, 8), (3, 300, 8), (4, 2500, 8), (12, 300, 8),
                                                       (3, 2880, 1), (5, 300, 2), (4, 2504, 8)])
def test_fused_router_norm_writes_the_normed_rows(device, tokens, hidden, per_program):
    # Each program writes its slice of the normalised rows and of x + residual: together, all of it,
    # equal to the rms_norm kernel; the routing equals routing the normed rows. Where C is a
    # multiple of 8, the rows in fp16_pairs form too (MoeConfig.gemv_pairs).
    experts = 32
    x, residual = torch.randn(tokens, hidden, device=device), torch.randn(tokens, hidden, device=device)
    weight = torch.rand(hidden, device=device)
    rw, rb = torch.randn(experts, hidden, device=device), torch.randn(experts, device=device)
    pairs = torch.full((tokens, hidden), float("nan"), dtype=torch.float16, device=device) if hidden % 8 == 0 else None
    norm = moe_router.RouterNorm(residual, weight, 1e-5, torch.full_like(x, float("nan")),
                                 torch.full_like(x, float("nan")), pairs)
    got = moe_router.route_tokens(x, rw, rb, 4, 16, sort=False, norm=norm, tokens_per_program=per_program)
    want_y, want_h = rms_norm(x, weight, 1e-5, residual)
    assert torch.equal(norm.residual_out, want_h)
    assert_close(norm.out, want_y, 1e-6, "normed rows")
    if pairs is not None:
        assert torch.equal(pairs, fp16_pairs(norm.out))
    assert torch.equal(got.topk_ids, route(router_logits(norm.out, rw, rb), 4, 16).topk_ids)
    with pytest.raises(ValueError, match="alias"):
        moe_router.route_tokens(x, rw, rb, 4, 16, norm=moe_router.RouterNorm(residual, weight, 1e-5, x, norm.out))


# gemv on the tensor cores (moe_gemv_mma.py): 2 tiles per warp; K split over the 4 warps (block_k 128:
# one block column per asm step), or 2 pairs of tiles per program and 2 splits of 4 columns (block_k 256).
GEMV_MMA = dataclasses.replace(GEMV, block_n1=16, block_n2=32, block_k=128, asm_dequant=True, gemv_f16=True,
                               gemv_mma=True)
GEMV_MMA_WIDE = dataclasses.replace(GEMV_MMA, block_n1=32, block_n2=64, block_k=256)


@requires_gpu
@pytest.mark.parametrize("config", [GEMV_MMA, GEMV_MMA_WIDE, *(dataclasses.replace(c, gemv_ahead=2)
                                                               for c in (GEMV_MMA, GEMV_MMA_WIDE))],
                         ids=["k128", "wide", "k128-ahead-2", "wide-ahead-2"])
@pytest.mark.parametrize("tokens,experts,hidden,inter,top_k", [(1, 32, 2880, 2880, 4), (3, 8, 576, 224, 2),
                                                               (2, 4, 1024, 512, 4)])
def test_gemv_mma_matches_twins(config, tokens, experts, hidden, inter, top_k):
    # 576 = 18 blocks: K steps of 4 (8) blocks end with a step moved back over blocks already
    # counted; 2 * 224 = 14 tiles = 7 pairs, so the last gemv1 program of GEMV_MMA_WIDE holds one
    # pair past the end. Every case runs the mma path (asserted), not the packed-fp16 fallback.
    from gptoss_cli.kernels import moe_gemv

    device, dtype = "cuda", torch.bfloat16
    w = prepare_moe_weights(*_raw_weights(experts, hidden, inter, device), row_group=16)
    if hidden >= config.block_k and inter >= config.block_k:
        launch = moe_gemv._launch_options(config, torch.empty(1, hidden, device=device, dtype=dtype), w,
                                          2 * config.block_n1, 2 * inter, config.block_k)
        assert launch["MMA"] and launch["MMA_AHEAD"] == (config.gemv_ahead if hidden > config.block_k else 1)
    x = torch.randn(tokens, hidden, device=device).to(dtype)
    r = route(torch.randn(tokens, experts, device=device), top_k, config.block_m)
    limit, alpha = 7.0, 1.702
    want_act = moe_gemm1_swiglu_ref(x, r, w, limit, alpha)
    in_slot_order = want_act[r.slot_rows.long()]
    act = moe_gemv1_swiglu(x, r, w, limit, alpha, config)
    assert_close(act.float(), in_slot_order.float(), _tol(dtype, device), "gemv1+swiglu (mma)")
    f16 = dataclasses.replace(config, gemv_mma=False)
    assert rel_err(act.float(), in_slot_order.float()) <= 1.5 * rel_err(
        moe_gemv1_swiglu(x, r, w, limit, alpha, f16).float(), in_slot_order.float()) + 1e-3
    y = moe_gemv2(in_slot_order, r, w, config)
    assert_close(y, moe_gemm2_ref(want_act, r, w), _tol(dtype, device), "gemv2 (mma)")


@requires_gpu
@pytest.mark.parametrize("tokens,experts,hidden,inter,top_k", [(1, 32, 2880, 2880, 4), (2, 8, 1024, 512, 4)])
def test_gemv_mma_on_fp16_pairs_gives_the_same_bits(tokens, experts, hidden, inter, top_k):
    # MoeConfig.gemv_pairs: the tensor-core steps load fp16_pairs(x) and gemv1's act pairs instead of
    # converting bf16 in each step; the B registers are the same, so every output bit is.
    from gptoss_cli.kernels import moe_gemv

    config = pick_config(1, experts, top_k)  # the batch-1 gemv: 32-row gemv1, gemv2 split in two
    w = prepare_moe_weights(*_raw_weights(experts, hidden, inter, "cuda"), row_group=16)
    x = torch.randn(tokens, hidden, device="cuda").to(torch.bfloat16)
    assert moe_gemv._launch_options(config, x, w, 2 * config.block_n1, 2 * inter, config.block_k)["MMA"]
    r = route(torch.randn(tokens, experts, device="cuda"), top_k, config.block_m)
    want = moe_gemv1_swiglu(x, r, w, 7.0, 1.702, config)
    act_pairs = torch.full((tokens * top_k, inter), float("nan"), dtype=torch.float16, device="cuda")
    act = moe_gemv1_swiglu(x, r, w, 7.0, 1.702, config, x_pairs=fp16_pairs(x), act_pairs=act_pairs)
    assert torch.equal(act, want) and torch.equal(act_pairs, fp16_pairs(act))
    assert torch.equal(moe_gemv2(act, r, w, config, act_pairs=act_pairs), moe_gemv2(act, r, w, config))


@requires_gpu
def test_one_token_moe_block_with_fp16_pairs_gives_the_same_bits(monkeypatch):
    # The whole batch-1 block with MoeConfig.gemv_pairs (the router's norm and gemv1 write the pairs)
    # against it off: bit for bit, eager and replayed in a CUDA graph.
    from gptoss_cli.kernels import moe as moe_module

    experts, hidden, inter, top_k = 32, 2880, 2880, 4
    w = prepare_moe_weights(*_raw_weights(experts, hidden, inter, "cuda", scale_lo=119, scale_hi=123))
    rw = (torch.randn(experts, hidden, device="cuda") / hidden**0.5).to(torch.bfloat16)
    rb = torch.randn(experts, device="cuda").to(torch.bfloat16)
    norm_w, next_w = ((torch.rand(hidden, device="cuda") + 0.5).to(torch.bfloat16) for _ in range(2))
    x, residual = (torch.randn(1, hidden, device="cuda").to(torch.bfloat16) for _ in range(2))
    ws = MoeWorkspace.allocate(1, w, top_k, torch.bfloat16, "cuda")

    assert pick_config(1, experts, top_k).gemv_pairs  # the default at one token; compared here against off
    default = moe_module.pick_config

    def block(pairs: bool):
        monkeypatch.setattr(moe_module, "pick_config",
                            lambda *args, **kwargs: dataclasses.replace(default(*args, **kwargs), gemv_pairs=pairs))
        return moe_block(x, residual, norm_w, next_w, 1e-5, rw, rb, w, top_k, workspace=ws)

    want = [t.clone() for t in block(False)]
    assert all(torch.equal(g, t) for g, t in zip(block(True), want))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = block(True)
    for _ in range(5):
        x.copy_(torch.randn_like(x))
        graph.replay()
        assert all(torch.equal(g, t) for g, t in zip(out, block(False)))


def test_mma_plan_runs_one_step_ahead_where_k_is_one_step():
    plan = functools.partial(mma_plan, 16, num_warps=4, ahead=2)
    assert plan(64, 256, 64, 128) == (2, 2)  # 64 rows: 2 pairs of tiles x 2 K splits; K = 2 steps of 128
    assert plan(64, 160, 64, 128) == (2, 2)  # the second step moved back over the first
    assert plan(64, 128, 64, 128) == (2, 1)  # a single K step
    assert plan(64, 96, 64, 128) == (0, 1)  # K shorter than a step: packed fp16
    assert plan(48, 256, 64, 128) == (0, 1)  # not whole pairs of tiles
    assert mma_plan(16, 64, 256, 64, 128, 4, 1) == (2, 1)


# Decode tiles on the tensor cores (moe_group_mma.py): 16-row routing tiles, one group of 8 token
# columns per mma B operand up to 8 rows, two from 9 to 16. GROUP: 2 pairs of weight tiles per gemm1
# program x 2 K splits of 4 block columns; gemm2 64 columns, the same. Neighbours: one step ahead,
# 2 block columns per asm step, one pair x 4 splits.
GROUP = dataclasses.replace(DECODE, block_n1=32, block_n2=64, block_k=256, num_warps=4, asm_dequant=True,
                            group_mma=True, group_ahead=2)
GROUP_VARIANTS = [GROUP, dataclasses.replace(GROUP, group_ahead=1), dataclasses.replace(GROUP, block_k=128),
                  dataclasses.replace(GROUP, block_n1=16, block_n2=32)]


@requires_gpu
@pytest.mark.parametrize("config", GROUP_VARIANTS, ids=["default", "ahead-1", "k128", "n16"])
@pytest.mark.parametrize("tokens,experts,hidden,inter,top_k", [(64, 32, 2880, 2880, 4), (64, 128, 2880, 2880, 4),
                                                               (13, 8, 608, 288, 2), (40, 4, 1024, 512, 4)])
def test_group_mma_matches_twins(config, tokens, experts, hidden, inter, top_k):
    # 20b and 120b at batch 64 (~8 and ~2 rows per expert: both group bodies); 608 = 19 blocks and
    # 288 = 9, so K steps of 4 or 8 blocks end with a step moved back over blocks already counted,
    # and 608 rows = 19 pairs of weight tiles: gemm2's last 2-pair program holds a pair past the
    # end; 40 rows per expert: full 16-row tiles and a part-full last one.
    from gptoss_cli.kernels.moe_group_mma import (
        group_fits,
        moe_group_gemm1_swiglu,
        moe_group_gemm2,
    )

    device, dtype = "cuda", torch.bfloat16
    w = prepare_moe_weights(*_raw_weights(experts, hidden, inter, device), row_group=16)
    assert group_fits(config, dtype, w)
    x = torch.randn(tokens, hidden, device=device).to(dtype)
    r = route(torch.randn(tokens, experts, device=device), top_k, config.block_m)
    limit, alpha = 7.0, 1.702
    want_act = moe_gemm1_swiglu_ref(x, r, w, limit, alpha)
    act = moe_group_gemm1_swiglu(x, r, w, limit, alpha, config)
    assert_close(act.float(), want_act.float(), _tol(dtype, device), "group gemm1+swiglu")
    y = moe_group_gemm2(want_act, r, w, config)
    assert_close(y, moe_gemm2_ref(want_act, r, w), _tol(dtype, device), "group gemm2")


@requires_gpu
def test_group_mma_forward_matches_moe_ref():
    # moe_forward picks the grouped kernels for a group_mma config (and the tiles' sorted routing).
    device, dtype = "cuda", torch.bfloat16
    raw = _raw_weights(32, 2880, 2880, device)
    x, rw, rb = _inputs(48, 32, 2880, 4, dtype, device)
    want = moe_ref(x, rw, rb, *raw, 4)
    got = moe_forward(x, rw, rb, prepare_moe_weights(*raw, row_group=16), 4, config=GROUP)
    assert rel_err(got, want) < 1e-2
    assert_close(got.float(), want.float(), 3e-2, "moe_forward (group mma)")


@requires_gpu
@pytest.mark.parametrize("grouped", [False, True], ids=["gemv", "group"])
def test_mma_redoes_overflowing_rows_in_fp32(grouped):
    # An activation past fp16's range (65504) makes each program that reads it redo its rows in
    # fp32: the batch-1 gemv (slot order) and the grouped decode kernels (sorted rows).
    from gptoss_cli.kernels.moe_group_mma import moe_group_gemm1_swiglu

    device, dtype = "cuda", torch.bfloat16
    tokens, config = (12, GROUP) if grouped else (1, GEMV_MMA)
    w = prepare_moe_weights(*_raw_weights(4, 1024, 512, device), row_group=16)
    x = torch.randn(tokens, 1024, device=device).to(dtype)
    x[tokens // 2, 77] = 1e5
    r = route(torch.randn(tokens, 4, device=device), 4, config.block_m)
    want = moe_gemm1_swiglu_ref(x, r, w, 7.0, 1.702)
    if grouped:
        got = moe_group_gemm1_swiglu(x, r, w, 7.0, 1.702, config)
    else:
        got, want = moe_gemv1_swiglu(x, r, w, 7.0, 1.702, config), want[r.slot_rows.long()]
    assert torch.isfinite(got).all()
    assert_close(got.float(), want.float(), _tol(dtype, device), "gemm1 with an fp16 overflow")


def test_group_plan_falls_back_to_the_tiles(monkeypatch):
    # Where the grouped kernels cannot run, moe_forward takes the tiles: no asm path (the
    # interpreter), other tile heights, split-K, weights not in 16-row groups.
    from gptoss_cli.kernels import moe_group_mma

    w = prepare_moe_weights(*_raw_weights(4, 1024, 512, "cpu"), row_group=16)
    monkeypatch.setattr(moe_group_mma, "_dot_scaled_format", lambda config, dtype: "asm")
    assert moe_group_mma.group_fits(GROUP, torch.bfloat16, w)
    assert moe_group_mma.group_plan(GROUP, torch.bfloat16, 16, 1024, 1024, 64, 256) == (2, 2)
    assert moe_group_mma.group_plan(GROUP, torch.bfloat16, 16, 1024, 256, 64, 256) == (2, 1)  # K is one step
    for off in ({"group_mma": False}, {"block_m": 32}, {"split_k": 2}):
        assert not moe_group_mma.group_fits(dataclasses.replace(GROUP, **off), torch.bfloat16, w)
    ungrouped = prepare_moe_weights(*_raw_weights(4, 1024, 512, "cpu"), row_group=1)
    assert not moe_group_mma.group_fits(GROUP, torch.bfloat16, ungrouped)
    monkeypatch.undo()
    assert moe_group_mma.group_fits(GROUP, torch.bfloat16, w) == (not moe_matmul.is_interpreted())
