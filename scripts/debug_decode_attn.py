"""Isolate the illegal memory access seen in bench_attention.py's CUDA-graph timing (2026-11-30):
each decode case runs in its own process, eagerly and then replayed from a CUDA graph.

    PYTHONPATH=src python scripts/debug_decode_attn.py
"""

from __future__ import annotations

import subprocess
import sys

CASES = [(1, 1024, 0), (1, 32768, 0), (1, 131072, 0), (1, 32768, 128), (64, 1024, 0), (64, 131072, 0), (64, 32768, 128)]


def one(batch: int, context: int, window: int) -> None:
    import torch

    sys.path.insert(0, "benchmarks")
    import bench_attention as ba

    from gptoss_cli.kernels.decode_attention import decode_attention

    ring = -(-window // ba.BLOCK_SIZE) + 1 if window else 0
    k_cache, v_cache, table = ba._paged_cache(batch, ring or -(-context // ba.BLOCK_SIZE), "cuda")
    q = torch.randn(batch, ba.NUM_HEADS, ba.HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    sinks = torch.randn(ba.NUM_HEADS, dtype=torch.bfloat16, device="cuda")
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    out = torch.empty_like(q)
    call = lambda: decode_attention(q, k_cache, v_cache, table, seq_lens, sinks, ba.SM_SCALE, window, ring, out=out)
    call()
    torch.cuda.synchronize()
    eager = out.clone()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        call()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            call()
    torch.cuda.synchronize()
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    print(f"B={batch} ctx={context} window={window}: eager ok, graph ok, equal={torch.equal(out, eager)}")


if __name__ == "__main__":
    if len(sys.argv) == 4:
        one(*map(int, sys.argv[1:]))
    else:
        for case in CASES:
            proc = subprocess.run([sys.executable, __file__, *map(str, case)], capture_output=True, text=True, check=False,
                                  env={**__import__("os").environ, "CUDA_LAUNCH_BLOCKING": "1"})
            print(proc.stdout.strip() or f"B={case[0]} ctx={case[1]} window={case[2]}: FAILED rc={proc.returncode}\n"
                  + "\n".join(proc.stderr.strip().splitlines()[-4:]))
