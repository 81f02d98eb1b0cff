"""Mixture of experts over packed MXFP4 weights (gpt-oss-model.md §2.5).

route: logits = x @ Wr^T + br; top-k of the logits, then softmax over those k.
expert e: h = x @ W1_e^T + b1_e (2I values, even = gate, odd = up, interleaved);
          a = min(gate, limit) * sigmoid(alpha * min(gate, limit)) * (clamp(up, -limit, limit) + 1);
          y_e = a @ W2_e^T + b2_e.
out = sum over the k chosen experts of w_e * y_e (the weight multiplies the bias too).
Dimension legend: T tokens, C hidden, E experts, K experts per token, I intermediate.

moe_forward is the GPU path: router matmul (torch; or inside the top-k launch: moe_router.py with
MoeConfig.fused_router at T x E <= 512, moe_router_tiles.py with MoeConfig.router_tiles above) ->
route (moe_routing.py) -> grouped gemm1 + SwiGLU -> grouped gemm2 + bias, routing-weight scaling ->
combine (moe_matmul.py; at about one row per expert the matrix-vector kernels of moe_gemv.py replace
the two grouped gemms). No step reads anything back to the host and all sizes depend on T only,
so a fixed-T forward is CUDA-graph safe.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.profiler import record_function

from . import moe_router, moe_router_tiles
from .moe_config import MoeConfig, pick_config, regime_config
from .moe_gemv import moe_gemv1_swiglu, moe_gemv2, pairs_fit
from .moe_group_mma import group_fits, moe_group_gemm1_swiglu, moe_group_gemm2
from .moe_matmul import (
    MoeWeights,
    moe_combine,
    moe_combine_norm,
    moe_gemm1_swiglu,
    moe_gemm2,
    prepare_moe_weights,
    slot_dtype,
)
from .moe_routing import MoeRouting, route
from .mxfp4 import dequantize_mxfp4
from .rmsnorm import rms_norm
from .skinny_linear import SkinnyScratch

__all__ = [
    "MoeConfig",
    "MoeWeights",
    "MoeWorkspace",
    "moe_forward",
    "moe_block",
    "moe_ref",
    "pick_config",
    "prepare_moe_weights",
    "route_ref",
    "swiglu_ref",
]


def router_logits(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """[T, C] -> [T, E] in x.dtype. One fused matmul + bias (as transformers' router computes it);
    `x @ W.T + b` launched a second kernel per layer for the add."""
    return torch.nn.functional.linear(x, weight.to(x.dtype), bias.to(x.dtype))


def route_ref(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, E] router logits -> (weights [T, K] fp32, expert ids [T, K] int64)."""
    values, idx = torch.topk(logits.float(), top_k, dim=-1)
    return torch.softmax(values, dim=-1), idx


def swiglu_ref(h: torch.Tensor, limit: float, alpha: float) -> torch.Tensor:
    """[..., 2I] interleaved gate/up -> [..., I] (fp32 math, h.dtype out)."""
    gate = h[..., 0::2].float().clamp(max=limit)
    up = h[..., 1::2].float().clamp(-limit, limit)
    return (gate * torch.sigmoid(alpha * gate) * (up + 1)).to(h.dtype)


def moe_ref(
    x: torch.Tensor,
    router_weight: torch.Tensor,
    router_bias: torch.Tensor,
    w1_blocks: torch.Tensor,
    w1_scales: torch.Tensor,
    w1_bias: torch.Tensor,
    w2_blocks: torch.Tensor,
    w2_scales: torch.Tensor,
    w2_bias: torch.Tensor,
    top_k: int,
    limit: float = 7.0,
    alpha: float = 1.702,
    expert_weights: Callable[[int], tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> torch.Tensor:
    """x [T, C] -> [T, C] in x.dtype. Experts are dequantised one at a time, only when hit,
    so peak memory is one expert (this is also the CPU path for real checkpoints).
    `expert_weights(e) -> (W1_e, W2_e)` in x.dtype may supply them instead (a cache)."""
    dt = x.dtype
    logits = router_logits(x, router_weight, router_bias)
    weights, experts = route_ref(logits, top_k)
    if expert_weights is None:
        expert_weights = lambda e: (dequantize_mxfp4(w1_blocks[e], w1_scales[e], dt),  # noqa: E731
                                    dequantize_mxfp4(w2_blocks[e], w2_scales[e], dt))
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in experts.unique().tolist():
        tok, slot = torch.where(experts == e)
        w1, w2 = expert_weights(e)
        h = x[tok] @ w1.T + w1_bias[e].to(dt)
        a = swiglu_ref(h, limit, alpha)
        y = a @ w2.T + w2_bias[e].to(dt)
        out.index_add_(0, tok, y.float() * weights[tok, slot, None])
    return out.to(dt)


# Steps of up to this many tokens (decode, where it was measured) take the next block's norm inside
# the combine (moe_block).
COMBINE_NORM_TOKENS = 64


@dataclass
class MoeWorkspace:
    """Preallocated intermediates of moe_forward for up to `max_tokens` tokens, so a captured
    graph allocates nothing but its output. Reuse it only for calls that run one after another."""

    max_tokens: int
    routing: MoeRouting  # sized for max_tokens with one-row tiles (the most tiles any block_m needs)
    act: torch.Tensor  # [max_tokens*K, I] activation dtype
    y: torch.Tensor  # [max_tokens*K, C] fp32
    router: moe_router.RouterScratch  # fused router (MoeConfig.fused_router)
    router_tiles: SkinnyScratch  # MoeConfig.router_tiles
    combine_arrivals: torch.Tensor  # [max_tokens] int32, zero between launches (MoeConfig.combine_block)

    @classmethod
    def allocate(
        cls, max_tokens: int, w: MoeWeights, top_k: int, dtype: torch.dtype, device: torch.device | str
    ) -> MoeWorkspace:
        slots = max_tokens * top_k
        return cls(
            max_tokens=max_tokens,
            routing=MoeRouting.allocate(max_tokens, w.num_experts, top_k, 1, device),
            act=torch.empty((slots, w.intermediate), dtype=dtype, device=device),
            y=torch.empty((slots, w.hidden), dtype=torch.float32, device=device),
            router=moe_router.RouterScratch.allocate(w.num_experts, device),
            router_tiles=moe_router_tiles.allocate_scratch(w.num_experts, w.hidden, device),
            combine_arrivals=torch.zeros(max_tokens, dtype=torch.int32, device=device),
        )

    def views(self, num_tokens: int, top_k: int, block_m: int, dtype: torch.dtype,
              y_dtype: torch.dtype = torch.float32):
        """(routing, act, y) buffers for one call; y of a narrower y_dtype (MoeConfig.round_slots)
        reuses the fp32 buffer's bytes."""
        if num_tokens > self.max_tokens or top_k != self.routing.top_k or dtype != self.act.dtype:
            raise ValueError(
                f"workspace holds {self.max_tokens} tokens, top_k {self.routing.top_k}, {self.act.dtype}; "
                f"called with {num_tokens} tokens, top_k {top_k}, {dtype}"
            )
        slots = num_tokens * top_k
        y = self.y[:slots] if y_dtype == self.y.dtype else \
            self.y.view(-1).view(y_dtype)[: slots * self.y.shape[1]].view(slots, self.y.shape[1])
        return self.routing.narrow(num_tokens, block_m), self.act[:slots], y


def _check_forward_args(x: torch.Tensor, router_weight: torch.Tensor, router_bias: torch.Tensor, w: MoeWeights) -> None:
    if x.dim() != 2 or x.shape[1] != w.hidden:
        raise ValueError(f"x must be [T, {w.hidden}], got {tuple(x.shape)}")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"x must be bf16, fp16 or fp32, got {x.dtype}")
    if tuple(router_weight.shape) != (w.num_experts, w.hidden) or tuple(router_bias.shape) != (w.num_experts,):
        raise ValueError(
            f"router weight/bias must be [{w.num_experts}, {w.hidden}]/[{w.num_experts}], "
            f"got {tuple(router_weight.shape)}/{tuple(router_bias.shape)}"
        )
    if x.device != w.w1_blocks.device:
        raise ValueError(f"x is on {x.device}, expert weights on {w.w1_blocks.device}")


def moe_forward(
    x: torch.Tensor,
    router_weight: torch.Tensor,
    router_bias: torch.Tensor,
    w: MoeWeights,
    top_k: int,
    limit: float = 7.0,
    alpha: float = 1.702,
    workspace: MoeWorkspace | None = None,
    *,
    config: MoeConfig | None = None,
) -> torch.Tensor:
    """x [T, C] -> [T, C] in x.dtype; the same function as moe_ref on the prepared weights.

    `config` forces a regime and tile sizes (default: pick_config from T).
    """
    y, cfg = _expert_outputs(x, router_weight, router_bias, w, top_k, limit, alpha, workspace, config)
    with record_function("moe.combine"):
        return moe_combine(y, top_k, x.dtype, splits=cfg.split_k)


def moe_block(
    x: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    next_norm_weight: torch.Tensor,
    eps: float,
    router_weight: torch.Tensor,
    router_bias: torch.Tensor,
    w: MoeWeights,
    top_k: int,
    limit: float = 7.0,
    alpha: float = 1.702,
    workspace: MoeWorkspace | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A whole MoE block and the next block's norm, as (normed input of the next block, residual):

        h, r = rms_norm(x, norm_weight, eps, residual)
        return rms_norm(moe_forward(h, ...), next_norm_weight, eps, r)

    In decode-sized steps (at most COMBINE_NORM_TOKENS tokens) the second norm runs inside the
    combine, one program per token over a whole row (or column blocks whose last arrival normalizes
    the row: MoeConfig.combine_block). H200, 20b batch 64 (session 25): the
    combine's 48 programs of 16 tokens x 256 columns and the separate norm took 8.0 + 2.4 us per
    layer, the one launch 4.8; step 6.160 -> 6.029 ms (120b: 19.198 -> 18.977 ms). Prompt steps
    keep the two launches: one launch there was not measurably different (TTFT of a 4k prompt
    63.4 against 64.2 ms). When the fused router runs (MoeConfig.fused_router), the first norm
    runs inside the router launch (two launches less per layer at batch 1); otherwise it is its own."""
    cfg = pick_config(x.shape[0], w.num_experts, top_k, w.has_frag_scales)
    x, residual = x.contiguous(), residual.contiguous()
    if _router_fused(cfg, x.shape[0]):
        pairs = torch.empty(x.shape, dtype=torch.float16, device=x.device) if pairs_fit(cfg, x, w) else None
        norm = moe_router.RouterNorm(residual, norm_weight, eps, torch.empty_like(x), torch.empty_like(x), pairs)
        y, cfg = _expert_outputs(x, router_weight, router_bias, w, top_k, limit, alpha, workspace, cfg, norm)
        residual = norm.residual_out
    else:
        h, residual = rms_norm(x, norm_weight, eps, residual)
        y, cfg = _expert_outputs(h, router_weight, router_bias, w, top_k, limit, alpha, workspace, cfg)
    if x.shape[0] > COMBINE_NORM_TOKENS:
        with record_function("moe.combine"):
            moe_out = moe_combine(y, top_k, x.dtype, splits=cfg.split_k)
        return rms_norm(moe_out, next_norm_weight, eps, residual)
    with record_function("moe.combine+norm"):
        return moe_combine_norm(y, top_k, residual, next_norm_weight, eps, splits=cfg.split_k, block=cfg.combine_block,
                                arrivals=workspace.combine_arrivals if workspace else None)


def runnable_config(cfg: MoeConfig, dtype: torch.dtype, w: MoeWeights, num_tokens: int, top_k: int) -> MoeConfig:
    """cfg, or where it asks for the grouped kernels (group_mma) and they cannot run here (no asm
    path: the interpreter, activations not bf16; weights not in 16-row groups), the decode tiles
    pick_config would choose without them."""
    if cfg.group_mma and not group_fits(cfg, dtype, w):
        return regime_config("decode", num_tokens, w.num_experts, top_k, w.has_frag_scales, group=False)
    return cfg


def uses_group_kernels(cfg: MoeConfig) -> bool:
    """Whether a runnable_config runs the grouped kernels (the gemv takes precedence)."""
    return cfg.group_mma and not cfg.gemv


def _router_fused(cfg: MoeConfig, num_tokens: int) -> bool:
    return cfg.fused_router and num_tokens <= moe_router.MAX_TOKENS


def _expert_outputs(x, router_weight, router_bias, w: MoeWeights, top_k: int, limit: float, alpha: float,
                    workspace: MoeWorkspace | None, config: MoeConfig | None,
                    norm: moe_router.RouterNorm | None = None) -> tuple[torch.Tensor, MoeConfig]:
    """Routing and both expert matmuls: (y [P*T*K, C] per slot, in slot order, fp32 or rounded to
    x's dtype (MoeConfig.round_slots); the config).
    With `norm` (fused router only) x is the block's input before its norm: the router launch
    writes the normalised rows to norm.out, which the expert matmuls then read."""
    _check_forward_args(x, router_weight, router_bias, w)
    if not 1 <= top_k <= w.num_experts:
        raise ValueError(f"top_k must be in [1, {w.num_experts}], got {top_k}")
    x = x.contiguous()
    num_tokens, dt = x.shape[0], x.dtype
    cfg = runnable_config(config or pick_config(num_tokens, w.num_experts, top_k, w.has_frag_scales), dt, w,
                          num_tokens, top_k)
    bufs = workspace.views(num_tokens, top_k, cfg.block_m, dt, slot_dtype(cfg, dt)) if workspace else (None, None, None)
    late_logits = None  # router logits whose top-k gemv1 takes (MoeConfig.gemv_topk)
    x_pairs = None  # the MoE input in fp16_pairs form (MoeConfig.gemv_pairs, from the router's norm)
    if _router_fused(cfg, num_tokens):
        scratch = workspace.router if workspace else moe_router.RouterScratch.allocate(w.num_experts, x.device)
        late_topk = cfg.gemv and cfg.gemv_topk
        with record_function("moe.router+route"):
            routing = moe_router.route_tokens(x, router_weight, router_bias, top_k, cfg.block_m, out=bufs[0],
                                              sort=not cfg.gemv, scratch=scratch, norm=norm, topk=not late_topk)
        late_logits = scratch.logits if late_topk else None
        x, x_pairs = (x, None) if norm is None else (norm.out, norm.pairs)
    elif cfg.router_tiles and num_tokens <= moe_router_tiles.MAX_TOKENS:
        with record_function("moe.router+route"):
            routing = moe_router_tiles.route_tiles(x, router_weight, router_bias, top_k, cfg.block_m, out=bufs[0],
                                                   sort=not cfg.gemv, scratch=workspace.router_tiles if workspace else None)
    else:
        with record_function("moe.router"):
            # The same function as moe_ref, so the logits (and the chosen experts) match bit for bit.
            logits = router_logits(x, router_weight, router_bias)
        with record_function("moe.route"):
            routing = route(logits, top_k, cfg.block_m, out=bufs[0], sort=not cfg.gemv)
    group = uses_group_kernels(cfg)
    gemm1 = moe_group_gemm1_swiglu if group else moe_gemm1_swiglu
    gemm2 = moe_gemv2 if cfg.gemv else moe_group_gemm2 if group else moe_gemm2
    with record_function("moe.w1+swiglu"):
        act_pairs = None if x_pairs is None else \
            torch.empty((num_tokens * top_k, w.intermediate), dtype=torch.float16, device=x.device)
        if cfg.gemv:
            act = moe_gemv1_swiglu(x, routing, w, limit, alpha, cfg, out=bufs[1], logits=late_logits, x_pairs=x_pairs,
                                   act_pairs=act_pairs)
        else:
            act = gemm1(x, routing, w, limit, alpha, cfg, out=bufs[1])
    with record_function("moe.w2"):
        # Split-K partial slabs do not fit the workspace's y; they are allocated (graph-safe).
        late = {"logits": late_logits} if cfg.gemv and cfg.gemv2_topk else {}
        if act_pairs is not None:
            late["act_pairs"] = act_pairs
        y = gemm2(act, routing, w, cfg, out=bufs[2] if cfg.split_k == 1 else None, **late)
    return y, cfg
