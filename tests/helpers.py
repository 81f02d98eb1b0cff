"""Comparison helpers shared by the tests: relative errors that print where they fail."""

from __future__ import annotations

import torch


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
