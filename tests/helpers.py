"""Helpers shared by the tests: relative errors that print where they fail; scripts loaded as modules."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import torch


def load_script(relative: str) -> ModuleType:
    """A repository script (e.g. "scripts/ncu_stalls.py") as a module, without putting its folder on sys.path."""
    path = Path(__file__).resolve().parents[1] / relative
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in fp64."""
    o, r = out.double(), ref.double()
    return ((o - r).norm() / r.norm().clamp_min(1e-30)).item()


def max_rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out - ref| / max |ref|."""
    o, r = out.double(), ref.double()
    return ((o - r).abs().max() / r.abs().max().clamp_min(1e-30)).item()


def assert_close(out: torch.Tensor, ref: torch.Tensor, tol: float, what: str = "") -> None:
    """Fail with the worst coordinate when max relative error exceeds `tol`; NaN always fails."""
    assert out.shape == ref.shape, f"{what}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    assert not torch.isnan(out).any(), f"{what}: output has NaN"
    err = max_rel_err(out, ref)
    if err > tol:
        diff = (out.double() - ref.double()).abs()
        at = tuple(int(i) for i in torch.unravel_index(diff.argmax(), diff.shape))
        raise AssertionError(
            f"{what}: max rel err {err:.3e} > {tol:.1e} at {at}: got {out[at].item()}, want {ref[at].item()}"
        )


def bf16_ulps(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest |out - ref| in units of ref's bf16 spacing (2^(exponent - 7)); values below 1e-3 of
    the largest count as that size, so an exact zero in ref does not demand an exact zero."""
    r = ref.float()
    floor = 1e-3 * r.abs().max().clamp_min(1e-30)
    spacing = torch.exp2(torch.floor(torch.log2(torch.maximum(r.abs(), floor))) - 7)
    return ((out.float() - r).abs() / spacing).max().item()


def capture_without_sync(launches) -> torch.cuda.CUDAGraph:
    """A CUDA graph of `launches()` (kernels already compiled), failing on any host synchronisation
    during the capture."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            launches()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return graph
