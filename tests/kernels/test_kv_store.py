"""kv_store kernel vs its twin, and the paged/ring slot formula vs a per-position loop."""

import pytest
import torch

from gptoss_cli.kernels.kv_store import cache_geometry, cache_slots, kv_store, kv_store_ref

requires_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _loop_slot(block_table, b, p, block_size, ring_blocks):
    logical = p // block_size
    if ring_blocks:
        logical %= ring_blocks
    return int(block_table[b, logical]) * block_size + p % block_size


@pytest.mark.parametrize("ring_blocks", [0, 3])
def test_cache_slots_matches_loop(ring_blocks):
    block_size, num_seqs = 16, 3
    block_table = torch.randperm(40)[: num_seqs * 10].view(num_seqs, 10).int()
    seq_ids = torch.randint(0, num_seqs, (200,))
    positions = torch.randint(0, 10 * block_size, (200,))
    got = cache_slots(block_table, seq_ids, positions, block_size, ring_blocks)
    want = [_loop_slot(block_table, int(b), int(p), block_size, ring_blocks) for b, p in zip(seq_ids, positions)]
    assert got.dtype == torch.int64 and got.tolist() == want


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens,block_size", [(1, 16), (16, 16), (17, 32), (37, 16)])
def test_kv_store_matches_ref(device, dtype, num_tokens, block_size):
    num_kv_heads, head_dim, num_blocks = 2, 64, 7
    # k and v are strided views into one fused qkv projection, as the engine produces them.
    qkv = torch.randn(num_tokens, 4 + 2 * num_kv_heads, head_dim, device=device).to(dtype)
    k, v = qkv[:, 4:4 + num_kv_heads], qkv[:, 4 + num_kv_heads:]
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, device=device).to(dtype)
    v_cache = torch.randn_like(k_cache)
    slots = torch.randperm(num_blocks * block_size, device=device)[:num_tokens]
    slots[torch.rand(num_tokens, device=device) < 0.25] = -1  # padding rows
    want_k, want_v = k_cache.clone(), v_cache.clone()
    kv_store_ref(k, v, want_k, want_v, slots)
    kv_store(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


def test_kv_store_casts_to_cache_dtype(device):
    k = torch.randn(5, 1, 64, device=device)
    v = torch.randn(5, 1, 64, device=device)
    k_cache = torch.zeros(2, 16, 1, 64, device=device, dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.tensor([3, 17, -1, 0, 31], device=device)
    kv_store(k, v, k_cache, v_cache, slots)
    flat = k_cache.view(-1, 1, 64)
    # Within one bf16 ulp: the interpreter truncates fp32 -> bf16, the GPU rounds to nearest.
    got, want = flat[slots[slots >= 0]].float(), k[slots >= 0]
    assert ((got - want).abs() <= want.abs() * 2.0**-7).all()
    assert flat.abs().sum(dim=(1, 2)).count_nonzero() == 4


def test_kv_store_rejects_bad_arguments():
    k = torch.randn(4, 2, 64)
    cache = torch.zeros(2, 16, 2, 64)
    with pytest.raises(TypeError, match="int64"):
        kv_store(k, k, cache, cache.clone(), torch.zeros(4, dtype=torch.int32))
    with pytest.raises(ValueError, match="k, v must be"):
        kv_store(k[:, :1], k[:, :1], cache, cache.clone(), torch.zeros(4, dtype=torch.int64))
    with pytest.raises(ValueError, match="power of two"):
        cache_geometry(torch.zeros(2, 12, 2, 64), torch.zeros(2, 12, 2, 64))
    with pytest.raises(ValueError, match="same shape"):
        cache_geometry(cache, torch.zeros(3, 16, 2, 64))


@requires_gpu
def test_kv_store_real_shapes_gpu():
    num_tokens, num_kv_heads, head_dim, block_size, num_blocks = 4099, 8, 64, 64, 300
    qkv = torch.randn(num_tokens, 80, head_dim, device="cuda", dtype=torch.bfloat16)
    k, v = qkv[:, 64:72], qkv[:, 72:]
    k_cache = torch.zeros(num_blocks, block_size, num_kv_heads, head_dim, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.randperm(num_blocks * block_size, device="cuda")[:num_tokens]
    slots[::7] = -1
    want_k, want_v = k_cache.clone(), v_cache.clone()
    kv_store_ref(k, v, want_k, want_v, slots)
    kv_store(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
