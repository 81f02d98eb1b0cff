"""The few-token projections: skinny_linear against F.linear, and qkv_rope_store_tokens (qkv with RoPE
and the K/V cache write) against skinny_linear followed by the rope launch, and against the torch
twins. Odd shapes: K not a multiple of the K step, N not a multiple of the row tile, T not a power
of two, several token blocks; positions outside the table and padding slots."""

import pytest
import torch
from helpers import assert_close, capture_without_sync
from test_qkv_rope import BLOCK_SIZE, assert_rotated_like_twins, qkv_case

from gptoss_cli.kernels.kv_store import kv_store_ref
from gptoss_cli.kernels.linear import linear_ref
from gptoss_cli.kernels.qkv_rope import qkv_rope_store_tokens, supports_qkv_rope_tokens
from gptoss_cli.kernels.rope import apply_rope_qkv, apply_rope_ref, qkv_views, rope_cos_sin
from gptoss_cli.kernels.skinny_linear import (
    SkinnyScratch,
    SkinnyTiles,
    skinny_linear,
    split_plan,
    supports_skinny_linear,
)
from gptoss_cli.runtime.config import ModelConfig

requires_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
NUM_BLOCKS = 8
TOL = {torch.float32: 1e-5, torch.bfloat16: 8e-3}
# The defaults (split K on both the interpreter and a GPU), one split, and three splits of a
# smaller row tile, which put odd sizes on tile edges and ragged last splits.
TILES = [None, SkinnyTiles(block_n=16, block_k=32, num_stages=2, splits=1),
         SkinnyTiles(block_n=32, block_k=32, splits=3)]


def _operands(device, t, n, k, dtype):
    x = torch.randn(t, k, device=device).to(dtype)
    w = (torch.randn(n, k, device=device) / k**0.5).to(dtype)
    b = torch.randn(n, device=device).to(dtype)
    return x, w, b


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t,n,k", [(2, 72, 96), (5, 100, 200), (16, 64, 64), (17, 48, 130), (64, 40, 33)])
@pytest.mark.parametrize("tiles", TILES)
def test_skinny_linear_matches_linear(device, dtype, t, n, k, tiles):
    x, w, b = _operands(device, t, n, k, dtype)
    got = skinny_linear(x, w, b, tiles=tiles)
    assert got.dtype == dtype and got.shape == (t, n)
    assert_close(got.float(), linear_ref(x.float(), w.float(), b.float()), TOL[dtype], "skinny_linear")


def test_split_plan_covers_k_evenly():
    cpu = torch.device("cpu")
    for k, splits, block_k in [(2880, 3, 128), (4096, 6, 128), (100, 3, 32), (64, 8, 32)]:
        got, per = split_plan(k, 10, SkinnyTiles(block_k=block_k, splits=splits), cpu)
        assert per % block_k == 0 and (got - 1) * per < k <= got * per and got <= splits


def test_shared_scratch_across_launches(device):
    """One scratch for many launches of different shapes: every row tile's counter is back at zero
    after each launch, so the next launch's last program is found again."""
    tiles = SkinnyTiles(block_n=16, block_k=32, splits=3)
    shapes = [(48, 96), (80, 64), (16, 200)]
    scratch = SkinnyScratch.for_shapes(shapes, device, tiles)
    for _ in range(2):
        for n, k in shapes:
            x, w, b = _operands(device, 5, n, k, torch.float32)
            got = skinny_linear(x, w, b, tiles=tiles, scratch=scratch)
            assert_close(got, linear_ref(x, w, b), 1e-5, f"{n}x{k}")
            assert not scratch.arrivals.any()
    with pytest.raises(ValueError, match="scratch too small"):
        skinny_linear(*_operands(device, 5, 160, 96, torch.float32), tiles=tiles, scratch=scratch)
    # qkv_rope's row tiles stop at a head (32 rows here, below the 64 of the tiles): the scratch fits them.
    heads, kv_heads, d, hidden, t = 2, 1, 32, 64, 5
    big = SkinnyTiles(block_n=64, block_k=32, splits=2)
    x, w, b, cos, sin, caches = _rope_case(device, t, heads, kv_heads, d, hidden, torch.float32, torch.float32)
    scratch = SkinnyScratch.for_shapes([tuple(w.shape)], device, big)
    pos, slots = torch.arange(t, device=device), torch.arange(t, device=device)
    want, want_k, want_v = _unfused(x, w, b, pos, cos, sin, heads, kv_heads, d, caches, slots)
    got = qkv_rope_store_tokens(x, w, b, pos, cos, sin, heads, kv_heads, d, *caches, slots, tiles=big, scratch=scratch)
    assert_close(got, want, 1e-5, "qkv")
    assert_close(caches[0], want_k, 1e-5, "k cache")


def test_skinny_linear_strided_x_into_out(device):
    """x a column slice of a wider buffer (as attention's output view may be), out preallocated."""
    wide = torch.randn(6, 100, device=device)
    x, (_, w, b) = wide[:, 10:74], _operands(device, 6, 24, 64, torch.float32)
    out = torch.full((6, 24), float("nan"), device=device)
    assert skinny_linear(x, w, b, out=out) is out
    assert_close(out, linear_ref(x, w, b), 1e-5, "out")


def test_skinny_linear_rejects_bad_shapes(device):
    x, w, b = _operands(device, 3, 24, 32, torch.float32)
    assert supports_skinny_linear(x) and not supports_skinny_linear(x[:1]) and not supports_skinny_linear(x, 2)
    assert not supports_skinny_linear(torch.randn(65, 32))
    with pytest.raises(ValueError, match=r"\[T, 32\]"):
        skinny_linear(torch.randn(3, 31, device=device), w, b)
    with pytest.raises(ValueError, match=r"T in 1\.\.64"):
        skinny_linear(torch.randn(65, 32, device=device), w, b)
    with pytest.raises(ValueError, match="bias"):
        skinny_linear(x, w, b[:-1])
    with pytest.raises(ValueError, match="out"):
        skinny_linear(x, w, b, out=torch.empty(3, 23, device=device))


def _rope_case(device, t, heads, kv_heads, d, hidden, dtype, cache_dtype):
    return qkv_case(device, heads, kv_heads, d, hidden, dtype, cache_dtype, tokens=t, num_blocks=NUM_BLOCKS)


def _unfused(x, w, b, pos, cos, sin, heads, kv_heads, d, caches, slots, tiles=None):
    """skinny_linear, then the rope launch that also stores K/V, on copies of the caches."""
    kc, vc = caches[0].clone(), caches[1].clone()
    qkv = skinny_linear(x, w, b, tiles=tiles)
    apply_rope_qkv(qkv, pos, cos, sin, heads, kv_heads, d, (kc, vc, slots))
    return qkv, kc, vc


def _assert_as_unfused(got, caches, want, want_k, want_v):
    """Within an ulp of the output dtype: the two launches' tiles hold other rows, so their dots are
    products of other shapes (on a GPU other MMA tilings, under the interpreter numpy matmuls whose
    blocking follows the shape and the CPU: bit for bit on some CPUs, an ulp apart on an AMD EPYC),
    and a GPU compiler may contract the rotation into FMAs differently."""
    for what, g, ref in (("qkv", got, want), ("k cache", caches[0], want_k), ("v cache", caches[1], want_v)):
        assert_close(g.float(), ref.float(), 2e-6 if ref.dtype == torch.float32 else 8e-3, what)


def _positions(device, t, table):
    """Positions inside the table, one at -1 and one past the table (both left unrotated)."""
    pos = torch.randint(0, table, (t,), device=device)
    pos[t // 2] = -1
    pos[-1] = table
    return pos


def _slots(device, t):
    """Distinct cache slots, one padding row (-1: nothing stored)."""
    slots = torch.randperm(NUM_BLOCKS * BLOCK_SIZE, device=device)[:t]
    slots[1] = -1
    return slots


SHAPES = [(8, 2, 16, 96), (4, 1, 64, 100), (6, 3, 32, 40)]  # D/2 = 8, 32, 16; K off the K step


@pytest.mark.parametrize("dtype,cache_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                               (torch.float32, torch.bfloat16)])
@pytest.mark.parametrize("heads,kv_heads,d,hidden", SHAPES)
@pytest.mark.parametrize("t", [2, 7, 20])
def test_fused_tokens_equal_skinny_linear_then_rope(device, dtype, cache_dtype, heads, kv_heads, d, hidden, t):
    x, w, b, cos, sin, caches = _rope_case(device, t, heads, kv_heads, d, hidden, dtype, cache_dtype)
    pos, slots = _positions(device, t, cos.shape[0]), _slots(device, t)
    want, want_k, want_v = _unfused(x, w, b, pos, cos, sin, heads, kv_heads, d, caches, slots)
    got = qkv_rope_store_tokens(x, w, b, pos, cos, sin, heads, kv_heads, d, *caches, slots)
    assert got.dtype == dtype and got.shape == want.shape
    _assert_as_unfused(got, caches, want, want_k, want_v)


@pytest.mark.parametrize("tiles", TILES[1:])
def test_fused_tokens_other_tiles(device, tiles):
    """Rotation pairs per program follow the row tile (8 pairs at 16 rows, 16 at 32)."""
    heads, kv_heads, d, hidden, t = 4, 2, 64, 72, 5
    x, w, b, cos, sin, caches = _rope_case(device, t, heads, kv_heads, d, hidden, torch.float32, torch.float32)
    pos, slots = _positions(device, t, cos.shape[0]), _slots(device, t)
    want, want_k, want_v = _unfused(x, w, b, pos, cos, sin, heads, kv_heads, d, caches, slots, tiles)
    got = qkv_rope_store_tokens(x, w, b, pos, cos, sin, heads, kv_heads, d, *caches, slots, tiles=tiles)
    _assert_as_unfused(got, caches, want, want_k, want_v)


def test_fused_tokens_match_the_torch_twins(device):
    heads, kv_heads, d, hidden, t = 8, 2, 16, 96, 6
    x, w, b, cos, sin, caches = _rope_case(device, t, heads, kv_heads, d, hidden, torch.float32, torch.float32)
    pos, slots = torch.arange(3, 3 + t, device=device), torch.arange(10, 10 + t, device=device)
    want_k, want_v = caches[0].clone(), caches[1].clone()
    q, k, v = qkv_views(linear_ref(x, w, b), heads, kv_heads, d)
    q, k = apply_rope_ref(q, pos, cos, sin), apply_rope_ref(k, pos, cos, sin)
    kv_store_ref(k, v, want_k, want_v, slots)
    got = qkv_rope_store_tokens(x, w, b, pos, cos, sin, heads, kv_heads, d, *caches, slots)
    assert_close(got, torch.cat([q, k, v], dim=1).reshape(t, -1), 1e-5, "qkv")
    assert_close(caches[0], want_k, 1e-5, "k cache")
    assert_close(caches[1], want_v, 1e-5, "v cache")


def test_fused_tokens_bad_arguments_raise(device):
    heads, kv_heads, d, hidden, t = 4, 2, 16, 32, 3
    x, w, b, cos, sin, caches = _rope_case(device, t, heads, kv_heads, d, hidden, torch.float32, torch.float32)
    pos, slots = torch.arange(t, device=device), torch.arange(t, device=device)
    assert supports_qkv_rope_tokens(64) and supports_qkv_rope_tokens(16) and not supports_qkv_rope_tokens(8)
    with pytest.raises(ValueError, match="multiple of 8"):
        qkv_rope_store_tokens(x, w, b, pos, cos[:, :4], sin[:, :4], heads, 2 * kv_heads, 8, *caches, slots)
    with pytest.raises(ValueError, match="rows"):
        qkv_rope_store_tokens(x, w[:-1], b[:-1], pos, cos, sin, heads, kv_heads, d, *caches, slots)
    with pytest.raises(ValueError, match="positions"):
        qkv_rope_store_tokens(x, w, b, pos[:2], cos, sin, heads, kv_heads, d, *caches, slots)
    with pytest.raises(TypeError, match="slot_mapping"):
        qkv_rope_store_tokens(x, w, b, pos, cos, sin, heads, kv_heads, d, *caches, slots.int())


@requires_gpu
@pytest.mark.parametrize("t", [2, 4, 16, 64])
def test_real_shapes_bf16_gpu(t):
    cfg = ModelConfig()
    heads, kv_heads, d, hidden = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.hidden_size
    x, w, b, _, _, caches = _rope_case("cuda", t, heads, kv_heads, d, hidden, torch.bfloat16, torch.bfloat16)
    cos, sin = rope_cos_sin(cfg, 131072, "cuda")
    pos = torch.tensor([0, 4095, 131071] * t, device="cuda")[:t]
    slots = torch.randperm(NUM_BLOCKS * BLOCK_SIZE, device="cuda")[:t]
    want, want_k, want_v = _unfused(x, w, b, pos, cos, sin, heads, kv_heads, d, caches, slots)
    got = qkv_rope_store_tokens(x, w, b, pos, cos, sin, heads, kv_heads, d, *caches, slots)
    _assert_as_unfused(got, caches, want, want_k, want_v)
    assert_rotated_like_twins(got, x, w, b, pos, cos, sin, heads, kv_heads, d)
    o = torch.randn(t, heads * d, device="cuda").bfloat16()
    o_w = (torch.randn(hidden, heads * d, device="cuda") / (heads * d) ** 0.5).bfloat16()
    o_b = torch.randn(hidden, device="cuda").bfloat16()
    assert_close(skinny_linear(o, o_w, o_b).float(), linear_ref(o.float(), o_w.float(), o_b.float()), 8e-3, "o")


@requires_gpu
def test_cuda_graph_and_no_sync():
    heads, kv_heads, d, hidden, t = 64, 8, 64, 2880, 8
    x, w, b, cos, sin, caches = _rope_case("cuda", t, heads, kv_heads, d, hidden, torch.bfloat16, torch.bfloat16)
    pos, slots = torch.arange(t, device="cuda"), torch.arange(t, device="cuda")
    scratch = SkinnyScratch.for_shapes([tuple(w.shape)], "cuda")
    out = qkv_rope_store_tokens(x, w, b, pos, cos, sin, heads, kv_heads, d, *caches, slots, scratch=scratch)
    y = skinny_linear(x, w[:hidden, :hidden], b[:hidden], scratch=scratch)  # compile both outside the capture

    def launches():
        for _ in range(3):  # one scratch, launches back to back
            qkv_rope_store_tokens(x, w, b, pos, cos, sin, heads, kv_heads, d, *caches, slots, out=out,
                                  scratch=scratch)
            skinny_linear(x, w[:hidden, :hidden], b[:hidden], out=y, scratch=scratch)

    graph = capture_without_sync(launches)
    pos.add_(40)
    slots.add_(17)
    x.copy_(torch.randn_like(x))
    want, want_k, want_v = _unfused(x, w, b, pos, cos, sin, heads, kv_heads, d, caches, slots)
    graph.replay()
    _assert_as_unfused(out, caches, want, want_k, want_v)
    assert_close(y.float(), linear_ref(x.float(), w[:hidden, :hidden].float(), b[:hidden].float()), 8e-3, "y")
