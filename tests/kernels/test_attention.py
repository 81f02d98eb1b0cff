"""attention_ref vs a per-row loop, and prefill attention (packed chunks + paged/ring context) vs attention_ref.

Prefill cases draw each sequence's K/V in full, put the context part (positions < ctx_len) into a
NaN-filled cache through an independent slot formula (a ring keeps only its last R * BS positions),
pass the chunk's own K/V as the fresh tensors, and compare with the twin on the original K/V.
"""

import math

import pytest
import torch
from helpers import assert_close

from gptoss_cli.kernels.attention import PrefillTiles, attention_ref, prefill_attention
from gptoss_cli.kernels.decode_attention import decode_attention
from gptoss_cli.kernels.kv_store import cache_slots, kv_store

requires_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
SM_SCALE = 0.125


def _fp32_tol(device):
    # The interpreter's fp32 dot is exact; the GPU's is TF32.
    return 1e-5 if device == "cpu" else 5e-3


def test_attention_ref_matches_row_loop():
    t, s, h, hkv, d, window = 5, 9, 4, 2, 8, 3
    q, k, v = torch.randn(t, h, d), torch.randn(s, hkv, d), torch.randn(s, hkv, d)
    sinks = torch.randn(h)
    q_pos, k_pos = torch.tensor([0, 2, 4, 7, 8]), torch.arange(s)
    out = attention_ref(q, k, v, sinks, 0.3, q_pos, k_pos, window)
    for i in range(t):
        for head in range(h):
            kv = head // (h // hkv)
            keys = [j for j in range(s) if q_pos[i] - window < k_pos[j] <= q_pos[i]]
            logits = [float(q[i, head] @ k[j, kv]) * 0.3 for j in keys]
            den = sum(math.exp(x) for x in logits) + math.exp(float(sinks[head]))
            want = sum(math.exp(x) / den * v[j, kv] for x, j in zip(logits, keys))
            assert torch.allclose(out[i, head], torch.as_tensor(want, dtype=torch.float32), atol=1e-5)


def _write_context(k_cache, v_cache, table, b, k, v, ctx, block_size, ring_blocks):
    first = max(0, ctx - ring_blocks * block_size) if ring_blocks else 0
    pos = torch.arange(first, ctx, device=k.device)
    logical = pos // block_size
    if ring_blocks:
        logical = logical % ring_blocks
    blocks = table[b, logical].long()
    k_cache[blocks, pos % block_size] = k[first:ctx]
    v_cache[blocks, pos % block_size] = v[first:ctx]


def _run(seqs, num_heads, num_kv_heads, block_size, window, ring_blocks, device, dtype=torch.float32,
         sink_scale=1.0, tiles=None, head_dim=64):
    """seqs: list of (ctx_len, chunk_len). Returns (kernel out, reference)."""
    max_blocks = ring_blocks or max(1, max(-(-c // block_size) for c, _ in seqs))
    num_blocks = len(seqs) * max_blocks + 2
    k_cache = torch.full((num_blocks, block_size, num_kv_heads, head_dim), float("nan"), device=device).to(dtype)
    v_cache = k_cache.clone()
    table = torch.randperm(num_blocks, device=device)[: len(seqs) * max_blocks]
    table = table.view(len(seqs), max_blocks).to(torch.int32)
    sinks = (torch.randn(num_heads, device=device) * sink_scale).to(dtype)
    qs, ks, vs, refs = [], [], [], []
    for b, (ctx, n) in enumerate(seqs):
        k = torch.randn(ctx + n, num_kv_heads, head_dim, device=device).to(dtype)
        v = torch.randn(ctx + n, num_kv_heads, head_dim, device=device).to(dtype)
        q = torch.randn(n, num_heads, head_dim, device=device).to(dtype)
        _write_context(k_cache, v_cache, table, b, k, v, ctx, block_size, ring_blocks)
        qs.append(q), ks.append(k[ctx:]), vs.append(v[ctx:])
        pos = torch.arange(ctx + n, device=device)
        refs.append(attention_ref(q, k, v, sinks, SM_SCALE, pos[ctx:], pos, window))
    lens = torch.tensor([n for _, n in seqs], device=device)
    cu = torch.cat((lens.new_zeros(1), lens.cumsum(0))).to(torch.int32)
    ctx_lens = torch.tensor([c for c, _ in seqs], dtype=torch.int32, device=device)
    # q, k, v as strided views of one fused projection output, the way the engine passes them.
    qkv = torch.cat((torch.cat(qs), torch.cat(ks), torch.cat(vs)), dim=1)
    q, k, v = qkv.split((num_heads, num_kv_heads, num_kv_heads), dim=1)
    out = prefill_attention(q, k, v, k_cache, v_cache, table, cu, ctx_lens, sinks, SM_SCALE, window, ring_blocks,
                            max(n for _, n in seqs), max(c for c, _ in seqs), tiles=tiles)
    return out, torch.cat(refs)


# ctx 0; a chunk that starts mid-block; ctx 129, BS-1, BS, BS+1 (BS = 16); one-token and long chunks.
MIXED = [(0, 37), (5, 16), (129, 20), (15, 1), (17, 70), (16, 15)]


def test_full_mixed_batch(device):
    out, ref = _run(MIXED, 16, 2, 16, 0, 0, device)
    assert_close(out, ref, _fp32_tol(device), "full, mixed")


@pytest.mark.parametrize("ring_blocks", [0, 9])
def test_sliding_mixed_batch(device, ring_blocks):
    # ring: R * BS = 144 = window + BS; ctx 400 wraps it ~3 times; chunk 150 > window.
    seqs = [(0, 150), (127, 3), (400, 33), (129, 1)]
    out, ref = _run(seqs, 8, 1, 16, 128, ring_blocks, device)
    assert_close(out, ref, _fp32_tol(device), f"window 128, ring {ring_blocks}")


@pytest.mark.parametrize("tiles", [PrefillTiles(16, 16, 4, 1), PrefillTiles(128, 64, 4, 1)],
                         ids=["tiles16x16", "tiles128x64"])
def test_tile_shapes_across_block_boundaries(device, tiles):
    # block_n 16 < BS 32 and block_n 64 > BS 32; a small window of 20 in a ring of 2 blocks.
    seqs = [(33, 17), (64, 9), (0, 35)]
    out, ref = _run(seqs, 8, 1, 32, 0, 0, device, tiles=tiles)
    assert_close(out, ref, _fp32_tol(device), f"full {tiles}")
    out, ref = _run(seqs, 8, 1, 32, 20, 2, device, tiles=tiles)
    assert_close(out, ref, _fp32_tol(device), f"window 20 {tiles}")


@pytest.mark.parametrize("sink_scale", [30.0, -30.0])
def test_bf16_gqa_8_to_1_with_extreme_sinks(device, sink_scale):
    out, ref = _run([(0, 40), (17, 24)], 8, 1, 16, 0, 0, device, dtype=torch.bfloat16, sink_scale=sink_scale)
    assert out.dtype == torch.bfloat16
    assert_close(out.float(), ref.float(), 2e-2, f"bf16, sinks x{sink_scale}")


def test_non_power_of_two_group(device):
    out, ref = _run([(3, 10), (0, 7)], 6, 2, 16, 0, 0, device)
    assert_close(out, ref, _fp32_tol(device), "group of 3")


def test_chunked_prefill_then_decode_matches_reference(device):
    """Engine-shaped flow: two prefill chunks with kv_store in between, then one decode step."""
    num_heads, num_kv_heads, head_dim, block_size, window, ring = 8, 1, 64, 16, 24, 3
    total = 61
    q = torch.randn(total + 1, num_heads, head_dim, device=device)
    k = torch.randn(total + 1, num_kv_heads, head_dim, device=device)
    v = torch.randn(total + 1, num_kv_heads, head_dim, device=device)
    sinks = torch.randn(num_heads, device=device)
    for win, ring_blocks in ((0, 0), (window, ring)):
        k_cache = torch.full((12, block_size, num_kv_heads, head_dim), float("nan"), device=device)
        v_cache = k_cache.clone()
        table = torch.randperm(12, device=device)[:5].view(1, 5).to(torch.int32)
        outs = []
        for lo, hi in ((0, 29), (29, total)):
            cu = torch.tensor([0, hi - lo], dtype=torch.int32, device=device)
            ctx = torch.tensor([lo], dtype=torch.int32, device=device)
            outs.append(prefill_attention(q[lo:hi], k[lo:hi], v[lo:hi], k_cache, v_cache, table, cu, ctx, sinks,
                                          SM_SCALE, win, ring_blocks, hi - lo, lo))
            pos = torch.arange(lo, hi, device=device)
            slots = cache_slots(table, torch.zeros_like(pos), pos, block_size, ring_blocks)
            if ring_blocks:  # a chunk longer than the ring keeps only its last R * BS tokens
                slots[: max(0, len(pos) - ring_blocks * block_size)] = -1
            kv_store(k[lo:hi], v[lo:hi], k_cache, v_cache, slots)
        slot = cache_slots(table, torch.zeros(1, device=device, dtype=torch.long),
                           torch.tensor([total], device=device), block_size, ring_blocks)
        kv_store(k[total:], v[total:], k_cache, v_cache, slot)
        lens = torch.tensor([total + 1], dtype=torch.int32, device=device)
        outs.append(decode_attention(q[total:], k_cache, v_cache, table, lens, sinks, SM_SCALE, win, ring_blocks))
        pos = torch.arange(total + 1, device=device)
        ref = attention_ref(q, k, v, sinks, SM_SCALE, pos, pos, win)
        assert_close(torch.cat(outs), ref, _fp32_tol(device), f"chunked, window {win}")


def test_empty_and_padded_rows_are_zero(device):
    q = torch.randn(6, 8, 64, device=device)
    k = torch.randn(6, 1, 64, device=device)
    cache = torch.zeros(2, 16, 1, 64, device=device)
    table = torch.zeros(2, 2, dtype=torch.int32, device=device)
    cu = torch.tensor([0, 0, 4], dtype=torch.int32, device=device)  # sequence 0 is empty; rows 4, 5 padding
    ctx = torch.zeros(2, dtype=torch.int32, device=device)
    sinks = torch.randn(8, device=device)
    out = prefill_attention(q, k, k, cache, cache.clone(), table, cu, ctx, sinks, SM_SCALE, 0, 0, 4, 0)
    pos = torch.arange(4, device=device)
    assert_close(out[:4], attention_ref(q[:4], k[:4], k[:4], sinks, SM_SCALE, pos, pos), _fp32_tol(device), "seq 1")
    assert torch.equal(out[4:], torch.zeros_like(out[4:]))


def test_rejects_bad_arguments():
    q, k = torch.zeros(4, 8, 64), torch.zeros(4, 1, 64)
    cache = torch.zeros(2, 16, 1, 64)
    table = torch.zeros(1, 2, dtype=torch.int32)
    cu, ctx = torch.tensor([0, 4], dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    sinks = torch.zeros(8)
    with pytest.raises(TypeError, match="int32"):
        prefill_attention(q, k, k, cache, cache, table, cu.long(), ctx, sinks, SM_SCALE, 0, 0, 4, 0)
    with pytest.raises(ValueError, match="k and v"):
        prefill_attention(q, k[:3], k[:3], cache, cache, table, cu, ctx, sinks, SM_SCALE, 0, 0, 4, 0)
    with pytest.raises(ValueError, match="ring"):
        prefill_attention(q, k, k, cache, cache, table, cu, ctx, sinks, SM_SCALE, 0, 2, 4, 0)
    with pytest.raises(ValueError, match="block_m"):
        prefill_attention(q, k, k, cache, cache, table, cu, ctx, sinks, SM_SCALE, 0, 0, 4, 0,
                          tiles=PrefillTiles(12, 16, 4, 1))


@requires_gpu
def test_real_shapes_gpu():
    out, ref = _run([(0, 4096)], 64, 8, 64, 0, 0, "cuda", dtype=torch.bfloat16)
    assert_close(out.float(), ref.float(), 2e-2, "4k prefill, full")
    out, ref = _run([(0, 4096)], 64, 8, 64, 128, 3, "cuda", dtype=torch.bfloat16)
    assert_close(out.float(), ref.float(), 2e-2, "4k prefill, sliding")
    seqs = [(3000, 1000), (0, 517), (130, 2000)]
    out, ref = _run(seqs, 64, 8, 64, 0, 0, "cuda", dtype=torch.bfloat16)
    assert_close(out.float(), ref.float(), 2e-2, "chunked prefill, full")
    out, ref = _run(seqs, 64, 8, 64, 128, 3, "cuda", dtype=torch.bfloat16)
    assert_close(out.float(), ref.float(), 2e-2, "chunked prefill, sliding")
