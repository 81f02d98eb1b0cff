"""One-token linear layer with bias (the batch-1 qkv and o projections): y = x @ W^T + b.

Twin: `linear_ref` (F.linear). At one token the product is a stream of W (2 bytes per weight) and
nothing else matters. cuBLAS runs it at 45-65 % of copy bandwidth on the H200 (o-proj as a
split-K GEMM plus a reduce launch). Here each program owns BLOCK_N rows of W and loads all of
them, the whole K at once, in one masked load: many bytes in flight per SM and no loop (H200:
qkv 9.4 us, 73 %; o-proj 8.0 us, 68 %; cuBLAS 10.5 / 12.1 us). The load depends only on the
weights, so under PDL (pdl.py) it is issued before the wait and streams while the previous launch
finishes (batch-1 engine step 2.06 ms with the load after the wait, 2.01 ms before it). fp32
products and sum, the bias added in fp32, one rounding.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .interpreter import is_interpreted
from .pdl import pdl_enabled, pdl_launch, wait_for_previous

BLOCK_N = 2  # rows per program: 1,440 programs for o-proj, 2,560 for qkv
NUM_WARPS = 4
MAX_K = 8192  # the whole K lives in registers
# The interpreter runs programs one after another (~5 ms each): a 1,280-row projection took 3.5 s
# with 2 rows per program and 0.16 s with 64, which is what the CPU engine tests spend per layer.
INTERPRETED_BLOCK_N = 64


def linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.linear(x, weight, bias)


@triton.jit
def _row_linear_kernel(x_ptr, w_ptr, b_ptr, out_ptr, n, k, stride_wn, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       PDL: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_K)
    row_ok = rows < n
    col_ok = cols < k
    w = tl.load(w_ptr + rows[:, None].to(tl.int64) * stride_wn + cols[None, :],
                mask=row_ok[:, None] & col_ok[None, :], other=0.0)
    b = tl.load(b_ptr + rows, mask=row_ok, other=0.0)
    wait_for_previous(PDL)
    x = tl.load(x_ptr + cols, mask=col_ok, other=0.0)
    y = tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1) + b.to(tl.float32)
    tl.store(out_ptr + rows, y.to(out_ptr.dtype.element_ty), mask=row_ok)


def supports_row_linear(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `row_linear` takes this call: one row, K that fits the register tile."""
    return x.dim() == 2 and x.shape[0] == 1 and weight.shape[1] <= MAX_K


def check_row_args(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, out: torch.Tensor | None,
                   what: str = "row_linear") -> torch.Tensor:
    """The checks of a one-token projection's operands (x a contiguous [1, K] row, weight
    row-major [N, K], bias [N], K within the register tile); returns its [1, N] output buffer."""
    n, k = weight.shape
    if x.dim() != 2 or x.shape != (1, k) or x.stride(1) != 1:
        raise ValueError(f"x must be a contiguous [1, {k}] row, got {tuple(x.shape)}")
    if weight.stride(1) != 1 or bias.shape != (n,) or not bias.is_contiguous():
        raise ValueError(f"weight must be row-major [N, K] and bias [N], got {tuple(weight.shape)} / {tuple(bias.shape)}")
    if k > MAX_K:
        raise ValueError(f"{what} keeps K <= {MAX_K} in registers, got {k}")
    if out is None:
        return torch.empty((1, n), dtype=x.dtype, device=x.device)
    if out.shape != (1, n) or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous [1, {n}] tensor")
    return out


def row_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, out: torch.Tensor | None = None,
               block_n: int | None = None, num_warps: int = NUM_WARPS) -> torch.Tensor:
    """`linear_ref(x, weight, bias)` for x [1, K], weight [N, K] (row-major), bias [N] -> [1, N] in x.dtype.
    block_n: rows per program (default BLOCK_N; INTERPRETED_BLOCK_N under the interpreter)."""
    out = check_row_args(x, weight, bias, out)
    if block_n is None:
        block_n = INTERPRETED_BLOCK_N if is_interpreted() else BLOCK_N
    n, k = weight.shape
    _row_linear_kernel[(triton.cdiv(n, block_n),)](
        x, weight, bias, out, n, k, weight.stride(0), BLOCK_N=block_n, BLOCK_K=triton.next_power_of_2(k),
        num_warps=num_warps, **pdl_launch(pdl_enabled(x)),
    )
    return out
