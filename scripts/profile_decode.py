"""Break one decode step down kernel by kernel (issue 7's method): where the time of a step goes.

    PYTHONPATH=src python scripts/profile_decode.py [--model 20b] [--batch 1 64] [--steps 20]
        [--moe fused_router=1 ...] [--engine warm_up=0 ...]

For each batch size: the engine decodes after a 128-token prompt; a window of steps is recorded
with torch.profiler (CUDA kernels, also inside CUDA-graph replays) and the device time per step is
summed by kernel family. Also printed: wall time per step with graphs (what the engine runs) and
the idle share (wall minus kernel time: launch gaps, host work, the per-step sync), and each
family's and each top kernel's share of the critical path (`critical_shares`: kernel durations
overlap under PDL).
`--moe field=value` overrides MoeConfig fields of pick_config's choice for decode-sized steps
(T <= 64), to measure a kernel variant inside the engine before making it the default;
`--engine field=value` sets GpuEngineConfig fields (bool or int) the same way.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from collections import defaultdict

import torch

# (family, pattern on the kernel name), first match wins; names are Triton function names or cuBLAS.
FAMILIES = [
    ("moe gemm1+swiglu", r"_gemm1_swiglu|_gemv1_swiglu"),
    ("moe gemm2", r"_gemm2_kernel|_gemv2_kernel"),
    ("moe routing", r"route|router|_hist|_tile|topk|_sort_slots"),
    ("moe combine", r"_combine"),
    ("decode attention", r"_decode_split|_decode_reduce"),
    ("prefill attention", r"_prefill|_attn_fwd"),
    ("kv store", r"_kv_store"),
    ("rms norm", r"rms"),
    ("qkv Triton+rope+store", r"_qkv_rope"),
    ("rope", r"rope"),
    ("sampling", r"sampl|_gumbel|_argmax|_top"),
    ("dense gemv (Triton)", r"_row_linear"),
    ("dense skinny (Triton)", r"_skinny_linear"),
    ("dense gemm (cuBLAS)", r"gemm|sm90_xmma|cutlass|cublas|nvjet"),
    ("other", r""),
]


def family(name: str) -> str:
    return next(f for f, pat in FAMILIES if re.search(pat, name, re.IGNORECASE))


def kernel_events(prof) -> list:
    """The device events of a torch.profiler run that are kernels (or copies): not the device-side
    spans of record_function labels, which eager steps also produce and which would count their
    kernels twice."""
    return [ev for ev in prof.events() if ev.device_type == torch.autograd.DeviceType.CUDA
            and ev.device_time_total > 0 and not getattr(ev, "is_user_annotation", False)]


def print_gaps(spans: list[tuple[float, float]], steps: int) -> None:
    """Idle time between consecutive kernels on the device timeline, per step: short gaps are
    launch latency inside a graph, long ones (> 20 us) host work between steps."""
    spans.sort()
    gaps = [b[0] - a[1] for a, b in zip(spans, spans[1:]) if b[0] > a[1]]
    long = [g for g in gaps if g > 20]
    print(f"device gaps per step: {sum(gaps) / steps:.1f} us in all; {len(long) / steps:.1f} gaps > 20 us "
          f"({sum(long) / steps:.1f} us), {(len(gaps) - len(long)) / steps:.0f} shorter ones "
          f"({(sum(gaps) - sum(long)) / steps:.1f} us); longest {max(gaps, default=0):.1f} us")


def critical_shares(events: list[tuple[float, float, str]]) -> dict[str, float]:
    """Each kernel's share of the device timeline: how far its end moves the latest end so far
    (kernels in start order). Under PDL a launch starts while the one before it runs, so its own
    duration overstates its cost; this share is about what the step would save without it (gaps aside)."""
    shares: dict[str, float] = defaultdict(float)
    frontier = float("-inf")
    for start, end, name in sorted(events):
        shares[name] += max(0.0, end - max(frontier, start))
        frontier = max(frontier, end)
    return shares


def profile(eng, batch: int, steps: int) -> None:
    from gpu_check import sampled_params  # same directory: on sys.path when run as a script

    g = torch.Generator().manual_seed(batch)
    for params in sampled_params(batch, steps * 3 + 16, 1):  # a seed per request (gpu_check.sampled_params)
        eng.add_request(torch.randint(0, 199998, (128,), generator=g).tolist(), params)
    while True:  # prefill, then a few decode steps to settle
        events = eng.step()
        if len(events) == batch and all(e.index >= 4 for e in events):
            break
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(steps):
        eng.step()
    torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - t) * 1e3 / steps
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(steps):
            eng.step()
        torch.cuda.synchronize()
    per_family: dict[str, float] = defaultdict(float)
    per_kernel: dict[str, float] = defaultdict(float)
    spans = []
    for ev in kernel_events(prof):
        per_family[family(ev.name)] += ev.device_time_total / steps
        per_kernel[ev.name] += ev.device_time_total / steps
        spans.append((ev.time_range.start, ev.time_range.end, ev.name))
    per_kernel_critical = critical_shares(spans)
    critical: dict[str, float] = defaultdict(float)
    for name, us in per_kernel_critical.items():
        critical[family(name)] += us / steps
    while eng.has_unfinished():
        eng.step()
    busy_us = sum(per_family.values())
    print(f"\nbatch {batch}: wall {wall_ms:.3f} ms/step ({batch / wall_ms * 1e3:,.0f} tok/s), "
          f"kernels {busy_us / 1e3:.3f} ms/step, idle {max(0.0, wall_ms - busy_us / 1e3):.3f} ms/step")
    print_gaps([span[:2] for span in spans], steps)
    print(f"{'family':<22}{'us/step':>10}{'share':>8}{'critical us':>13}")  # critical: critical_shares
    for fam, us in sorted(per_family.items(), key=lambda kv: -kv[1]):
        print(f"{fam:<22}{us:>10.1f}{100 * us / busy_us:>7.1f}%{critical[fam]:>13.1f}")
    print("top kernels (us/step, critical us):")
    for name, us in sorted(per_kernel.items(), key=lambda kv: -kv[1])[:16]:
        print(f"  {us:>9.1f} {per_kernel_critical.get(name, 0.0) / steps:>9.1f}  {family(name)[:12]:<13}{name[:90]}")


def engine_options(pairs: list[str]) -> dict[str, bool | int | str]:
    """GpuEngineConfig fields from FIELD=VALUE pairs, typed by the dataclass (so moe_row_group=1
    is the int 1, fused_qkv_rope=1 the bool True)."""
    import dataclasses

    from gptoss_cli.runtime.gpu.engine import GpuEngineConfig

    fields = {f.name: str(f.type) for f in dataclasses.fields(GpuEngineConfig)}  # annotations are strings
    options = {}
    for pair in pairs:
        name, _, value = pair.partition("=")
        if name not in fields:
            raise SystemExit(f"unknown GpuEngineConfig field {name!r} (fields: {', '.join(fields)})")
        kind = fields[name]
        if kind.startswith("bool"):
            options[name] = value.lower() in ("1", "true")
        else:
            options[name] = int(value) if "int" in kind else float(value) if "float" in kind else value
    return options


def moe_fields(pairs: list[str], flag: str = "--moe") -> dict:
    """MoeConfig fields from FIELD=VALUE pairs, typed by the dataclass."""
    import dataclasses

    from gptoss_cli.kernels import moe

    fields = {f.name: f.type for f in dataclasses.fields(moe.MoeConfig)}
    changes = {}
    for pair in pairs:
        name, _, value = pair.partition("=")
        if name not in fields:
            raise SystemExit(f"{flag}: unknown MoeConfig field {name!r} (fields: {', '.join(fields)})")
        kind = str(fields[name])  # annotations are strings (postponed evaluation)
        is_int = kind in ("int", "int | None")
        changes[name] = value.lower() in ("1", "true") if kind == "bool" else int(value) if is_int else value
    return changes


# MoeConfig fields outside the matmuls, which every decode config takes.
SHARED_MOE_FIELDS = ("combine_block",)


def moe_changes_apply(config, changes: dict) -> bool:
    """Whether MoeConfig `changes` are meant for `config`: the matrix-vector configs (T = 1) take only
    changes that name gemv fields, since tile specs for the tiled decode kernels would reshape the
    gemv's blocks; the tiled configs only changes that name none (SHARED_MOE_FIELDS go to both)."""
    names = [name for name in changes if name not in SHARED_MOE_FIELDS]
    if not names:
        return True
    names_gemv = any(name.startswith("gemv") for name in names)
    return names_gemv if config.gemv else not names_gemv


def override_moe(pairs: list[str]) -> None:
    """Patch kernels.moe.pick_config so steps of <= 64 tokens use the given MoeConfig fields."""
    import dataclasses

    from gptoss_cli.kernels import moe

    changes = moe_fields(pairs)
    base = moe.pick_config

    def patched(num_tokens: int, num_experts: int, top_k: int, frag_scales: bool = False):
        cfg = base(num_tokens, num_experts, top_k, frag_scales)
        return dataclasses.replace(cfg, **changes) if num_tokens <= 64 and moe_changes_apply(cfg, changes) else cfg

    moe.pick_config = patched
    print(f"MoE override for T <= 64: {changes}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="20b", choices=["tiny", "20b", "120b"])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--moe", nargs="*", default=[], metavar="FIELD=VALUE")
    parser.add_argument("--engine", nargs="*", default=[], metavar="FIELD=VALUE")
    args = parser.parse_args()
    if args.moe:
        override_moe(args.moe)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    from gptoss_cli.runtime.gpu.engine import GpuEngine
    from gptoss_cli.runtime.random_checkpoint import random_weights

    options = engine_options(args.engine)
    eng = GpuEngine(random_weights(args.model, device="cuda"), max_batch=max(args.batch), **options)
    print(f"engine options: {eng.options}")
    for b in args.batch:
        profile(eng, b, args.steps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
