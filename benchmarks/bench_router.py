"""Launch sweep of the MoE block edges (a script, not a test): the router launch with the block's
input norm (kernels/moe_router.py), from 2 tokens also the router's K-split tiles
(kernels/moe_router_tiles.py), and the combine with the next block's norm
(moe_matmul.moe_combine_norm), against the separate launches they replace.

    PYTHONPATH=src python benchmarks/bench_router.py [TOKENS ...]   # H200; tokens per step, default 1

For each case: median time of a CUDA-graph replay (triton.testing.do_bench_cudagraph), and whether
its outputs equal the separate launches' (chosen experts identical, normalised rows within one
bf16 step). The weights stay in L2 across replays, unlike in the engine, so the times are lower
bounds; the sweep is for choosing launch parameters.
"""

from __future__ import annotations

import sys

import torch


def _time_us(fn) -> float:
    import triton

    fn()
    return triton.testing.do_bench_cudagraph(fn, rep=50) * 1e3


def _router_rows(experts: int, tokens: int = 1, hidden: int = 2880) -> list[tuple]:
    """(label, us, outputs ok, (group_e, num_warps, tokens per program) or None for the separate
    launches)"""
    from gptoss_cli.kernels import moe_router
    from gptoss_cli.kernels.moe import router_logits
    from gptoss_cli.kernels.moe_routing import route
    from gptoss_cli.kernels.rmsnorm import rms_norm

    x = torch.randn(tokens, hidden, device="cuda").bfloat16()
    residual = torch.randn(tokens, hidden, device="cuda").bfloat16()
    norm_w = (torch.rand(hidden, device="cuda") + 0.5).bfloat16()
    rw = (torch.randn(experts, hidden, device="cuda") / hidden**0.5).bfloat16()
    rb = torch.randn(experts, device="cuda").bfloat16()
    h, _ = rms_norm(x, norm_w, 1e-5, residual)
    want = route(router_logits(h, rw, rb), 4, 16, sort=False)
    head = f"router E={experts} T={tokens}:"
    rows = [(f"{head} rms_norm + F.linear + top-k (3-4 launches)",
             _time_us(lambda: route(router_logits(rms_norm(x, norm_w, 1e-5, residual)[0], rw, rb), 4, 16, sort=False)),
             True, None)]
    scratch = moe_router.RouterScratch.allocate(experts, "cuda")
    # The defaults first; one token per program takes whole rows in one step (ONE_STEP).
    variants = [(moe_router.GROUP_E, moe_router.NUM_WARPS, moe_router.TOKENS_PER_PROGRAM)]
    if tokens == 1:
        variants += [(g, w, 1) for g in (1, 2, 4) for w in (2, 4, 8)]
    else:
        variants += [(2, 8, 1), (2, 4, 1), (1, 4, 1), (4, 8, 1), (2, 8, 2)]
    for group_e, warps, tpp in dict.fromkeys(variants):
        norm = moe_router.RouterNorm(residual, norm_w, 1e-5, torch.empty_like(x), torch.empty_like(x))
        kw = {"sort": False, "scratch": scratch, "norm": norm, "group_e": group_e, "num_warps": warps,
              "tokens_per_program": tpp}
        out = moe_router.route_tokens(x, rw, rb, 4, 16, **kw)
        ok = torch.equal(out.topk_ids, want.topk_ids) and torch.allclose(norm.out.float(), h.float(), rtol=1e-2)
        us = _time_us(lambda: moe_router.route_tokens(x, rw, rb, 4, 16, out=out, **kw))  # noqa: B023 (timed now)
        rows.append((f"{head} fused, group_e={group_e} warps={warps} tokens/program={tpp}", us, ok,
                     (group_e, warps, tpp)))
    return rows


def _tiles_rows(experts: int, tokens: int, hidden: int = 2880) -> list[tuple]:
    """The K-split tiles (moe_router_tiles) against F.linear + top-k, both without the norm (it stays
    its own launch there): (label, us, chosen experts equal, RouterTiles or None)."""
    from gptoss_cli.kernels import moe_router_tiles as rt
    from gptoss_cli.kernels.moe import router_logits
    from gptoss_cli.kernels.moe_routing import route

    x = torch.randn(tokens, hidden, device="cuda").bfloat16()
    rw = (torch.randn(experts, hidden, device="cuda") / hidden**0.5).bfloat16()
    rb = torch.randn(experts, device="cuda").bfloat16()
    want = route(router_logits(x, rw, rb), 4, 16, sort=False)
    head = f"router E={experts} T={tokens}:"
    rows = [(f"{head} F.linear + top-k (2-3 launches)",
             _time_us(lambda: route(router_logits(x, rw, rb), 4, 16, sort=False)), True, None)]
    variants = [rt.RouterTiles(), rt.RouterTiles(128, 1), rt.RouterTiles(64, 2), rt.RouterTiles(64, 4, 3),
                rt.RouterTiles(128, 4, 3), rt.RouterTiles(256, 1), rt.RouterTiles(128, 2, 2, 8)]
    for tiles in dict.fromkeys(variants):
        scratch = rt.allocate_scratch(experts, hidden, "cuda", tiles)
        out = rt.route_tiles(x, rw, rb, 4, 16, sort=False, scratch=scratch, tiles=tiles)
        ok = torch.equal(out.topk_ids, want.topk_ids)
        us = _time_us(lambda: rt.route_tiles(x, rw, rb, 4, 16, out=out, sort=False, scratch=scratch,  # noqa: B023
                                             tiles=tiles))  # noqa: B023 (timed now)
        rows.append((f"{head} tiles k{tiles.block_k} x{tiles.steps_per_split} s{tiles.num_stages} "
                     f"w{tiles.num_warps}", us, ok, tiles))
    return rows


def _combine_rows(hidden: int = 2880, top_k: int = 4) -> list[tuple]:
    """(label, us, outputs ok, num_warps or None for the separate launches)"""
    from gptoss_cli.kernels.moe_matmul import moe_combine, moe_combine_norm
    from gptoss_cli.kernels.rmsnorm import rms_norm

    y = torch.randn(top_k, hidden, device="cuda")
    residual = torch.randn(1, hidden, device="cuda").bfloat16()
    norm_w = (torch.rand(hidden, device="cuda") + 0.5).bfloat16()
    want, _ = rms_norm(moe_combine(y, top_k, torch.bfloat16), norm_w, 1e-5, residual)
    rows = [("combine: moe_combine + rms_norm (2 launches)",
             _time_us(lambda: rms_norm(moe_combine(y, top_k, torch.bfloat16), norm_w, 1e-5, residual)), True, None)]
    for warps in (4, 8, 16):
        got, _ = moe_combine_norm(y, top_k, residual, norm_w, 1e-5, num_warps=warps)
        ok = torch.allclose(got.float(), want.float(), rtol=1e-2, atol=1e-2)
        us = _time_us(lambda: moe_combine_norm(y, top_k, residual, norm_w, 1e-5, num_warps=warps))
        rows.append((f"combine: fused, warps={warps}", us, ok, warps))
    return rows


def main() -> int:
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    tokens = [int(t) for t in sys.argv[1:]] or [1]
    torch.manual_seed(0)
    rows = [r for t in tokens for e in (32, 128) for r in _router_rows(e, t)]
    rows += [r for t in tokens if t > 1 for e in (32, 128) for r in _tiles_rows(e, t)]
    for label, us, ok, _ in rows + _combine_rows():
        print(f"{label:<62}{us:7.2f} us  {'ok' if ok else 'MISMATCH'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
