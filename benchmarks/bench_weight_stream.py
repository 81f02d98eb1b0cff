"""Load-only benchmark: does the batch-1 MoE gemv's access pattern cost DRAM bandwidth? (a script)

The gemv kernels (kernels/moe_gemv.py) read, per K step, 256 bytes of each of a program's 32 weight
rows, rows 1,440 bytes apart; the whole GPU at one moment touches short pieces spread over the 4
experts' 33 MB. This script streams the same bytes with no arithmetic, in three orders:
  strided  the gemv's order on the checkpoint layout (row-major [E, N, K/2]);
  blocked  the same programs and steps on a layout where a program's rows form one group and each
           16-byte block column of the group is contiguous (MoeWeights.row_group = rows per
           program), so every K step of a program reads one contiguous piece;
  rowwise  the checkpoint layout, but each step reads whole rows (4 rows x 1,440 bytes).
If strided is much slower than blocked, a one-time reordering of the packed bytes at load is a
bandwidth lever for the gemv; if they tie, the gemv's limit is elsewhere.
--ring adds the blocked order read by tensor-memory copies into shared memory, several K steps in
flight per program without registers: the ceiling of a gemv1 fed that way.

    PYTHONPATH=src python benchmarks/bench_weight_stream.py [--batch64] [--ring]   # H200
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl
from bench_attention import _graph_ms  # same directory: on sys.path when run as a script

COPY_TBPS = 4.3


@triton.jit
def _strided_kernel(w_ptr, ids_ptr, out_ptr, stride_we, stride_wn, k_bytes, BLOCK_R: tl.constexpr,
                    G: tl.constexpr):
    expert = tl.load(ids_ptr + tl.program_id(0)).to(tl.int64)
    rows = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    g = tl.arange(0, G)
    words = (w_ptr + expert * stride_we).to(tl.pointer_type(tl.int32))
    ptrs = words + rows[:, None, None] * (stride_wn // 4) + g[None, :, None] * 4 + tl.arange(0, 4)[None, None, :]
    acc = tl.zeros((BLOCK_R, G, 4), dtype=tl.int32)
    for k0 in range(0, k_bytes, G * 16):
        g_ok = g < (k_bytes - k0) // 16
        acc ^= tl.load(ptrs, mask=g_ok[None, :, None], other=0)
        ptrs += G * 4
    tl.store(out_ptr + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1), tl.xor_sum(tl.xor_sum(tl.xor_sum(acc, 2), 1), 0))


@triton.jit
def _blocked_kernel(w_ptr, ids_ptr, out_ptr, stride_we, k_bytes, BLOCK_R: tl.constexpr, G: tl.constexpr):
    """Layout [E, N / BLOCK_R, K / 32, BLOCK_R, 16 bytes]."""
    expert = tl.load(ids_ptr + tl.program_id(0)).to(tl.int64)
    n_g = k_bytes // 16
    g = tl.arange(0, G)
    r = tl.arange(0, BLOCK_R)
    words = (w_ptr + expert * stride_we).to(tl.pointer_type(tl.int32))
    base = tl.program_id(1).to(tl.int64) * n_g * BLOCK_R * 4
    ptrs = words + base + (g[None, :, None] * BLOCK_R + r[:, None, None]) * 4 + tl.arange(0, 4)[None, None, :]
    acc = tl.zeros((BLOCK_R, G, 4), dtype=tl.int32)
    for k0 in range(0, k_bytes, G * 16):
        g_ok = g < (k_bytes - k0) // 16
        acc ^= tl.load(ptrs, mask=g_ok[None, :, None], other=0)
        ptrs += G * BLOCK_R * 4
    tl.store(out_ptr + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1), tl.xor_sum(tl.xor_sum(tl.xor_sum(acc, 2), 1), 0))


@triton.jit
def _rowwise_kernel(w_ptr, ids_ptr, out_ptr, stride_we, stride_wn, k_bytes, BLOCK_R: tl.constexpr,
                    STEP_R: tl.constexpr, G: tl.constexpr):
    """Whole rows per step: STEP_R rows x G 16-byte blocks (G >= k_bytes / 16, masked)."""
    expert = tl.load(ids_ptr + tl.program_id(0)).to(tl.int64)
    g = tl.arange(0, G)
    g_ok = g < k_bytes // 16
    words = (w_ptr + expert * stride_we).to(tl.pointer_type(tl.int32))
    rows = tl.program_id(1) * BLOCK_R + tl.arange(0, STEP_R)
    ptrs = words + rows[:, None, None] * (stride_wn // 4) + g[None, :, None] * 4 + tl.arange(0, 4)[None, None, :]
    acc = tl.zeros((STEP_R, G, 4), dtype=tl.int32)
    for _ in range(0, BLOCK_R, STEP_R):
        acc ^= tl.load(ptrs, mask=g_ok[None, :, None], other=0)
        ptrs += STEP_R * (stride_wn // 4)
    tl.store(out_ptr + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1), tl.xor_sum(tl.xor_sum(tl.xor_sum(acc, 2), 1), 0))


@triton.jit
def _ring_kernel(desc, ids_ptr, out_ptr, groups_per_expert, steps, BLOCK_R: tl.constexpr, G: tl.constexpr,
                 STAGES: tl.constexpr):
    """The blocked layout as int32 [E * N / BLOCK_R, K / 32, BLOCK_R * 4] read by tensor-memory copies
    into shared memory, STAGES - 1 K steps in flight per program without holding registers (the
    software pipeline of tl.range); a box past K is filled with zeros by the copy engine."""
    expert = tl.load(ids_ptr + tl.program_id(0))
    group = expert * groups_per_expert + tl.program_id(1)
    acc = tl.zeros((1, G, BLOCK_R * 4), dtype=tl.int32)
    for step in tl.range(0, steps, num_stages=STAGES):
        acc ^= desc.load([group, step * G, 0])
    tl.store(out_ptr + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1), tl.xor_sum(tl.xor_sum(tl.xor_sum(acc, 2), 1), 0))


def _graph_us(launches: list, replays: int = 20) -> float:
    """Median µs per launch, the launches captured in one CUDA graph (bench_attention's timer)."""
    return _graph_ms(lambda: [fn() for fn in launches], calls=1, replays=replays) * 1e3 / len(launches)


def run(experts: int, rows: int, k_bytes: int, block_r: int, g: int, num_warps: int, calls: int = 24,
        per_call: int = 4) -> None:
    """Each call reads `per_call` of the `experts` (4: a batch-1 step; all 32 of 20b: a batch-64 step)."""
    w = torch.randint(-2**31, 2**31 - 1, (experts, rows, k_bytes // 4), dtype=torch.int32, device="cuda")
    w = w.view(torch.uint8).view(experts, rows, k_bytes)
    gen = torch.Generator(device="cpu").manual_seed(0)
    # A different set of experts per call (4: 33 MB), so consecutive calls mostly miss L2.
    ids = torch.stack([torch.randperm(experts, generator=gen)[:per_call] for _ in range(calls)]).to(torch.int32).cuda()
    out = torch.empty(per_call * rows // block_r, dtype=torch.int32, device="cuda")
    grid = (per_call, rows // block_r)
    nbytes = per_call * rows * k_bytes

    def strided(i):
        return lambda: _strided_kernel[grid](w, ids[i], out, w.stride(0), w.stride(1), k_bytes, BLOCK_R=block_r, G=g,
                                             num_warps=num_warps)

    def blocked(i):
        return lambda: _blocked_kernel[grid](w, ids[i], out, w.stride(0), k_bytes, BLOCK_R=block_r, G=g,
                                             num_warps=num_warps)

    def rowwise(i):
        return lambda: _rowwise_kernel[grid](w, ids[i], out, w.stride(0), w.stride(1), k_bytes, BLOCK_R=block_r,
                                             STEP_R=4, G=triton.next_power_of_2(k_bytes // 16), num_warps=num_warps)

    for name, make in (("strided", strided), ("blocked", blocked), ("rowwise", rowwise), ("strided", strided),
                       ("blocked", blocked)):
        us = _graph_us([make(i) for i in range(calls)])
        print(f"E={per_call}/{experts} N={rows} K bytes={k_bytes} rows/program={block_r} step={g * 16} B "
              f"warps={num_warps} "
              f"{name:8} {us:7.2f} us  {nbytes / us / 1e6:6.2f} TB/s  {100 * nbytes / us / 1e6 / COPY_TBPS:5.1f} %",
              flush=True)


def run_ring(experts: int, rows: int, k_bytes: int, block_r: int, g: int, num_warps: int, stages: int,
             calls: int = 24, per_call: int = 4) -> None:
    """`run`'s blocked order read by tensor-memory copies into shared memory (_ring_kernel): how fast
    the same bytes stream when the bytes in flight do not cost registers."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    w = torch.randint(-2**31, 2**31 - 1, (experts * rows // block_r, k_bytes // 16, block_r * 4), dtype=torch.int32,
                      device="cuda")
    desc = TensorDescriptor.from_tensor(w, [1, g, block_r * 4])
    gen = torch.Generator(device="cpu").manual_seed(0)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:per_call] for _ in range(calls)]).to(torch.int32).cuda()
    out = torch.empty(per_call * rows // block_r, dtype=torch.int32, device="cuda")
    grid = (per_call, rows // block_r)
    steps = triton.cdiv(k_bytes // 16, g)
    launches = [lambda i=i: _ring_kernel[grid](desc, ids[i], out, rows // block_r, steps, BLOCK_R=block_r, G=g,
                                               STAGES=stages, num_warps=num_warps) for i in range(calls)]
    us = _graph_us(launches)
    nbytes = per_call * rows * k_bytes
    print(f"E={per_call}/{experts} N={rows} K bytes={k_bytes} rows/program={block_r} step={g * 16} B "
          f"warps={num_warps} ring{stages:<4} {us:7.2f} us  {nbytes / us / 1e6:6.2f} TB/s  "
          f"{100 * nbytes / us / 1e6 / COPY_TBPS:5.1f} %", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch64", action="store_true",
                        help="a batch-64 step's volume instead: all 32 experts of a 128-expert pool per call")
    parser.add_argument("--ring", action="store_true",
                        help="also gemv1's tile through tensor-memory copies, 2-5 pipeline stages (bytes in flight "
                             "without registers)")
    args = parser.parse_args()
    if args.batch64:
        run(128, 5760, 1440, 128, 2, 2, calls=8, per_call=32)  # the decode tiles' gemm1 programs (K step 64)
        run(128, 5760, 1440, 64, 16, 4, calls=8, per_call=32)  # the grouped mma's (K step 512 values)
        run(128, 5760, 1440, 16, 32, 4, calls=8, per_call=32)
        return
    run(32, 5760, 1440, 32, 16, 4)  # gemv1's tile (16 columns = 32 W1 rows, K step 512 values)
    run(32, 2880, 1440, 8, 16, 4)  # gemv2's tile (8 rows, K step 512 values)
    run(32, 5760, 1440, 16, 32, 4)  # longer steps, fewer rows (session 9: faster alone)
    if args.ring:
        for g, stages in ((8, 3), (8, 4), (8, 5), (16, 3), (16, 4), (8, 3), (8, 5)):  # gemv1's K step is 8 blocks
            run_ring(32, 5760, 1440, 32, g, 4, stages)
        run(32, 5760, 1440, 32, 8, 4)  # the blocked plain loads at gemv1's K step, for the comparison


if __name__ == "__main__":
    main()
