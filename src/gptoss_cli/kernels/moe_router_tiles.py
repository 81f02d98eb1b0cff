"""Router logits and top-k in one launch for steps of many tokens x experts (20b: 17-64 tokens;
120b: 5-64), where moe_router's one-token programs lose (session 26: 16-21 us at 64 tokens).

Until now those steps ran cuBLAS's split-K GEMM, its reduce launch and the top-k kernel: 8.3 us
per layer at 20b batch 64 on the H200 (docs/performance.md, session 25) for 184 KB of weights.
Here the product runs on the tensor cores as skinny_linear's does: a program owns one of the
routing's token blocks (moe_routing.token_block: its histogram row) and a range of K, computes
[experts, tokens] partial logits with skinny_dot, and the last program of each token block (arrival
counter, skinny_linear.reduce_splits) sums the partials in split order, adds the bias, rounds the
logits to the activation dtype as F.linear does and runs the routing's top-k/softmax for its
tokens. The expert-sorting launch (moe_routing.sort_slots) stays separate.

Twin: moe_routing.route(F.linear(x, W, b), ...). The summation order differs from cuBLAS, so a
logit can differ in its last bit, which changes the chosen experts only at exact ties after
rounding. The block's input norm stays its own launch: every program would need its tokens' whole
rows before its K range (rms_norm's rounding precedes the product).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .interpreter import dot_dtype, is_interpreted
from .moe_routing import MoeRouting, _topk_softmax_store, routing_buffers, sort_slots, token_block
from .pdl import pdl_enabled, pdl_launch, wait_for_previous
from .skinny_linear import MIN_BLOCK, SkinnyScratch, reduce_splits, skinny_dot, split_range

MAX_TOKENS = 64  # decode-sized steps (GpuEngineConfig.max_batch's default); above, cuBLAS reuses W well


@dataclass(frozen=True)
class RouterTiles:
    """Launch shape: K step, K steps per split, pipeline depth, warps. The default was the best
    compromise of bench_router's sweep (H200, session 28, us at 32 / 64 tokens): 20b 5.04 / 5.13
    (best 4.83 / 4.83 with one 256-column step per split), 120b 6.76 / 6.76 (best 6.55 / 6.65 with
    4 steps of 64); 2 steps of 128 per split took 5.18-5.21 / 6.80-6.86."""

    block_k: int = 128
    steps_per_split: int = 4
    num_stages: int = 3
    num_warps: int = 4


# The interpreter runs programs one after another: few programs, but still more than one split
# so that the CPU tests cover the reduction.
INTERPRETED_TILES = RouterTiles(block_k=64, steps_per_split=2, num_stages=1, num_warps=4)


def default_tiles() -> RouterTiles:
    return INTERPRETED_TILES if is_interpreted() else RouterTiles()


def _expert_block(num_experts: int) -> int:
    return max(MIN_BLOCK, triton.next_power_of_2(num_experts))


def _plan(num_tokens: int, num_experts: int, hidden: int, tiles: RouterTiles) -> tuple[int, int, int, int]:
    """(token block, token blocks, splits, K per split)."""
    block_t = token_block(num_tokens, num_experts)
    per_split = tiles.block_k * tiles.steps_per_split
    return block_t, triton.cdiv(num_tokens, block_t), triton.cdiv(hidden, per_split), per_split


def allocate_scratch(num_experts: int, hidden: int, device: torch.device | str,
                     tiles: RouterTiles | None = None) -> SkinnyScratch:
    """Partials and arrival counters for launches of up to MAX_TOKENS tokens."""
    tiles = tiles or default_tiles()
    # Up to 1,024 tokens the routing's token blocks are 16 tokens: MAX_TOKENS needs the most.
    block_t, blocks, splits, _ = _plan(MAX_TOKENS, num_experts, hidden, tiles)
    return SkinnyScratch.allocate(blocks * splits * _expert_block(num_experts) * block_t, blocks, device)


@triton.jit
def _router_tiles_kernel(
    x_ptr, stride_xt, w_ptr, stride_we, b_ptr, part_ptr, count_ptr, weights_ptr, ids_ptr, hist_ptr,
    num_tokens, num_experts, hidden, k_per_split,
    TOP_K: tl.constexpr, BLOCK_TOPK: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr, SPLITS: tl.constexpr, DOT: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Program (i, j): tokens BLOCK_T * i .., K split j; the last of token block i takes its top-k."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < num_tokens
    es = tl.arange(0, BLOCK_E)
    e_ok = es < num_experts
    out_dtype = x_ptr.dtype.element_ty
    bias = tl.load(b_ptr + es, mask=e_ok, other=0.0).to(out_dtype).to(tl.float32)
    wait_for_previous(PDL)
    k_lo, k_hi = split_range(hidden, k_per_split)
    # [experts, tokens]: the experts are the weight rows of skinny_dot's product.
    acc = skinny_dot(x_ptr, stride_xt, w_ptr, stride_we, tl.minimum(es, num_experts - 1),
                     tl.minimum(rows, num_tokens - 1), k_lo, k_hi, BLOCK_K, DOT)
    last, acc = reduce_splits(acc, part_ptr, count_ptr, SPLITS, BLOCK_E, BLOCK_T)
    if last:
        logits = tl.trans((acc + bias[:, None]).to(out_dtype).to(tl.float32))
        _topk_softmax_store(logits, tl.program_id(0), rows, row_ok, es, e_ok, weights_ptr, ids_ptr, hist_ptr,
                            num_experts, TOP_K, BLOCK_TOPK, BLOCK_T, BLOCK_E)


def route_tiles(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, top_k: int, block_m: int,
                out: MoeRouting | None = None, sort: bool = True, scratch: SkinnyScratch | None = None,
                tiles: RouterTiles | None = None) -> MoeRouting:
    """x [T, C] (T <= MAX_TOKENS) -> moe_routing.route(F.linear(x, weight, bias), top_k, block_m, out,
    sort) in one launch (two with `sort`). `scratch`: allocate_scratch's (each call allocates its own
    without it)."""
    num_tokens, hidden = x.shape
    num_experts = weight.shape[0]
    if not 1 <= num_tokens <= MAX_TOKENS:
        raise ValueError(f"route_tiles is for 1..{MAX_TOKENS} tokens, got {num_tokens}")
    if weight.shape != (num_experts, hidden) or bias.shape != (num_experts,):
        raise ValueError(f"router weight {tuple(weight.shape)} / bias {tuple(bias.shape)} do not match x {tuple(x.shape)}")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("x and the router weight must be contiguous along the hidden dimension")
    tiles = tiles or default_tiles()
    weight = weight.to(x.dtype)  # F.linear's cast (the engine's router weights are already x's dtype)
    block_t, blocks, splits, per_split = _plan(num_tokens, num_experts, hidden, tiles)
    block_e = _expert_block(num_experts)
    if scratch is None:
        scratch = allocate_scratch(num_experts, hidden, x.device, tiles)
    scratch.check(blocks, splits, block_e, block_t)
    out = routing_buffers(out, num_tokens, num_experts, top_k, block_m, x.device)
    _router_tiles_kernel[(blocks, splits)](
        x, x.stride(0), weight, weight.stride(0), bias, scratch.partials, scratch.arrivals, out.topk_weights,
        out.topk_ids, out.block_hist, num_tokens, num_experts, hidden, per_split,
        TOP_K=top_k, BLOCK_TOPK=triton.next_power_of_2(top_k), BLOCK_T=block_t, BLOCK_E=block_e,
        BLOCK_K=tiles.block_k, SPLITS=splits, DOT=dot_dtype(x.dtype), num_warps=tiles.num_warps,
        num_stages=tiles.num_stages, **pdl_launch(pdl_enabled(x)),
    )  # fmt: skip
    if sort:
        sort_slots(out, block_t, 4)
    return out
