"""The gpt-oss forward pass on the Triton kernels, over a flat batch of tokens and the paged cache.

One `ForwardBatch` describes a step: the tokens, their positions and cache slots, and either
decode metadata (one token per sequence, keys all in the cache) or prefill metadata (packed
chunks that also see earlier context from the cache). No host synchronisation happens here, so
a decode step can be captured in a CUDA graph. Dimension legend: T tokens, B sequences, C
hidden, H query heads, Hkv KV heads, D head dim, R rows that need logits.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ...kernels import (MoeWorkspace, SkinnyScratch, apply_rope_qkv, decode_attention, kv_store, moe_block, moe_forward,
                        prefill_attention, qkv_rope_store, qkv_rope_store_tokens, rms_norm, rope_cos_sin, row_linear,
                        skinny_linear, supports_qkv_rope_tokens, supports_row_linear, supports_skinny_linear)
from ...kernels.skinny_linear import SkinnyTiles, default_tiles
from .kv_cache import KvCache
from .weights import GpuWeights, LayerWeights


@dataclass
class ForwardBatch:
    tokens: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    full_slots: torch.Tensor  # [T] int64, flat cache slot per token (full-attention pool)
    slide_slots: torch.Tensor  # [T] int64 (sliding pool)
    full_tables: torch.Tensor  # [B, max_blocks] int32
    slide_tables: torch.Tensor  # [B, max_blocks] int32
    logits_rows: torch.Tensor | None  # [R] int64 rows of T needing logits; None = all rows
    decode: bool
    seq_lens: torch.Tensor | None = None  # decode: [B] int32, keys per sequence incl. the new one
    num_splits: tuple[int, int] = (1, 1)  # decode: split-K for (full, sliding) layers
    cu_seqlens: torch.Tensor | None = None  # prefill: [B+1] int32
    ctx_lens: torch.Tensor | None = None  # prefill: [B] int32, cached tokens before each chunk
    max_seqlen_q: int = 0
    max_ctx_len: int = 0


@dataclass(frozen=True)
class SkinnyPlan:
    """Which projections of 2 or more tokens run in kernels.skinny_linear rather than cuBLAS
    (GpuEngineConfig's skinny_* fields say why): up to `tokens` tokens (o-proj, and the qkv of
    short prompt chunks), decode qkv with RoPE and the K/V store up to `qkv_tokens`, in one K split
    from `qkv_unsplit_from` tokens (0: split as skinny_linear plans)."""

    tokens: int = 0
    qkv_tokens: int = 0
    qkv_unsplit_from: int = 0

    def qkv_tiles(self, num_tokens: int) -> SkinnyTiles:
        tiles = default_tiles()
        unsplit = 0 < self.qkv_unsplit_from <= num_tokens
        return dataclasses.replace(tiles, splits=1) if unsplit else tiles


class GpuModel:
    def __init__(self, weights: GpuWeights, kv: KvCache, max_positions: int, max_step_tokens: int,
                 use_row_linear: bool = True, fused_qkv_rope: bool = False, skinny: SkinnyPlan = SkinnyPlan()):
        self.w = weights
        self.use_row_linear = use_row_linear
        self.fused_qkv_rope = use_row_linear and fused_qkv_rope
        self.cfg = cfg = weights.config
        self.skinny = skinny
        self.skinny_qkv_rope = fused_qkv_rope and supports_qkv_rope_tokens(cfg.head_dim)
        self.kv = kv
        device = weights.embed.device
        self.cos, self.sin = rope_cos_sin(cfg, max_positions, device)
        self.moe_workspace = MoeWorkspace.allocate(max_step_tokens, weights.layers[0].experts,
                                                   cfg.num_experts_per_tok, weights.embed.dtype, device)
        layer = weights.layers[0]
        self.skinny_scratch = SkinnyScratch.for_shapes([tuple(layer.qkv_w.shape), tuple(layer.o_w.shape)], device)

    def forward(self, b: ForwardBatch) -> torch.Tensor:
        """Logits [R, V] (activation dtype) for the requested rows."""
        cfg = self.cfg
        eps, layers = cfg.rms_norm_eps, self.w.layers
        h, residual = rms_norm(self.w.embed, layers[0].attn_norm, eps, row_ids=b.tokens)  # embedding + norm
        for n, layer in enumerate(layers):
            x = self._attention(n, layer, h, b)
            moe = (layer.router_w, layer.router_b, layer.experts, cfg.num_experts_per_tok, cfg.swiglu_limit,
                   cfg.swiglu_alpha, self.moe_workspace)
            if n + 1 == len(layers) and b.logits_rows is not None:
                # Prompt chunks: only the rows that need logits go through the final norm.
                h, residual = rms_norm(x, layer.mlp_norm, eps, residual)
                x = moe_forward(h, *moe)
                h, _ = rms_norm(x[b.logits_rows], self.w.final_norm, eps, residual[b.logits_rows])
            else:
                # The block's norm and the next block's (the final norm after the last layer) are
                # fused into the MoE launches for decode-sized steps (kernels.moe.moe_block).
                norm = self.w.final_norm if n + 1 == len(layers) else layers[n + 1].attn_norm
                h, residual = moe_block(x, residual, layer.mlp_norm, norm, eps, *moe)
        return h @ self.w.lm_head.T

    def _attention(self, n: int, layer: LayerWeights, h: torch.Tensor, b: ForwardBatch) -> torch.Tensor:
        cfg = self.cfg
        t = h.shape[0]
        sliding = layer.window > 0
        kc, vc = self.kv.k[n], self.kv.v[n]
        slots = b.slide_slots if sliding else b.full_slots
        tables = b.slide_tables if sliding else b.full_tables
        heads = (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)
        if b.decode and self.fused_qkv_rope and supports_row_linear(h, layer.qkv_w):
            qkv = qkv_rope_store(h, layer.qkv_w, layer.qkv_b, b.positions, self.cos, self.sin, *heads, kc, vc, slots)
        elif b.decode and self.skinny_qkv_rope and supports_skinny_linear(h, self.skinny.qkv_tokens):
            qkv = qkv_rope_store_tokens(h, layer.qkv_w, layer.qkv_b, b.positions, self.cos, self.sin, *heads, kc, vc,
                                        slots, tiles=self.skinny.qkv_tiles(t), scratch=self.skinny_scratch)
        else:
            qkv = self._linear(h, layer.qkv_w, layer.qkv_b)
            # Decode stores K/V in the rope launch. A prompt chunk stores after its attention: the
            # chunk's new keys must not overwrite ring slots its own earlier queries still read.
            apply_rope_qkv(qkv, b.positions, self.cos, self.sin, *heads, (kc, vc, slots) if b.decode else None)
        q, k, v = qkv.split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
        q = q.view(t, cfg.num_attention_heads, cfg.head_dim)
        k = k.view(t, cfg.num_key_value_heads, cfg.head_dim)
        v = v.view(t, cfg.num_key_value_heads, cfg.head_dim)
        if b.decode:
            o = decode_attention(q, kc, vc, tables, b.seq_lens, layer.sinks, cfg.sm_scale, layer.window, 0,
                                 num_splits=b.num_splits[1 if sliding else 0])
        else:
            o = prefill_attention(q, k, v, kc, vc, tables, b.cu_seqlens, b.ctx_lens, layer.sinks, cfg.sm_scale,
                                  layer.window, 0, b.max_seqlen_q, b.max_ctx_len)
            kv_store(k, v, kc, vc, slots)
        return self._linear(o.reshape(t, cfg.q_size), layer.o_w, layer.o_b)

    def _linear(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        if self.use_row_linear and supports_row_linear(x, w):
            return row_linear(x, w, b)
        if supports_skinny_linear(x, self.skinny.tokens):
            return skinny_linear(x, w, b, scratch=self.skinny_scratch)
        return torch.addmm(b, x, w.T)
