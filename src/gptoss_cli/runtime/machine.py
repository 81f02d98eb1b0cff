"""What the benchmark measures about the machine: copy bandwidth (the roofline's ceiling), peak
memory, and the environment block of `--json` (GPU, driver, versions). No model code here."""

from __future__ import annotations

import os
import statistics
import sys
import time
from typing import Any

CUDA_COPY_BYTES = 1 << 30
HOST_COPY_BYTES = 1 << 28  # big enough to defeat CPU caches, small enough for a laptop


def _cuda_ready() -> bool:
    import torch

    return torch.cuda.is_available()


def reset_peak_memory() -> None:
    if _cuda_ready():
        import torch

        torch.cuda.reset_peak_memory_stats()


def peak_memory() -> tuple[int | None, str]:
    """(bytes, "gpu") from the CUDA allocator, else the process's peak RSS as (bytes, "host")."""
    if _cuda_ready():
        import torch

        return int(torch.cuda.max_memory_allocated()), "gpu"
    try:
        import resource
    except ImportError:  # Windows
        return None, "host"
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024), "host"  # macOS reports bytes, Linux KiB


def measure_copy_bandwidth(device: str | None = None, nbytes: int | None = None, runs: int = 5) -> float:
    """Bytes per second of a large buffer copy, counting read plus write; median of `runs` copies.

    On CUDA a device-to-device copy timed with CUDA events (the buffer halves on out-of-memory);
    on the host a memcpy timed with perf_counter.
    """
    import torch

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda"):
        return _cuda_copy_bandwidth(torch, device, nbytes or CUDA_COPY_BYTES, runs)
    return _host_copy_bandwidth(torch, nbytes or HOST_COPY_BYTES, runs)


def _cuda_copy_bandwidth(torch, device: str, nbytes: int, runs: int) -> float:
    while True:
        try:
            src = torch.empty(nbytes, dtype=torch.uint8, device=device)
            dst = torch.empty_like(src)
            break
        except torch.cuda.OutOfMemoryError:
            if nbytes <= 1 << 26:
                raise
            nbytes //= 2
    src.fill_(1)
    dst.copy_(src)  # first touch and launch overhead out of the way
    seconds = []
    for _ in range(runs):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        stop.record()
        stop.synchronize()
        seconds.append(start.elapsed_time(stop) / 1e3)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * nbytes / statistics.median(seconds)


def _host_copy_bandwidth(torch, nbytes: int, runs: int) -> float:
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)  # fault the destination pages in before timing
    seconds = []
    for _ in range(runs):
        start = time.perf_counter()
        dst.copy_(src)
        seconds.append(time.perf_counter() - start)
    return 2 * nbytes / statistics.median(seconds)


def environment_info(model: str, seed: int, **extra: Any) -> dict[str, Any]:
    """GPU (or "cpu"), driver, CUDA, library versions, model, seed, date: what a result needs to be
    reproduced. `extra` (effort, sampling, ...) is added as is."""
    import datetime
    import platform

    import torch

    from .. import __version__

    cuda = torch.cuda.is_available()
    info = {
        "gpu": torch.cuda.get_device_name(0) if cuda else "cpu",
        "gpu_count": torch.cuda.device_count() if cuda else 0,
        "driver": _nvidia_driver() if cuda else None,
        "cuda": torch.version.cuda,
        "torch": torch.__version__,
        "triton": _package_version("triton"),
        "gptoss": __version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "model": model,
        "seed": seed,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    info.update(extra)
    return info


def _package_version(name: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _nvidia_driver() -> str | None:
    """The driver version from nvidia-smi; None when it is not there (torch does not expose it)."""
    import subprocess

    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = done.stdout.strip().splitlines()
    return lines[0].strip() if lines else None
