"""Benchmark of the MXFP4 MoE kernels at gpt-oss shapes (a script, not a test).

For gpt-oss-20b (E=32) and -120b (E=128) at T = 1, 64 and 4096 tokens it prints, per kernel
(routing, gemm1+SwiGLU, gemm2, combine, and the whole moe_forward): the median time, the bytes
that must move (packed weights of the distinct experts touched + activations), the FLOPs, and
the achieved fraction of the H200's measured copy bandwidth and dense bf16 matmul rate.

Timing replays a CUDA graph (triton.testing.do_bench_cudagraph), as the engine runs decode, so
Python launch overhead is not counted. Graph replays do not flush L2, so each timed call sweeps
several copies of the layer's weights ("layers") whose total is well above the 50 MB L2, and the
reported time is per layer.

    PYTHONPATH=src python benchmarks/bench_moe.py            # on the H200
    PYTHONPATH=src python benchmarks/bench_moe.py --smoke    # CPU, Triton interpreter, tiny shapes
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import time
from dataclasses import dataclass

import torch

COPY_TBPS = 4.3  # measured H200 device-to-device copy bandwidth
BF16_TFLOPS = 786.0  # measured H200 dense bf16 matmul rate
L2_BYTES = 50e6
L2_SWEEP = 8  # each timed call touches at least this many L2 sizes of weights
MAX_LAYERS = 8


@dataclass(frozen=True)
class Case:
    model: str
    experts: int
    hidden: int
    inter: int
    top_k: int
    tokens: int


MODELS = (("20b", 32), ("120b", 128))  # (name, experts); both have hidden = intermediate = 2880, top-4
CASES = [Case(m, e, 2880, 2880, 4, t) for m, e in MODELS for t in (1, 64, 4096)]
SMOKE_CASES = [Case("tiny", 8, 64, 64, 4, 1), Case("tiny", 8, 64, 64, 4, 3)]  # T=1: the gemv with its top-k


def _random_layer(case: Case, device: str):
    """Checkpoint-layout expert tensors: random packed bytes, scales near 2**-6 (values O(0.05))."""
    e, c, i = case.experts, case.hidden, case.inter

    def mx(n: int, k: int):
        blocks = torch.randint(0, 256, (e, n, k // 32, 16), dtype=torch.uint8, device=device)
        return blocks, torch.randint(119, 123, (e, n, k // 32), dtype=torch.uint8, device=device)

    b1, s1 = mx(2 * i, c)
    b2, s2 = mx(c, i)
    return b1, s1, torch.randn(e, 2 * i, device=device), b2, s2, torch.randn(e, c, device=device)


def _expert_bytes(case: Case) -> tuple[int, int]:
    """Packed bytes (blocks + scales + fp32 bias) of one expert's gate_up and down matrices."""
    c, i = case.hidden, case.inter
    w1 = 2 * i * (c // 2 + c // 32 + 4)
    w2 = c * (i // 2 + i // 32 + 4)
    return w1, w2


def _time_ms(fn, device: str) -> float:
    if device == "cpu":  # the interpreter: one run is the measurement (do_bench needs a GPU)
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    import triton.testing

    return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")


def _row(case: Case, kernel: str, variant: str, regime: str, ms: float, nbytes: float, flops: float) -> dict:
    s = ms * 1e-3
    return {
        "model": case.model, "tokens": case.tokens, "kernel": kernel, "variant": variant, "regime": regime,
        "ms": ms, "bytes": nbytes, "flops": flops,
        "tbps": nbytes / s / 1e12, "pct_bw": 100 * nbytes / s / 1e12 / COPY_TBPS,
        "tflops": flops / s / 1e12, "pct_mma": 100 * flops / s / 1e12 / BF16_TFLOPS,
    }  # fmt: skip


@dataclass
class _Setup:
    """Inputs, routing and buffers of one case; `weights` holds `layers` copies of the layer."""

    case: Case
    x: torch.Tensor
    router_weight: torch.Tensor
    router_bias: torch.Tensor
    logits: torch.Tensor
    routing: object
    weights: list
    workspace: object
    act: torch.Tensor
    y: torch.Tensor
    out: torch.Tensor
    touched: int  # distinct experts the routing uses


def _setup(case: Case, device: str, row_group: int | None = None) -> _Setup:
    from gptoss_cli.kernels.moe import MoeWorkspace, pick_config, prepare_moe_weights
    from gptoss_cli.kernels.moe_routing import route

    dt, t, k, c = torch.bfloat16, case.tokens, case.top_k, case.hidden
    torch.manual_seed(0)  # the same routing (and bytes) in every run, so runs compare
    x = torch.randn(t, c, device=device).to(dt)
    # The router spread of the random checkpoints the engine runs (runtime/random_checkpoint.py:
    # weights std 2/sqrt(C), bias std 0.2), so rows spread over the experts as in `gptoss bench`.
    # Until session 13 the bias had std 1, which made some experts far more popular: tiles held
    # more rows than the engine's, and tile choices measured here did not carry over (session 14).
    rw = (torch.randn(case.experts, c, device=device) * (2 / c**0.5)).to(dt)
    rb = (torch.randn(case.experts, device=device) * 0.2).to(dt)
    logits = x @ rw.T + rb
    routing = route(logits, k, pick_config(t, case.experts, k).block_m)
    counts = torch.bincount(routing.topk_ids.flatten().long(), minlength=case.experts)  # host syncs, outside
    touched = int((counts > 0).sum())                                                      # every timing
    print(f"# {case.model} T={t}: {touched} experts touched, rows per expert max {int(counts.max())}, "
          f"{int(torch.ceil(counts / routing.block_m).sum())} tiles of {routing.block_m}", flush=True)
    per_layer = touched * sum(_expert_bytes(case))
    layers = 1 if device == "cpu" else min(MAX_LAYERS, max(1, math.ceil(L2_SWEEP * L2_BYTES / per_layer)))
    grouping = {} if row_group is None else {"row_group": row_group}
    # frag_scales: the fragment-order copies of the scales, as the engine prepares them; split_copy:
    # the decode tiles' split-word copy, as the engine holds it for 20b (variant "checkpoint-words": without)
    weights = [prepare_moe_weights(*_random_layer(case, device), frag_scales=True, split_copy=True, **grouping)
               for _ in range(layers)]
    return _Setup(
        case, x, rw, rb, logits, routing, weights, MoeWorkspace.allocate(t, weights[0], k, dt, device),
        act=torch.empty(t * k, case.inter, dtype=dt, device=device),
        y=torch.empty(t * k, c, dtype=torch.float32, device=device),
        out=torch.empty(t, c, dtype=dt, device=device),
        touched=touched,
    )  # fmt: skip


# Tile specs for both gemms: gemm2's own K step and register cap (MoeConfig.block_k2 / maxnreg2) unset.
BOTH_GEMMS = {"block_k2": 0, "maxnreg2": None}
GEMV = {"gemv": True, "block_n1": 16, "block_n2": 16, "block_k": 256, "split_k": 1}
F16_GEMV = {"gemv_mma": False, "block_n1": 16, "block_n2": 8, "block_k": 512, "block_k2": 0}
GROUP = {"group_mma": True, "block_m": 16, "block_n1": 32, "block_n2": 64, "block_k": 256, "num_warps": 4,
         "group_ahead": 2, "split_k": 1} | BOTH_GEMMS
VARIANTS = {  # MoeConfig switches on top of pick_config's choice
    # T=1: matrix-vector kernels, packed fp16; decode: packed-bf16 (inline asm) tiles; prefill: the
    # same asm with the weights as wgmma's register operand (swap_ab)
    "default": {},
    "fp32deq": {"use_dot_scaled": False, "asm_dequant": False},
    "dot_scaled": {"use_dot_scaled": True, "swap_ab": False},
    "unswapped": {"swap_ab": False, "asm_dequant": False},  # prefill until session 7: fp32 dequant, shared-memory B
    "swap-s1": {"num_stages": 1},  # no load pipelining, but ptxas does not serialise the wgmmas
    "swap-s2": {"num_stages": 2},
    "swap-m256": {"block_m": 256, "block_m1": 0},  # gemm1 in whole 256-row tiles too
    "swap-m128": {"block_m": 128, "block_m1": 0},  # session 7's first swapped default
    "swap-m64": {"block_m": 64, "block_m1": 0},
    # One warpgroup per program and half-height weight tiles: two programs per SM, so one
    # dequantises while the other's wgmmas run, with no barrier between them.
    "w4": {"num_warps": 4, "block_n1": 32, "block_n2": 64},
    # w4 with gemm1 on whole 256-row tiles: 254 registers, 2 programs per SM (offline sm_90). At
    # ~128 rows per expert (120b, T=4096) a 128-row slice dequantises each weight tile again for
    # the few rows past 128.
    "w4-m256": {"num_warps": 4, "block_n1": 32, "block_n2": 64, "block_m": 256, "block_m1": 0},
    "interleaved": {"even_odd": False},  # decode tiles: one dot over interleaved K (before session 7)
    "unfolded": {"fold_scales": False},  # the asm's two multiplies per pair (before session 7)
    # decode tiles on the checkpoint-order bytes, not MoeWeights' split-word copy (before session 38;
    # what the engine runs where it holds no copy, e.g. 120b on one H200)
    "checkpoint-words": {"split_words": False},
    "regs-free": {"maxnreg": 0} | BOTH_GEMMS,  # decode tiles without the register cap (before session 8)
    "byte-scales": {"scale_words": False},  # prefill tiles: scales as bytes, outside the cp.async ring (before session 11)
    # The scale words' unpack (MoeConfig.scale_unpack), the same in both gemms
    "scale-join": {"scale_unpack": "join", "scale_unpack2": ""},
    "scale-gather": {"scale_unpack": "gather", "scale_unpack2": ""},
    "scale-shift": {"scale_unpack": "shift", "scale_unpack2": ""},  # sessions 11-14
    # Both gemms on fragment-order scale words (MoeWeights.w1_scales_frag / w2_scales_frag)
    "scale-frag": {"scale_unpack": "frag", "scale_unpack2": "frag"},
    "masked-k": {"even_k": False},  # K masks in every step even where K is whole K steps (before session 15)
    "y-fp32": {"round_slots": False},  # prefill: gemm2's per-slot outputs in fp32 (before session 16)
    # MoeConfig.short_tiles / pair_tiles (prefill; before session 17: "long"): half-height bodies
    # for tiles (gemm1: slices) at most half full, and quarter-height ones (2)
    "short": {"short_tiles": 1, "pair_tiles": False},
    "short2": {"short_tiles": 2, "pair_tiles": False},
    "pairs": {"short_tiles": 2, "pair_tiles": True},  # gemm2: half + an eighth / a quarter, two dots
    "long": {"short_tiles": 0, "pair_tiles": False},
    # gemm1 on 256 weight rows (128 activation columns) per program: half the activation bytes per
    # FLOP from L2, 231 registers (no spills, offline sm_90), one program per SM. H200, 20b T=4096
    # (session 15, shifted scale words): gemm1 1,482 -> 1,853 us; ncu had L2 at 51 %, not the limit.
    "g1-n128": {"block_n1": 128},
    # T=1 before the matrix-vector kernels: 32-column tiles, K step 128, gemm2 split in 2
    "tiled": {"gemv": False, "gemv_f16": False, "block_n1": 32, "block_n2": 32, "block_k": 128, "split_k": 2},
    "gemv": GEMV,
    "gemv-fp32": {"gemv_mma": False, "gemv_f16": False},  # session 3's T=1 default: dequantise to fp32, then FMA
    # T=1 in packed fp16 for both gemvs (session 21's default), and variations of it
    "f16-old": F16_GEMV,
    "f16-k256": F16_GEMV | {"block_k": 256},
    "f16-n32": F16_GEMV | {"block_n1": 32},
    "f16-n2-16": F16_GEMV | {"block_n2": 16},  # session 4-5's gemm2 default
    "f16-n1-8": F16_GEMV | {"block_n1": 8},
    "fused-router": {"fused_router": True},  # logits inside the top-k kernel (moe_router.py)
    # gemv1 on the tensor cores (MoeConfig.gemv_mma, moe_gemv_mma.py; the default): block columns per
    # asm step = block_k / 32 / K splits, splits = 4 warps / pairs of 16-row tiles per program.
    "mma-n32": {"block_n1": 16, "block_k": 512},  # 1 pair: 4 splits x 4 columns
    "mma-k128": {"block_k": 128},  # 2 pairs: 2 splits x 2 columns
    "mma-both": {"block_n2": 32, "block_k2": 256},  # gemv2 on mma too: 1 pair, 4 splits x 2 columns
    "mma-both-k512": {"block_n2": 32, "block_k2": 512},  # gemv2 on mma, 4 splits x 4 columns, as gemv1's steps
    "mma-ahead1": {"gemv_ahead": 1},  # loads one K step before their mmas (session 22)
    # Decode tiles of up to 16 rows on the tensor cores fed from the packed words (MoeConfig.group_mma,
    # moe_group_mma.py): 64 gemm1 weight rows (2 pairs of tiles x 2 K splits) and 64 gemm2 columns
    # per program, 4 block columns per asm step, loads 2 K steps ahead.
    "group": GROUP,
    "group-ahead1": GROUP | {"group_ahead": 1},
    "group-k128": GROUP | {"block_k": 128},  # 2 block columns per asm step
    "group-n16": GROUP | {"block_n1": 16, "block_n2": 32},  # 1 pair of tiles x 4 K splits, 2 columns per step
    # Longer K steps in the decode tiles and gemv2: with grouped rows (MoeWeights.row_group) each
    # step's bytes are contiguous, so fewer, longer steps may keep more bytes in flight.
    "k128": {"block_k": 128} | BOTH_GEMMS,
    "k256": {"block_k": 256} | BOTH_GEMMS,
    "n32-k128": {"block_n1": 32, "block_n2": 32, "block_k": 128} | BOTH_GEMMS,
    "f16-n2-32": {"block_n2": 32},
    # Session 12's decode tiles: 4 warps, whose K steps load 1-2 scale bytes per thread, below
    # cp.async's minimum, so every step waited on them (from 4 rows per expert; 32-column ones below,
    # with split_k 2 at <= 1 row per expert).
    "s12-tiles": {"block_n1": 64, "block_n2": 64, "block_k": 64, "num_warps": 4, "maxnreg": 80, "split_k": 1}
    | BOTH_GEMMS,
    "s12-tiles32": {"block_n1": 32, "block_n2": 32, "block_k": 128, "num_warps": 4, "maxnreg": 96, "split_k": 1}
    | BOTH_GEMMS,
    # Other tile specs with >= 4 scale bytes per thread and step (session 13): one warp, or 4 warps
    # on twice the rows; and the default's gemm2 split in two along K.
    "t64w1": {"block_n1": 64, "block_n2": 128, "block_k": 64, "num_warps": 1, "maxnreg": 0, "split_k": 1} | BOTH_GEMMS,
    "t128w4": {"block_n1": 128, "block_n2": 256, "block_k": 64, "num_warps": 4, "maxnreg": 0, "split_k": 1}
    | BOTH_GEMMS,
    "split2": {"split_k": 2},
    "stages4": {"num_stages": 4},
    "r96": {"maxnreg": 96} | BOTH_GEMMS,  # 10 programs per SM instead of 9, a few spilled bytes (offline sm_90)
    # ncu (session 25): the T=64 tiles sit at 25 % theoretical occupancy, 8 programs per SM by
    # registers (105) and 9 by shared memory (3 stages, 12.8 KB); 2 stages and a cap of 80 allow 12.
    # Measured (session 25): 20b T=64 moe_forward 184.9 -> 251.1 us, engine batch 64 -25 %.
    "occ-s2-r80": {"num_stages": 2, "maxnreg": 80} | BOTH_GEMMS,
    # Both gemms' K step and register cap (block_k2 / maxnreg2 unset): K step 128 without a cap (141
    # registers: 7 programs per SM), and session 13's K step 64 under a cap of 128 everywhere.
    "k128-free": {"block_k": 128, "maxnreg": 0} | BOTH_GEMMS,
    "s13-tiles": {"block_m": 16, "block_k": 64, "maxnreg": 128} | BOTH_GEMMS,
    # Half the rows at K step 128: still 4 scale bytes per thread, 102 registers, 9 programs per SM.
    "t32k128": {"block_n1": 32, "block_n2": 64, "block_k": 128, "maxnreg": 0} | BOTH_GEMMS,
    # 32-row tiles (2 warps, no cap: 187 / 213 registers): at ~32 rows per expert each weight tile
    # is dequantised once instead of once per 16-row tile.
    "m32": {"block_m": 32, "block_k": 64, "maxnreg": 0} | BOTH_GEMMS,
    "m32-t32k128": {"block_m": 32, "block_n1": 32, "block_n2": 64, "block_k": 128, "maxnreg": 0} | BOTH_GEMMS,
}
# Which variants each token count runs (the GPU table; the CPU smoke run takes fp32deq only).
VARIANTS_BY_TOKENS = {
    1: ["default", "f16-old", "mma-n32", "mma-k128", "mma-both", "mma-both-k512", "mma-ahead1"],
    64: ["default", "checkpoint-words", "group", "group-ahead1", "group-k128", "group-n16", "s12-tiles", "t64w1",
         "t128w4", "unfolded", "interleaved", "fused-router", "fp32deq", "dot_scaled", "gemv"],
    4096: ["default", "scale-shift", "byte-scales", "w4", "unfolded", "swap-m128", "swap-m256", "unswapped"],
}


# Either regime's tiles (kernels.moe_config.regime_config) where pick_config takes the other one,
# e.g. the decode tiles past DECODE_MAX_ROWS_PER_EXPERT rows per expert, or where it takes the
# grouped tensor-core kernels (MoeConfig.group_mma).
REGIME_VARIANTS = {"decode-tiles": "decode", "prefill-tiles": "prefill"}


def _variant_config(case: Case, variant: str | dict):
    """pick_config's choice with a named variant's switches (or explicit fields) applied, or the
    named regime's tiles for this case."""
    from gptoss_cli.kernels.moe_config import pick_config, regime_config

    if isinstance(variant, str) and variant in REGIME_VARIANTS:
        return regime_config(REGIME_VARIANTS[variant], case.tokens, case.experts, case.top_k, frag_scales=True,
                             group=False)
    base = pick_config(case.tokens, case.experts, case.top_k, frag_scales=True)
    return dataclasses.replace(base, **(VARIANTS[variant] if isinstance(variant, str) else variant))


def _kernels(st: _Setup, variant):
    """(kernel, config, fn, layers per call, bytes, flops) for the matmul-based kernels of one variant."""
    from gptoss_cli.kernels.moe import (
        moe_forward,
        pick_config,
        runnable_config,
        uses_group_kernels,
    )
    from gptoss_cli.kernels.moe_gemv import moe_gemv1_swiglu, moe_gemv2
    from gptoss_cli.kernels.moe_group_mma import moe_group_gemm1_swiglu, moe_group_gemm2
    from gptoss_cli.kernels.moe_matmul import moe_gemm1_swiglu, moe_gemm2, slot_dtype

    case, r, ws = st.case, st.routing, st.weights
    base = pick_config(case.tokens, case.experts, case.top_k, frag_scales=True)
    # As moe_forward runs it: the tiles where a variant's grouped kernels cannot run here.
    cfg = runnable_config(_variant_config(case, variant), st.x.dtype, ws[0], case.tokens, case.top_k)
    same_tiles = cfg.block_m == base.block_m
    if not same_tiles:  # a variant with other tile heights needs its own tile table
        from gptoss_cli.kernels.moe_routing import route

        r = route(st.logits, case.top_k, cfg.block_m)
    slots, c, i, layers = case.tokens * case.top_k, case.hidden, case.inter, len(ws)
    w1_bytes, w2_bytes = (st.touched * b for b in _expert_bytes(case))
    x_bytes, act_bytes = case.tokens * c * 2, slots * i * 2
    gemm1_flops, gemm2_flops = 2 * slots * c * 2 * i, 2 * slots * i * c
    router_bytes, router_flops = case.experts * c * 2, 2 * case.tokens * c * case.experts

    y_dtype = slot_dtype(cfg, st.x.dtype)  # MoeConfig.round_slots
    y_out = st.y if cfg.split_k == 1 and y_dtype == st.y.dtype else \
        torch.empty(cfg.split_k * slots, c, dtype=y_dtype, device=st.y.device)

    group = uses_group_kernels(cfg)
    g2, logit_bytes = (moe_gemv2 if cfg.gemv else moe_group_gemm2 if group else moe_gemm2), 0
    if cfg.gemv:
        # With gemv_topk every gemv1 program takes its slot's top-k from the router logits, as
        # moe_forward runs it. Until session 19 this row left that prologue out, and 8-column
        # programs were 1.5 us faster in it while moe_forward was 1.1 us slower (not yet re-timed).
        logits = st.logits.float() if cfg.gemv_topk else None
        logit_bytes = logits.numel() * 4 if logits is not None else 0

        def gemm1():
            return [moe_gemv1_swiglu(st.x, r, w, 7.0, 1.702, cfg, out=st.act, logits=logits) for w in ws]
    else:
        g1 = moe_group_gemm1_swiglu if group else moe_gemm1_swiglu

        def gemm1():
            return [g1(st.x, r, w, 7.0, 1.702, cfg, out=st.act) for w in ws]

    def gemm2():
        return [g2(st.act, r, w, cfg, out=y_out) for w in ws]

    def forward():
        workspace = st.workspace if same_tiles else None
        return [moe_forward(st.x, st.router_weight, st.router_bias, w, case.top_k, workspace=workspace, config=cfg)
                for w in ws]  # fmt: skip

    return [
        ("gemm1+swiglu", cfg, gemm1, layers, w1_bytes + x_bytes + logit_bytes + act_bytes, gemm1_flops),
        ("gemm2", cfg, gemm2, layers, w2_bytes + act_bytes + y_out.numel() * y_out.element_size(), gemm2_flops),
        ("moe_forward", cfg, forward, layers, w1_bytes + w2_bytes + router_bytes + 2 * x_bytes,
         gemm1_flops + gemm2_flops + router_flops),
    ]  # fmt: skip


def _measure(case: Case, kernel: str, variant: str, cfg, fn, layers: int, nbytes: float, flops: float, device: str):
    try:
        return _row(case, kernel, variant, cfg.regime, _time_ms(fn, device) / layers, nbytes, flops)
    except Exception as exc:  # noqa: BLE001 - report and go on: one failing variant must not hide the others
        return {**_row(case, kernel, variant, cfg.regime, math.nan, nbytes, flops), "error": repr(exc)[:200]}


def _bench_case(case: Case, device: str, variants: list[str], row_group: int | None = None) -> list[dict]:
    from gptoss_cli.kernels.moe import pick_config
    from gptoss_cli.kernels.moe_matmul import moe_combine
    from gptoss_cli.kernels.moe_routing import route

    st = _setup(case, device, row_group)
    base = pick_config(case.tokens, case.experts, case.top_k, frag_scales=True)
    slots, c = case.tokens * case.top_k, case.hidden

    def routing():
        return route(st.logits, case.top_k, base.block_m, out=st.routing)

    def combine():
        return moe_combine(st.y, case.top_k, st.out.dtype, out=st.out)

    rows = [_measure(case, "route", "-", base, routing, 1, case.tokens * case.experts * 2 + slots * 16, 0, device)]
    if not variants:  # the GPU table: 20b compares variants, 120b runs the default (and its engine's T=64)
        # (120b's engine holds no split-word copy on one H200: its T=64 row without it too)
        variants = VARIANTS_BY_TOKENS[case.tokens] if case.model == "20b" else \
            ["default", "checkpoint-words"] if case.tokens == 64 else ["default"]
    for variant in variants:
        try:
            kernels = _kernels(st, variant)
        except ValueError as exc:  # a variant that does not apply to this case's tiles
            rows.append({**_row(case, "-", variant, "-", math.nan, 0, 0), "error": repr(exc)[:200]})
            continue
        rows += [_measure(case, name, variant, *rest, device) for name, *rest in kernels]
    combine_bytes = slots * c * 4 + case.tokens * c * 2
    rows.append(_measure(case, "combine", "-", base, combine, 1, combine_bytes, slots * c, device))
    return rows


def sweep(device: str = "cuda", smoke: bool = False) -> list[dict]:
    """20b decode cases (T = 1, 64): gemm1 and gemm2 over a grid of tile settings."""
    rows = []
    grid = [
        {"block_n1": n, "block_n2": n, "block_k": k, "num_warps": warps, "num_stages": 1 if smoke else 3}
        for n in (16, 32, 64) for k in (64, 128, 256) for warps in (4, 8)
    ]  # fmt: skip
    for case in SMOKE_CASES if smoke else [c for c in CASES if c.model == "20b" and c.tokens <= 64]:
        st = _setup(case, device)
        for fields in grid:
            label = "n{block_n1} k{block_k} w{num_warps} s{num_stages}".format(**fields)
            for name, *rest in _kernels(st, fields)[:2]:
                rows.append(_measure(case, name, label, *rest, device))
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows


def bench(device: str = "cuda", smoke: bool = False, tokens: list[int] | None = None,
          variants: list[str] | None = None, row_group: int | None = None) -> list[dict]:
    """One row per (case, kernel, variant); see _row for the fields. `smoke`: tiny shapes; `tokens`:
    only the cases with these token counts; `variants`: these instead of VARIANTS_BY_TOKENS;
    `row_group`: the weights' MoeWeights.row_group (None: prepare_moe_weights' default)."""
    if not variants:
        variants = ["fp32deq", "gemv"] if device == "cpu" else []  # [] = VARIANTS_BY_TOKENS
    rows = []
    cases = SMOKE_CASES if smoke else CASES
    if tokens and not smoke:  # any token count, not only the table's
        cases = [Case(m, e, 2880, 2880, 4, t) for m, e in MODELS for t in tokens]
    for case in cases:
        if tokens and case.tokens not in tokens:
            continue
        rows += _bench_case(case, device, variants, row_group)
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows


def print_table(rows: list[dict]) -> None:
    width = max([11] + [len(r["variant"]) + 1 for r in rows])
    head = (
        f"{'model':>5} {'T':>5} {'kernel':<13}{'variant':<{width}}{'regime':<8}{'time':>10} {'MB':>9} {'GFLOP':>9} "
        f"{'TB/s':>7} {'%bw':>5} {'TFLOP/s':>8} {'%mma':>5}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        line = (
            f"{r['model']:>5} {r['tokens']:>5} {r['kernel']:<13}{r['variant']:<{width}}{r['regime']:<8}"
            f"{r['ms'] * 1e3:>8.1f}us {r['bytes'] / 1e6:>9.2f} {r['flops'] / 1e9:>9.2f} "
            f"{r['tbps']:>7.2f} {r['pct_bw']:>5.0f} {r['tflops']:>8.1f} {r['pct_mma']:>5.0f}"
        )
        print(line + (f"  ERROR {r['error']}" if "error" in r else ""))
    print(f"\n%bw: of {COPY_TBPS} TB/s copy bandwidth; %mma: of {BF16_TFLOPS} TFLOP/s dense bf16.")
    print("Targets: moe_forward decode (T=1) >= 70 %bw; prefill (T=4096) >= 45 %mma.")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU under the Triton interpreter")
    parser.add_argument("--sweep", action="store_true", help="also sweep group-dot tile settings at decode")
    parser.add_argument("--tokens", type=int, nargs="+", help="only the cases with these token counts")
    parser.add_argument("--variants", nargs="+", choices=[*VARIANTS, *REGIME_VARIANTS],
                        help="these variants for every case")
    parser.add_argument("--row-group", type=int, help="MoeWeights.row_group of the weights (default: the kernels')")
    args = parser.parse_args()
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before the kernel modules are imported (inside bench)
    elif not torch.cuda.is_available():
        raise SystemExit("no CUDA GPU: run with --smoke for the CPU code path")
    device = "cpu" if args.smoke else "cuda"
    print_table(bench(device, smoke=args.smoke, tokens=args.tokens, variants=args.variants, row_group=args.row_group))
    if args.sweep:
        print()
        print_table(sweep(device, smoke=args.smoke))


if __name__ == "__main__":
    main()
