"""Does the confident lm_head (random_checkpoint.py) make bf16 and fp32 references agree on
greedy decoding, and can a greedy comparison still catch bugs? CPU, ~8 minutes on 2 cores.

A 24-layer model with the full vocabulary, 32 experts, top-4, but 704 wide (the width whose
MXFP4 scale rounding gives the same effective expert gains as 20b, so the residual stream grows
as in 20b), 16 query / 2 KV heads of 64. For the OLD init (successor gain 0 = plain Gaussian
lm_head) and the NEW one: logits error bf16 vs fp32 on a 200-token prompt, greedy agreement over
64 tokens for 20 prompts, the greedy token's softmax probability; then, NEW init only, how many
greedy outputs four injected bugs in the fp32 reference change (the logits error of a bug is
measured on a prefill, so a decode-only bug shows 0 there).

    python scripts/debug_confident.py [--margin 3.0 ...] [--tokens 64] [--prompts 20]
    python scripts/debug_confident.py --model 20b --device cuda   # the real shapes, on a GPU
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import torch

import gptoss_cli.runtime.model_ref as mr
import gptoss_cli.runtime.random_checkpoint as rc
from gptoss_cli.runtime.config import ModelConfig
from gptoss_cli.runtime.model_ref import ReferenceModel

CFG = ModelConfig(hidden_size=704, intermediate_size=704, num_hidden_layers=24, num_attention_heads=16,
                  num_key_value_heads=2, head_dim=64, num_local_experts=32, num_experts_per_tok=4)
LENGTHS = (1, 2, 5, 9, 17, 30, 48, 64, 90, 110, 127, 128, 129, 150, 175, 200, 240, 280, 330, 400)
# Every expert stays dequantised: 4.6 GB fp32 for the 704-wide model, 76 GB for 20b.
EXPERT_CACHE = {"cpu": 6 << 30, "cuda": 90 << 30}


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 199998, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Mean over rows of |a - b| / |b|."""
    a, b = a.float(), b.float()
    return ((a - b).norm(dim=-1) / b.norm(dim=-1)).mean().item()


def greedy(m: ReferenceModel, prompts: list[list[int]], steps: int):
    """Batched greedy decoding: tokens per prompt, and per decision (prompt, step, softmax
    probability of the chosen token, its logit gap to the runner-up in logit sd, runner-up)."""
    caches = [m.new_cache() for _ in prompts]
    logits = m.forward([(p, c) for p, c in zip(prompts, caches)])
    out: list[list[int]] = [[] for _ in prompts]
    decisions = []
    for step in range(steps):
        top = logits.topk(2, dim=-1)
        prob = logits.softmax(-1).max(-1).values.tolist()
        gap = ((top.values[:, 0] - top.values[:, 1]) / logits.std(-1)).tolist()
        tok, second = top.indices[:, 0].tolist(), top.indices[:, 1].tolist()
        for i, o in enumerate(out):
            o.append(tok[i])
            decisions.append((i, step, prob[i], gap[i], second[i]))
        if step + 1 < steps:
            logits = m.forward([([t], c) for t, c in zip(tok, caches)])
    return out, decisions


def near_misses(prompts, outs, decisions, perm, below=1.0) -> str:
    """What the close decisions are made of: winner and runner-up as the successor of the current
    token (cur), of an earlier context token (ctx) or neither (rand)."""
    def kind(x, context):
        if int(perm[context[-1]]) == x:
            return "cur"
        return "ctx" if x in {int(perm[u]) for u in context[:-1]} else "rand"
    counts: dict[str, int] = {}
    for i, step, _, gap, second in decisions:
        if gap < below:
            context = prompts[i] + outs[i][:step]
            key = f"{kind(outs[i][step], context)}>{kind(second, context)}"
            counts[key] = counts.get(key, 0) + 1
    return ", ".join(f"{k} {v}" for k, v in sorted(counts.items())) or "none"


def compare(a: list[list[int]], b: list[list[int]]) -> str:
    same = sum(x == y for x, y in zip(a, b))
    tokens = sum(p == q for x, y in zip(a, b) for p, q in zip(x, y)) / sum(len(x) for x in a)
    first = [next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), len(x)) for x, y in zip(a, b)]
    return f"{same}/{len(a)} prompts identical, {tokens:.1%} tokens, mean first difference at {statistics.mean(first):.1f}"


def chain_share(prompts: list[list[int]], outs: list[list[int]], perm: torch.Tensor) -> float:
    """Share of greedy tokens that are the seeded successor of the token before them."""
    hits = total = 0
    for p, o in zip(prompts, outs):
        prev = [p[-1]] + o[:-1]
        hits += sum(int(perm[x]) == y for x, y in zip(prev, o))
        total += len(o)
    return hits / total


def run(weights, dtype, prompts, long_ids, steps, bug=None):
    m = ReferenceModel(weights, dtype=dtype, expert_cache_bytes=EXPERT_CACHE[weights.device.type])
    undo = bug(m) if bug else None
    try:
        logits = m.forward([(long_ids, m.new_cache())], all_logits=True)
        outs, decisions = greedy(m, prompts, steps)
    finally:
        if undo:
            undo()
        del m
        gc.collect()  # the bug closures hold the model in a cycle; free its expert cache now
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return logits, outs, decisions


# ---- injected bugs (each returns an undo) ---------------------------------------------------
def no_sinks(m):
    for layer in m.layers:
        layer.sinks = torch.full_like(layer.sinks, -1e9)


def query_rope_plus_one(m):
    """Queries rotated as if one position later than their keys (an off-by-one in decode)."""
    orig = mr.apply_rope_ref

    def rope(x, positions, cos, sin):
        shifted = positions + 1 if x.shape[1] == m.config.num_attention_heads else positions
        return orig(x, shifted, cos, sin)
    mr.apply_rope_ref = rope
    return lambda: setattr(mr, "apply_rope_ref", orig)


def skip_middle_attention(m):
    orig = m._attention

    def attention(n, layer, h, *rest):
        out = orig(n, layer, h, *rest)
        return torch.zeros_like(out) if n == m.config.num_hidden_layers // 2 else out
    m._attention = attention


def decode_ignores_cache(m):
    """Single-token steps attend to their own key only (a KV-cache bug; prefill is right)."""
    orig = mr.attention_ref

    def attention(q, k, v, sinks, sm_scale, q_pos, k_pos, window=0):
        if q.shape[0] == 1:
            k, v, k_pos = k[-1:], v[-1:], k_pos[-1:]
        return orig(q, k, v, sinks, sm_scale, q_pos, k_pos, window)
    mr.attention_ref = attention
    return lambda: setattr(mr, "attention_ref", orig)


BUGS = {"no attention sinks": no_sinks, "query RoPE position +1": query_rope_plus_one,
        "middle layer attention skipped": skip_middle_attention, "decode ignores the KV cache": decode_ignores_cache}


def report(label, weights, prompts, long_ids, steps, perm, bugs):
    t0 = time.time()
    res = {dt: run(weights, dt, prompts, long_ids, steps) for dt in (torch.bfloat16, torch.float32)}
    (l16, o16, _), (l32, o32, d32) = res[torch.bfloat16], res[torch.float32]
    p32, g32 = [d[2] for d in d32], sorted(d[3] for d in d32)
    print(f"[{label}] ({time.time() - t0:.0f} s)")
    print(f"  logits bf16 vs fp32 (200-token prompt): mean row rel err {rel(l16, l32):.4f}, "
          f"argmax agree {(l16.argmax(-1) == l32.argmax(-1)).float().mean():.3f}, "
          f"finite {bool(torch.isfinite(l16).all() and torch.isfinite(l32).all())}, |logit| max {l32.abs().max():.1f}")
    print(f"  greedy bf16 vs fp32 over {steps} tokens: {compare(o16, o32)}")
    print(f"  fp32 greedy token: median prob {statistics.median(p32):.4f}, gap to runner-up median "
          f"{statistics.median(g32):.2f} / 1st pct {g32[len(g32) // 100]:.2f} / min {g32[0]:.2f} logit sd; "
          f"successor-chain share {chain_share(prompts, o32, perm):.1%}", flush=True)
    print(f"  decisions with gap < 1 sd (winner>runner-up): {near_misses(prompts, o32, d32, perm)}")
    del res
    for name in bugs:
        lb, ob, _ = run(weights, torch.float32, prompts, long_ids, steps, BUGS[name])
        print(f"  bug '{name}': logits rel err {rel(lb, l32):.3f}; greedy vs correct fp32: {compare(ob, o32)}; "
              f"chain share {chain_share(prompts, ob, perm):.1%}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--margin", type=float, nargs="+", default=[rc.SUCCESSOR_MARGIN])
    ap.add_argument("--model", default="debug", help="debug (the 704-wide model above), tiny, 20b or 120b")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--no-old", action="store_true", help="skip the old init")
    ap.add_argument("--bugs", nargs="*", default=list(BUGS), help="bugs to inject (NEW init, first margin)")
    args = ap.parse_args()
    cfg = CFG if args.model == "debug" else rc.random_config(args.model)
    prompts = [prompt(n, 100 + i) for i, n in enumerate(LENGTHS[:args.prompts])]
    long_ids = prompt(200, 1)
    gain = rc.successor_gain
    perm = rc.successor_permutation(cfg.vocab_size, 0, args.device).cpu()
    runs = ([] if args.no_old else [None]) + args.margin
    for margin in runs:
        if margin is None:
            rc.successor_gain = lambda *a, **k: 0.0
        else:
            rc.SUCCESSOR_MARGIN = margin
        weights = rc.build_random_weights(cfg, seed=0, device=args.device, confident=True)
        rc.successor_gain = gain
        label = f"{args.model}, " + ("old init" if margin is None else f"new init, margin {margin}, "
                                     f"gain {gain(cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers):.3f}")
        bugs = args.bugs if margin is not None and margin == args.margin[0] else []
        report(label, weights, prompts, long_ids, args.tokens, perm, bugs)
        del weights
        if args.device != "cpu":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
