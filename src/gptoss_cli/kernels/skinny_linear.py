"""Few-token projections (decode steps of 2 to MAX_TOKENS tokens): y = x @ W^T + b, W streamed
through shared memory with the tokens as the small operand of the tensor-core product.

Twin: `linear.linear_ref` (F.linear). At a few tokens the product is still a stream of W's bytes.
cuBLAS takes 10.3 us for the 20b qkv weight (29.5 MB, 67 % of copy bandwidth) at 2-16 tokens and
runs o-proj as a split-K GEMM plus a reduce launch (12.1 us); row_linear's register-resident rows
lose from 4 tokens on (docs/optimizations.md, session 26). Here a program owns BLOCK_N rows of W
and walks K in BLOCK_K steps, each step one tl.dot of the [BLOCK_N, BLOCK_K] weight tile with the
[BLOCK_K, BLOCK_T] slice of x^T; Triton's pipeliner keeps NUM_STAGES - 1 steps of both in flight
(cp.async into shared memory), which is what keeps the bytes moving without registers.
fp32 accumulation, the bias added in fp32, one rounding to the output dtype.

`skinny_dot` is the K loop alone, which qkv_rope's few-token kernel shares.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .interpreter import dot_dtype, is_interpreted
from .pdl import pdl_enabled, pdl_launch, wait_for_previous

MAX_TOKENS = 64  # decode-sized steps; larger ones are cuBLAS's (compute-bound, big tiles)
MIN_BLOCK = 16  # tl.dot's smallest dimension


@dataclass(frozen=True)
class SkinnyTiles:
    """Launch shape: weight rows per program, K step, pipeline depth, warps."""

    block_n: int = 32
    block_k: int = 128
    num_stages: int = 4
    num_warps: int = 4


# The interpreter runs programs one after another: few, wide programs.
INTERPRETED_TILES = SkinnyTiles(block_n=64, block_k=64, num_stages=1, num_warps=4)


def default_tiles() -> SkinnyTiles:
    return INTERPRETED_TILES if is_interpreted() else SkinnyTiles()


def token_block(num_tokens: int) -> int:
    """Token columns of the product tile: the step's tokens rounded up to a power of two >= 16."""
    return max(MIN_BLOCK, triton.next_power_of_2(num_tokens))


@triton.jit
def skinny_dot(x_ptr, stride_xt, w_ptr, stride_wn, rows, tokens, k, BLOCK_K: tl.constexpr, DOT: tl.constexpr):
    """acc [len(rows), len(tokens)] fp32 = W[rows, :k] @ x[tokens, :k]^T. Rows and tokens must be
    valid indices (callers clamp them and mask their stores); K is masked in its last step."""
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_wn
    x_cols = x_ptr + tokens.to(tl.int64)[None, :] * stride_xt
    acc = tl.zeros((rows.shape[0], tokens.shape[0]), dtype=tl.float32)
    for k0 in range(0, k, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        col_ok = cols < k
        w = tl.load(w_rows + cols[None, :], mask=col_ok[None, :], other=0.0)
        xt = tl.load(x_cols + cols[:, None], mask=col_ok[:, None], other=0.0)
        acc = tl.dot(w.to(DOT), xt.to(DOT), acc, input_precision="ieee")  # fp32 inputs: no TF32
    return acc


@triton.jit
def _skinny_linear_kernel(x_ptr, w_ptr, b_ptr, out_ptr, num_tokens, n, k, stride_xt, stride_wn, stride_ot,
                          BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, DOT: tl.constexpr,
                          PDL: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    tokens = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < n
    token_ok = tokens < num_tokens
    bias = tl.load(b_ptr + rows, mask=row_ok, other=0.0)
    wait_for_previous(PDL)
    acc = skinny_dot(x_ptr, stride_xt, w_ptr, stride_wn, tl.minimum(rows, n - 1), tl.minimum(tokens, num_tokens - 1),
                     k, BLOCK_K, DOT)
    y = acc + bias.to(tl.float32)[:, None]
    dst = out_ptr + tokens.to(tl.int64)[None, :] * stride_ot + rows[:, None]
    tl.store(dst, y.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & token_ok[None, :])


def supports_skinny_linear(x: torch.Tensor, max_tokens: int = MAX_TOKENS) -> bool:
    """Whether a projection of x [T, K] goes to `skinny_linear`: 2 <= T <= max_tokens (one token is
    row_linear's)."""
    return x.dim() == 2 and 2 <= x.shape[0] <= min(max_tokens, MAX_TOKENS)


def check_skinny_args(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, out: torch.Tensor | None,
                      what: str = "skinny_linear") -> torch.Tensor:
    """The checks of a few-token projection's operands (x [T, K] with unit stride in K, weight
    row-major [N, K], bias [N]); returns its [T, N] output buffer."""
    n, k = weight.shape
    if x.dim() != 2 or x.shape[1] != k or x.stride(1) != 1 or not 1 <= x.shape[0] <= MAX_TOKENS:
        raise ValueError(f"{what}: x must be [T, {k}] with T in 1..{MAX_TOKENS} and unit stride in K, "
                         f"got {tuple(x.shape)}")
    if weight.stride(1) != 1 or bias.shape != (n,) or not bias.is_contiguous():
        raise ValueError(f"{what}: weight must be row-major [N, K] and bias [N], got {tuple(weight.shape)} / "
                         f"{tuple(bias.shape)}")
    t = x.shape[0]
    if out is None:
        return torch.empty((t, n), dtype=x.dtype, device=x.device)
    if out.shape != (t, n) or out.stride(1) != 1:
        raise ValueError(f"{what}: out must be [{t}, {n}] with unit stride in N")
    return out


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, out: torch.Tensor | None = None,
                  tiles: SkinnyTiles | None = None) -> torch.Tensor:
    """`linear_ref(x, weight, bias)` for x [T, K] (T <= MAX_TOKENS), weight [N, K] row-major, bias [N]
    -> [T, N] in x.dtype."""
    out = check_skinny_args(x, weight, bias, out)
    tiles = tiles or default_tiles()
    (t, k), n = x.shape, weight.shape[0]
    block_t = token_block(t)
    _skinny_linear_kernel[(triton.cdiv(n, tiles.block_n), triton.cdiv(t, block_t))](
        x, weight, bias, out, t, n, k, x.stride(0), weight.stride(0), out.stride(0),
        BLOCK_N=tiles.block_n, BLOCK_T=block_t, BLOCK_K=tiles.block_k, DOT=dot_dtype(x.dtype),
        num_warps=tiles.num_warps, num_stages=tiles.num_stages, **pdl_launch(pdl_enabled(x)),
    )  # fmt: skip
    return out
