"""qkv_rope_store (the batch-1 qkv projection with RoPE and the K/V cache write in one launch) against
the two launches it replaces (bit for bit in the interpreter, to the last fp32 bit on a GPU), and
against the torch twins."""

import pytest
import torch
from helpers import assert_close, capture_without_sync

from gptoss_cli.kernels.kv_store import kv_store_ref
from gptoss_cli.kernels.linear import linear_ref, row_linear
from gptoss_cli.kernels.qkv_rope import qkv_rope_store
from gptoss_cli.kernels.rope import (
    apply_rope_qkv,
    apply_rope_ref,
    qkv_views,
    rope_cos_sin,
)
from gptoss_cli.runtime.config import ModelConfig

requires_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
BLOCK_SIZE, NUM_BLOCKS = 16, 4


def qkv_case(device, heads, kv_heads, d, hidden, dtype, cache_dtype, positions=50, tokens=1, num_blocks=NUM_BLOCKS):
    """x [tokens, hidden], the fused qkv weight and bias, cos/sin tables and a K/V cache pair."""
    x = torch.randn(tokens, hidden, device=device).to(dtype)
    w = (torch.randn((heads + 2 * kv_heads) * d, hidden, device=device) / hidden**0.5).to(dtype)
    b = torch.randn(w.shape[0], device=device).to(dtype)
    cos, sin = torch.randn(positions, d // 2, device=device), torch.randn(positions, d // 2, device=device)
    caches = [torch.randn(num_blocks, BLOCK_SIZE, kv_heads, d, device=device).to(cache_dtype) for _ in range(2)]
    return x, w, b, cos, sin, caches


def _unfused(x, w, b, pos, cos, sin, heads, kv_heads, d, caches, slot):
    """The two launches the fused one replaces, on copies of the caches."""
    kc, vc = caches[0].clone(), caches[1].clone()
    qkv = row_linear(x, w, b)
    apply_rope_qkv(qkv, pos, cos, sin, heads, kv_heads, d, (kc, vc, slot))
    return qkv, kc, vc


def _assert_as_unfused(pairs):
    """(got, want) pairs: bit for bit under the interpreter. On a GPU each kernel's dot product
    ends in a butterfly reduction whose first step the compiler contracts into an FMA, so lanes
    hold sums that differ in the last fp32 bit, and the two kernels store different lanes' values
    (found on the H200 and in both kernels' PTX, session 11): one fp32 bit, which a bf16 rounding
    turns into at most one bf16 ulp before the rotation."""
    for what, got, want in pairs:
        if not got.is_cuda:
            assert torch.equal(got, want), what
        else:
            assert_close(got.float(), want.float(), 2e-6 if want.dtype == torch.float32 else 8e-3, what)


def _check_unfused(got, caches, want, want_k, want_v):
    _assert_as_unfused([("qkv", got, want), ("k cache", caches[0], want_k), ("v cache", caches[1], want_v)])


SHAPES = [(8, 2, 8, 64), (5, 3, 6, 100), (4, 1, 64, 48)]  # odd sizes: D/2 = 3, K not a power of two


@pytest.mark.parametrize("dtype,cache_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                               (torch.float32, torch.bfloat16)])
@pytest.mark.parametrize("heads,kv_heads,d,hidden", SHAPES)
def test_fused_equals_row_linear_then_rope(device, dtype, cache_dtype, heads, kv_heads, d, hidden):
    x, w, b, cos, sin, caches = qkv_case(device, heads, kv_heads, d, hidden, dtype, cache_dtype)
    pos = torch.tensor([37], device=device)
    slot = torch.tensor([BLOCK_SIZE * 2 + 5], device=device)
    want, want_k, want_v = _unfused(x, w, b, pos, cos, sin, heads, kv_heads, d, caches, slot)
    got = qkv_rope_store(x, w, b, pos, cos, sin, heads, kv_heads, d, *caches, slot)
    assert got.dtype == dtype
    _check_unfused(got, caches, want, want_k, want_v)


@pytest.mark.parametrize("heads,kv_heads,d,hidden", SHAPES[:2])
def test_fused_matches_the_torch_twins(device, heads, kv_heads, d, hidden):
    x, w, b, cos, sin, caches = qkv_case(device, heads, kv_heads, d, hidden, torch.float32, torch.float32)
    pos, slot = torch.tensor([3], device=device), torch.tensor([7], device=device)
    want_k, want_v = caches[0].clone(), caches[1].clone()
    q, k, v = qkv_views(linear_ref(x, w, b), heads, kv_heads, d)
    q, k = apply_rope_ref(q, pos, cos, sin), apply_rope_ref(k, pos, cos, sin)
    kv_store_ref(k, v, want_k, want_v, slot)
    got = qkv_rope_store(x, w, b, pos, cos, sin, heads, kv_heads, d, *caches, slot)
    assert_close(got, torch.cat([q, k, v], dim=1).reshape(1, -1), 1e-5, "qkv")
    assert_close(caches[0], want_k, 1e-5, "k cache")
    assert_close(caches[1], want_v, 1e-5, "v cache")


def test_out_of_table_position_and_padding_slot(device):
    heads, kv_heads, d, hidden = 4, 2, 8, 32
    x, w, b, cos, sin, caches = qkv_case(device, heads, kv_heads, d, hidden, torch.float32, torch.float32)
    before = [c.clone() for c in caches]
    got = qkv_rope_store(x, w, b, torch.tensor([-1], device=device), cos, sin, heads, kv_heads, d, *caches,
                         torch.tensor([-1], device=device))
    assert_close(got, linear_ref(x, w, b), 1e-5, "unrotated qkv")  # position -1: nothing rotated
    assert torch.equal(caches[0], before[0]) and torch.equal(caches[1], before[1])  # slot -1: nothing stored
    pos = torch.tensor([cos.shape[0]], device=device)  # one past the table
    slot = torch.tensor([0], device=device)
    want, want_k, want_v = _unfused(x, w, b, pos, cos, sin, heads, kv_heads, d, caches, slot)
    _check_unfused(qkv_rope_store(x, w, b, pos, cos, sin, heads, kv_heads, d, *caches, slot), caches, want, want_k,
                   want_v)


def test_bad_arguments_raise(device):
    heads, kv_heads, d, hidden = 4, 2, 8, 32
    x, w, b, cos, sin, caches = qkv_case(device, heads, kv_heads, d, hidden, torch.float32, torch.float32)
    pos, slot = torch.tensor([1], device=device), torch.tensor([0], device=device)
    with pytest.raises(ValueError, match="rows"):
        qkv_rope_store(x, w[:-1], b[:-1], pos, cos, sin, heads, kv_heads, d, *caches, slot)
    with pytest.raises(ValueError, match=r"\[1, 32\]"):
        qkv_rope_store(torch.randn(2, hidden, device=device), w, b, pos, cos, sin, heads, kv_heads, d, *caches, slot)
    with pytest.raises(ValueError, match="positions"):
        qkv_rope_store(x, w, b, torch.tensor([1, 2], device=device), cos, sin, heads, kv_heads, d, *caches, slot)
    with pytest.raises(ValueError, match="KV cache"):
        qkv_rope_store(x, w, b, pos, cos, sin, heads, kv_heads, d, caches[0][:, :, :1], caches[1][:, :, :1], slot)
    with pytest.raises(TypeError, match="slot_mapping"):
        qkv_rope_store(x, w, b, pos, cos, sin, heads, kv_heads, d, *caches, slot.int())


@requires_gpu
def test_fused_real_shapes_bf16_gpu():
    cfg = ModelConfig()
    heads, kv_heads, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    x, w, b, _, _, caches = qkv_case("cuda", heads, kv_heads, d, cfg.hidden_size, torch.bfloat16, torch.bfloat16)
    cos, sin = rope_cos_sin(cfg, 131072, "cuda")
    for p in (0, 4095, 131071):
        pos, slot = torch.tensor([p], device="cuda"), torch.tensor([p % (NUM_BLOCKS * BLOCK_SIZE)], device="cuda")
        want, want_k, want_v = _unfused(x, w, b, pos, cos, sin, heads, kv_heads, d, caches, slot)
        got = qkv_rope_store(x, w, b, pos, cos, sin, heads, kv_heads, d, *caches, slot)
        _check_unfused(got, caches, want, want_k, want_v)
        assert_rotated_like_twins(got, x, w, b, pos, cos, sin, heads, kv_heads, d)


def assert_rotated_like_twins(got, x, w, b, pos, cos, sin, heads, kv_heads, d):
    """bf16 q and k of `got` against the fp32 torch twins: rounded before the rotation (as the
    unfused launches do), then again after it."""
    q, k, _ = qkv_views(linear_ref(x.float(), w.float(), b.float()), heads, kv_heads, d)
    got_q, got_k, _ = qkv_views(got, heads, kv_heads, d)
    assert_close(got_q.float(), apply_rope_ref(q, pos, cos, sin), 8e-3, "q")
    assert_close(got_k.float(), apply_rope_ref(k, pos, cos, sin), 8e-3, "k")


@requires_gpu
def test_fused_cuda_graph_and_no_sync():
    heads, kv_heads, d, hidden = 64, 8, 64, 2880
    x, w, b, cos, sin, caches = qkv_case("cuda", heads, kv_heads, d, hidden, torch.bfloat16, torch.bfloat16)
    pos, slot = torch.tensor([1], device="cuda"), torch.tensor([3], device="cuda")
    out = qkv_rope_store(x, w, b, pos, cos, sin, heads, kv_heads, d, *caches, slot)  # compile outside the capture
    graph = capture_without_sync(lambda: qkv_rope_store(x, w, b, pos, cos, sin, heads, kv_heads, d, *caches, slot,
                                                        out=out))
    pos.fill_(42)
    slot.fill_(17)
    x.copy_(torch.randn_like(x))
    want, want_k, want_v = _unfused(x, w, b, pos, cos, sin, heads, kv_heads, d, caches, slot)
    graph.replay()
    _check_unfused(out, caches, want, want_k, want_v)
