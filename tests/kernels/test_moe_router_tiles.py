"""The router's K-split tiles (moe_router_tiles.route_tiles) against F.linear + moe_routing.route:
the chosen experts exactly, their weights, and the sorted tile metadata. Odd shapes: hidden not a
multiple of the K step or of a split, experts below the tile's 16 rows and not a power of two,
token counts across token blocks with a part-full last one, one split and several."""

import dataclasses

import pytest
import torch
from helpers import assert_close, capture_without_sync

from gptoss_cli.kernels import moe_router_tiles as rt
from gptoss_cli.kernels.moe import MoeWorkspace, moe_forward, moe_ref, pick_config, prepare_moe_weights, router_logits
from gptoss_cli.kernels.moe_routing import route
from test_moe import DECODE, _raw_weights, _tol

requires_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
SORTED = ("expert_counts", "expert_offsets", "sorted_slots", "slot_rows", "tile_expert", "tile_row_start")
# The defaults, one split of a whole K (hidden <= 256), and 3-4 splits of 32-column steps.
TILES = [None, rt.RouterTiles(block_k=64, steps_per_split=4, num_stages=1),
         rt.RouterTiles(block_k=32, steps_per_split=1, num_stages=2)]


def _case(device, tokens, experts, hidden, dtype=torch.float32):
    x = torch.randn(tokens, hidden, device=device).to(dtype)
    rw = (torch.randn(experts, hidden, device=device) / hidden**0.5).to(dtype)
    rb = torch.randn(experts, device=device).to(dtype)
    return x, rw, rb


def _assert_routes_like_linear(got, x, rw, rb, top_k, sort, tol=1e-5):
    want = route(router_logits(x, rw, rb), top_k, 16)
    assert torch.equal(got.topk_ids, want.topk_ids)
    assert_close(got.topk_weights, want.topk_weights, tol, "routing weights")
    if sort:
        for name in SORTED:
            assert torch.equal(getattr(got, name), getattr(want, name)), name


@pytest.mark.parametrize("tokens,experts,hidden,top_k", [(1, 32, 300, 4), (17, 5, 96, 2), (20, 32, 136, 4),
                                                        (33, 128, 100, 4), (64, 32, 160, 4), (64, 8, 64, 2)])
@pytest.mark.parametrize("tiles", TILES, ids=["default", "one-split", "k32-splits"])
@pytest.mark.parametrize("sort", [True, False], ids=["sort", "no-sort"])
def test_route_tiles_matches_linear_then_route(device, tokens, experts, hidden, top_k, tiles, sort):
    # 5 / 8 experts: most of the 16-row expert tile is masked; 17, 20, 33 tokens: a part-full last
    # token block; hidden 300 / 136 / 100: the last K step and the last split are ragged.
    x, rw, rb = _case(device, tokens, experts, hidden)
    got = rt.route_tiles(x, rw, rb, top_k, 16, sort=sort, tiles=tiles)
    _assert_routes_like_linear(got, x, rw, rb, top_k, sort)


def test_route_tiles_scratch_is_reusable(device):
    # Each token block's last program resets its counter: launch after launch on one scratch stays
    # right, across token counts (and so token-block counts).
    experts, hidden = 16, 200
    tiles = rt.RouterTiles(block_k=32, steps_per_split=2, num_stages=1)
    scratch = rt.allocate_scratch(experts, hidden, device, tiles)
    for tokens in (40, 3, 64, 17):
        x, rw, rb = _case(device, tokens, experts, hidden)
        got = rt.route_tiles(x, rw, rb, 2, 16, sort=False, scratch=scratch, tiles=tiles)
        _assert_routes_like_linear(got, x, rw, rb, 2, sort=False)
        assert int(scratch.arrivals.abs().sum()) == 0


def test_route_tiles_rejects_bad_inputs(device):
    x, rw, rb = _case(device, rt.MAX_TOKENS + 1, 8, 32)
    with pytest.raises(ValueError, match="1..64 tokens"):
        rt.route_tiles(x, rw, rb, 2, 16)
    with pytest.raises(ValueError, match="do not match"):
        rt.route_tiles(x[:4], rw[:, :16], rb, 2, 16)


def test_route_tiles_scratch_too_small(device):
    x, rw, rb = _case(device, 40, 8, 256)
    small = rt.allocate_scratch(8, 64, device, rt.RouterTiles(block_k=32, steps_per_split=1))
    with pytest.raises(ValueError, match="scratch too small"):
        rt.route_tiles(x, rw, rb, 2, 16, scratch=small, tiles=rt.RouterTiles(block_k=32, steps_per_split=1))


def test_moe_forward_with_router_tiles_matches_moe_ref(device):
    experts, hidden, inter, top_k = 6, 64, 96, 2
    raw = _raw_weights(experts, hidden, inter, device)
    w = prepare_moe_weights(*raw)
    x = torch.randn(20, hidden, device=device)
    rw, rb = torch.randn(experts, hidden, device=device), torch.randn(experts, device=device)
    workspace = MoeWorkspace.allocate(20, w, top_k, torch.float32, device)
    config = dataclasses.replace(DECODE, router_tiles=True)
    for ws in (None, workspace):
        got = moe_forward(x, rw, rb, w, top_k, config=config, workspace=ws)
        assert_close(got, moe_ref(x, rw, rb, *raw, top_k), _tol(torch.float32, device), "router tiles")


def test_pick_config_takes_the_tiles_where_the_fused_router_stops():
    for experts, fused_up_to in ((32, 16), (128, 4)):
        tiles = [t for t in range(1, 65) if pick_config(t, experts, 4).router_tiles]
        assert tiles == list(range(fused_up_to + 1, 65))
        assert not any(pick_config(t, experts, 4).fused_router for t in tiles)
    assert not pick_config(4096, 32, 4).router_tiles


@requires_gpu
@pytest.mark.parametrize("tokens,experts", [(17, 32), (32, 32), (64, 32), (5, 128), (64, 128)])
def test_route_tiles_bf16_real_shapes(tokens, experts):
    # bf16 logits: both paths round an fp32 sum once; the sums differ in order only, so the chosen
    # experts agree except at exact ties after rounding (none in random data of this size).
    x, rw, rb = _case("cuda", tokens, experts, 2880, torch.bfloat16)
    got = rt.route_tiles(x, rw, rb, 4, 16)
    _assert_routes_like_linear(got, x, rw, rb, 4, sort=True, tol=2e-2)


@requires_gpu
def test_route_tiles_graph_replays_see_every_program():
    # The last program of a token block reads the other splits' partials: replayed many times in a
    # CUDA graph with new inputs (stale L1 lines or a missed arrival would show as wrong experts).
    tokens, experts, hidden = 64, 32, 2880
    x, rw, rb = _case("cuda", tokens, experts, hidden, torch.bfloat16)
    scratch = rt.allocate_scratch(experts, hidden, "cuda")
    out = rt.route_tiles(x, rw, rb, 4, 16, sort=False, scratch=scratch)
    graph = capture_without_sync(lambda: [rt.route_tiles(x, rw, rb, 4, 16, out=out, sort=False, scratch=scratch)
                                          for _ in range(4)])  # back to back on one scratch, as in layers
    bad = 0
    for _ in range(200):
        x.copy_(torch.randn(tokens, hidden, device="cuda"))
        graph.replay()
        bad += not torch.equal(out.topk_ids, route(router_logits(x, rw, rb), 4, 16).topk_ids)
    assert bad == 0 and int(scratch.arrivals.abs().sum()) == 0
