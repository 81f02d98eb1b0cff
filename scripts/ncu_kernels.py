"""Run each hot kernel once at real shapes inside a profiler range, for Nsight Compute.

Usage (GPU):
  ncu --clock-control none --profile-from-start off --section SpeedOfLight --section WarpStateStats \
      --section SchedulerStats --section Occupancy --section LaunchStats \
      python scripts/ncu_kernels.py moe1 moe64 moe4096 attn32k
Every case is run once outside the range first (Triton compiles, caches warm up the way a second
call finds them), then once inside it. Cases: moe1 / moe64 / moe4096 (20b gemm1 + gemm2 at T
tokens, pick_config's tiles; `--moe FIELD=VALUE` overrides them), attn32k (batch-1 decode
attention over a 32k-token context). Not a test and not a timer: ncu's replay is the measurement.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


def _moe_case(tokens: int, overrides: dict):
    import bench_moe

    case = bench_moe.Case("20b", 32, 2880, 2880, 4, tokens)
    st = bench_moe._setup(case, "cuda")
    st.weights = st.weights[:1]
    kernels = bench_moe._kernels(st, overrides)
    return [fn for name, _, fn, *_ in kernels if name != "moe_forward"]


def _attn_case(context: int):
    import bench_attention as ba

    calls = []
    ba._decode_case(1, context, 0, "cuda", lambda fn: calls.append(fn) or 1.0)
    return calls


def _overrides(pairs: list[str]) -> dict:
    from gptoss_cli.kernels.moe import MoeConfig

    fields = {f.name for f in dataclasses.fields(MoeConfig)}
    out = {}
    for pair in pairs:
        name, _, value = pair.partition("=")
        if name not in fields:
            raise SystemExit(f"--moe: unknown MoeConfig field {name!r}")
        out[name] = int(value) if value.lstrip("-").isdigit() else value
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cases", nargs="+", choices=["moe1", "moe64", "moe4096", "attn32k"])
    parser.add_argument("--moe", nargs="*", default=[], metavar="FIELD=VALUE")
    args = parser.parse_args()
    overrides = _overrides(args.moe)
    for name in args.cases:
        fns = _attn_case(32768) if name == "attn32k" else _moe_case(int(name[3:]), overrides)
        for fn in fns:
            fn()
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
        for fn in fns:
            fn()
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
        print(f"ran {name}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
