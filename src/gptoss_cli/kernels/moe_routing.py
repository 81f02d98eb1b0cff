"""MoE routing on the device: top-k of the router logits, softmax over those k, and the
expert-sorted work lists the grouped matmuls read (gpt-oss-model.md §2.5).

Everything is sized from (T, E, K, BLOCK_M) alone, never from the data, and nothing is read back
to the host, so a forward pass with a fixed T can be captured in a CUDA graph.

Dimension legend: T tokens, E experts, K experts per token, S = T*K token slots (slot = t*K + k),
NB token blocks of the top-k kernel, BLOCK_M rows (slots) per matmul tile.

Order of the slots of one expert in the sorted list: by slot index, i.e. a stable sort of the
flattened expert ids (`route_metadata_ref`). Ties between equal logits go to the lowest expert
index, which is what torch.topk does on CUDA (CPU torch.topk breaks ties arbitrarily).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

# The top-k kernel's token block: at least this many tokens, so scratch can be sized from T alone.
MIN_TOKEN_BLOCK = 16
# Elements of one [token block, expert] tile the routing kernels hold in registers.
MAX_TILE_ELEMS = 4096
# Aim for at most this many token blocks: every sorting program re-reads all block histograms.
TARGET_TOKEN_BLOCKS = 64
HIST_ROWS_PER_STEP = 32  # block-histogram rows the sorting kernel sums per loop step
TILE_ENTRIES_PER_STEP = 64  # tile-table entries built per loop step
MAX_EXPERTS = 1024


@dataclass
class MoeRouting:
    """Routing of T tokens over E experts, as the grouped matmuls consume it.

    topk_weights   [T, K] fp32   softmax over the chosen logits, largest first
    topk_ids       [T, K] int32  chosen experts, largest logit first
    expert_counts  [E]    int32  slots routed to each expert
    expert_offsets [E+1]  int32  first sorted row of each expert; [E] = S
    sorted_slots   [S]    int32  sorted row -> slot (token = slot // K)
    slot_rows      [S]    int32  slot -> sorted row (the inverse permutation)
    tile_expert    [max_tiles] int32  expert of each BLOCK_M-row tile, -1 = no work
    tile_row_start [max_tiles] int32  first sorted row of each tile
    block_hist     [NB, E] int32  scratch: experts chosen inside each token block
    """

    topk_weights: torch.Tensor
    topk_ids: torch.Tensor
    expert_counts: torch.Tensor
    expert_offsets: torch.Tensor
    sorted_slots: torch.Tensor
    slot_rows: torch.Tensor
    tile_expert: torch.Tensor
    tile_row_start: torch.Tensor
    block_hist: torch.Tensor
    block_m: int

    @property
    def num_tokens(self) -> int:
        return self.topk_ids.shape[0]

    @property
    def top_k(self) -> int:
        return self.topk_ids.shape[1]

    @property
    def num_experts(self) -> int:
        return self.expert_counts.shape[0]

    @property
    def max_tiles(self) -> int:
        return self.tile_expert.shape[0]

    @classmethod
    def allocate(
        cls, num_tokens: int, num_experts: int, top_k: int, block_m: int, device: torch.device | str
    ) -> MoeRouting:
        """Buffers for up to `num_tokens` tokens; `narrow` gives the views for fewer."""
        slots = num_tokens * top_k

        def i32(*shape: int) -> torch.Tensor:
            return torch.empty(shape, dtype=torch.int32, device=device)

        return cls(
            topk_weights=torch.empty((num_tokens, top_k), dtype=torch.float32, device=device),
            topk_ids=i32(num_tokens, top_k),
            expert_counts=i32(num_experts),
            expert_offsets=i32(num_experts + 1),
            sorted_slots=i32(slots),
            slot_rows=i32(slots),
            tile_expert=i32(max_tiles(num_tokens, top_k, num_experts, 1)),
            tile_row_start=i32(max_tiles(num_tokens, top_k, num_experts, 1)),
            block_hist=i32(triton.cdiv(max(num_tokens, 1), MIN_TOKEN_BLOCK), num_experts),
            block_m=block_m,
        ).narrow(num_tokens, block_m)

    def narrow(self, num_tokens: int, block_m: int) -> MoeRouting:
        """Views of these buffers for `num_tokens` tokens and tiles of `block_m` rows."""
        if num_tokens > self.topk_ids.shape[0]:
            raise ValueError(f"routing buffers hold {self.topk_ids.shape[0]} tokens, asked for {num_tokens}")
        k, e = self.top_k, self.num_experts
        tiles = max_tiles(num_tokens, k, e, block_m)
        blocks = triton.cdiv(num_tokens, token_block(num_tokens, e))
        return MoeRouting(
            topk_weights=self.topk_weights[:num_tokens],
            topk_ids=self.topk_ids[:num_tokens],
            expert_counts=self.expert_counts,
            expert_offsets=self.expert_offsets,
            sorted_slots=self.sorted_slots[: num_tokens * k],
            slot_rows=self.slot_rows[: num_tokens * k],
            tile_expert=self.tile_expert[:tiles],
            tile_row_start=self.tile_row_start[:tiles],
            block_hist=self.block_hist[:blocks],
            block_m=block_m,
        )


def max_tiles(num_tokens: int, top_k: int, num_experts: int, block_m: int) -> int:
    """Worst-case number of non-empty BLOCK_M tiles: each holds >= 1 slot, and at most E - 1
    experts end in a partial tile."""
    slots = num_tokens * top_k
    return min(slots, triton.cdiv(slots, block_m) + num_experts - 1)


def token_block(num_tokens: int, num_experts: int) -> int:
    """Tokens per top-k program: grows with T so there are about TARGET_TOKEN_BLOCKS blocks,
    bounded so one [tokens, experts] tile stays small."""
    cap = max(MIN_TOKEN_BLOCK, MAX_TILE_ELEMS // triton.next_power_of_2(num_experts))
    want = triton.next_power_of_2(triton.cdiv(max(num_tokens, 1), TARGET_TOKEN_BLOCKS))
    return min(max(want, MIN_TOKEN_BLOCK), cap)


@triton.jit
def _topk_softmax_kernel(
    logits_ptr, stride_lt, weights_ptr, ids_ptr, hist_ptr, num_tokens, num_experts,
    TOP_K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    rows = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    row_ok = rows < num_tokens
    col_ok = cols < num_experts
    ptrs = logits_ptr + rows[:, None].to(tl.int64) * stride_lt + cols[None, :]
    logits = tl.load(ptrs, mask=row_ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
    _topk_softmax_store(logits, pid, rows, row_ok, cols, col_ok, weights_ptr, ids_ptr, hist_ptr, num_experts,
                        TOP_K, BLOCK_K, BLOCK_T, BLOCK_E)


@triton.jit
def topk_row(logits, cols, col_ok, num_experts, TOP_K: tl.constexpr, BLOCK_K: tl.constexpr,
             BLOCK_E: tl.constexpr):
    """_topk_softmax_store's choice for one token's fp32 logits [BLOCK_E], in registers: (values,
    ids) [BLOCK_K], largest first, entries >= TOP_K zero. The same steps on 1-D tensors: the [1, E]
    form of the 2-D code took moe_gemv's gemv1 from 66 to 168 registers at 128 experts (offline
    sm_90)."""
    ks = tl.arange(0, BLOCK_K)
    taken = cols < 0
    values = tl.zeros((BLOCK_K,), dtype=tl.float32)
    ids = tl.zeros((BLOCK_K,), dtype=tl.int32)
    for k in tl.static_range(TOP_K):
        free = col_ok & ~taken
        best = tl.max(tl.where(free, logits, float("-inf")), axis=0)
        idx = tl.minimum(tl.min(tl.where(free & (logits == best), cols, BLOCK_E), axis=0), num_experts - 1)
        taken = taken | (cols == idx)
        values = tl.where(ks == k, best, values)
        ids = tl.where(ks == k, idx, ids)
    return values, ids


@triton.jit
def _logit_keys(row_ptr, c0, num_experts, WIDTH: tl.constexpr):
    """topk_row_bf16's keys of columns c0 .. c0 + WIDTH - 1 of a row of bf16-valued fp32 logits
    (INT32_MIN past num_experts). A logit and its column share one int32 key ordered by value, then
    by the lower column (ties as torch.topk on CUDA); -0 counts as +0, as == does."""
    cols = c0 + tl.arange(0, WIDTH)
    ok = cols < num_experts
    # .cg: the same scratch held the previous layer's logits; this SM's L1 may still have them.
    bits = tl.load(row_ptr + cols, mask=ok, other=0.0, cache_modifier=".cg").to(tl.int32, bitcast=True)
    bits = tl.where(bits == -2147483648, 0, bits)
    # Negative floats order backwards as integers: flipping their magnitude bits makes the signed
    # integer order the float order. bf16 values leave the low 16 bits free for the column.
    key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits) & -65536
    return tl.where(ok, key | (65535 - cols), -2147483648)


@triton.jit
def topk_row_bf16(row_ptr, num_experts, rank, TOP_K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr):
    """topk_row's values and the id of choice `rank` (a scalar) for a row of logits that are bf16
    values in fp32 (the low 16 bits zero: the router rounds them to bf16 activations' dtype), read
    from row_ptr. Each of the K rounds is one integer max over _logit_keys (REDUX.MAX within a warp)
    instead of a float max and then an index min, two chains of five shuffles each. The row is
    read in chunks of 32 columns, up to 4 of them, each of which every warp holds whole, so that
    at 128 experts the rounds stay within a warp too (one [128] tensor spans the 4 warps, and
    each round then passes through shared memory and barriers)."""
    WIDTH: tl.constexpr = BLOCK_E if BLOCK_E <= 32 else max(32, BLOCK_E // 4)
    CHUNKS: tl.constexpr = BLOCK_E // WIDTH
    k0 = _logit_keys(row_ptr, 0, num_experts, WIDTH)
    k1 = _logit_keys(row_ptr, WIDTH, num_experts, WIDTH) if CHUNKS > 1 else k0
    k2 = _logit_keys(row_ptr, 2 * WIDTH, num_experts, WIDTH) if CHUNKS > 2 else k0
    k3 = _logit_keys(row_ptr, 3 * WIDTH, num_experts, WIDTH) if CHUNKS > 2 else k0
    ks = tl.arange(0, BLOCK_K)
    values = tl.zeros((BLOCK_K,), dtype=tl.float32)
    chosen = rank * 0
    for k in tl.static_range(TOP_K):
        both = tl.maximum(k0, k1) if CHUNKS > 1 else k0
        if CHUNKS > 2:
            both = tl.maximum(both, tl.maximum(k2, k3))
        best = tl.max(both, axis=0)
        # Keys are distinct: exactly the best one leaves the race.
        k0 = tl.where(k0 == best, -2147483648, k0)
        if CHUNKS > 1:
            k1 = tl.where(k1 == best, -2147483648, k1)
        if CHUNKS > 2:
            k2 = tl.where(k2 == best, -2147483648, k2)
            k3 = tl.where(k3 == best, -2147483648, k3)
        top = best & -65536
        value = tl.where(top < 0, (top ^ 0x7FFFFFFF) & -65536, top).to(tl.float32, bitcast=True)
        values = tl.where(ks == k, value, values)
        chosen = tl.where(rank == k, tl.minimum(65535 - (best & 65535), num_experts - 1), chosen)
    return values, chosen


@triton.jit
def softmax_k(values, TOP_K: tl.constexpr, BLOCK_K: tl.constexpr):
    """Softmax over the first TOP_K of topk_row's values (the rest 0)."""
    k_ok = tl.arange(0, BLOCK_K) < TOP_K
    e = tl.where(k_ok, tl.exp(values - tl.max(tl.where(k_ok, values, float("-inf")), axis=0)), 0.0)
    return e / tl.sum(e, axis=0)


@triton.jit
def _topk_softmax_store(
    logits, pid, rows, row_ok, cols, col_ok, weights_ptr, ids_ptr, hist_ptr, num_experts,
    TOP_K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
):  # fmt: skip
    """Top-k of fp32 logits [BLOCK_T, BLOCK_E], softmax over them; stores weights, ids and the
    block's expert histogram (row `pid` of hist)."""
    ks = tl.arange(0, BLOCK_K)
    logits = tl.where(col_ok[None, :], logits, float("-inf"))  # padding columns are never chosen
    taken = tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.int1)
    values = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.float32)
    ids = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.int32)
    for k in tl.static_range(TOP_K):
        free = col_ok[None, :] & ~taken
        best = tl.max(tl.where(free, logits, float("-inf")), axis=1)
        # Lowest index among the columns equal to the maximum (torch.topk's choice on CUDA).
        hit = free & (logits == best[:, None])
        idx = tl.min(tl.where(hit, cols[None, :], BLOCK_E), axis=1)
        idx = tl.minimum(idx, num_experts - 1)  # NaN rows match nothing; keep the id in range
        taken = taken | (cols[None, :] == idx[:, None])
        values = tl.where(ks[None, :] == k, best[:, None], values)
        ids = tl.where(ks[None, :] == k, idx[:, None], ids)
    k_ok = ks[None, :] < TOP_K
    # values[:, 0] is the largest: subtracting it keeps exp() <= 1.
    e = tl.where(k_ok, tl.exp(values - tl.max(tl.where(k_ok, values, float("-inf")), axis=1)[:, None]), 0.0)
    probs = e / tl.sum(e, axis=1)[:, None]
    out = rows[:, None] * TOP_K + ks[None, :]
    tl.store(weights_ptr + out, probs, mask=row_ok[:, None] & k_ok)
    tl.store(ids_ptr + out, ids, mask=row_ok[:, None] & k_ok)
    hist = tl.sum((taken & row_ok[:, None]).to(tl.int32), axis=0)
    tl.store(hist_ptr + pid * num_experts + cols, hist, mask=col_ok)


@triton.jit
def _load_choices(ids_ptr, rows, row_ok, cols, TOP_K: tl.constexpr):
    """[BLOCK_T, BLOCK_E] bool: expert `col` is among the choices of token `row`."""
    chosen = (rows[:, None] < 0) & (cols[None, :] < 0)  # all False, [BLOCK_T, BLOCK_E]
    for k in tl.static_range(TOP_K):
        e = tl.load(ids_ptr + rows * TOP_K + k, mask=row_ok, other=-1)
        chosen = chosen | (cols[None, :] == e[:, None])
    return chosen


@triton.jit
def _hist_prefix(hist_ptr, pid, num_blocks, num_experts, cols, col_ok, BLOCK_B: tl.constexpr, BLOCK_E: tl.constexpr):
    """(slots of each expert in token blocks before `pid`, slots of each expert in all blocks)."""
    before = tl.zeros((BLOCK_E,), dtype=tl.int32)
    total = tl.zeros((BLOCK_E,), dtype=tl.int32)
    for b0 in range(0, num_blocks, BLOCK_B):
        b = b0 + tl.arange(0, BLOCK_B)
        ok = (b < num_blocks)[:, None] & col_ok[None, :]
        h = tl.load(hist_ptr + b[:, None] * num_experts + cols[None, :], mask=ok, other=0)
        total += tl.sum(h, axis=0)
        before += tl.sum(tl.where((b < pid)[:, None], h, 0), axis=0)
    return before, total


@triton.jit
def _write_tile_table(
    tile_expert_ptr, tile_start_ptr, num_tiles, total, starts, cols,
    BLOCK_M: tl.constexpr, BLOCK_J: tl.constexpr,
):  # fmt: skip
    """Tiles of BLOCK_M sorted rows, expert by expert; entries past the last tile get expert -1."""
    tiles = (total + BLOCK_M - 1) // BLOCK_M
    tile_end = tl.cumsum(tiles, axis=0)
    tile_begin = tile_end - tiles
    for j0 in range(0, num_tiles, BLOCK_J):
        j = j0 + tl.arange(0, BLOCK_J)
        hit = (j[:, None] >= tile_begin[None, :]) & (j[:, None] < tile_end[None, :])  # one column at most
        expert = tl.sum(tl.where(hit, cols[None, :], 0), axis=1)
        start = tl.sum(tl.where(hit, starts[None, :] + (j[:, None] - tile_begin[None, :]) * BLOCK_M, 0), axis=1)
        used = tl.sum(hit.to(tl.int32), axis=1) > 0
        tl.store(tile_expert_ptr + j, tl.where(used, expert, -1), mask=j < num_tiles)
        tl.store(tile_start_ptr + j, start, mask=j < num_tiles)


# Counts that vary with the step are not specialised (= 1, divisible by 16): each new
# combination would be a Triton compile in the middle of serving (runtime/gpu/warmup.py).
@triton.jit(do_not_specialize=["num_tokens", "num_blocks", "num_tiles"])
def _sort_slots_kernel(
    ids_ptr, hist_ptr, counts_ptr, offsets_ptr, sorted_slots_ptr, slot_rows_ptr,
    tile_expert_ptr, tile_start_ptr, num_tokens, num_experts, num_blocks, num_tiles,
    TOP_K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_B: tl.constexpr, BLOCK_J: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    rows = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    row_ok = rows < num_tokens
    col_ok = cols < num_experts
    before, total = _hist_prefix(hist_ptr, pid, num_blocks, num_experts, cols, col_ok, BLOCK_B, BLOCK_E)
    starts = tl.cumsum(total, axis=0) - total  # first sorted row of each expert
    chosen = _load_choices(ids_ptr, rows, row_ok, cols, TOP_K).to(tl.int32)
    # A token picks an expert at most once, so earlier tokens of the block = earlier slots.
    rank = tl.cumsum(chosen, axis=0) - chosen
    sorted_row = starts[None, :] + before[None, :] + rank
    for k in tl.static_range(TOP_K):
        e = tl.load(ids_ptr + rows * TOP_K + k, mask=row_ok, other=-1)
        r = tl.sum(tl.where(cols[None, :] == e[:, None], sorted_row, 0), axis=1)
        slot = rows * TOP_K + k
        tl.store(sorted_slots_ptr + r, slot, mask=row_ok)
        tl.store(slot_rows_ptr + slot, r, mask=row_ok)
    if pid == 0:
        tl.store(counts_ptr + cols, total, mask=col_ok)
        tl.store(offsets_ptr + cols, starts, mask=col_ok)
        tl.store(offsets_ptr + num_experts, tl.sum(total, axis=0))
        _write_tile_table(tile_expert_ptr, tile_start_ptr, num_tiles, total, starts, cols, BLOCK_M, BLOCK_J)


def routing_buffers(out: MoeRouting | None, num_tokens: int, num_experts: int, top_k: int, block_m: int,
                    device: torch.device) -> MoeRouting:
    """The sizes checked, then `out` checked against them or fresh buffers; for zero tokens, the
    empty routing."""
    if not 1 <= num_experts <= MAX_EXPERTS:
        raise ValueError(f"number of experts must be in [1, {MAX_EXPERTS}], got {num_experts}")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, {num_experts}], got {top_k}")
    if block_m < 1 or block_m & (block_m - 1):
        raise ValueError(f"block_m must be a power of two, got {block_m}")
    if out is None:
        out = MoeRouting.allocate(num_tokens, num_experts, top_k, block_m, device)
    if out.topk_ids.shape != (num_tokens, top_k) or out.num_experts != num_experts or out.block_m != block_m:
        raise ValueError("routing buffers do not match the tokens, experts, top_k or block_m")
    if num_tokens == 0:
        out.expert_counts.zero_()
        out.expert_offsets.zero_()
    return out


def route(logits: torch.Tensor, top_k: int, block_m: int, out: MoeRouting | None = None,
          sort: bool = True) -> MoeRouting:
    """[T, E] router logits -> MoeRouting with tiles of `block_m` rows (two kernel launches).

    `out`, when given, must have been made by MoeRouting.allocate(...).narrow(T, block_m).
    sort=False launches only the top-k kernel: topk_weights and topk_ids are valid, every other
    field is left as it was (the matrix-vector kernels read slots in order and need nothing else).
    """
    if logits.dim() != 2:
        raise ValueError(f"router logits must be [T, E], got shape {tuple(logits.shape)}")
    if not logits.dtype.is_floating_point:
        raise TypeError(f"router logits must be floating point, got {logits.dtype}")
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    num_tokens, num_experts = logits.shape
    out = routing_buffers(out, num_tokens, num_experts, top_k, block_m, logits.device)
    if num_tokens == 0:
        return out
    block_t = token_block(num_tokens, num_experts)
    block_e = triton.next_power_of_2(num_experts)
    num_blocks = triton.cdiv(num_tokens, block_t)
    num_warps = 4 if block_t * block_e <= 2048 else 8
    _topk_softmax_kernel[(num_blocks,)](
        logits, logits.stride(0), out.topk_weights, out.topk_ids, out.block_hist, num_tokens, num_experts,
        TOP_K=top_k, BLOCK_K=triton.next_power_of_2(top_k), BLOCK_T=block_t, BLOCK_E=block_e, num_warps=num_warps,
    )  # fmt: skip
    if sort:
        sort_slots(out, block_t, num_warps)
    return out


def sort_slots(out: MoeRouting, block_t: int, num_warps: int) -> None:
    """The sorting launch: expert-sorted slots and the tile table from out.topk_ids and the block
    histograms the top-k kernel wrote with `block_t` tokens per program."""
    num_tokens, top_k = out.topk_ids.shape
    num_blocks = triton.cdiv(num_tokens, block_t)
    _sort_slots_kernel[(num_blocks,)](
        out.topk_ids, out.block_hist, out.expert_counts, out.expert_offsets, out.sorted_slots, out.slot_rows,
        out.tile_expert, out.tile_row_start, num_tokens, out.num_experts, num_blocks, out.max_tiles,
        TOP_K=top_k, BLOCK_T=block_t, BLOCK_E=triton.next_power_of_2(out.num_experts), BLOCK_M=out.block_m,
        BLOCK_B=HIST_ROWS_PER_STEP, BLOCK_J=TILE_ENTRIES_PER_STEP, num_warps=num_warps,
    )  # fmt: skip


def route_metadata_ref(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> dict[str, torch.Tensor]:
    """The twin of the sorting step: [T, K] expert ids -> counts, offsets, sorted_slots, slot_rows,
    and the tile table (tile_expert padded with -1 and tile_row_start padded with 0 to max_tiles)."""
    num_tokens, top_k = topk_ids.shape
    flat = topk_ids.reshape(-1).long()
    counts = torch.bincount(flat, minlength=num_experts)
    offsets = torch.zeros(num_experts + 1, dtype=torch.int64, device=flat.device)
    offsets[1:] = torch.cumsum(counts, 0)
    sorted_slots = torch.sort(flat, stable=True).indices
    slot_rows = torch.empty_like(sorted_slots)
    slot_rows[sorted_slots] = torch.arange(flat.numel(), device=flat.device)
    size = max_tiles(num_tokens, top_k, num_experts, block_m)
    tile_expert = torch.full((size,), -1, dtype=torch.int64)
    tile_start = torch.zeros(size, dtype=torch.int64)
    j = 0
    for e, (c, o) in enumerate(zip(counts.tolist(), offsets.tolist())):
        for start in range(o, o + c, block_m):
            tile_expert[j], tile_start[j] = e, start
            j += 1
    return {
        "expert_counts": counts,
        "expert_offsets": offsets,
        "sorted_slots": sorted_slots,
        "slot_rows": slot_rows,
        "tile_expert": tile_expert.to(flat.device),
        "tile_row_start": tile_start.to(flat.device),
    }
