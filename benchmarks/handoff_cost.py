"""What a grid-wide hand-off inside one launch costs against a PDL link between launches (H200 machine).

    PYTHONPATH=src python benchmarks/handoff_cost.py [--phases 48] [--programs 0] [--rounds 5]

A persistent decode layer would replace the step's chain of dependent launches (each link ~1 us,
scripts/launch_cost.py) by phases of one launch that wait for each other on device counters.
Whether that pays depends on what one such hand-off costs. Both forms run the same `phases`
dependent phases over G programs (default: one per SM, all resident, so spinning cannot starve
anyone): in each phase program p reads what program p + 1 wrote in the phase before (through L2)
and writes that plus one.
- launches: one launch per phase, chained with PDL (each waits for the one before), in a CUDA graph;
- counters: one launch; after its write each program counts itself in on the phase's counter
  (release) and spins until all G have (volatile loads, then an acquire fence);
- acquire: the same, spinning on acquire loads (no fence).
Each prints microseconds per phase (median over `rounds` replays of a graph of the whole chain)
and checks that every program ended with the value `phases`, which a missed hand-off (a stale
read) would not give. The interpreter cannot run it: its programs run one after another, so the
counted form's first program would spin forever.
"""

from __future__ import annotations

import argparse
import sys

import torch
import triton
import triton.language as tl
from bench_attention import _graph_ms  # same directory: on sys.path when run as a script

from gptoss_cli.kernels.pdl import pdl_enabled, pdl_launch, wait_for_previous


@triton.jit
def _phase_kernel(src_ptr, dst_ptr, PDL: tl.constexpr):
    """One phase as its own launch: dst[p] = src[p + 1] + 1."""
    wait_for_previous(PDL)
    p = tl.program_id(0)
    g = tl.num_programs(0)
    v = tl.load(src_ptr + (p + 1) % g, cache_modifier=".cg")
    tl.store(dst_ptr + p, v + 1)


@triton.jit
def _acquire_fence():
    tl.inline_asm_elementwise("fence.acq_rel.gpu; mov.b32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _load_acquire(ptr):
    return tl.inline_asm_elementwise("ld.acquire.gpu.global.u32 $0, [$1];", "=r,l", [ptr], dtype=tl.int32,
                                     is_pure=False, pack=1)


@triton.jit
def _counted_phases_kernel(buf_ptr, count_ptr, phases, PDL: tl.constexpr, ACQUIRE_LOADS: tl.constexpr = False):
    """All phases in one launch: buffers alternate by phase parity; count_ptr[i] (zero at the start)
    counts the programs done with phase i. ACQUIRE_LOADS: spin on ld.acquire.gpu instead of volatile
    loads and a fence (which also invalidates L1)."""
    wait_for_previous(PDL)
    p = tl.program_id(0)
    g = tl.num_programs(0)
    for i in range(phases):
        src = buf_ptr + (i % 2) * g
        dst = buf_ptr + ((i + 1) % 2) * g
        v = tl.load(src + (p + 1) % g, cache_modifier=".cg")
        tl.store(dst + p, v + 1)
        tl.debug_barrier()  # every thread's store before the arrival
        tl.atomic_add(count_ptr + i, 1, sem="release", scope="gpu")
        if ACQUIRE_LOADS:
            seen = _load_acquire(count_ptr + i)
            while seen < g:
                seen = _load_acquire(count_ptr + i)
        else:
            seen = tl.load(count_ptr + i, volatile=True)
            while seen < g:
                seen = tl.load(count_ptr + i, volatile=True)
            _acquire_fence()


def run_launches(programs: int, phases: int, rounds: int) -> tuple[float, bool]:
    buf = torch.zeros((2, programs), dtype=torch.int32, device="cuda")
    opts = pdl_launch(pdl_enabled(buf))

    def fn():
        buf.zero_()
        for i in range(phases):
            _phase_kernel[(programs,)](buf[i % 2], buf[(i + 1) % 2], **opts)

    us = _graph_ms(fn, calls=1, replays=rounds) * 1e3 / phases
    return us, bool((buf[phases % 2] == phases).all())


def run_counters(programs: int, phases: int, rounds: int, acquire_loads: bool = False) -> tuple[float, bool]:
    buf = torch.zeros((2, programs), dtype=torch.int32, device="cuda")
    count = torch.zeros(phases, dtype=torch.int32, device="cuda")
    opts = pdl_launch(pdl_enabled(buf))

    def fn():
        buf.zero_()
        count.zero_()
        _counted_phases_kernel[(programs,)](buf, count, phases, num_warps=4, ACQUIRE_LOADS=acquire_loads, **opts)

    us = _graph_ms(fn, calls=1, replays=rounds) * 1e3 / phases
    return us, bool((buf[phases % 2] == phases).all())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--phases", type=int, default=48)
    parser.add_argument("--programs", type=int, default=0, help="0: one per SM")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU (the counted form spins, which the interpreter's serial programs cannot)",
              file=sys.stderr)
        return 2
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    programs = args.programs or sms
    if programs > sms:
        print(f"--programs {programs} > {sms} SMs: the counted form needs every program resident", file=sys.stderr)
        return 2
    ok = True
    forms = (("launches", run_launches), ("counters", run_counters),
             ("acquire", lambda *a: run_counters(*a, acquire_loads=True)))
    for name, fn in forms:
        us, right = fn(programs, args.phases, args.rounds)
        ok &= right
        print(f"{name:9s} {programs} programs x {args.phases} phases: {us:.2f} us per phase"
              + ("" if right else "  WRONG: a phase read a stale value"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
