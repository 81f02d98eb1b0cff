"""Programmatic dependent launch: when it is on, and that a PDL chain computes the same bits.

The GPU test captures a batch-1 decode chain (qkv, rope + K/V store, split decode attention with
its reduce, o-proj, the MoE block's router, gemv1, gemv2 and combine + norm) for three layers in a
CUDA graph with PDL, replays it with new inputs, and compares every replay bit for bit (outputs
and the K/V cache) with the same chain launched eagerly without PDL. A kernel that read its
predecessor's output before the wait would see stale data and differ.
"""

import pytest
import torch

from gptoss_cli.kernels import apply_rope_qkv, decode_attention, moe_block, prepare_moe_weights, rope_cos_sin
from gptoss_cli.kernels.pdl import pdl_enabled, pdl_launch
from gptoss_cli.runtime.config import ModelConfig

requires_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_pdl_is_off_on_the_cpu_and_its_launch_arguments():
    assert not pdl_enabled(torch.zeros(1))
    assert pdl_launch(False) == {"PDL": False}
    assert pdl_launch(True) == {"PDL": True, "launch_pdl": True}


@requires_gpu
def test_env_switch_turns_pdl_off(monkeypatch):
    t = torch.zeros(1, device="cuda")
    monkeypatch.setenv("GPTOSS_PDL", "0")
    assert not pdl_enabled(t)
    monkeypatch.setenv("GPTOSS_PDL", "1")
    assert pdl_enabled(t) == (torch.cuda.get_device_capability()[0] >= 9)


def _layer_weights(cfg: ModelConfig, gen: torch.Generator):
    c, dt = cfg.hidden_size, torch.bfloat16

    def rnd(*shape, std=1.0):
        return (torch.randn(*shape, generator=gen, device="cuda") * std).to(dt)

    e, inter = cfg.num_local_experts, cfg.intermediate_size

    def packed(n, k):  # MXFP4 blocks and scales around 2**-7, checkpoint layout
        return (torch.randint(0, 256, (e, n, k // 32, 16), dtype=torch.uint8, device="cuda", generator=gen),
                torch.randint(118, 122, (e, n, k // 32), dtype=torch.uint8, device="cuda", generator=gen))

    experts = prepare_moe_weights(*packed(2 * inter, c), torch.randn(e, 2 * inter, device="cuda"),
                                  *packed(c, inter), torch.randn(e, c, device="cuda"))
    width = cfg.q_size + 2 * cfg.kv_size
    return {"qkv_w": rnd(width, c, std=c**-0.5), "qkv_b": rnd(width, std=0.1), "o_w": rnd(c, cfg.q_size, std=0.02),
            "o_b": rnd(c, std=0.1), "router_w": rnd(e, c, std=c**-0.5), "router_b": rnd(e), "sinks": rnd(cfg.num_attention_heads),
            "norm": rnd(c, std=0.1) + 1, "experts": experts}


@requires_gpu
def test_pdl_chain_in_a_graph_equals_eager_chain_without_pdl(monkeypatch):
    cfg = ModelConfig(num_hidden_layers=3, num_local_experts=32)
    gen = torch.Generator(device="cuda").manual_seed(0)
    layers = [_layer_weights(cfg, gen) for _ in range(cfg.num_hidden_layers)]
    cos, sin = rope_cos_sin(cfg, 4096, "cuda")
    block_size, blocks = 16, 64
    kc = torch.randn(cfg.num_hidden_layers, blocks, block_size, cfg.num_key_value_heads, cfg.head_dim,
                     generator=gen, device="cuda").to(torch.bfloat16)
    vc = torch.randn_like(kc)
    table = torch.randperm(blocks, device="cuda", generator=gen)[None, :].to(torch.int32)
    x = torch.randn(1, cfg.hidden_size, device="cuda").to(torch.bfloat16)
    residual = torch.randn_like(x)
    pos = torch.tensor([300], device="cuda")

    def step():
        h, r = x, residual
        slots = table[0, pos // block_size].long() * block_size + pos % block_size
        seq_lens = (pos + 1).to(torch.int32)
        for n, lw in enumerate(layers):
            qkv = torch.addmm(lw["qkv_b"], h, lw["qkv_w"].T)
            apply_rope_qkv(qkv, pos, cos, sin, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                           (kc[n], vc[n], slots))
            q = qkv[:, : cfg.q_size].view(1, cfg.num_attention_heads, cfg.head_dim)
            o = decode_attention(q, kc[n], vc[n], table, seq_lens, lw["sinks"], cfg.sm_scale, 0, 0, num_splits=4)
            a = torch.addmm(lw["o_b"], o.reshape(1, cfg.q_size), lw["o_w"].T)
            h, r = moe_block(a, r, lw["norm"], lw["norm"], cfg.rms_norm_eps, lw["router_w"], lw["router_b"],
                             lw["experts"], cfg.num_experts_per_tok)
        return h, r

    step()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for i in range(10):
        x.copy_(torch.randn_like(x, dtype=torch.float32))
        residual.copy_(torch.randn_like(residual, dtype=torch.float32))
        pos.fill_(300 + 7 * i)
        kc0, vc0 = kc.clone(), vc.clone()
        graph.replay()
        got = [t.clone() for t in (*out, kc, vc)]
        kc.copy_(kc0)
        vc.copy_(vc0)
        monkeypatch.setenv("GPTOSS_PDL", "0")
        want = [*step(), kc, vc]
        monkeypatch.setenv("GPTOSS_PDL", "1")
        for name, g, w in zip(("normed", "residual", "k cache", "v cache"), got, want):
            assert torch.equal(g, w), f"replay {i}: {name} differs"
