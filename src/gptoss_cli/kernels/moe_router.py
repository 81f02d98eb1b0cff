"""Router logits and top-k in one kernel, for a few tokens (decode).

At batch 1 the router is a [1, 2880] x [2880, 32] product (184 KB of weights), and cuBLAS runs it
as a split-K GEMM plus a reduce kernel, about 8 us per layer on the H200 (docs/optimizations.md);
the top-k kernel then reads the logits back. Here one program per token block computes its
logits with tl.dot, rounds them to the activation dtype as F.linear does (fp32 sum, bias added in
fp32, one rounding), and runs the same top-k/softmax code as moe_routing.route. Different
summation order than cuBLAS: the logits can differ in the last bit, which changes the chosen
experts only at exact ties after rounding.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .moe_matmul import _dot_dtype, _dot_precision
from .moe_routing import (
    MoeRouting,
    _topk_softmax_store,
    routing_buffers,
    sort_slots,
    token_block,
)

# Above this many tokens the logits go through F.linear and moe_routing.route (prefill: the
# router is a small share of the step and cuBLAS is efficient there).
MAX_TOKENS = 64
BLOCK_C = 256  # hidden columns per K step


@triton.jit
def _router_topk_kernel(
    x_ptr, stride_xt, w_ptr, stride_we, b_ptr, weights_ptr, ids_ptr, hist_ptr, num_tokens, num_experts, hidden,
    TOP_K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
    BLOCK_C: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    rows = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    cs = tl.arange(0, BLOCK_C)
    row_ok = rows < num_tokens
    col_ok = cols < num_experts
    out_dtype = x_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.float32)
    for c0 in range(0, hidden, BLOCK_C):
        c_ok = c0 + cs < hidden
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xt + c0 + cs[None, :],
                    mask=row_ok[:, None] & c_ok[None, :], other=0.0)
        # F.linear casts the weight to the activation dtype first: so do we.
        w = tl.load(w_ptr + cols[:, None] * stride_we + c0 + cs[None, :], mask=col_ok[:, None] & c_ok[None, :],
                    other=0.0).to(out_dtype)
        acc = tl.dot(x.to(DOT_DTYPE), tl.trans(w.to(DOT_DTYPE)), acc, input_precision=DOT_PRECISION)
    bias = tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(out_dtype).to(tl.float32)
    logits = (acc + bias[None, :]).to(out_dtype).to(tl.float32)
    _topk_softmax_store(logits, pid, rows, row_ok, cols, col_ok, weights_ptr, ids_ptr, hist_ptr, num_experts,
                        TOP_K, BLOCK_K, BLOCK_T, BLOCK_E)


def route_tokens(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, top_k: int, block_m: int,
                 out: MoeRouting | None = None, sort: bool = True) -> MoeRouting:
    """x [T, C] -> moe_routing.route(router_logits(x, weight, bias), top_k, block_m, out, sort), with the
    logits computed inside the top-k kernel (T <= MAX_TOKENS)."""
    num_tokens, hidden = x.shape
    num_experts = weight.shape[0]
    if num_tokens > MAX_TOKENS:
        raise ValueError(f"route_tokens is for at most {MAX_TOKENS} tokens, got {num_tokens}")
    if weight.shape != (num_experts, hidden) or bias.shape != (num_experts,):
        raise ValueError(f"router weight {tuple(weight.shape)} / bias {tuple(bias.shape)} do not match x {tuple(x.shape)}")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("x and the router weight must be contiguous along the hidden dimension")
    out = routing_buffers(out, num_tokens, num_experts, top_k, block_m, x.device)
    if num_tokens == 0:
        return out
    block_t = token_block(num_tokens, num_experts)
    block_e = max(16, triton.next_power_of_2(num_experts))  # tl.dot needs N >= 16
    num_warps = 4 if block_t * block_e <= 2048 else 8
    _router_topk_kernel[(triton.cdiv(num_tokens, block_t),)](
        x, x.stride(0), weight, weight.stride(0), bias, out.topk_weights, out.topk_ids, out.block_hist,
        num_tokens, num_experts, hidden, TOP_K=top_k, BLOCK_K=triton.next_power_of_2(top_k), BLOCK_T=block_t,
        BLOCK_E=block_e, BLOCK_C=BLOCK_C, DOT_DTYPE=_dot_dtype(x.dtype), DOT_PRECISION=_dot_precision(x.dtype),
        num_warps=num_warps,
    )  # fmt: skip
    if sort:
        sort_slots(out, block_t, num_warps)
    return out
