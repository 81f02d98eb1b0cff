"""Few-token projections (decode steps of 2 to MAX_TOKENS tokens): y = x @ W^T + b, W streamed
through shared memory with the tokens as the small operand of the tensor-core product.

Twin: `linear.linear_ref` (F.linear). At a few tokens the product is still a stream of W's bytes.
cuBLAS takes 10.3 us for the 20b qkv weight (29.5 MB, 67 % of copy bandwidth) at 2-16 tokens and
runs o-proj as a split-K GEMM plus a reduce launch (12.1 us); row_linear's register-resident rows
lose from 4 tokens on (docs/optimizations.md, session 26). Here a program owns BLOCK_N rows of W
and a range of K, which it walks in BLOCK_K steps, each one tl.dot of the [BLOCK_N, BLOCK_K]
weight tile with the [BLOCK_K, BLOCK_T] slice of x^T; Triton's pipeliner keeps NUM_STAGES - 1
steps in flight (cp.async into shared memory).

Why split K, stream-K style: an SM streams ~35 GB/s here (H200, session 27: a 64-row program of
the qkv weight, 368 KB, took 10.7 us), about the 4.3 TB/s copy rate's share of one SM, so a launch
is only as fast as its busiest SM, and 80 or 160 row tiles on 132 SMs leave SMs idle or doubly
loaded. So the (row tile, K step) pairs are laid out tile after tile and cut into PROGRAMS equal
runs, one per program (~2 per SM): a program's run may end inside a tile and the next one's begin
there. Each program computes a partial per tile it touches; a tile that more than one program
touched gets its fp32 partials stored to scratch and arrivals counted, and the last to arrive sums
them in program order (the same order whoever arrives last) and runs the epilogue. fp32
accumulation, the bias added in fp32, one rounding to the output dtype.

`skinny_dot` (the K loop), `stream_segment` and `reduce_parts` are shared with qkv_rope's
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
PROGRAMS_PER_SM = 2


@dataclass(frozen=True)
class SkinnyTiles:
    """Launch shape: weight rows per program, K step, pipeline depth, warps, programs (0:
    PROGRAMS_PER_SM per SM; at most one per (row tile, K step) pair)."""

    block_n: int = 64
    block_k: int = 128
    num_stages: int = 4
    num_warps: int = 4
    programs: int = 0


# The interpreter runs programs one after another: few, wide programs, 3 of them so that runs end
# inside tiles and the CPU tests cover the partials.
INTERPRETED_TILES = SkinnyTiles(block_n=64, block_k=64, num_stages=1, num_warps=4, programs=3)


def default_tiles() -> SkinnyTiles:
    return INTERPRETED_TILES if is_interpreted() else SkinnyTiles()


def token_block(num_tokens: int) -> int:
    """Token columns of the product tile: the step's tokens rounded up to a power of two >= 16."""
    return max(MIN_BLOCK, triton.next_power_of_2(num_tokens))


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _owner(unit: int, units: int, programs: int) -> int:
    """The program whose run holds `unit` (runs: [p * units // programs, (p + 1) * units // programs))."""
    return ((unit + 1) * programs - 1) // units


@dataclass(frozen=True)
class StreamPlan:
    """How a launch cuts its (row tile, K step) pairs: programs, K steps per tile, and the most
    programs that share one tile (the partial slots per tile in the scratch)."""

    programs: int
    steps: int
    parts: int


@functools.lru_cache(maxsize=256)
def _plan(k: int, row_tiles: int, block_k: int, programs: int) -> StreamPlan:
    steps = triton.cdiv(k, block_k)
    units = row_tiles * steps
    programs = max(1, min(programs, units))
    parts = max(_owner(t * steps + steps - 1, units, programs) - _owner(t * steps, units, programs) + 1
                for t in range(row_tiles))
    return StreamPlan(programs, steps, parts)


def stream_plan(k: int, row_tiles: int, tiles: SkinnyTiles, device: torch.device) -> StreamPlan:
    programs = tiles.programs
    if programs == 0:
        index = device.index if device.index is not None else torch.cuda.current_device()
        programs = PROGRAMS_PER_SM * (_sm_count(index) if device.type == "cuda" else 1)
    return _plan(k, row_tiles, tiles.block_k, programs)


@dataclass
class SkinnyScratch:
    """The partials (fp32, `parts` [BLOCK_N, BLOCK_T] slots per row tile) and one arrival counter
    per row tile, zero between launches (each shared tile's last program resets it). Launches
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
            plan = stream_plan(k, row_tiles, tiles, device)
            need = max(need, row_tiles * plan.parts * block_n * token_block(MAX_TOKENS))
            counters = max(counters, row_tiles)
        return cls.allocate(need, counters, device)

    def check(self, row_tiles: int, plan: StreamPlan, block_n: int, block_t: int) -> None:
        if plan.parts > 1 and (self.partials.numel() < row_tiles * plan.parts * block_n * block_t
                               or self.arrivals.numel() < row_tiles):
            raise ValueError(f"skinny scratch too small for {row_tiles} row tiles x {plan.parts} partials")


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
def _owner_of(unit, units, programs):
    return ((unit + 1) * programs - 1) // units


@triton.jit
def stream_bounds(units, programs):
    """This program's run of (row tile, K step) units: [lo, hi)."""
    pid = tl.program_id(0)
    return pid * units // programs, (pid + 1) * units // programs


@triton.jit
def stream_segment(u, hi, steps, units, programs):
    """The segment of the run starting at unit u: (tile, first K step, end K step, first and last
    program touching the tile)."""
    tile = u // steps
    s0 = u - tile * steps
    s1 = tl.minimum(steps, s0 + hi - u)
    first = _owner_of(tile * steps, units, programs)
    last = _owner_of(tile * steps + steps - 1, units, programs)
    return tile, s0, s1, first, last


@triton.jit
def reduce_parts(acc, part_ptr, count_ptr, parts, tile, first, last, BLOCK_N: tl.constexpr,
                 BLOCK_T: tl.constexpr):
    """(done, total): whether this program finishes the tile, and then the tile's sum over every
    program's partial in program order. A tile of one program is finished by it without scratch."""
    done = first == last
    total = acc
    if first != last:
        offs = tl.arange(0, BLOCK_N)[:, None] * BLOCK_T + tl.arange(0, BLOCK_T)[None, :]
        base = part_ptr + tile.to(tl.int64) * parts * (BLOCK_N * BLOCK_T)
        tl.store(base + (tl.program_id(0) - first) * (BLOCK_N * BLOCK_T) + offs, acc)
        # Every thread's stores precede the arrival (barrier), which releases them at GPU scope; the
        # last program's acquire then sees all partials. Its loads bypass L1 (.cg), which may hold
        # an earlier launch's rows of the same scratch.
        tl.debug_barrier()
        arrived = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu")
        done = arrived == last - first
        if done:
            total = tl.zeros((BLOCK_N, BLOCK_T), dtype=tl.float32)
            for j in range(0, last - first + 1):
                total += tl.load(base + j * (BLOCK_N * BLOCK_T) + offs, cache_modifier=".cg")
            tl.atomic_xchg(count_ptr + tile, 0, sem="relaxed", scope="gpu")
    return done, total


@triton.jit
def _skinny_linear_kernel(x_ptr, w_ptr, b_ptr, out_ptr, part_ptr, count_ptr, num_tokens, n, k, steps, units,
                          programs, parts, stride_xt, stride_wn, stride_ot, BLOCK_N: tl.constexpr,
                          BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, DOT: tl.constexpr, PDL: tl.constexpr):
    tokens = tl.arange(0, BLOCK_T)
    token_ok = tokens < num_tokens
    wait_for_previous(PDL)
    u, hi = stream_bounds(units, programs)
    while u < hi:
        tile, s0, s1, first, last = stream_segment(u, hi, steps, units, programs)
        rows = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < n
        acc = skinny_dot(x_ptr, stride_xt, w_ptr, stride_wn, tl.minimum(rows, n - 1),
                         tl.minimum(tokens, num_tokens - 1), s0 * BLOCK_K, tl.minimum(k, s1 * BLOCK_K), BLOCK_K, DOT)
        done, acc = reduce_parts(acc, part_ptr, count_ptr, parts, tile, first, last, BLOCK_N, BLOCK_T)
        if done:
            bias = tl.load(b_ptr + rows, mask=row_ok, other=0.0)
            y = acc + bias.to(tl.float32)[:, None]
            dst = out_ptr + tokens.to(tl.int64)[None, :] * stride_ot + rows[:, None]
            tl.store(dst, y.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & token_ok[None, :])
        u += s1 - s0


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
    """What a few-token launch passes besides its operands: the plan's integers, scratch, constexprs."""

    args: tuple[int, int, int, int]  # steps, units, programs, parts
    programs: int
    scratch: SkinnyScratch
    constexprs: dict


def plan_launch(x: torch.Tensor, row_tiles: int, block_n: int, tiles: SkinnyTiles,
                scratch: SkinnyScratch | None) -> SkinnyLaunch:
    """Stream plan, scratch (a private one when none is given and tiles are shared) and launch options."""
    t, k = x.shape
    block_t = token_block(t)
    plan = stream_plan(k, row_tiles, tiles, x.device)
    if scratch is None:
        scratch = SkinnyScratch.allocate(row_tiles * plan.parts * block_n * block_t, row_tiles, x.device)
    scratch.check(row_tiles, plan, block_n, block_t)
    constexprs = {"BLOCK_T": block_t, "BLOCK_K": tiles.block_k, "DOT": dot_dtype(x.dtype),
                  "num_warps": tiles.num_warps, "num_stages": tiles.num_stages, **pdl_launch(pdl_enabled(x))}
    args = (plan.steps, row_tiles * plan.steps, plan.programs, plan.parts)
    return SkinnyLaunch(args, plan.programs, scratch, constexprs)


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, out: torch.Tensor | None = None,
                  tiles: SkinnyTiles | None = None, scratch: SkinnyScratch | None = None) -> torch.Tensor:
    """`linear_ref(x, weight, bias)` for x [T, K] (T <= MAX_TOKENS), weight [N, K] row-major, bias [N]
    -> [T, N] in x.dtype. `scratch`: the partials' scratch (SkinnyScratch.for_shapes); without it
    each call allocates and zeroes its own."""
    out = check_skinny_args(x, weight, bias, out)
    tiles = tiles or default_tiles()
    (t, k), n = x.shape, weight.shape[0]
    launch = plan_launch(x, triton.cdiv(n, tiles.block_n), tiles.block_n, tiles, scratch)
    _skinny_linear_kernel[(launch.programs,)](
        x, weight, bias, out, launch.scratch.partials, launch.scratch.arrivals, t, n, k, *launch.args,
        x.stride(0), weight.stride(0), out.stride(0), BLOCK_N=tiles.block_n, **launch.constexprs,
    )  # fmt: skip
    return out
