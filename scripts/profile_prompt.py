"""Where the time to the first token of one prompt goes: device kernels against host work.

    PYTHONPATH=src python scripts/profile_prompt.py [--model 20b] [--lengths 128 4096] [--runs 5]

For each prompt length: the median TTFT of a batch-1 request with max_tokens=1 (each run a new
prompt, so no prefix-cache hits); one request's timeline (metadata, forward launched, forward
done on the device, first token); one more such request under torch.profiler (kernel time summed
by family, as profile_decode.py groups them, and the number of launches) and one under cProfile
(the host functions with the most time of their own). A TTFT far above its kernel time
is host-bound: launches, Python, synchronisation.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time
from collections import defaultdict

import torch

from profile_decode import engine_options, family, kernel_events  # same directory: on sys.path when run as a script


def _prompt(length: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 199998, (length,), generator=g).tolist()


def _first_token(eng, prompt: list[int]) -> float:
    """Seconds from submission to the first token of one request (max_tokens=1)."""
    from gptoss_cli.runtime.api import SamplingParams

    out = eng.generate([prompt], SamplingParams(temperature=0, max_tokens=1))[0]
    return out.timings.first_token - out.timings.arrival


def _kernels(eng, prompt: list[int]) -> None:
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        _first_token(eng, prompt)
        torch.cuda.synchronize()
    per_family: dict[str, float] = defaultdict(float)
    per_kernel: dict[str, float] = defaultdict(float)
    events = kernel_events(prof)
    for ev in events:
        per_family[family(ev.name)] += ev.device_time_total
        per_kernel[ev.name] += ev.device_time_total
    busy, launches = sum(per_family.values()), len(events)
    print(f"  kernels {busy / 1e3:.2f} ms in {launches} launches:")
    for fam, us in sorted(per_family.items(), key=lambda kv: -kv[1])[:8]:
        print(f"    {fam:<26}{us / 1e3:>8.2f} ms")
    print("  top kernels:")
    for name, us in sorted(per_kernel.items(), key=lambda kv: -kv[1])[:8]:
        print(f"    {us / 1e3:>8.2f} ms  {name[:90]}")


def _timeline(eng, prompt: list[int]) -> None:
    """One request's prompt step in phases (host ms since arrival): metadata built, forward launched
    (host only: the kernels are queued), forward done on the device (a sync added here), sampled
    token on the host. Runs the wrapped step once, then restores the engine's functions."""
    import gptoss_cli.runtime.gpu.runner as runner_mod

    runner, marks = eng.runner, {}
    build, forward, sample = runner._build_eager, runner.model.forward, runner_mod.sample

    def timed(name, fn, sync=False):
        def call(*a, **k):
            out = fn(*a, **k)
            marks[name] = time.perf_counter()
            if sync:
                torch.cuda.synchronize()
                marks[name + " (device done)"] = time.perf_counter()
            return out
        return call

    runner._build_eager = timed("metadata built", build)
    runner.model.forward = timed("forward launched", forward, sync=True)
    runner_mod.sample = timed("sampling launched", sample)
    try:
        start = time.perf_counter()
        _first_token(eng, prompt)
        marks["first token"] = time.perf_counter()
    finally:
        runner._build_eager, runner.model.forward, runner_mod.sample = build, forward, sample
    print("  timeline (ms since submission): " + ", ".join(
        f"{name} {(t - start) * 1e3:.1f}" for name, t in sorted(marks.items(), key=lambda kv: kv[1])))


def _host(eng, prompt: list[int], top: int) -> None:
    prof = cProfile.Profile()
    prof.enable()
    _first_token(eng, prompt)
    torch.cuda.synchronize()
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
    lines = [ln for ln in out.getvalue().splitlines() if ln.strip()]
    start = next(i for i, ln in enumerate(lines) if ln.lstrip().startswith("ncalls"))
    print("  host, by own time (cProfile):")
    for ln in lines[start - 1:start + top + 1]:
        print("    " + ln[:150])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="20b", choices=["tiny", "20b", "120b"])
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 4096])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--top", type=int, default=25, help="host functions to print")
    parser.add_argument("--engine", nargs="*", default=[], metavar="FIELD=VALUE")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    from gptoss_cli.runtime.gpu.engine import GpuEngine
    from gptoss_cli.runtime.random_checkpoint import random_weights

    eng = GpuEngine(random_weights(args.model, device="cuda"), max_batch=1, **engine_options(args.engine))
    seed = 0
    for length in args.lengths:
        _first_token(eng, _prompt(length, seed := seed + 1))  # settle
        times = []
        for _ in range(args.runs):
            times.append(_first_token(eng, _prompt(length, seed := seed + 1)) * 1e3)
        print(f"\nprompt {length} tokens: TTFT median {statistics.median(times):.1f} ms "
              f"(runs {', '.join(f'{t:.1f}' for t in times)})")
        _timeline(eng, _prompt(length, seed := seed + 1))
        t = time.perf_counter()
        _kernels(eng, _prompt(length, seed := seed + 1))
        print(f"  (profiled request {(time.perf_counter() - t) * 1e3:.1f} ms)")
        _host(eng, _prompt(length, seed := seed + 1), args.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
