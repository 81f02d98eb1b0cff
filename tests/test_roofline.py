"""runtime/roofline.py: decode bytes and prefill FLOPs against performance.md §2.2-2.3, and against
brute-force counts over the checkpoint's tensor list (an independent derivation)."""

import math
import subprocess
import sys

import pytest

from gptoss_cli.runtime.checkpoint import expected_tensors
from gptoss_cli.runtime.config import ModelConfig
from gptoss_cli.runtime.random_checkpoint import random_config
from gptoss_cli.runtime.roofline import (
    attention_flops,
    attention_layer_bytes,
    decode_step_bytes,
    distinct_experts,
    expert_bytes,
    kv_bytes_per_token_layer,
    lm_head_bytes,
    linear_flops_per_token,
    prefill_flops,
    roofline_tok_s,
    router_layer_bytes,
)

CFG = {name: random_config(name) for name in ("tiny", "20b", "120b")}
H200 = 4.3e12  # performance.md's measured copy bandwidth


def close(actual: float, expected: float, rel: float = 0.01) -> bool:
    return abs(actual - expected) <= rel * abs(expected)


# ---- components (performance.md §2.2) ------------------------------------------------------

def test_component_sizes_match_reference():
    cfg = CFG["20b"]
    assert close(expert_bytes(cfg), 13.236e6, 1e-3)
    assert close(attention_layer_bytes(cfg), 53.11e6, 1e-3)
    assert close(router_layer_bytes(cfg), 0.18e6, 0.03)
    assert close(router_layer_bytes(CFG["120b"]), 0.74e6, 0.01)
    assert close(lm_head_bytes(cfg), 1.158e9, 1e-3)
    assert kv_bytes_per_token_layer(cfg) == 2048


def _checkpoint_bytes(cfg: ModelConfig) -> dict[str, float]:
    """Bytes per role from the checkpoint layout: packed tensors 1 byte/elem, the rest bf16."""
    groups = {"attention": 0, "router": 0, "experts": 0, "embed": 0, "lm_head": 0, "norm": 0}
    for name, spec in expected_tensors(cfg).items():
        size = math.prod(spec.shape) * (1 if spec.packed else 2)
        if ".mlp.experts." in name:
            groups["experts"] += size
        elif ".mlp.router." in name:
            groups["router"] += size
        elif ".layers." in name:
            groups["attention"] += size  # projections, biases, sinks and both layer norms
        elif "embed_tokens" in name:
            groups["embed"] += size
        elif "lm_head" in name:
            groups["lm_head"] += size
        else:
            groups["norm"] += size
    return groups


@pytest.mark.parametrize("name", ["tiny", "20b", "120b"])
def test_components_agree_with_checkpoint_layout(name):
    cfg = CFG[name]
    truth = _checkpoint_bytes(cfg)
    layers, experts = cfg.num_hidden_layers, cfg.num_local_experts
    assert layers * attention_layer_bytes(cfg) == truth["attention"]
    assert layers * router_layer_bytes(cfg) == truth["router"]
    assert layers * experts * expert_bytes(cfg) == truth["experts"]
    assert lm_head_bytes(cfg) == truth["lm_head"]
    parts = decode_step_bytes(cfg, 3, 0)
    assert parts["final_norm"] == truth["norm"]
    assert parts["embedding"] == 3 * truth["embed"] / cfg.vocab_size  # one row per sequence


@pytest.mark.parametrize("name", ["tiny", "20b", "120b"])
@pytest.mark.parametrize("batch,context", [(1, 0), (1, 127), (3, 128), (5, 129), (7, 1000)])
def test_kv_bytes_brute_force(name, batch, context):
    cfg = CFG[name]
    per_token = 2 * cfg.num_key_value_heads * cfg.head_dim * 2  # K and V, bf16
    tokens = sum(min(context, cfg.sliding_window) if cfg.layer_types[n] == "sliding_attention" else context
                 for n in range(cfg.num_hidden_layers))
    assert decode_step_bytes(cfg, batch, context)["kv_cache"] == batch * tokens * per_token


def test_total_is_sum_of_parts():
    parts = decode_step_bytes(CFG["120b"], 17, 333)
    total = parts.pop("total")
    assert total == pytest.approx(sum(parts.values()), rel=1e-12)
    assert set(parts) == {"attention", "router", "experts", "lm_head", "final_norm", "embedding", "kv_cache"}


# ---- totals and ceilings (performance.md §2.2 table) ---------------------------------------

@pytest.mark.parametrize("name,batch,context,gb", [
    ("20b", 1, 0, 3.71), ("20b", 1, 4096, 3.81), ("20b", 1, 32768, 4.52), ("20b", 1, 131072, 6.93),
    ("120b", 1, 0, 5.00), ("120b", 1, 4096, 5.16), ("120b", 1, 32768, 6.22), ("120b", 1, 131072, 9.84),
    ("20b", 64, 0, 12.60), ("20b", 64, 1024, 14.41), ("20b", 64, 2048, 16.02), ("20b", 64, 4096, 19.25),
    ("120b", 64, 0, 56.1), ("120b", 64, 1024, 58.8), ("120b", 64, 2048, 61.2), ("120b", 64, 4096, 66.1),
])
def test_decode_bytes_match_reference_table(name, batch, context, gb):
    assert close(decode_step_bytes(CFG[name], batch, context)["total"], gb * 1e9)


def test_batch1_breakdown_matches_reference():
    for name, attention, experts in (("20b", 1.275e9, 1.271e9), ("120b", 1.912e9, 1.906e9)):
        parts = decode_step_bytes(CFG[name], 1, 0)
        assert close(parts["attention"], attention, 2e-3)
        assert close(parts["experts"], experts, 2e-3)


@pytest.mark.parametrize("name,batch,context,tok_s", [
    ("20b", 1, 0, 1160), ("20b", 1, 4096, 1128), ("120b", 1, 0, 860), ("120b", 1, 131072, 437),
    ("20b", 64, 0, 21.8e3), ("120b", 64, 0, 4906), ("120b", 64, 4096, 4166),
    ("120b", 8, 1536, 1992), ("120b", 32, 1536, 3129), ("20b", 8, 1536, 3645), ("20b", 256, 1536, 47.7e3),
])
def test_ceilings_match_reference(name, batch, context, tok_s):
    assert close(roofline_tok_s(CFG[name], batch, context, H200), tok_s)


def test_h100_ceilings():
    assert close(roofline_tok_s(CFG["120b"], 64, 0, 3.35e12), 3822)
    assert close(roofline_tok_s(CFG["20b"], 1, 0, 3.35e12), 903)


def test_distinct_experts():
    assert close(distinct_experts(CFG["120b"], 64), 111.2, 1e-3)
    assert close(distinct_experts(CFG["20b"], 64), 32.0, 1e-3)
    for cfg in CFG.values():
        assert distinct_experts(cfg, 1) == pytest.approx(cfg.num_experts_per_tok)
        counts = [distinct_experts(cfg, b) for b in range(1, 300)]
        assert all(a < b for a, b in zip(counts, counts[1:]) if b < cfg.num_local_experts - 1e-9)
        assert max(counts) <= cfg.num_local_experts


def test_distinct_experts_matches_simulation():
    """Uniform top-k routing simulated directly: the closed form is its expectation."""
    import random

    rng = random.Random(1234)
    experts, k, batch, trials = 128, 4, 13, 4000
    seen = [len({e for _ in range(batch) for e in rng.sample(range(experts), k)}) for _ in range(trials)]
    cfg = ModelConfig(num_local_experts=experts, num_experts_per_tok=k, num_hidden_layers=2)
    assert close(sum(seen) / trials, distinct_experts(cfg, batch), 0.01)


def test_bad_arguments_raise():
    cfg = CFG["tiny"]
    with pytest.raises(ValueError, match="batch"):
        decode_step_bytes(cfg, 0, 10)
    with pytest.raises(ValueError, match="context"):
        decode_step_bytes(cfg, 1, -1)
    with pytest.raises(ValueError, match="bandwidth"):
        roofline_tok_s(cfg, 1, 0, 0.0)
    with pytest.raises(ValueError):
        prefill_flops(cfg, -1)


# ---- prefill FLOPs (performance.md §2.3) -----------------------------------------------------

def test_linear_flops_per_token_match_reference():
    assert close(linear_flops_per_token(CFG["20b"]), 6.06e9, 2e-3)
    assert close(linear_flops_per_token(CFG["120b"]), 9.10e9, 2e-3)


@pytest.mark.parametrize("name,tokens,tflop", [
    ("20b", 1024, 6.3), ("20b", 4096, 26.6), ("20b", 32768, 305),
    ("120b", 1024, 9.5), ("120b", 4096, 39.9), ("120b", 32768, 458),
])
def test_prefill_flops_match_reference(name, tokens, tflop):
    assert close(prefill_flops(CFG[name], tokens), tflop * 1e12)


def test_attention_flops_average_matches_reference():
    assert close(attention_flops(CFG["20b"], 4096) / 4096, 0.43e9)
    assert close(attention_flops(CFG["120b"], 4096) / 4096, 0.64e9)


@pytest.mark.parametrize("tokens,start", [(1, 0), (5, 0), (127, 1), (128, 0), (200, 50), (3, 400), (257, 129)])
def test_attention_flops_brute_force(tokens, start):
    """Enumerate every (query, key) pair the causal / banded masks allow."""
    cfg = CFG["tiny"]
    pairs = 0
    for n in range(cfg.num_hidden_layers):
        sliding = cfg.layer_types[n] == "sliding_attention"
        for q in range(start, start + tokens):
            keys = range(max(0, q - cfg.sliding_window + 1) if sliding else 0, q + 1)
            pairs += len(keys)
    assert attention_flops(cfg, tokens, start) == 4 * cfg.num_attention_heads * cfg.head_dim * pairs


def test_prefill_flops_additive_over_chunks():
    """Prefilling in two chunks costs the same as one, except the lm_head runs twice."""
    cfg = CFG["20b"]
    lm_head = 2 * cfg.vocab_size * cfg.hidden_size
    whole = prefill_flops(cfg, 1000)
    assert prefill_flops(cfg, 300) + prefill_flops(cfg, 700, start=300) == whole + lm_head
    assert prefill_flops(cfg, 0) == 0


def test_roofline_imports_no_torch():
    code = "import sys, gptoss_cli.runtime.roofline; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
