"""Programmatic dependent launch (PDL, Hopper and later): when a kernel may start before the one
before it has finished, and what it may do until then.

A decode step is a chain of ~250 short launches; between two of them the GPU idles for the
launch latency and the first kernel's tail. A kernel launched with PDL may be scheduled as soon
as every program of its predecessor has released it (or exited); it then runs its prologue and
blocks in `wait_for_previous` until the predecessor has finished and its writes are visible.

The rule every kernel here follows, so that no ordering is ever lost:
- before `wait_for_previous` it writes nothing and reads only weights (written once at load):
  any other buffer may be what the launch before it writes, whoever the caller is;
- `wait_for_previous` releases the next launch right after the wait, so at most one launch runs
  ahead, and that one's predecessor (this kernel) has already passed its own wait: everything
  before the predecessor has finished.
- So the one exception: a buffer that only launches two or more back wrote may be read before
  the wait, if the caller guarantees that order, through L2 (`.cg`: the SM's L1 may still hold
  older lines). moe_gemv2 with router logits (MoeConfig.gemv2_topk) does, with gemv1 between.
Kernels launched without PDL (cuBLAS, torch) wait for everything before them as usual, and the
wait instruction is a no-op in a kernel launched without the attribute.

Set GPTOSS_PDL=0 to launch everything the ordinary way (measurements, or a driver that
mishandles PDL inside CUDA graphs).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@functools.cache
def _capability_major(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]


def pdl_enabled(t: torch.Tensor) -> bool:
    """Whether kernels working on `t` launch with PDL: CUDA, compute capability >= 9, not disabled."""
    if not t.is_cuda or os.environ.get("GPTOSS_PDL", "1") == "0":
        return False
    return _capability_major(t.device.index if t.device.index is not None else torch.cuda.current_device()) >= 9


def pdl_launch(enabled: bool) -> dict:
    """Launch keyword arguments: the constexpr the kernels test and Triton's launch flag."""
    return {"PDL": True, "launch_pdl": True} if enabled else {"PDL": False}


@triton.jit
def wait_for_previous(PDL: tl.constexpr):
    """Block until the previous launch has finished; then let the next launch start early."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
