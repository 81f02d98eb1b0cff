"""The memory and compute floor of gpt-oss: bytes one decode step must read, FLOPs of a prefill.

Everything is derived from a ModelConfig (performance.md §2.2-2.3): bf16 attention, router,
embedding and lm_head; MXFP4 experts (4-bit values plus one E8M0 scale byte per 32) with bf16
biases; a bf16 KV cache where full-attention layers read the whole context and sliding layers
read at most `sliding_window` tokens. Routing is assumed uniform, the worst case for expert
traffic and what random weights give. Pure Python: no torch.
"""

from __future__ import annotations

from .config import ModelConfig

BF16_BYTES = 2
MXFP4_BLOCK = 32  # values sharing one E8M0 scale byte
MXFP4_BYTES_PER_VALUE = 0.5 + 1 / MXFP4_BLOCK  # 0.53125


def attention_layer_bytes(cfg: ModelConfig) -> int:
    """q/k/v/o weights and biases, the two RMSNorm gains and the sinks of one layer (bf16)."""
    c, q, kv = cfg.hidden_size, cfg.q_size, cfg.kv_size
    weights = c * (q + 2 * kv) + q * c
    biases = (q + 2 * kv + c) if cfg.attention_bias else 0
    norms = 2 * c
    return (weights + biases + norms + cfg.num_attention_heads) * BF16_BYTES


def router_layer_bytes(cfg: ModelConfig) -> int:
    return (cfg.num_local_experts * cfg.hidden_size + cfg.num_local_experts) * BF16_BYTES


def expert_bytes(cfg: ModelConfig) -> float:
    """One expert: packed gate_up [2I, C] and down [C, I] plus their bf16 biases."""
    c, i = cfg.hidden_size, cfg.intermediate_size
    values = 2 * i * c + c * i
    return values * MXFP4_BYTES_PER_VALUE + (2 * i + c) * BF16_BYTES


def lm_head_bytes(cfg: ModelConfig) -> int:
    return cfg.vocab_size * cfg.hidden_size * BF16_BYTES


def kv_bytes_per_token_layer(cfg: ModelConfig) -> int:
    """K and V of one token in one layer (2048 for gpt-oss: 8 heads x 64 x bf16, twice)."""
    return 2 * cfg.kv_size * BF16_BYTES


def distinct_experts(cfg: ModelConfig, batch: int) -> float:
    """Expected experts touched per layer when `batch` tokens each pick top-k uniformly: E(1-(1-k/E)^B)."""
    e, k = cfg.num_local_experts, cfg.num_experts_per_tok
    return e * (1.0 - (1.0 - k / e) ** batch)


def _check(batch: int, context: float) -> None:
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    if context < 0:
        raise ValueError(f"context must be >= 0, got {context}")


def decode_step_bytes(cfg: ModelConfig, batch: int, context: float) -> dict[str, float]:
    """Bytes one decode step reads for `batch` sequences that each attend to `context` cached tokens.

    Keys: attention, router, experts, lm_head, final_norm, embedding, kv_cache, total.
    """
    _check(batch, context)
    layers = cfg.num_hidden_layers
    sliding = sum(cfg.is_sliding(n) for n in range(layers))
    kv_tokens = (layers - sliding) * context + sliding * min(context, cfg.sliding_window)
    parts = {
        "attention": float(layers * attention_layer_bytes(cfg)),
        "router": float(layers * router_layer_bytes(cfg)),
        "experts": layers * distinct_experts(cfg, batch) * expert_bytes(cfg),
        "lm_head": float(lm_head_bytes(cfg)),
        "final_norm": float(cfg.hidden_size * BF16_BYTES),
        "embedding": float(batch * cfg.hidden_size * BF16_BYTES),  # one row per token
        "kv_cache": float(batch * kv_tokens * kv_bytes_per_token_layer(cfg)),
    }
    parts["total"] = sum(parts.values())
    return parts


def roofline_tok_s(cfg: ModelConfig, batch: int, context: float, bandwidth_bytes_s: float) -> float:
    """Decode tokens per second (all sequences together) if every step ran at `bandwidth_bytes_s`."""
    if not bandwidth_bytes_s > 0:
        raise ValueError(f"bandwidth must be > 0, got {bandwidth_bytes_s}")
    return batch * bandwidth_bytes_s / decode_step_bytes(cfg, batch, context)["total"]


# ---- prefill compute ---------------------------------------------------------------------

def linear_flops_per_token(cfg: ModelConfig) -> int:
    """2 x (attention projections + router + top-k experts) weights, summed over layers."""
    c, q, kv, i = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
    attention = c * (q + 2 * kv) + q * c
    router = cfg.num_local_experts * c
    experts = cfg.num_experts_per_tok * (2 * i * c + c * i)
    return 2 * cfg.num_hidden_layers * (attention + router + experts)


def _sum_capped(first: int, last: int, cap: int) -> int:
    """sum(min(n, cap) for n in first..last), in closed form."""
    if last < first:
        return 0
    below_last = min(last, cap)
    below = (below_last * (below_last + 1) - (first - 1) * first) // 2 if first <= below_last else 0
    above = max(0, last - max(first, cap + 1) + 1) * cap
    return below + above


def attention_flops(cfg: ModelConfig, tokens: int, start: int = 0) -> int:
    """QK^T and PV for prompt positions start..start+tokens-1, each attending causally (and banded
    on sliding layers): 4 x heads x head_dim FLOPs per attended key per layer."""
    first, last = start + 1, start + tokens  # keys attended by the first and last new token
    per_key = 4 * cfg.num_attention_heads * cfg.head_dim
    total = 0
    for n in range(cfg.num_hidden_layers):
        cap = cfg.sliding_window if cfg.is_sliding(n) else last
        total += _sum_capped(first, last, cap)
    return per_key * total


def prefill_flops(cfg: ModelConfig, tokens: int, start: int = 0) -> int:
    """FLOPs to prefill `tokens` prompt tokens after `start` cached ones; the lm_head runs once,
    since only the last position needs logits."""
    if tokens < 0 or start < 0:
        raise ValueError(f"tokens and start must be >= 0, got {tokens} and {start}")
    if tokens == 0:
        return 0
    lm_head = 2 * cfg.vocab_size * cfg.hidden_size
    return tokens * linear_flops_per_token(cfg) + attention_flops(cfg, tokens, start) + lm_head
