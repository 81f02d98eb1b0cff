"""apply_rope / apply_rope_qkv (in place, q and k in one launch) vs apply_rope_ref on the real YaRN table."""

import pytest
import torch
from helpers import assert_close, bf16_ulps

from gptoss_cli.kernels.kv_store import kv_store
from gptoss_cli.kernels.rope import apply_rope, apply_rope_qkv, apply_rope_ref, qkv_views, rope_cos_sin
from gptoss_cli.runtime.config import ModelConfig

requires_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
H, HKV, D, MAX_POS = 64, 8, 64, 131072


@pytest.fixture(scope="module")
def tables():
    """The real gpt-oss table for every position, built once on the test device."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return rope_cos_sin(ModelConfig(), MAX_POS, device)


def _assert_rotated(out, ref, what):
    if out.dtype == torch.float32:
        assert_close(out, ref, 2e-6, what)  # the GPU may fuse x1*c - x2*s into one FMA
    else:
        # One bf16 step: the GPU may round an FMA result differently, and the interpreter
        # truncates fp32 -> bf16 stores where torch rounds to nearest even.
        assert bf16_ulps(out, ref) <= 1.0, what


def _positions(tokens, device):
    pos = torch.randint(0, MAX_POS, (tokens,), device=device)
    pos[0] = MAX_POS - 1  # the last row of the table
    if tokens > 1:
        pos[1] = 0
    return pos


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 5, 17])
def test_rope_qkv_matches_ref(device, tables, dtype, tokens):
    cos, sin = tables
    qkv = torch.randn(tokens, (H + 2 * HKV) * D, device=device).to(dtype)
    positions = _positions(tokens, device)
    q, k, v = qkv_views(qkv, H, HKV, D)
    q_ref, k_ref = apply_rope_ref(q, positions, cos, sin), apply_rope_ref(k, positions, cos, sin)
    v_before = v.clone()
    apply_rope_qkv(qkv, positions, cos, sin, H, HKV, D)
    _assert_rotated(q, q_ref, "q")
    _assert_rotated(k, k_ref, "k")
    assert torch.equal(v, v_before)


def test_rope_arbitrary_strides_and_odd_sizes(device):
    tokens, heads, kv_heads, d = 7, 5, 3, 6  # half = 3: nothing is a power of two
    cos, sin = torch.randn(50, d // 2, device=device), torch.randn(50, d // 2, device=device)
    q = torch.randn(heads, tokens, d, device=device).transpose(0, 1)  # token stride < head stride
    k = torch.randn(tokens, kv_heads, 2 * d, device=device)[..., ::2]  # element stride 2
    positions = torch.randint(0, 50, (tokens,), device=device, dtype=torch.int32)
    q_ref, k_ref = apply_rope_ref(q, positions, cos, sin), apply_rope_ref(k, positions, cos, sin)
    k_base = k._base.clone()
    apply_rope(q, k, positions, cos, sin)
    _assert_rotated(q, q_ref, "q")
    _assert_rotated(k, k_ref, "k")
    assert torch.equal(k._base[..., 1::2], k_base[..., 1::2])  # the gaps are untouched


def test_rope_skips_out_of_table_positions(device, tables):
    cos, sin = tables
    qkv = torch.randn(4, (H + 2 * HKV) * D, device=device)
    positions = torch.tensor([3, -1, MAX_POS, 9], device=device)
    before = qkv.clone()
    apply_rope_qkv(qkv, positions, cos, sin, H, HKV, D)
    assert torch.equal(qkv[1:3], before[1:3])
    q, k, _ = qkv_views(before[[0, 3]], H, HKV, D)
    got_q, got_k, _ = qkv_views(qkv[[0, 3]], H, HKV, D)
    _assert_rotated(got_q, apply_rope_ref(q, positions[[0, 3]], cos, sin), "q")
    _assert_rotated(got_k, apply_rope_ref(k, positions[[0, 3]], cos, sin), "k")


@pytest.mark.parametrize("qkv_dtype,cache_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                                   (torch.float32, torch.bfloat16)])
@pytest.mark.parametrize("heads,kv_heads,d,tokens", [(H, HKV, D, 5), (5, 3, 6, 7)])
def test_rope_with_cache_store_matches_rope_then_kv_store(device, qkv_dtype, cache_dtype, heads, kv_heads, d, tokens):
    # The decode launch also writes the rotated k and v rows to the cache: same bytes as rope, then
    # kv_store. Slot -1 (padding) writes nothing; position -1 stores k unrotated, as the two
    # separate launches do.
    block_size, num_blocks = 16, 6
    cos, sin = torch.randn(50, d // 2, device=device), torch.randn(50, d // 2, device=device)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d, device=device).to(qkv_dtype)
    positions = torch.randint(0, 50, (tokens,), device=device)
    positions[1] = -1
    slots = torch.randperm(num_blocks * block_size, device=device)[:tokens]
    slots[2] = -1
    caches = [torch.randn(num_blocks, block_size, kv_heads, d, device=device).to(cache_dtype) for _ in range(2)]
    caches += [c.clone() for c in caches]
    want_qkv = qkv.clone()
    apply_rope_qkv(want_qkv, positions, cos, sin, heads, kv_heads, d)
    _, k, v = qkv_views(want_qkv, heads, kv_heads, d)
    kv_store(k, v, caches[0], caches[1], slots)
    apply_rope_qkv(qkv, positions, cos, sin, heads, kv_heads, d, (caches[2], caches[3], slots))
    assert torch.equal(qkv, want_qkv)
    assert torch.equal(caches[2], caches[0]) and torch.equal(caches[3], caches[1])


def test_rope_bad_arguments_raise(device, tables):
    cos, sin = tables
    q = torch.randn(3, H, D, device=device)
    k = torch.randn(3, HKV, D, device=device)
    with pytest.raises(ValueError, match="positions"):
        apply_rope(q, k, torch.zeros(4, dtype=torch.long, device=device), cos, sin)
    with pytest.raises(TypeError, match="fp32"):
        apply_rope(q, k, torch.zeros(3, dtype=torch.long, device=device), cos.double(), sin.double())
    with pytest.raises(ValueError, match="same T"):
        apply_rope(q, k[:2], torch.zeros(3, dtype=torch.long, device=device), cos, sin)
    with pytest.raises(ValueError, match="qkv"):
        apply_rope_qkv(torch.randn(3, 100, device=device), torch.zeros(3, dtype=torch.long, device=device),
                       cos, sin, H, HKV, D)
    qkv = torch.randn(3, (H + 2 * HKV) * D, device=device)
    cache = torch.zeros(4, 16, HKV, D, device=device)
    with pytest.raises(TypeError, match="slot_mapping"):
        apply_rope_qkv(qkv, torch.zeros(3, dtype=torch.long, device=device), cos, sin, H, HKV, D,
                       (cache, cache.clone(), torch.zeros(3, dtype=torch.int32, device=device)))


@requires_gpu
@pytest.mark.parametrize("tokens", [1, 64, 4096])
def test_rope_real_shapes_gpu(tables, tokens):
    cos, sin = tables
    qkv = torch.randn(tokens, (H + 2 * HKV) * D, device="cuda").bfloat16()
    positions = _positions(tokens, "cuda")
    q, k, _ = qkv_views(qkv, H, HKV, D)
    q_ref, k_ref = apply_rope_ref(q, positions, cos, sin), apply_rope_ref(k, positions, cos, sin)
    apply_rope_qkv(qkv, positions, cos, sin, H, HKV, D)
    _assert_rotated(q, q_ref, "q")
    _assert_rotated(k, k_ref, "k")


@requires_gpu
def test_rope_cuda_graph_and_no_sync(tables):
    cos, sin = tables
    qkv = torch.randn(32, (H + 2 * HKV) * D, device="cuda").bfloat16()
    positions = torch.zeros(32, dtype=torch.long, device="cuda")
    apply_rope_qkv(qkv, positions, cos, sin, H, HKV, D)  # compile outside the capture
    torch.cuda.set_sync_debug_mode("error")
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            apply_rope_qkv(qkv, positions, cos, sin, H, HKV, D)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    positions.copy_(_positions(32, "cuda"))
    qkv.copy_(torch.randn(qkv.shape, device="cuda"))
    q, k, _ = qkv_views(qkv.clone(), H, HKV, D)
    graph.replay()
    got_q, got_k, _ = qkv_views(qkv, H, HKV, D)
    _assert_rotated(got_q, apply_rope_ref(q, positions, cos, sin), "q")
    _assert_rotated(got_k, apply_rope_ref(k, positions, cos, sin), "k")
