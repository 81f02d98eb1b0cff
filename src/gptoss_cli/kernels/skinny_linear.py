"""Few-token projections (decode steps of 2 to MAX_TOKENS tokens): y = x @ W^T + b, W streamed
through shared memory with the tokens as the small operand of the tensor-core product.

Twin: `linear.linear_ref` (F.linear). At a few tokens the product is still a stream of W's bytes.
cuBLAS takes 10.3 us for the 20b qkv weight (29.5 MB, 67 % of copy bandwidth) at 2-16 tokens and
runs o-proj as a split-K GEMM plus a reduce launch (12.1 us); row_linear's register-resident rows
lose from 4 tokens on (docs/optimizations.md, session 26). Here a program owns BLOCK_N rows of W
and a range of K, which it walks in BLOCK_K steps, each one tl.dot of the [BLOCK_N, BLOCK_K]
weight tile with the [BLOCK_K, BLOCK_T] slice of x^T; Triton's pipeliner keeps NUM_STAGES - 1
steps in flight (cp.async into shared memory).

Why split K: an SM streams ~35 GB/s here (H200, session 27: a 64-row program of the qkv weight,
368 KB, took 10.7 us), about the 4.3 TB/s copy rate's share of one SM, so the launch is only as
fast as its busiest SM. 80 or 160 row tiles on 132 SMs leave SMs idle or doubly loaded; splitting
K gives ~2 even programs per SM. Each program stores its fp32 partial to a scratch row and counts
its arrival on its row tile's counter; the last to arrive sums the partials in split order (the
same order whoever arrives last) and runs the epilogue. fp32 accumulation, the bias added in
fp32, one rounding to the output dtype. H200 at 16 tokens: qkv with RoPE and the K/V store 11.3
us (cuBLAS + the rope launch 14.3), o-proj 9.35 us (cuBLAS 12.5); stream-K cuts were slower
(docs/optimizations.md, session 27).

`skinny_dot` (the K loop) and `reduce_splits` (the arrival and the sum) are shared with qkv_rope's
few-token kernel.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .interpreter import dot_dtype, is_interpreted
from .pdl import pdl_enabled, pdl_launch, wait_for_previous

MAX_TOKENS = 64  # decode-sized steps; larger ones are cuBLAS's (compute-bound, big tiles)
MIN_BLOCK = 16  # tl.dot's smallest dimension
PROGRAMS_PER_SM = 2  # split-K target: even work per SM (see the module docstring)


@dataclass(frozen=True)
class SkinnyTiles:
    """Launch shape: weight rows per program, K step, pipeline depth, warps, K splits (0: enough
    for PROGRAMS_PER_SM programs per SM)."""

    block_n: int = 64
    block_k: int = 128
    num_stages: int = 4
    num_warps: int = 4
    splits: int = 0


# The interpreter runs programs one after another: few, wide programs (2 splits keep the
# reduction covered by the CPU tests' default tiles).
INTERPRETED_TILES = SkinnyTiles(block_n=64, block_k=64, num_stages=1, num_warps=4, splits=2)


def default_tiles() -> SkinnyTiles:
    return INTERPRETED_TILES if is_interpreted() else SkinnyTiles()


def token_block(num_tokens: int) -> int:
    """Token columns of the product tile: the step's tokens rounded up to a power of two >= 16."""
    return max(MIN_BLOCK, triton.next_power_of_2(num_tokens))


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def split_plan(k: int, row_tiles: int, tiles: SkinnyTiles, device: torch.device) -> tuple[int, int]:
    """(splits, K per split): K per split a multiple of the K step, every split non-empty. Being a
    multiple of 16, K per split is marked divisible by 16 by the launcher, which the pipeliner needs
    to copy W in 16-byte cp.async pieces (unmarked, it fell back to 2-byte loads and 255 registers)."""
    steps = triton.cdiv(k, tiles.block_k)
    splits = tiles.splits
    if splits == 0:
        sms = _sm_count(device.index if device.index is not None else torch.cuda.current_device()) \
            if device.type == "cuda" else 1
        splits = max(1, round(PROGRAMS_PER_SM * sms / row_tiles))
    splits = min(splits, steps)
    per_split = triton.cdiv(steps, splits) * tiles.block_k
    return triton.cdiv(k, per_split), per_split


@dataclass
class SkinnyScratch:
    """The split-K partials (fp32, one [BLOCK_N, BLOCK_T] tile per program) and one arrival
    counter per row tile, zero between launches (each tile's last program resets it). Launches
    sharing it must not overlap: each writes only after its PDL wait (pdl.py), when the launch
    before it has finished."""

    partials: torch.Tensor
    arrivals: torch.Tensor

    @classmethod
    def allocate(cls, elements: int, counters: int, device: torch.device | str) -> SkinnyScratch:
        return cls(torch.empty(elements, dtype=torch.float32, device=device),
                   torch.zeros(counters, dtype=torch.int32, device=device))

    @classmethod
    def for_shapes(cls, shapes: list[tuple[int, int]], device: torch.device | str,
                   tiles: SkinnyTiles | None = None) -> SkinnyScratch:
        """Scratch for launches of weights [N, K] in `shapes` at up to MAX_TOKENS tokens, with row
        tiles of tiles.block_n or fewer rows (qkv_rope's tiles stop at a head)."""
        tiles = tiles or default_tiles()
        device = torch.device(device)
        need, counters = 1, 1
        blocks = [b for b in (MIN_BLOCK, 2 * MIN_BLOCK, 4 * MIN_BLOCK) if b < tiles.block_n] + [tiles.block_n]
        for (n, k), block_n in itertools.product(shapes, blocks):
            row_tiles = triton.cdiv(n, block_n)
            splits, _ = split_plan(k, row_tiles, tiles, device)
            need = max(need, row_tiles * splits * block_n * token_block(MAX_TOKENS))
            counters = max(counters, row_tiles)
        return cls.allocate(need, counters, device)

    def check(self, row_tiles: int, splits: int, block_n: int, block_t: int) -> None:
        if splits > 1 and (self.partials.numel() < row_tiles * splits * block_n * block_t
                           or self.arrivals.numel() < row_tiles):
            raise ValueError(f"skinny scratch too small for {row_tiles} row tiles x {splits} splits")


@triton.jit
def skinny_dot(x_ptr, stride_xt, w_ptr, stride_wn, rows, tokens, k_lo, k_hi, BLOCK_K: tl.constexpr,
               DOT: tl.constexpr):
    """acc [len(rows), len(tokens)] fp32 = W[rows, k_lo:k_hi] @ x[tokens, k_lo:k_hi]^T. Rows and tokens
    must be valid indices (callers clamp them and mask their stores); K is masked at k_hi."""
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_wn
    x_cols = x_ptr + tokens.to(tl.int64)[None, :] * stride_xt
    acc = tl.zeros((rows.shape[0], tokens.shape[0]), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        col_ok = cols < k_hi
        w = tl.load(w_rows + cols[None, :], mask=col_ok[None, :], other=0.0)
        xt = tl.load(x_cols + cols[:, None], mask=col_ok[:, None], other=0.0)
        acc = tl.dot(w.to(DOT), xt.to(DOT), acc, input_precision="ieee")  # fp32 inputs: no TF32
    return acc


@triton.jit
def split_range(k, k_per_split):
    """This program's K range [lo, hi) (program_id(1) is the split)."""
    lo = tl.program_id(1) * k_per_split
    return lo, tl.minimum(lo + k_per_split, k)


@triton.jit
def reduce_splits(acc, part_ptr, count_ptr, SPLITS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr):
    """(last, total): whether this program is its row tile's last to arrive, and then the sum of
    every split's partial in split order (grid: row tiles, splits)."""
    if SPLITS == 1:
        return tl.program_id(0) >= 0, acc
    tile = tl.program_id(0)
    offs = tl.arange(0, BLOCK_N)[:, None] * BLOCK_T + tl.arange(0, BLOCK_T)[None, :]
    base = part_ptr + tile.to(tl.int64) * (SPLITS * BLOCK_N * BLOCK_T)
    tl.store(base + tl.program_id(1) * (BLOCK_N * BLOCK_T) + offs, acc)
    # Every thread's stores precede the arrival (barrier), which releases them at GPU scope; the last
    # program's acquire then sees all partials. Its loads bypass L1 (.cg), which may hold an earlier
    # launch's rows of the same scratch.
    tl.debug_barrier()
    arrived = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu")
    last = arrived == SPLITS - 1
    total = tl.zeros((BLOCK_N, BLOCK_T), dtype=tl.float32)
    if last:
        for s in tl.static_range(SPLITS):
            total += tl.load(base + s * (BLOCK_N * BLOCK_T) + offs, cache_modifier=".cg")
        tl.atomic_xchg(count_ptr + tile, 0, sem="relaxed", scope="gpu")
    return last, total


@triton.jit
def _skinny_linear_kernel(x_ptr, w_ptr, b_ptr, out_ptr, part_ptr, count_ptr, num_tokens, n, k, k_per_split,
                          stride_xt, stride_wn, stride_ot, BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr,
                          BLOCK_K: tl.constexpr, SPLITS: tl.constexpr, DOT: tl.constexpr, PDL: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    tokens = tl.arange(0, BLOCK_T)  # every token of the step (BLOCK_T >= T)
    row_ok = rows < n
    token_ok = tokens < num_tokens
    bias = tl.load(b_ptr + rows, mask=row_ok, other=0.0)
    wait_for_previous(PDL)
    k_lo, k_hi = split_range(k, k_per_split)
    acc = skinny_dot(x_ptr, stride_xt, w_ptr, stride_wn, tl.minimum(rows, n - 1), tl.minimum(tokens, num_tokens - 1),
                     k_lo, k_hi, BLOCK_K, DOT)
    last, acc = reduce_splits(acc, part_ptr, count_ptr, SPLITS, BLOCK_N, BLOCK_T)
    if last:
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


@dataclass(frozen=True)
class SkinnyLaunch:
    """What a few-token launch passes besides its operands: grid, split plan, constexprs."""

    grid: tuple[int, int]
    k_per_split: int
    scratch: SkinnyScratch
    constexprs: dict


def plan_launch(x: torch.Tensor, row_tiles: int, block_n: int, tiles: SkinnyTiles,
                scratch: SkinnyScratch | None) -> SkinnyLaunch:
    """Split plan, scratch (a private one when none is given and K is split) and launch options."""
    t, k = x.shape
    block_t = token_block(t)
    splits, per_split = split_plan(k, row_tiles, tiles, x.device)
    if scratch is None:
        one = splits == 1  # nothing to reduce: placeholders
        scratch = SkinnyScratch.allocate(1 if one else row_tiles * splits * block_n * block_t, 1 if one else row_tiles,
                                         x.device)
    scratch.check(row_tiles, splits, block_n, block_t)
    constexprs = {"BLOCK_T": block_t, "BLOCK_K": tiles.block_k, "SPLITS": splits, "DOT": dot_dtype(x.dtype),
                  "num_warps": tiles.num_warps, "num_stages": tiles.num_stages, **pdl_launch(pdl_enabled(x))}
    return SkinnyLaunch((row_tiles, splits), per_split, scratch, constexprs)


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, out: torch.Tensor | None = None,
                  tiles: SkinnyTiles | None = None, scratch: SkinnyScratch | None = None) -> torch.Tensor:
    """`linear_ref(x, weight, bias)` for x [T, K] (T <= MAX_TOKENS), weight [N, K] row-major, bias [N]
    -> [T, N] in x.dtype. `scratch`: the split-K scratch (SkinnyScratch.for_shapes); without it each
    call allocates and zeroes its own."""
    out = check_skinny_args(x, weight, bias, out)
    tiles = tiles or default_tiles()
    (t, k), n = x.shape, weight.shape[0]
    launch = plan_launch(x, triton.cdiv(n, tiles.block_n), tiles.block_n, tiles, scratch)
    _skinny_linear_kernel[launch.grid](
        x, weight, bias, out, launch.scratch.partials, launch.scratch.arrivals, t, n, k, launch.k_per_split,
        x.stride(0), weight.stride(0), out.stride(0), BLOCK_N=tiles.block_n, **launch.constexprs,
    )  # fmt: skip
    return out
