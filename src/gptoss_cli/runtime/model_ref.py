"""The gpt-oss forward pass in plain PyTorch: the CPU path and the oracle for the GPU engine.

Composes the kernels' torch twins (which define each op's meaning) over a ragged batch of
sequences, each with its own growing KV cache. fp32 compute on CPU, bf16 on GPU. Experts stay
packed and are dequantised one at a time when hit, so a real gpt-oss-20b fits in 24 GB of RAM.
Dimension legend: T tokens in the batch, C hidden, H query heads, Hkv KV heads, D head dim.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from ..kernels.attention import attention_ref
from ..kernels.moe import moe_ref
from ..kernels.mxfp4 import dequantize_mxfp4
from ..kernels.rmsnorm import rms_norm_ref
from ..kernels.rope import apply_rope_ref, rope_cos_sin
from .checkpoint import ModelWeights


class SequenceCache:
    """Keys and values of every processed token of one sequence, per layer: [cap, Hkv, D]."""

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device):
        self.length = 0
        self._shape = (kv_heads, head_dim)
        self._k = [torch.empty(0, kv_heads, head_dim, dtype=dtype, device=device) for _ in range(num_layers)]
        self._v = [torch.empty(0, kv_heads, head_dim, dtype=dtype, device=device) for _ in range(num_layers)]

    def _reserve(self, layer: int, needed: int) -> None:
        cap = self._k[layer].shape[0]
        if needed <= cap:
            return
        new_cap = max(needed, 2 * cap, 64)
        for store in (self._k, self._v):
            grown = store[layer].new_empty(new_cap, *self._shape)
            grown[:cap] = store[layer]
            store[layer] = grown

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k/v [t, Hkv, D] after the current length; return all keys/values so far."""
        start, end = self.length, self.length + k.shape[0]
        self._reserve(layer, end)
        self._k[layer][start:end] = k
        self._v[layer][start:end] = v
        return self._k[layer][:end], self._v[layer][:end]

    def advance(self, n: int) -> None:
        self.length += n

    def truncated_copy(self, length: int) -> "SequenceCache":
        """A new cache holding the first `length` tokens (prefix reuse)."""
        other = SequenceCache.__new__(SequenceCache)
        other.length = length
        other._shape = self._shape
        other._k = [k[:length].clone() for k in self._k]
        other._v = [v[:length].clone() for v in self._v]
        return other

    def nbytes(self) -> int:
        return sum(k.numel() * k.element_size() * 2 for k in self._k)


@dataclass
class _Layer:
    attn_norm: torch.Tensor
    qkv_w: torch.Tensor
    qkv_b: torch.Tensor
    o_w: torch.Tensor
    o_b: torch.Tensor
    sinks: torch.Tensor
    mlp_norm: torch.Tensor
    router_w: torch.Tensor
    router_b: torch.Tensor
    experts: tuple[torch.Tensor, ...]  # w1 blocks, scales, bias, w2 blocks, scales, bias (packed)
    window: int


class ExpertCache:
    """Dequantised experts kept within a byte budget (LRU): a small model keeps them all, a
    real 20b on a 24 GB machine keeps the hot ones and re-dequantises the rest on demand."""

    def __init__(self, budget_bytes: int, dtype: torch.dtype):
        self.budget = budget_bytes
        self.dtype = dtype
        self._entries: OrderedDict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = OrderedDict()
        self._bytes = 0

    def get(self, layer: int, packed: tuple[torch.Tensor, ...], e: int) -> tuple[torch.Tensor, torch.Tensor]:
        key = (layer, e)
        if key in self._entries:
            self._entries.move_to_end(key)
            return self._entries[key]
        w1b, w1s, _, w2b, w2s, _ = packed
        pair = (dequantize_mxfp4(w1b[e], w1s[e], self.dtype), dequantize_mxfp4(w2b[e], w2s[e], self.dtype))
        size = sum(t.numel() * t.element_size() for t in pair)
        if size <= self.budget:
            self._entries[key] = pair
            self._bytes += size
            while self._bytes > self.budget:
                _, old = self._entries.popitem(last=False)
                self._bytes -= sum(t.numel() * t.element_size() for t in old)
        return pair


class ReferenceModel:
    """Plain-torch gpt-oss over ragged batches: forward(list of (token ids, cache))."""

    def __init__(self, weights: ModelWeights, dtype: torch.dtype | None = None,
                 expert_cache_bytes: int = 2 << 30):
        self.config = cfg = weights.config
        self.device = weights.device
        self.dtype = dtype or (torch.float32 if self.device.type == "cpu" else torch.bfloat16)
        cast = lambda t: t.to(self.dtype)  # noqa: E731
        w = weights.tensors
        self.embed = cast(w["model.embed_tokens.weight"])
        self.final_norm = cast(w["model.norm.weight"])
        self.lm_head = cast(w["lm_head.weight"])
        self.layers = [self._layer(weights, n, cast) for n in range(cfg.num_hidden_layers)]
        self.experts = ExpertCache(expert_cache_bytes, self.dtype)
        self._cos = self._sin = torch.empty(0)

    def _layer(self, weights: ModelWeights, n: int, cast) -> _Layer:
        get = lambda name: weights.layer(n, name)  # noqa: E731
        qkv_w = torch.cat([get(f"self_attn.{p}_proj.weight") for p in "qkv"])
        qkv_b = torch.cat([get(f"self_attn.{p}_proj.bias") for p in "qkv"])
        experts = tuple(get(f"mlp.experts.{name}") for name in (
            "gate_up_proj_blocks", "gate_up_proj_scales", "gate_up_proj_bias",
            "down_proj_blocks", "down_proj_scales", "down_proj_bias"))
        window = self.config.sliding_window if self.config.is_sliding(n) else 0
        return _Layer(cast(get("input_layernorm.weight")), cast(qkv_w), cast(qkv_b),
                      cast(get("self_attn.o_proj.weight")), cast(get("self_attn.o_proj.bias")),
                      get("self_attn.sinks").float(), cast(get("post_attention_layernorm.weight")),
                      cast(get("mlp.router.weight")), cast(get("mlp.router.bias")), experts, window)

    def new_cache(self) -> SequenceCache:
        cfg = self.config
        return SequenceCache(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, self.dtype, self.device)

    def _rope_tables(self, max_position: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._cos.shape[0] <= max_position:
            size = min(max(2 * max_position, 4096), max(self.config.max_position_embeddings, max_position + 1))
            self._cos, self._sin = rope_cos_sin(self.config, size, self.device)
        return self._cos, self._sin

    @torch.inference_mode()
    def forward(self, batch: list[tuple[list[int], SequenceCache]], all_logits: bool = False) -> torch.Tensor:
        """Run new tokens of several sequences; caches grow. Returns fp32 logits for the last
        token of each sequence [B, V], or for every new token [T, V] when `all_logits`."""
        lengths = [len(ids) for ids, _ in batch]
        ids = torch.tensor([t for seq, _ in batch for t in seq], dtype=torch.long, device=self.device)
        positions = torch.cat([torch.arange(c.length, c.length + n, device=self.device)
                               for (_, c), n in zip(batch, lengths)])
        cos, sin = self._rope_tables(int(positions.max()) + 1)
        x = self.embed[ids]
        residual = None
        for n, layer in enumerate(self.layers):
            h, residual = rms_norm_ref(x, layer.attn_norm, self.config.rms_norm_eps, residual)
            x = self._attention(n, layer, h, positions, cos, sin, batch, lengths)
            h, residual = rms_norm_ref(x, layer.mlp_norm, self.config.rms_norm_eps, residual)
            x = self._moe(n, layer, h)
        for (_, cache), n in zip(batch, lengths):
            cache.advance(n)
        h, _ = rms_norm_ref(x, self.final_norm, self.config.rms_norm_eps, residual)
        if not all_logits:
            last = torch.tensor(lengths, device=self.device).cumsum(0) - 1
            h = h[last]
        return (h @ self.lm_head.T).float()

    def _attention(self, n, layer, h, positions, cos, sin, batch, lengths) -> torch.Tensor:
        cfg = self.config
        qkv = h @ layer.qkv_w.T + layer.qkv_b
        q, k, v = qkv.split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
        q = apply_rope_ref(q.reshape(-1, cfg.num_attention_heads, cfg.head_dim), positions, cos, sin)
        k = apply_rope_ref(k.reshape(-1, cfg.num_key_value_heads, cfg.head_dim), positions, cos, sin)
        v = v.reshape(-1, cfg.num_key_value_heads, cfg.head_dim)
        outs, start = [], 0
        for (_, cache), t in zip(batch, lengths):
            sl = slice(start, start + t)
            keys, values = cache.append(n, k[sl], v[sl])
            # Sliding layers only ever see the last `window` keys before the first query.
            first = max(0, cache.length - layer.window + 1) if layer.window else 0
            k_pos = torch.arange(first, keys.shape[0], device=self.device)
            outs.append(attention_ref(q[sl], keys[first:], values[first:], layer.sinks, cfg.sm_scale,
                                      positions[sl], k_pos, layer.window))
            start += t
        o = torch.cat(outs).reshape(-1, cfg.q_size)
        return o @ layer.o_w.T + layer.o_b

    def _moe(self, n: int, layer: _Layer, h: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        return moe_ref(h, layer.router_w, layer.router_b, *layer.experts,
                       top_k=cfg.num_experts_per_tok, limit=cfg.swiglu_limit, alpha=cfg.swiglu_alpha,
                       expert_weights=lambda e: self.experts.get(n, layer.experts, e))
