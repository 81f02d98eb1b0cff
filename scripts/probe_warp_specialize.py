"""Does Hopper warp specialisation help a dequantise-then-dot loop? (H200; a probe, not product code)

The MoE kernels load packed weights, dequantise them with integer ALU work and feed tensor cores,
all in the same warps, at ~45-55 % issue efficiency (docs/optimizations.md, session 21). Triton
3.6 can split a `tl.range(..., warp_specialize=True)` loop into a TMA producer warp group and a
consumer group on sm_90. This times one such loop with and without the split:
    C[M, N] = A[M, K] @ dequant(W[N, K])^T,   A bf16, W one uint8 code per value,
at the shape of 32 experts' gate_up rows against 128 tokens each (120b at a 4k prompt), with two
dequantisations that bracket the production asm's cost (~2.3 integer instructions per value):
"cheap" (a shift and a bitcast, ~1) and "e2m1" (an FP4 decode from bit fields and a scale, ~10).
"bf16" is the same loop over bf16 weights with no dequantisation. Prints µs and TFLOP/s, each
configuration from a process of its own with a time limit.

    PYTHONPATH=src python scripts/probe_warp_specialize.py [--timeout 60]

Session 21 (H200, torch 2.11, triton 3.6): bf16 without the split 336.2 µs (404 TFLOP/s); the
first warp-specialised launch (bf16, 3 stages) never returned, and the call ended at its limit.
"""

from __future__ import annotations

import argparse
import subprocess
import sys

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

BM, BN, BK = 128, 128, 64


@triton.jit
def _dequant(codes, MODE: tl.constexpr):
    if MODE == 1:  # cheap: the byte is the high byte of a bf16
        w = (codes.to(tl.int16) << 7).to(tl.bfloat16, bitcast=True)
    elif MODE == 2:  # e2m1 from bit fields, then a power-of-two scale
        v = codes.to(tl.int32)
        mag = v & 7
        normal = (((mag >> 1) + 126) << 7) | ((mag & 1) << 6)
        bits = tl.where(mag >= 2, normal, tl.where(mag == 1, 0x3F00, 0)) | ((v & 8) << 12)
        w = (bits.to(tl.int16).to(tl.bfloat16, bitcast=True).to(tl.float32) * 0.25).to(tl.bfloat16)
    else:
        w = codes
    return w


@triton.jit
def _kernel(a_desc, w_desc, c_ptr, N, K, MODE: tl.constexpr, WS: tl.constexpr, STAGES: tl.constexpr,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n = tl.program_id(0)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in tl.range(0, K, BLOCK_K, num_stages=STAGES, warp_specialize=WS):
        a = a_desc.load([0, k])
        w = _dequant(w_desc.load([pid_n * BLOCK_N, k]), MODE)
        acc = tl.dot(a, w.T, acc)
    rows = tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(c_ptr + rows[:, None] * N + cols[None, :], acc.to(tl.bfloat16))


def _time(fn, iters: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2] * 1e3  # median, µs


MODES = {"bf16": 0, "cheap": 1, "e2m1": 2}


def run_one(name: str, stages: int, ws: bool, experts: int, n_per: int, k: int) -> None:
    """Time one configuration and print its row."""
    n = experts * n_per
    a = torch.randn(BM, k, device="cuda", dtype=torch.bfloat16)
    if name == "bf16":
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    else:
        w = torch.randint(0, 256, (n, k), device="cuda", dtype=torch.uint8)
    c = torch.empty(BM, n, device="cuda", dtype=torch.bfloat16)
    a_desc, w_desc = TensorDescriptor.from_tensor(a, [BM, BK]), TensorDescriptor.from_tensor(w, [BN, BK])
    us = _time(lambda: _kernel[(triton.cdiv(n, BN),)](
        a_desc, w_desc, c, n, k, MODE=MODES[name], WS=ws, STAGES=stages, BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK,
        num_warps=4))
    print(f"{name:<6} stages {stages} warp_specialize={ws!s:<5} {us:9.1f} µs {2 * BM * n * k / us / 1e6:7.1f} TFLOP/s",
          flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--k", type=int, default=2880)
    parser.add_argument("--n", type=int, default=5760)
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds per configuration (compile + run)")
    parser.add_argument("--one", nargs=3, metavar=("MODE", "STAGES", "WS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU (Hopper)")
    if args.one:
        run_one(args.one[0], int(args.one[1]), args.one[2] == "1", args.experts, args.n, args.k)
        return
    print(f"M={BM} N={args.experts * args.n} K={args.k} ({args.experts} experts of {args.n} rows), "
          f"tiles {BM}x{BN}x{BK}", flush=True)
    # Each configuration in a process of its own: session 21's first run of this script never came
    # back from its first warp-specialised launch, and took the whole device call with it.
    for name in MODES:
        for stages in (3, 4):
            for ws in (False, True):
                cmd = [sys.executable, __file__, "--one", name, str(stages), "1" if ws else "0",
                       "--experts", str(args.experts), "--n", str(args.n), "--k", str(args.k)]
                try:
                    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, check=False)
                    out = proc.stdout.strip() or f"rc={proc.returncode}: {proc.stderr.strip()[-200:]}"
                except subprocess.TimeoutExpired:
                    out = f"no result within {args.timeout:.0f} s (compile or kernel hung)"
                print(out if out.startswith(name) else f"{name:<6} stages {stages} warp_specialize={ws}: {out}",
                      flush=True)


if __name__ == "__main__":
    main()
