"""Decode attention (paged / ring KV cache, sinks, window, GQA, split-K) vs attention_ref.

Each sequence's K/V are drawn in full, the part a real cache would still hold is written into a
NaN-filled cache through an independent slot formula, and the kernel output is compared with the
twin run on the original K/V: a kernel that reads a slot it should not sees NaN.
"""

import pytest
import torch
from helpers import assert_close

from gptoss_cli.kernels.attention import attention_ref
from gptoss_cli.kernels.decode_attention import DecodeTiles, choose_num_splits, decode_attention

requires_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
SM_SCALE = 0.125


def _fp32_tol(device):
    # The interpreter's fp32 dot is exact; the GPU's is TF32.
    return 1e-5 if device == "cpu" else 5e-3


def _build_cache(seq_lens, num_kv_heads, head_dim, block_size, ring_blocks, dtype, device):
    """NaN cache + block table holding each sequence's live positions; returns (caches, table, kv list)."""
    max_blocks = ring_blocks or max(1, -(-max(seq_lens) // block_size))
    num_blocks = len(seq_lens) * max_blocks + 3
    k_cache = torch.full((num_blocks, block_size, num_kv_heads, head_dim), float("nan"), device=device).to(dtype)
    v_cache = k_cache.clone()
    table = torch.randperm(num_blocks, device=device)[: len(seq_lens) * max_blocks]
    table = table.view(len(seq_lens), max_blocks).to(torch.int32)
    kvs = []
    for b, seq_len in enumerate(seq_lens):
        k = torch.randn(seq_len, num_kv_heads, head_dim, device=device).to(dtype)
        v = torch.randn(seq_len, num_kv_heads, head_dim, device=device).to(dtype)
        # A ring only still holds its last ring_blocks * block_size positions.
        first = max(0, seq_len - ring_blocks * block_size) if ring_blocks else 0
        pos = torch.arange(first, seq_len, device=device)
        logical = pos // block_size
        if ring_blocks:
            logical = logical % ring_blocks
        blocks = table[b, logical].long()
        k_cache[blocks, pos % block_size] = k[first:]
        v_cache[blocks, pos % block_size] = v[first:]
        kvs.append((k, v))
    return k_cache, v_cache, table, kvs


def _reference(q, kvs, seq_lens, sinks, window):
    rows = []
    for b, seq_len in enumerate(seq_lens):
        if seq_len == 0:
            rows.append(torch.zeros_like(q[b:b + 1]))
            continue
        k, v = kvs[b]
        pos = torch.arange(seq_len, device=q.device)
        rows.append(attention_ref(q[b:b + 1], k, v, sinks, SM_SCALE, pos[-1:], pos, window))
    return torch.cat(rows)


def _run(seq_lens, num_heads, num_kv_heads, block_size, window, ring_blocks, num_splits, device,
         dtype=torch.float32, sink_scale=1.0, head_dim=64, tiles=None):
    k_cache, v_cache, table, kvs = _build_cache(seq_lens, num_kv_heads, head_dim, block_size, ring_blocks,
                                                dtype, device)
    # q as a strided view of a fused projection output, the way the engine passes it.
    q = torch.randn(len(seq_lens), num_heads + 2 * num_kv_heads, head_dim, device=device).to(dtype)[:, :num_heads]
    sinks = (torch.randn(num_heads, device=device) * sink_scale).to(dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    out = decode_attention(q, k_cache, v_cache, table, lens, sinks, SM_SCALE, window, ring_blocks,
                           num_splits=num_splits, tiles=tiles)
    return out, _reference(q, kvs, seq_lens, sinks, window)


BOUNDARY_LENS = [1, 15, 16, 17, 129, 300, 0]  # BS-1, BS, BS+1 for BS=16; 0 = padding row


@pytest.mark.parametrize("num_splits", [1, 4])
def test_full_attention_paged(device, num_splits):
    out, ref = _run(BOUNDARY_LENS, 16, 2, 16, 0, 0, num_splits, device)
    assert_close(out, ref, _fp32_tol(device), f"full, {num_splits} splits")
    assert torch.equal(out[-1], torch.zeros_like(out[-1])), "padding row must be zero"


def test_splits_agree_with_one_split(device):
    torch.manual_seed(1)
    a, _ = _run([300, 77], 8, 1, 32, 0, 0, 1, device)
    torch.manual_seed(1)
    b, _ = _run([300, 77], 8, 1, 32, 0, 0, 5, device)
    assert_close(b, a, _fp32_tol(device), "5 splits vs 1")


def test_min_chunk_leaves_trailing_splits_empty(device):
    # 96 keys per split at least: 300 keys fill 4 of 8 splits (the last one partly), 77 fill one,
    # 1 key leaves 7 splits empty; the reduce must ignore the empty partials.
    tiles = DecodeTiles(block_n=32, num_warps=4, num_stages=1, min_chunk=96)
    out, ref = _run([300, 77, 1, 0], 8, 1, 16, 0, 0, 8, device, tiles=tiles)
    assert_close(out, ref, _fp32_tol(device), "min_chunk 96, 8 splits")


@pytest.mark.parametrize("ring_blocks,num_splits", [(0, 1), (9, 1), (9, 3)])
def test_sliding_window(device, ring_blocks, num_splits):
    # R * BS = 144 = window + BS exactly; 700 positions wrap the ring about 5 times.
    lens = [1, 127, 128, 129, 300, 700, 0]
    out, ref = _run(lens, 16, 2, 16, 128, ring_blocks, num_splits, device)
    assert_close(out, ref, _fp32_tol(device), f"window 128, ring {ring_blocks}")


def test_small_ring_tiles_span_blocks(device):
    # window 20 in a ring of 3 blocks of 8: a 32-key tile covers four blocks and wraps the ring.
    out, ref = _run([5, 20, 21, 95], 8, 1, 8, 20, 3, 2, device)
    assert_close(out, ref, _fp32_tol(device), "window 20, ring 3x8")


@pytest.mark.parametrize("sink_scale", [30.0, -30.0])
def test_bf16_gqa_8_to_1_with_extreme_sinks(device, sink_scale):
    # Sinks of +-30 dominate or vanish from the denominator; bf16 storage, fp32 math inside.
    out, ref = _run([33, 200, 0], 8, 1, 32, 0, 0, 2, device, dtype=torch.bfloat16, sink_scale=sink_scale)
    assert out.dtype == torch.bfloat16
    assert_close(out.float(), ref.float(), 2e-2, f"bf16, sinks x{sink_scale}")


def test_default_splits_and_out_argument(device):
    k_cache, v_cache, table, kvs = _build_cache([40, 3], 2, 64, 16, 0, torch.float32, device)
    q = torch.randn(2, 16, 64, device=device)
    sinks = torch.randn(16, device=device)
    lens = torch.tensor([40, 3], dtype=torch.int32, device=device)
    out = torch.full_like(q, float("nan"))
    got = decode_attention(q, k_cache, v_cache, table, lens, sinks, SM_SCALE, 0, 0, out=out)
    assert got.data_ptr() == out.data_ptr()
    assert_close(out, _reference(q, kvs, [40, 3], sinks, 0), _fp32_tol(device), "default splits")


def test_choose_num_splits_is_static_and_bounded():
    assert choose_num_splits(1, 8, 32768, 132) == 64
    assert choose_num_splits(64, 8, 32768, 132) == 2
    assert choose_num_splits(1, 8, 128, 132) == 1
    assert choose_num_splits(0, 8, 10**6, 132) == 128


def test_rejects_bad_arguments():
    cache = torch.zeros(4, 16, 2, 64)
    q, sinks = torch.zeros(1, 16, 64), torch.zeros(16)
    table, lens = torch.zeros(1, 4, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    with pytest.raises(TypeError, match="int32"):
        decode_attention(q, cache, cache, table.long(), lens, sinks, SM_SCALE, 0, 0)
    with pytest.raises(ValueError, match="ring"):
        decode_attention(q, cache, cache, table, lens, sinks, SM_SCALE, 128, 4)  # 4 * 16 < 128
    with pytest.raises(ValueError, match="sinks"):
        decode_attention(q, cache, cache, table, lens, sinks[:8], SM_SCALE, 0, 0)
    with pytest.raises(ValueError, match="multiple"):
        decode_attention(torch.zeros(1, 15, 64), cache, cache, table, lens, sinks[:15], SM_SCALE, 0, 0)
    with pytest.raises(ValueError, match="num_splits"):
        decode_attention(q, cache, cache, table, lens, sinks, SM_SCALE, 0, 0, num_splits=0)


@requires_gpu
@pytest.mark.parametrize("context", [300, 4096, 32768])  # 300: a short row over several 128-key splits
def test_real_shapes_gpu(context):
    lens = [context, context - 1, 1000, 0]
    out, ref = _run(lens, 64, 8, 64, 0, 0, None, "cuda", dtype=torch.bfloat16)
    assert_close(out.float(), ref.float(), 2e-2, f"full {context}")
    out, ref = _run(lens, 64, 8, 64, 128, 3, None, "cuda", dtype=torch.bfloat16)
    assert_close(out.float(), ref.float(), 2e-2, f"sliding {context}")
