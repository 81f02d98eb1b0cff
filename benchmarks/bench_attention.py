"""Benchmark of decode and prefill attention at gpt-oss shapes (H=64, Hkv=8, D=64, bf16 KV).

Usage:  PYTHONPATH=src python benchmarks/bench_attention.py           # H100/H200
        PYTHONPATH=src python benchmarks/bench_attention.py --smoke   # tiny shapes, Triton interpreter, CPU
Decode is memory-bound: its bytes are the K/V rows read plus q and out, compared with copy
bandwidth (4.3 TB/s on H200). Prefill is compute-bound: FLOPs are 4*D per visible (query head,
key) pair, compared with the measured dense bf16 rate (786 TFLOP/s). Not a test: nothing is asserted.
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import dataclass

import torch

COPY_TBPS = 4.3
BF16_TFLOPS = 786.0
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, WINDOW = 64, 8, 64, 64, 128
SM_SCALE = HEAD_DIM ** -0.5


@dataclass(frozen=True)
class Sizes:
    """Workload grid: the real one for the GPU, a tiny one for the interpreter smoke run."""

    decode_batches: tuple[int, ...]
    decode_contexts: tuple[int, ...]
    sliding_context: int
    prefill_tokens: tuple[int, ...]


GPU_SIZES = Sizes((1, 64), (1024, 4096, 32768, 131072), 32768, (4096, 16384))
SMOKE_SIZES = Sizes((1, 2), (100,), 300, (48,))


def _timer(device: str):
    """Median milliseconds of fn() replayed in a CUDA graph on the GPU (as the engine runs decode:
    eager do_bench timed Python launch gaps, ~0.13 ms flat at batch 1 on 2026-11-30); one
    wall-clock run in the interpreter."""
    if device == "cuda":
        return _graph_ms

    def wall(fn):
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3

    return wall


def _graph_ms(fn, calls: int = 20, replays: int = 15) -> float:
    """fn captured `calls` times in one graph (as the engine captures one step), median of
    `replays` replays per call. triton's do_bench_cudagraph captures rep/estimate calls (tens of
    thousands here) and the decode case then hit an illegal address on 2026-11-30, although
    every case runs clean eagerly and as a one-call graph (scripts/debug_decode_attn.py).
    Replays do not flush L2 (50 MB): cases whose KV is smaller read it from L2 after the first call."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # compile and warm up outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
    torch.cuda.current_stream().wait_stream(stream)
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return sorted(times)[len(times) // 2]


def _paged_cache(num_seqs: int, blocks_per_seq: int, device: str):
    """Random bf16 K/V caches whose blocks are shuffled among sequences, as paging leaves them."""
    num_blocks = num_seqs * blocks_per_seq
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k_cache = torch.empty(shape, dtype=torch.bfloat16, device=device).normal_()
    v_cache = torch.empty(shape, dtype=torch.bfloat16, device=device).normal_()
    table = torch.randperm(num_blocks, device=device).view(num_seqs, blocks_per_seq).to(torch.int32)
    return k_cache, v_cache, table


def _row(op: str, layer: str, batch: int, tokens: int, ms: float, nbytes: float, flops: float) -> dict:
    tbps = nbytes / (ms * 1e-3) / 1e12
    tflops = flops / (ms * 1e-3) / 1e12
    return dict(op=op, layer=layer, batch=batch, tokens=tokens, ms=ms, gbytes=nbytes / 1e9, tbps=tbps,
                pct_copy=100 * tbps / COPY_TBPS, tflop=flops / 1e12, tflops=tflops,
                pct_bf16=100 * tflops / BF16_TFLOPS)


def _decode_case(batch: int, context: int, window: int, device: str, timer, tiles=None, num_splits=None,
                 table_blocks: int = 0) -> dict:
    """table_blocks: the block table's width when wider than the context needs (the engine sizes it
    for its longest row; the entries past the context are never read)."""
    from gptoss_cli.kernels.decode_attention import decode_attention

    ring = -(-window // BLOCK_SIZE) + 1 if window else 0
    blocks_per_seq = ring or -(-context // BLOCK_SIZE)
    k_cache, v_cache, table = _paged_cache(batch, blocks_per_seq, device)
    if table_blocks > blocks_per_seq:
        wide = torch.zeros(batch, table_blocks, dtype=table.dtype, device=device)
        wide[:, :blocks_per_seq] = table
        table = wide
    q = torch.randn(batch, NUM_HEADS, HEAD_DIM, dtype=torch.bfloat16, device=device)
    sinks = torch.randn(NUM_HEADS, dtype=torch.bfloat16, device=device)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    out = torch.empty_like(q)
    ms = timer(lambda: decode_attention(q, k_cache, v_cache, table, seq_lens, sinks, SM_SCALE, window, ring,
                                        num_splits=num_splits, out=out, tiles=tiles))
    keys = min(context, window) if window else context
    kv_bytes = batch * keys * NUM_KV_HEADS * HEAD_DIM * 2 * 2
    flops = 4 * HEAD_DIM * NUM_HEADS * batch * keys
    return _row("decode", "sliding" if window else "full", batch, context, ms, kv_bytes + 2 * q.numel() * 2, flops)


def _visible_pairs(tokens: int, window: int) -> int:
    if not window:
        return tokens * (tokens + 1) // 2
    w = min(window, tokens)
    return w * (w + 1) // 2 + (tokens - w) * window


def _prefill_case(tokens: int, window: int, device: str, timer, tiles=None) -> dict:
    from gptoss_cli.kernels.attention import prefill_attention

    ring = -(-window // BLOCK_SIZE) + 1 if window else 0
    k_cache, v_cache, table = _paged_cache(1, ring or -(-tokens // BLOCK_SIZE), device)
    q = torch.randn(tokens, NUM_HEADS, HEAD_DIM, dtype=torch.bfloat16, device=device)
    k = torch.randn(tokens, NUM_KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device=device)
    v = torch.randn_like(k)
    sinks = torch.randn(NUM_HEADS, dtype=torch.bfloat16, device=device)
    cu = torch.tensor([0, tokens], dtype=torch.int32, device=device)
    ctx = torch.zeros(1, dtype=torch.int32, device=device)
    ms = timer(lambda: prefill_attention(q, k, v, k_cache, v_cache, table, cu, ctx, sinks, SM_SCALE, window, ring,
                                         tokens, 0, tiles=tiles))
    nbytes = (2 * q.numel() + 2 * k.numel()) * 2
    flops = 4 * HEAD_DIM * NUM_HEADS * _visible_pairs(tokens, window)
    return _row("prefill", "sliding" if window else "full", 1, tokens, ms, nbytes, flops)


def bench(device: str = "cuda", sizes: Sizes | None = None) -> list[dict]:
    """Time every case; on "cpu" (needs TRITON_INTERPRET=1 set before import) the tiny smoke grid."""
    sizes = sizes or (GPU_SIZES if device == "cuda" else SMOKE_SIZES)
    timer = _timer(device)
    rows = []
    for batch in sizes.decode_batches:
        for context in sizes.decode_contexts:
            rows.append(_decode_case(batch, context, 0, device, timer))
        rows.append(_decode_case(batch, sizes.sliding_context, WINDOW, device, timer))
        if device == "cuda":
            torch.cuda.empty_cache()
    for tokens in sizes.prefill_tokens:
        for window in (0, WINDOW):
            rows.append(_prefill_case(tokens, window, device, timer))
    return rows


def sweep(device: str = "cuda") -> list[tuple[str, dict]]:
    """Batch-1 decode at 32k over key tile, warps, pipeline depth, fewest keys per split and split
    count (66: the engine's, sized for 131k rows on 132 SMs); then decode_tiles' default and the
    three fastest again, twice at 32k and at 131k, interleaved: single samples at 32k move by
    ~0.5 us between runs (session 19), as much as most differences in the grid."""
    from gptoss_cli.kernels.decode_attention import DecodeTiles, decode_tiles

    timer, out = _timer(device), []
    if device == "cpu":
        grid, contexts = [(32, 4, 1, 32, 2), (32, 2, 1, 64, 4)], (100, 300)
    else:
        grid = [(bn, w, st, mc, sp) for bn in (64, 128) for w in (2, 4, 8) for st in (2, 3, 4)
                for mc in (256, 512) for sp in (66, 132)]
        contexts = (32768, 131072)

    def run(spec, context):
        bn, w, st, mc, sp = spec
        label = f"block_n={bn} warps={w} stages={st} min_chunk={mc} splits={sp}"
        tiles = DecodeTiles(block_n=bn, num_warps=w, num_stages=st, min_chunk=mc)
        out.append((label, _decode_case(1, context, 0, device, timer, tiles=tiles, num_splits=sp)))
        return out[-1][1]["ms"]

    times = {spec: run(spec, contexts[0]) for spec in grid}
    d = decode_tiles(grid[0][4])
    default = (d.block_n, d.num_warps, d.num_stages, d.min_chunk or d.block_n, grid[0][4])
    for context in (contexts[0], contexts[0], contexts[1]):
        for spec in dict.fromkeys([default, *sorted(times, key=times.get)[:3]]):
            run(spec, context)
    return out


def short_sweep(device: str = "cuda") -> list[tuple[str, dict]]:
    """Decode at the short contexts of a chat or `gptoss bench` (a 128-token prompt), with the
    engine's block table (131,072 keys wide) and so its split count (choose_num_splits): the
    fewest keys per split (min_chunk) decides how many programs share a short row's keys."""
    from gptoss_cli.kernels.decode_attention import DecodeTiles, choose_num_splits

    timer, out = _timer(device), []
    sms = torch.cuda.get_device_properties(0).multi_processor_count if device == "cuda" else 4
    table_keys = 131072 if device == "cuda" else 512
    for batch in (1, 64) if device == "cuda" else (1,):
        splits = choose_num_splits(batch, NUM_KV_HEADS, table_keys, sms)
        for context in (256, 384, 1024, 4096) if device == "cuda" else (100,):
            for mc in (128, 256, 512) if device == "cuda" else (32, 64):
                tiles = DecodeTiles(block_n=128 if device == "cuda" else 32, num_warps=4,
                                    num_stages=3 if device == "cuda" else 1, min_chunk=mc)
                label = f"batch {batch} splits {splits} min_chunk={mc}"
                out.append((label, _decode_case(batch, context, 0, device, timer, tiles=tiles, num_splits=splits,
                                                table_blocks=table_keys // BLOCK_SIZE)))
    return out


def prefill_sweep(device: str = "cuda") -> list[tuple[str, dict]]:
    """A 4k-token prompt (CPU: 48 tokens) over the prefill kernel's launch shape, full and sliding
    layers: rows of (token, query head) per program, keys per step, warps and pipeline depth
    (kernels.attention.prefill_tiles picks 128 / 64 / 4 / 3 at these sizes). The shapes that
    compile without spills for sm_90 (offline, session 17; registers per thread, full layers):
    128/64 with 4 warps 232-248, with 8 warps 127-137; 128/128 with 8 warps 229-233; 256/64 with 8
    warps 225-226. 128/128 and 256/64 with 4 warps and every 256/128 spill."""
    from gptoss_cli.kernels.attention import PrefillTiles

    timer, out = _timer(device), []
    shapes = [(128, 64, 4), (128, 64, 8), (128, 128, 8), (256, 64, 8)]
    grid = [PrefillTiles(bm, bn, w, st) for bm, bn, w in shapes for st in (2, 3)]
    if device == "cpu":
        grid = [PrefillTiles(64, 32, 4, 1), PrefillTiles(128, 32, 4, 1)]
    tokens = 48 if device == "cpu" else 4096
    for window in (0, WINDOW):
        for t in grid:
            label = f"block_m={t.block_m} block_n={t.block_n} warps={t.num_warps} stages={t.num_stages}"
            try:
                out.append((label, _prefill_case(tokens, window, device, timer, tiles=t)))
            except Exception as e:  # a shape the compiler rejects (e.g. out of shared memory): report it
                print(f"{label}: {type(e).__name__}: {str(e)[:120]}")
    return out


def format_table(rows: list[dict]) -> str:
    head = (f"{'op':8}{'layer':9}{'B':>4}{'ctx/T':>8}{'ms':>10}{'GB':>9}{'TB/s':>7}{'%copy':>7}"
            f"{'TFLOP':>8}{'TF/s':>8}{'%bf16':>7}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['op']:8}{r['layer']:9}{r['batch']:>4}{r['tokens']:>8}{r['ms']:>10.4f}"
                     f"{r['gbytes']:>9.4f}{r['tbps']:>7.2f}{r['pct_copy']:>7.1f}{r['tflop']:>8.3f}"
                     f"{r['tflops']:>8.1f}{r['pct_bf16']:>7.1f}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true",
                        help="tiny shapes on the CPU under the Triton interpreter")
    parser.add_argument("--sweep", action="store_true", help="also sweep batch-1 decode tiles and splits at 32k")
    parser.add_argument("--prefill-sweep", action="store_true", help="also sweep the prefill kernel's tiles at 4k")
    parser.add_argument("--short-sweep", action="store_true",
                        help="also sweep the fewest keys per split at short contexts, engine-wide block table")
    args = parser.parse_args()
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before any kernel module is imported
    elif not torch.cuda.is_available():
        raise SystemExit("no CUDA GPU: run with --smoke for the interpreter check")
    device = "cpu" if args.smoke else "cuda"
    if device == "cuda":
        print(f"{torch.cuda.get_device_name()}  H={NUM_HEADS} Hkv={NUM_KV_HEADS} D={HEAD_DIM} BS={BLOCK_SIZE} bf16")
    print(format_table(bench(device)))
    if args.sweep:
        for label, r in sweep(device):
            print(f"{label:<54} ctx {r['tokens']:>6}  {r['ms'] * 1e3:8.1f} us  {r['pct_copy']:5.1f} % of copy bw")
    if args.short_sweep:
        for label, r in short_sweep(device):
            print(f"{label:<40} ctx {r['tokens']:>6}  {r['ms'] * 1e3:8.1f} us")
    if args.prefill_sweep:
        for label, r in prefill_sweep(device):
            print(f"{label:<46} {r['layer']:<8} T {r['tokens']:>5}  {r['ms'] * 1e3:8.1f} us  {r['pct_bf16']:5.1f} % of bf16")


if __name__ == "__main__":
    main()
