"""Localise bf16 disagreement at real 20b shapes: each kernel vs its torch twin on layer-0 data."""
import sys
import torch
from gptoss_cli.runtime.random_checkpoint import random_tensor, random_config
from gptoss_cli.runtime.checkpoint import expected_tensors
from gptoss_cli import kernels as K
from gptoss_cli.kernels.attention import attention_ref
from gptoss_cli.kernels.moe import moe_ref
from gptoss_cli.kernels.rmsnorm import rms_norm_ref
from gptoss_cli.kernels.rope import apply_rope_ref

cfg = random_config("20b")
spec = expected_tensors(cfg)
dev = torch.device("cuda")
get = lambda n: random_tensor(n, spec[n], 0, dev)
def rel(a, b): a, b = a.float(), b.float(); return ((a - b).norm() / b.norm()).item()
T = 257
ids = torch.randint(0, 199998, (T,), device=dev)
for dt in (torch.float32, torch.bfloat16):
    x = get("model.embed_tokens.weight")[ids].to(dt)
    p = "model.layers.0."
    w = get(p + "input_layernorm.weight").float()
    y, _ = K.rms_norm(x, w, 1e-5); yr, _ = rms_norm_ref(x, w, 1e-5)
    print(dt, "rms_norm", rel(y, yr))
    qkv_w = torch.cat([get(p + f"self_attn.{c}_proj.weight") for c in "qkv"]).to(dt)
    qkv_b = torch.cat([get(p + f"self_attn.{c}_proj.bias") for c in "qkv"]).to(dt)
    qkv = torch.addmm(qkv_b, yr, qkv_w.T)
    cos, sin = K.rope_cos_sin(cfg, 4096, dev)
    pos = torch.arange(T, device=dev)
    q0 = apply_rope_ref(qkv[:, :4096].reshape(T, 64, 64), pos, cos, sin)
    k0 = apply_rope_ref(qkv[:, 4096:4608].reshape(T, 8, 64), pos, cos, sin)
    qkv2 = qkv.clone(); K.apply_rope_qkv(qkv2, pos, cos, sin, 64, 8, 64)
    print(dt, "rope q", rel(qkv2[:, :4096].reshape(T, 64, 64), q0), "k", rel(qkv2[:, 4096:4608].reshape(T, 8, 64), k0))
    v = qkv[:, 4608:].reshape(T, 8, 64)
    sinks = get(p + "self_attn.sinks").float()
    kc = torch.zeros(16, 64, 8, 64, dtype=dt, device=dev); vc = torch.zeros_like(kc)
    bt = torch.arange(1, 9, dtype=torch.int32, device=dev)[None]
    for window in (0, 128):
        o = K.prefill_attention(q0, k0, v, kc, vc, bt, torch.tensor([0, T], dtype=torch.int32, device=dev),
                                torch.tensor([0], dtype=torch.int32, device=dev), sinks, 0.125, window, 0, T, 0)
        orf = attention_ref(q0, k0, v, sinks, 0.125, pos, pos, window)
        print(dt, "prefill attention window", window, rel(o, orf))
    h = yr
    rw = get(p + "mlp.router.weight").to(dt); rb = get(p + "mlp.router.bias").to(dt)
    raw = [get(p + "mlp.experts." + n) for n in ("gate_up_proj_blocks", "gate_up_proj_scales", "gate_up_proj_bias",
                                               "down_proj_blocks", "down_proj_scales", "down_proj_bias")]
    mw = K.prepare_moe_weights(*raw)
    for t in (1, 17, 257):
        out = K.moe_forward(h[:t], rw, rb, mw, 4)
        ref = moe_ref(h[:t], rw, rb, *raw, top_k=4)
        print(dt, "moe T", t, rel(out, ref))
    ws = K.MoeWorkspace.allocate(512, mw, 4, dt, dev)
    out = K.moe_forward(h, rw, rb, mw, 4, 7.0, 1.702, ws)
    print(dt, "moe with workspace T", T, rel(out, moe_ref(h, rw, rb, *raw, top_k=4)))
    out = K.moe_forward(h[:17], rw, rb, mw, 4, 7.0, 1.702, ws)
    print(dt, "moe with workspace T 17 after 257", rel(out, moe_ref(h[:17], rw, rb, *raw, top_k=4)))
    sys.stdout.flush()
