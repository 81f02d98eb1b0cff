"""Where the time to the first token of one prompt goes: device kernels against host work.

    PYTHONPATH=src python scripts/profile_prompt.py [--model 20b] [--lengths 128 4096] [--runs 5]

For each prompt length: the median TTFT of a batch-1 request with max_tokens=1 (each run a new
prompt, so no prefix-cache hits); then one more such request under torch.profiler (kernel time
summed by family, as profile_decode.py groups them, and the number of launches) and one under
cProfile (the host functions with the most time of their own). A TTFT far above its kernel time
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

from profile_decode import engine_options, family  # same directory: on sys.path when run as a script


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
    launches = 0
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA and ev.device_time_total > 0:
            per_family[family(ev.name)] += ev.device_time_total
            launches += 1
    busy = sum(per_family.values())
    print(f"  kernels {busy / 1e3:.2f} ms in {launches} launches:")
    for fam, us in sorted(per_family.items(), key=lambda kv: -kv[1])[:8]:
        print(f"    {fam:<26}{us / 1e3:>8.2f} ms")


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
        t = time.perf_counter()
        _kernels(eng, _prompt(length, seed := seed + 1))
        print(f"  (profiled request {(time.perf_counter() - t) * 1e3:.1f} ms)")
        _host(eng, _prompt(length, seed := seed + 1), args.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
