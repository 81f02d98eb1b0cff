"""benchmarks/bench_weight_stream.py's load-only kernels read exactly the bytes they claim to:
each program's XOR of its rows, in all three orders and through the tensor-memory ring, equals the
XOR of the same rows on the CPU."""

from __future__ import annotations

import functools
import importlib.util
import sys
from pathlib import Path

import pytest
import torch


@functools.cache
def _bench():
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_weight_stream.py"
    spec = importlib.util.spec_from_file_location("bench_weight_stream_test", path)
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(path.parent))  # it imports bench_attention's timer
    spec.loader.exec_module(module)
    return module


def _expected(words: torch.Tensor, ids: torch.Tensor, block_r: int) -> list[int]:
    """XOR of each (slot, row block)'s int32 words."""
    out = []
    for expert in ids.tolist():
        for start in range(0, words.shape[1], block_r):
            acc = 0
            for v in words[expert, start:start + block_r].flatten().tolist():
                acc ^= v
            out.append(acc)
    return out


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter check; the GPU runs the benchmark itself")
@pytest.mark.parametrize("k_bytes,g", [(160, 4), (96, 2)])  # 160: a half-masked last step
def test_every_order_reads_the_programs_bytes(k_bytes, g):
    bench = _bench()
    experts, rows, block_r = 3, 64, 16
    w = torch.randint(-2**31, 2**31 - 1, (experts, rows, k_bytes // 4), dtype=torch.int32)
    blocked = w.view(experts, rows // block_r, block_r, k_bytes // 16, 4).transpose(2, 3).contiguous()
    ids = torch.tensor([2, 0, 1, 2], dtype=torch.int32)
    want = _expected(w, ids, block_r)
    out = torch.empty(4 * rows // block_r, dtype=torch.int32)
    grid = (4, rows // block_r)
    as_bytes = w.view(torch.uint8).view(experts, rows, k_bytes)
    bench._strided_kernel[grid](as_bytes, ids, out, as_bytes.stride(0), as_bytes.stride(1), k_bytes,
                                BLOCK_R=block_r, G=g)
    assert out.tolist() == want
    bench._rowwise_kernel[grid](as_bytes, ids, out, as_bytes.stride(0), as_bytes.stride(1), k_bytes,
                                BLOCK_R=block_r, STEP_R=4, G=16)
    assert out.tolist() == want
    grouped = blocked.view(torch.uint8).view(experts, rows, k_bytes)
    bench._blocked_kernel[grid](grouped, ids, out, grouped.stride(0), k_bytes, BLOCK_R=block_r, G=g)
    assert out.tolist() == want
    from triton.tools.tensor_descriptor import TensorDescriptor

    ring = blocked.view(experts * rows // block_r, k_bytes // 16, block_r * 4)
    out.zero_()
    bench._ring_kernel[grid](TensorDescriptor.from_tensor(ring, [1, g, block_r * 4]), ids, out, rows // block_r,
                             -(-k_bytes // (16 * g)), BLOCK_R=block_r, G=g, STAGES=3)
    assert out.tolist() == want
