"""Benchmark of the small kernels at gpt-oss shapes: rms_norm, rope and sample (a script, not a test).

Cases: rms_norm (with the residual add) at T = 1, 64, 4096 and C = 2880; rope on q and k of the
fused qkv output at T = 1, 64, 4096; sample at B = 1, 64, 256 and V = 201088 for greedy,
temperature-only and top-p = 0.9 rows; the batch-1 qkv and o projections in each form torch
offers (cuBLAS chooses differently per form); the few-token projections (T = 2-64) in cuBLAS and in
kernels.skinny_linear at several tiles. The logits are bf16 and shaped like a language model's
(a few strong tokens well above a broad tail), where a top-p row's threshold search runs on its
small window; "top-p=0.9 flat" rows have no strong tokens, so their window overflows and the
search re-reads the whole row (the slow path). For each case it prints the median time, the
bytes that must move (each input read once, each output written once) and that rate as a
fraction of the H200's 4.3 TB/s.

Timing replays a CUDA graph (triton.testing.do_bench_cudagraph), as the engine runs decode, so
Python launch overhead is not counted; if capture fails it falls back to triton.testing.do_bench.
Graph replays do not flush L2, so a timed call sweeps enough copies of the inputs to exceed the
50 MB L2 (at most MAX_COPIES) and the time is reported per copy.

    PYTHONPATH=src python benchmarks/bench_small_kernels.py            # on the H200
    PYTHONPATH=src python benchmarks/bench_small_kernels.py --smoke    # CPU, Triton interpreter, tiny shapes
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

PEAK_TBPS = 4.3  # measured H200 device-to-device copy bandwidth
L2_BYTES = 50e6
MAX_COPIES = 64
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 2880, 64, 8, 64, 201088


@dataclass(frozen=True)
class Sizes:
    """The shapes one run covers."""

    norm_tokens: tuple[int, ...] = (1, 64, 4096)
    rope_tokens: tuple[int, ...] = (1, 64, 4096)
    sample_batches: tuple[int, ...] = (1, 64, 256)
    vocab: int = VOCAB
    skinny_tokens: tuple[int, ...] = (2, 8, 16, 32, 64)


SMOKE_SIZES = Sizes(norm_tokens=(1, 3), rope_tokens=(1, 3), sample_batches=(1, 2), vocab=3001, skinny_tokens=(3,))


@dataclass
class Case:
    """One timed call: `make(copy)` builds the inputs of one copy and returns the call to time."""

    kernel: str
    label: str
    nbytes: int
    make: Callable[[int], Callable[[], object]]


def _copies(nbytes: int, device: str) -> int:
    return 1 if device != "cuda" else max(1, min(MAX_COPIES, math.ceil(2 * L2_BYTES / nbytes)))


def _time_gpu(calls: list[Callable[[], object]]) -> float:
    """Median ms per call of the sweep over all copies."""
    import triton.testing

    def sweep():
        for call in calls:
            call()

    sweep()  # compile and warm up outside any capture
    try:
        return triton.testing.do_bench_cudagraph(sweep, return_mode="median") / len(calls)
    except Exception as err:  # capture can fail on an odd driver; eager timing still says a lot
        print(f"  (graph capture failed: {err!r}; timing eagerly)")
        return triton.testing.do_bench(sweep, return_mode="median") / len(calls)


def _time_cpu(calls: list[Callable[[], object]], repeats: int = 2) -> float:
    """Median ms of a few interpreter runs (triton.testing cannot time without a GPU)."""
    calls[0]()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        calls[0]()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def _rms_norm_cases(sizes: Sizes, device: str) -> list[Case]:
    from gptoss_cli.kernels.rmsnorm import rms_norm

    def make(tokens):
        def build(_copy):
            x = torch.randn(tokens, HIDDEN, device=device).bfloat16()
            residual = torch.randn(tokens, HIDDEN, device=device).bfloat16()
            weight = torch.rand(HIDDEN, device=device).bfloat16()
            y, h = torch.empty_like(x), torch.empty_like(x)
            return lambda: rms_norm(x, weight, 1e-5, residual, out=y, residual_out=h)
        return build

    # read x, residual, weight; write y and h (bf16)
    return [Case("rms_norm", f"T={t} C={HIDDEN} +residual", 2 * (4 * t * HIDDEN + HIDDEN), make(t))
            for t in sizes.norm_tokens]


def _rope_cases(sizes: Sizes, device: str) -> list[Case]:
    from gptoss_cli.kernels.rope import apply_rope_qkv, rope_cos_sin
    from gptoss_cli.runtime.config import ModelConfig

    cos, sin = rope_cos_sin(ModelConfig(), 131072, device)
    width = (HEADS + 2 * KV_HEADS) * HEAD_DIM

    def make(tokens):
        def build(_copy):
            qkv = torch.randn(tokens, width, device=device).bfloat16()
            positions = torch.randint(0, 131072, (tokens,), device=device)
            return lambda: apply_rope_qkv(qkv, positions, cos, sin, HEADS, KV_HEADS, HEAD_DIM)
        return build

    def nbytes(t):  # q and k read and written in bf16, positions, one cos and one sin row per token
        return 2 * 2 * t * (HEADS + KV_HEADS) * HEAD_DIM + 8 * t + 2 * 4 * t * HEAD_DIM // 2

    return [Case("rope", f"T={t} H={HEADS} Hkv={KV_HEADS} D={HEAD_DIM}", nbytes(t), make(t))
            for t in sizes.rope_tokens]


def _lm_logits(batch: int, vocab: int, device: str, strong: int = 16) -> torch.Tensor:
    """A broad N(0, 2^2) tail plus `strong` tokens per row at 15 to 25, in bf16."""
    logits = torch.randn(batch, vocab, device=device) * 2
    if strong:
        ids = torch.randint(0, vocab, (batch, strong), device=device)
        logits.scatter_(1, ids, torch.rand(batch, strong, device=device) * 10 + 15)
    return logits.bfloat16()


def _sample_cases(sizes: Sizes, device: str) -> list[Case]:
    from gptoss_cli.kernels.sampling import sample

    modes = {"greedy": (0.0, 1.0, 16), "temperature": (1.0, 1.0, 16), "top-p=0.9": (1.0, 0.9, 16),
             "top-p=0.9 flat": (1.0, 0.9, 0)}

    def make(batch, temperature, top_p, strong):
        def build(copy):
            logits = _lm_logits(batch, sizes.vocab, device, strong)
            args = (torch.full((batch,), temperature, device=device),
                    torch.zeros(batch, dtype=torch.int32, device=device),
                    torch.full((batch,), top_p, device=device), torch.zeros(batch, device=device),
                    torch.arange(batch, device=device) + 1000 * copy,
                    torch.zeros(batch, dtype=torch.long, device=device))
            out = torch.empty(batch, dtype=torch.long, device=device)
            return lambda: sample(logits, *args, out=out)
        return build

    return [Case("sample", f"B={b} V={sizes.vocab} {name}", 2 * b * sizes.vocab + 40 * b, make(b, *mode))
            for b in sizes.sample_batches for name, mode in modes.items()]


# Batch-1 projections: cuBLAS picks its kernel from the call's shape and layout, so the same
# product is timed in the forms torch offers (the engine uses addmm).
PROJECTIONS = {"qkv": ((HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN), "o": (HIDDEN, HEADS * HEAD_DIM)}
PROJECTION_FORMS = {
    "addmm": lambda x, w, b: torch.addmm(b, x, w.T),
    "linear": lambda x, w, b: torch.nn.functional.linear(x, w, b),
    "addmv": lambda x, w, b: torch.addmv(b, w, x[0]),
    "addmm W@x^T": lambda x, w, b: torch.addmm(b[:, None], w, x.T),
}
# kernels/linear.py's row_linear at a few (rows per program, warps).
ROW_LINEAR_LAUNCHES = [(1, 4), (2, 4), (4, 8), (2, 2)]


def _row_linear_form(block_n: int, num_warps: int):
    from gptoss_cli.kernels.linear import row_linear

    return lambda x, w, b: row_linear(x, w, b, block_n=block_n, num_warps=num_warps)


def _projection_cases(device: str) -> list[Case]:
    def make(n, k, form):
        def build(_copy):
            x = torch.randn(1, k, device=device).bfloat16()
            w = (torch.randn(n, k, device=device) / k**0.5).bfloat16()
            b = torch.randn(n, device=device).bfloat16()
            return lambda: form(x, w, b)
        return build

    forms = dict(PROJECTION_FORMS)
    forms |= {f"row_linear n{bn} w{nw}": _row_linear_form(bn, nw) for bn, nw in ROW_LINEAR_LAUNCHES}
    return [Case("linear", f"T=1 {name} {k}->{n} {label}", 2 * (n * k + n + k), make(n, k, form))
            for name, (n, k) in PROJECTIONS.items() for label, form in forms.items()]


# Few-token projections (decode steps of 2-64 tokens): cuBLAS (qkv then the rope launch that stores
# K/V, as the engine ran them before kernels.skinny_linear) against the skinny kernels at a few
# tiles (rows per program, K step, pipeline stages, warps, K splits; 0: ~2 programs per SM).
SKINNY_TILES = [(64, 128, 4, 4, 0), (64, 128, 4, 4, 1), (32, 128, 4, 4, 0), (64, 256, 3, 4, 0), (64, 128, 6, 4, 0),
                (64, 64, 6, 4, 0), (128, 128, 3, 8, 0), (32, 128, 6, 4, 0)]


def _skinny_cases(sizes: Sizes, device: str) -> list[Case]:
    from gptoss_cli.kernels import SkinnyScratch, apply_rope_qkv, qkv_rope_store_tokens, skinny_linear
    from gptoss_cli.kernels.skinny_linear import SkinnyTiles

    blocks = 64

    def make(t, which, tiles):
        n, k = PROJECTIONS[which]

        def build(_copy):
            x = torch.randn(t, k, device=device).bfloat16()
            w = (torch.randn(n, k, device=device) / k**0.5).bfloat16()
            b = torch.randn(n, device=device).bfloat16()
            scratch = SkinnyScratch.for_shapes([(n, k)], device, tiles) if tiles is not None else None
            if which == "o":
                if tiles is None:
                    return lambda: torch.addmm(b, x, w.T)
                return lambda: skinny_linear(x, w, b, tiles=tiles, scratch=scratch)
            pos = torch.arange(t, device=device)
            cos, sin = torch.randn(4096, HEAD_DIM // 2, device=device), torch.randn(4096, HEAD_DIM // 2, device=device)
            kc, vc = (torch.zeros(blocks, 64, KV_HEADS, HEAD_DIM, device=device).bfloat16() for _ in range(2))
            slots = torch.arange(t, device=device) * 3
            heads = (HEADS, KV_HEADS, HEAD_DIM)
            if tiles is None:
                def unfused():
                    qkv = torch.addmm(b, x, w.T)
                    apply_rope_qkv(qkv, pos, cos, sin, *heads, (kc, vc, slots))
                return unfused
            return lambda: qkv_rope_store_tokens(x, w, b, pos, cos, sin, *heads, kc, vc, slots, tiles=tiles,
                                                 scratch=scratch)
        return build

    cases = []
    for t in sizes.skinny_tokens:
        for which, (n, k) in PROJECTIONS.items():
            nbytes = 2 * (n * k + n + t * k + t * n)
            forms = {"cuBLAS" + (" + rope" if which == "qkv" else ""): None}
            forms |= {f"skinny n{bn} k{bk} s{st} w{nw} x{sp}": SkinnyTiles(bn, bk, st, nw, sp)
                      for bn, bk, st, nw, sp in SKINNY_TILES}
            cases += [Case("skinny", f"T={t} {which} {label}", nbytes, make(t, which, tiles))
                      for label, tiles in forms.items()]
    return cases


def bench(device: str = "cuda", sizes: Sizes = Sizes(), only: str | None = None) -> list[dict]:
    """Time every case (or only those of one kernel); one dict per case with kernel, case, ms, bytes,
    tbps, peak_fraction."""
    timer = _time_gpu if device == "cuda" else _time_cpu
    results = []
    cases = (_rms_norm_cases(sizes, device) + _rope_cases(sizes, device) + _sample_cases(sizes, device)
             + _projection_cases(device) + _skinny_cases(sizes, device))
    for case in (c for c in cases if only is None or c.kernel == only):
        calls = [case.make(i) for i in range(_copies(case.nbytes, device))]
        ms = timer(calls)
        tbps = case.nbytes / (ms * 1e-3) / 1e12
        results.append({"kernel": case.kernel, "case": case.label, "ms": ms, "bytes": case.nbytes,
                        "tbps": tbps, "peak_fraction": tbps / PEAK_TBPS})
        del calls
        if device == "cuda":
            torch.cuda.empty_cache()
    return results


def _print_table(results: list[dict], device: str) -> None:
    where = torch.cuda.get_device_name() if device == "cuda" else "CPU (Triton interpreter)"
    print(f"small kernels on {where}; peak = {PEAK_TBPS} TB/s")
    print(f"{'kernel':9} {'case':42} {'time (us)':>11} {'bytes':>12} {'TB/s':>7} {'% peak':>7}")
    for r in results:
        print(f"{r['kernel']:9} {r['case']:42} {r['ms'] * 1e3:11.2f} {r['bytes']:12,d} {r['tbps']:7.3f} "
              f"{100 * r['peak_fraction']:6.1f}%")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="CPU, Triton interpreter, tiny shapes")
    parser.add_argument("--only", choices=["rms_norm", "rope", "sample", "linear", "skinny"], help="one kernel's cases")
    args = parser.parse_args(argv)
    if args.smoke:
        # Must be set before any kernel module is imported (the kernels are decorated at import).
        os.environ["TRITON_INTERPRET"] = "1"
        device, sizes = "cpu", SMOKE_SIZES
    else:
        if not torch.cuda.is_available():
            raise SystemExit("no CUDA GPU: run with --smoke for the CPU interpreter path")
        device, sizes = "cuda", Sizes()
    torch.manual_seed(0)
    _print_table(bench(device, sizes, args.only), device)


if __name__ == "__main__":
    main()
