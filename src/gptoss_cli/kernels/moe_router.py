"""Router logits and top-k in one launch, for decode-sized steps (up to MAX_TOKENS tokens).

At batch 1 the router is a [1, 2880] x [2880, 32] product (184 KB of weights): cuBLAS runs it as a
split-K GEMM plus a reduce kernel, ~6 us per layer on the H200, and the top-k kernel then reads the
logits back (~1.7 us). A first version here computed the logits and the top-k in one program: one
SM streaming 184 KB took 10 us (session 5, docs/optimizations.md). So the experts are spread over
programs (GROUP_E each, all hidden columns in one or a few wide loads), each writes its logits to
a scratch row and counts its arrival on an atomic counter; the last program to arrive runs the
top-k/softmax of moe_routing over all experts and resets the counter for the next launch (and the
next graph replay).

From 2 tokens the programs also split the tokens, TOKENS_PER_PROGRAM each (a second grid
dimension), so that each program's row is one load; the last program to arrive takes the top-k of
every token. The launch count grows with tokens x experts, so larger steps (pick_config:
moe_config.FUSED_ROUTER_SLOTS) keep cuBLAS's split-K GEMM, its reduce, the top-k kernel and a
separate rms_norm launch (10.7 us per layer at 20b batch 64 on the H200, session 25), which reuse
each weight row over the tokens.

The MoE block's input norm can run here too (`RouterNorm`): every program needs the whole
normalised rows of its tokens for its dot products anyway, and writes its slice of them and of
the residual stream, which saves the rms_norm launch.

The logits are rounded to the activation dtype as F.linear does (fp32 sum, bias added in fp32, one
rounding). The summation order differs from cuBLAS, so a logit can differ in its last bit, which
changes the chosen experts only at exact ties after rounding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .interpreter import is_interpreted
from .moe_gemv_mma import pairs_order
from .moe_routing import (
    MoeRouting,
    _topk_softmax_store,
    routing_buffers,
    sort_slots,
    token_block,
)
from .pdl import pdl_enabled, pdl_launch, wait_for_previous

# Above this many tokens the logits go through F.linear and moe_routing.route (there cuBLAS
# reuses each weight row over the tokens; here every token is a row of a register tile). 64: the
# engine's largest decode step (GpuEngineConfig.max_batch's default). pick_config decides where
# the fused router runs (moe_config.FUSED_ROUTER_SLOTS).
MAX_TOKENS = 64
# Rows of the activations a program streams. One: a program's whole row fits one step (ONE_STEP),
# so its loads are one round trip; with 8 (session 25) each program looped over column steps,
# twice with the norm, and took 7-9 us at 2-4 tokens against 4.5-5.1 (bench_router, session 26).
TOKENS_PER_PROGRAM = 1
# The interpreter runs programs one after another at a fixed cost each: 8 tokens per program keep
# the CPU engine's steps (random:tiny routes up to 64 tokens here) at a few programs per layer.
INTERPRETED_TOKENS_PER_PROGRAM = 8
GROUP_E = 2  # experts per program: 16 programs for 20b, 64 for 120b
NUM_WARPS = 8
PRODUCT_ELEMS = 8192  # elements of one [tokens, experts, columns] product step


@dataclass
class RouterScratch:
    """Per-launch scratch: the logits [MAX_TOKENS, E] fp32 and the arrival counter, which is zero
    between launches (the last program resets it). Launches that share it must not overlap."""

    logits: torch.Tensor
    arrivals: torch.Tensor

    @classmethod
    def allocate(cls, num_experts: int, device: torch.device | str) -> RouterScratch:
        return cls(torch.empty((MAX_TOKENS, num_experts), dtype=torch.float32, device=device),
                   torch.zeros(1, dtype=torch.int32, device=device))


@triton.jit
def _residual_sum(x_ptr, stride_xt, res_ptr, stride_rt, rows, cols, mask, NORM: tl.constexpr):
    """fp32 [BLOCK_T, BLOCK_C] tile of x, or with NORM of x + residual rounded to x's dtype (the
    residual stream as rms_norm stores it)."""
    x = tl.load(x_ptr + rows[:, None] * stride_xt + cols[None, :], mask=mask, other=0.0)
    if NORM:
        r = tl.load(res_ptr + rows[:, None] * stride_rt + cols[None, :], mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
    return x.to(tl.float32)


@triton.jit
def _normed_slice(h, rstd, nw_ptr, y_ptr, h_ptr, rows, c0, cs, c_ok, mask, hidden, pid, out_dtype: tl.constexpr,
                  yp_ptr=None):
    """y = h * rstd * nw rounded to the activation dtype (rms_norm's output) for columns c0 + cs;
    stores this program's slice of y and of h (the rows' residual stream) and returns y in fp32.
    Mirrors rmsnorm.normalize_rows, whose arithmetic it must repeat. yp_ptr: y in fp16_pairs form
    too (RouterNorm.pairs). A program's slice is whole groups of 8 columns: with the slice's first
    column a known multiple of 8 the masks are constant over 8 columns, so all three stores are
    16-byte vectors (the pairs in pairs_order)."""
    nw = tl.load(nw_ptr + c0 + cs, mask=c_ok, other=0.0).to(tl.float32)
    y = (h * rstd[:, None] * nw[None, :]).to(out_dtype)
    per = tl.cdiv(tl.cdiv(hidden, 8), tl.num_programs(0)) * 8
    lo = pid * per
    cols = c0 + cs
    mine = mask & ((cols >= lo) & (cols < lo + per))[None, :]
    dst = rows[:, None] * hidden + cols[None, :]
    tl.store(h_ptr + dst, h.to(out_dtype), mask=mine)
    tl.store(y_ptr + dst, y, mask=mine)
    if yp_ptr is not None:
        tl.store(yp_ptr + dst, pairs_order(y.to(tl.float16)), mask=mine)
    return y.to(tl.float32)


@triton.jit
def _router_split_kernel(
    x_ptr, stride_xt, w_ptr, stride_we, b_ptr, logits_ptr, arrivals_ptr, weights_ptr, ids_ptr, hist_ptr,
    num_tokens, num_experts, hidden,
    res_ptr, stride_rt, nw_ptr, eps, y_ptr, h_ptr,
    TOP_K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
    GROUP_E: tl.constexpr, BLOCK_C: tl.constexpr, NORM: tl.constexpr, ONE_STEP: tl.constexpr,
    PDL: tl.constexpr, TOPK: tl.constexpr = True, BLOCK_TA: tl.constexpr = 1, yp_ptr=None,
):  # fmt: skip
    """Program (i, j): experts GROUP_E * i .., tokens BLOCK_T * j ..; the last to arrive takes the
    top-k of all tokens, BLOCK_TA rows (one histogram row) at a time."""
    pid = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < num_tokens
    es = pid * GROUP_E + tl.arange(0, GROUP_E)
    e_ok = es < num_experts
    cs = tl.arange(0, BLOCK_C)
    out_dtype = x_ptr.dtype.element_ty
    bias = tl.load(b_ptr + es, mask=e_ok, other=0.0).to(out_dtype).to(tl.float32)
    if ONE_STEP:
        # The whole row in one step (batch 1): the weight load is issued first (before the wait
        # under PDL), so its latency overlaps the previous launch's tail and the norm's loads.
        c_ok = cs < hidden
        w = tl.load(w_ptr + es[:, None] * stride_we + cs[None, :], mask=e_ok[:, None] & c_ok[None, :],
                    other=0.0).to(out_dtype).to(tl.float32)
        wait_for_previous(PDL)
        mask = row_ok[:, None] & c_ok[None, :]
        x = _residual_sum(x_ptr, stride_xt, res_ptr, stride_rt, rows, cs, mask, NORM)
        if NORM:
            rstd = tl.rsqrt(tl.sum(x * x, 1) / hidden + eps)
            x = _normed_slice(x, rstd, nw_ptr, y_ptr, h_ptr, rows, 0, cs, c_ok, mask, hidden, pid, out_dtype, yp_ptr)
        acc = tl.sum(x[:, None, :] * w[None, :, :], axis=2)
    else:
        wait_for_previous(PDL)
        if NORM:
            # rms_norm(x, nw, eps, residual) first: every program needs the whole normalised row.
            sq = tl.zeros((BLOCK_T,), dtype=tl.float32)
            for c0 in range(0, hidden, BLOCK_C):
                mask = row_ok[:, None] & (c0 + cs < hidden)[None, :]
                h = _residual_sum(x_ptr, stride_xt, res_ptr, stride_rt, rows, c0 + cs, mask, NORM)
                sq += tl.sum(h * h, 1)
            rstd = tl.rsqrt(sq / hidden + eps)
        acc = tl.zeros((BLOCK_T, GROUP_E), dtype=tl.float32)
        for c0 in range(0, hidden, BLOCK_C):
            c_ok = c0 + cs < hidden
            mask = row_ok[:, None] & c_ok[None, :]
            x = _residual_sum(x_ptr, stride_xt, res_ptr, stride_rt, rows, c0 + cs, mask, NORM)
            if NORM:
                x = _normed_slice(x, rstd, nw_ptr, y_ptr, h_ptr, rows, c0, cs, c_ok, mask, hidden, pid, out_dtype,
                                  yp_ptr)
            # F.linear casts the weight to the activation dtype first: so do we.
            w = tl.load(w_ptr + es[:, None] * stride_we + c0 + cs[None, :], mask=e_ok[:, None] & c_ok[None, :],
                        other=0.0).to(out_dtype).to(tl.float32)
            acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
    logits = (acc + bias[None, :]).to(out_dtype).to(tl.float32)
    tl.store(logits_ptr + rows[:, None] * num_experts + es[None, :], logits, mask=row_ok[:, None] & e_ok[None, :])
    if not TOPK:
        return  # the next launch takes the top-k from the logits (moe_gemv's gemv1)
    # Every thread's stores precede the arrival (barrier), which releases them at GPU scope; the
    # last program's acquire then sees all rows. Its loads bypass L1 (.cg), which may hold the
    # previous layer's rows of the same scratch.
    tl.debug_barrier()
    arrived = tl.atomic_add(arrivals_ptr, 1, sem="acq_rel", scope="gpu")
    if arrived == tl.num_programs(0) * tl.num_programs(1) - 1:
        cols = tl.arange(0, BLOCK_E)
        col_ok = cols < num_experts
        for c0 in range(0, num_tokens, BLOCK_TA):
            every_row = c0 + tl.arange(0, BLOCK_TA)
            every_ok = every_row < num_tokens
            every = tl.load(logits_ptr + every_row[:, None] * num_experts + cols[None, :],
                            mask=every_ok[:, None] & col_ok[None, :], other=0.0, cache_modifier=".cg")
            _topk_softmax_store(every, c0 // BLOCK_TA, every_row, every_ok, cols, col_ok, weights_ptr, ids_ptr,
                                hist_ptr, num_experts, TOP_K, BLOCK_K, BLOCK_TA, BLOCK_E)
        tl.atomic_xchg(arrivals_ptr, 0, sem="relaxed", scope="gpu")


@dataclass
class RouterNorm:
    """rms_norm(x, weight, eps, residual) done inside route_tokens: the normalised rows go to `out`
    (the MoE input) and x + residual to `residual_out` ([T, C] contiguous, x.dtype); with `pairs`
    (contiguous fp16 [T, C]) the normalised rows in fp16_pairs form too (MoeConfig.gemv_pairs)."""

    residual: torch.Tensor
    weight: torch.Tensor
    eps: float
    out: torch.Tensor
    residual_out: torch.Tensor
    pairs: torch.Tensor | None = None


def launch_blocks(num_tokens: int, num_experts: int, hidden: int, group_e: int = GROUP_E,
                  per_program: int | None = None) -> tuple[int, int, int]:
    """(tokens per program, tokens per step of the last program's top-k, columns per product step)
    of a launch. Tokens per program: at most `per_program` (default TOKENS_PER_PROGRAM,
    INTERPRETED_TOKENS_PER_PROGRAM under the interpreter); the top-k goes by the routing's own
    token blocks (one histogram row each), at most all tokens. The launch takes its one-load path
    (ONE_STEP) when the column step covers `hidden`."""
    if per_program is None:
        per_program = INTERPRETED_TOKENS_PER_PROGRAM if is_interpreted() else TOKENS_PER_PROGRAM
    rows = triton.next_power_of_2(num_tokens)
    block_t = min(rows, per_program)
    block_c = min(triton.next_power_of_2(hidden), PRODUCT_ELEMS // (block_t * group_e))
    return block_t, min(rows, token_block(num_tokens, num_experts)), block_c


def route_tokens(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, top_k: int, block_m: int,
                 out: MoeRouting | None = None, sort: bool = True, scratch: RouterScratch | None = None,
                 norm: RouterNorm | None = None, group_e: int = GROUP_E, num_warps: int = NUM_WARPS,
                 topk: bool = True, tokens_per_program: int | None = None) -> MoeRouting:
    """x [T, C] -> moe_routing.route(router_logits(x, weight, bias), top_k, block_m, out, sort), with
    the logits computed across programs of the top-k launch (T <= MAX_TOKENS). With `norm`, the
    router input is rms_norm(x, norm.weight, norm.eps, norm.residual), also written to norm.out.
    `group_e` (experts per program, a power of two), `num_warps` and `tokens_per_program` (a
    power of two; default: launch_blocks') are launch choices (benchmarks/bench_router.py sweeps
    them). topk=False: only
    the logits (scratch.logits, fp32, rounded as F.linear's) and the norm; the routing's tensors
    are left for the next launch to fill (moe_gemv1_swiglu with `logits`), and `sort` must be
    False."""
    num_tokens, hidden = x.shape
    num_experts = weight.shape[0]
    if num_tokens > MAX_TOKENS:
        raise ValueError(f"route_tokens is for at most {MAX_TOKENS} tokens, got {num_tokens}")
    if weight.shape != (num_experts, hidden) or bias.shape != (num_experts,):
        raise ValueError(f"router weight {tuple(weight.shape)} / bias {tuple(bias.shape)} do not match x {tuple(x.shape)}")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("x and the router weight must be contiguous along the hidden dimension")
    if norm is not None:
        for name in ("residual", "out", "residual_out"):
            t = getattr(norm, name)
            if t.shape != x.shape or t.dtype != x.dtype or t.stride(1) != 1 or t.device != x.device:
                raise ValueError(f"norm.{name} must be a {x.dtype} [T, C] tensor like x, got {t.dtype} {tuple(t.shape)}")
        if not (norm.out.is_contiguous() and norm.residual_out.is_contiguous()) or norm.weight.shape != (hidden,):
            raise ValueError("norm.out / norm.residual_out must be contiguous and norm.weight [C]")
        if norm.pairs is not None and (norm.pairs.shape != x.shape or norm.pairs.dtype != torch.float16
                                       or not norm.pairs.is_contiguous() or hidden % 8):
            raise ValueError("norm.pairs must be a contiguous fp16 [T, C] tensor, C a multiple of 8")
        inputs = {x.data_ptr(), norm.residual.data_ptr()}
        if norm.out.data_ptr() in inputs or norm.residual_out.data_ptr() in inputs:
            raise ValueError("norm.out / norm.residual_out must not alias x or the residual (other programs read them)")
    if not topk and sort:
        raise ValueError("route_tokens(topk=False) leaves the top-k to the next launch: nothing to sort")
    out = routing_buffers(out, num_tokens, num_experts, top_k, block_m, x.device)
    scratch = scratch or RouterScratch.allocate(num_experts, x.device)
    if scratch.logits.shape[1] != num_experts or scratch.logits.device != x.device:
        raise ValueError(f"router scratch is for {scratch.logits.shape[1]} experts on {scratch.logits.device}")
    if num_tokens == 0:
        return out
    block_t, block_ta, block_c = launch_blocks(num_tokens, num_experts, hidden, group_e, tokens_per_program)
    n = norm or RouterNorm(x, bias, 0.0, x, x)  # placeholders: NORM=False reads none of them
    _router_split_kernel[(triton.cdiv(num_experts, group_e), triton.cdiv(num_tokens, block_t))](
        x, x.stride(0), weight, weight.stride(0), bias, scratch.logits, scratch.arrivals, out.topk_weights,
        out.topk_ids, out.block_hist, num_tokens, num_experts, hidden,
        n.residual, n.residual.stride(0), n.weight, float(n.eps), n.out, n.residual_out,
        TOP_K=top_k, BLOCK_K=triton.next_power_of_2(top_k), BLOCK_T=block_t,
        BLOCK_E=triton.next_power_of_2(num_experts), GROUP_E=group_e, BLOCK_C=block_c, NORM=norm is not None,
        ONE_STEP=block_c >= hidden, TOPK=topk, BLOCK_TA=block_ta, yp_ptr=norm.pairs if norm else None,
        num_warps=num_warps, **pdl_launch(pdl_enabled(x)),
    )  # fmt: skip
    if sort:
        sort_slots(out, block_ta, 4)
    return out
