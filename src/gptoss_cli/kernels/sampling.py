"""Token sampling with per-row parameters and counter-based randomness (no host sync, no state).

Semantics of one row (logits l over V tokens):
  temperature == 0 -> argmax(l) (lowest index on ties).
  otherwise z = l / temperature;
    top_k > 0  : keep tokens whose z >= the k-th largest z;
    p = softmax(z over kept);
    top_p < 1  : keep token i when the mass of tokens strictly more likely than i is < top_p
                 (ties at the boundary are all kept, so the rule is a probability threshold);
    min_p > 0  : keep tokens with p >= min_p * max(p);
    token = argmax over kept of log p_i + G_i, G_i = -log(-log u_i)   (Gumbel-max == sampling p).
u_i depends only on (seed, offset, i) through a 32-bit integer hash, so the same seed and step
give the same token on CPU and GPU, in any batch composition. `offset` is the step counter.

`sample` runs this on device in three launches with no host sync and no data-dependent shapes,
so it can be captured in a CUDA graph. Logits are read in l-space: z = l / T is monotone in l,
so every filter is a threshold on l, and argmax(log p + G) == argmax(l + T G) on the kept set.
  1. chunks (grid B x S): per chunk of a row, the argmax of l (greedy rows; filtered rows use it
     as the row max m) or of l + T G (plain temperature rows: that is the whole answer).
  2. window (grid B x S, filtered rows only): the row's window, every token that could matter
     (l >= m - 20.5 T: anything lower loses the Gumbel race to the max token; tighter for top-p
     and min-p), copied in id order with the ids, plus the chunk's mass sum(exp((l - m) / T)).
  3. finish (grid B): reduce the chunks. A filtered row finds its threshold exactly over its
     window (or, when the window is too large, over the whole row): passes that split the
     bracket holding it at NT thresholds (count and mass above each) until it holds one distinct
     value or at most CAP tokens, which are gathered and ranked (sampling_threshold.py); then
     argmax(l + T G) over the kept tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from .sampling_threshold import filtered_threshold

MASK32 = 0xFFFFFFFF
GOLDEN = 0x9E3779B9


def _mul32(a: torch.Tensor, b: int) -> torch.Tensor:
    """(a * b) mod 2**32 for int64 a in [0, 2**32) without int64 overflow."""
    lo = (a * (b & 0xFFFF)) & MASK32
    hi = ((a * (b >> 16)) & 0xFFFF) << 16
    return (lo + hi) & MASK32


def hash32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 integer hash on int64 tensors holding uint32 values."""
    x = x & MASK32
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def row_key(seeds: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """[B] int64 seeds and offsets -> [B] uint32 keys (as int64)."""
    s = seeds.long()
    return hash32((s & MASK32) ^ hash32(((s >> 32) & MASK32) ^ hash32(offsets.long() & MASK32)))


def uniform_ref(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B] keys -> [B, V] fp32 uniforms in (0, 1). On the CPU through numpy (`_uniform_np`, the
    same bits): the CPU engine draws one per vocabulary entry for every sampled token."""
    return _uniform_np(keys, vocab) if keys.device.type == "cpu" else _uniform_torch(keys, vocab)


def _uniform_torch(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    idx = torch.arange(vocab, dtype=torch.int64, device=keys.device)
    x = hash32(_mul32(idx, GOLDEN)[None, :] + keys[:, None])
    # 23 bits: (2**23 - 1 + 0.5) is exact in fp32, so u < 1 always; with 24 bits the top value
    # rounds to 1.0, -log(u) = 0 and the token's Gumbel score becomes +inf (seen on the H200).
    return ((x >> 9).float() + 0.5) * (1.0 / (1 << 23))


def _hash32_np(x: np.ndarray) -> np.ndarray:
    """`hash32` on uint32 arrays: numpy's uint32 multiplies wrap, so each is one operation where
    `_mul32` needs seven on int64 (uniforms of one 201k-token row: 7.5 ms that way, 0.7 ms here)."""
    x = x ^ (x >> np.uint32(16))
    x = x * np.uint32(0x7FEB352D)
    x = x ^ (x >> np.uint32(15))
    x = x * np.uint32(0x846CA68B)
    return x ^ (x >> np.uint32(16))


def _uniform_np(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """`uniform_ref` for CPU keys, bit for bit (uint32 sums wrap as `hash32`'s mask does; the
    float steps are exact in fp32)."""
    ids = np.arange(vocab, dtype=np.uint32) * np.uint32(GOLDEN)
    x = _hash32_np(ids[None, :] + keys.numpy().astype(np.uint32)[:, None])
    u = ((x >> np.uint32(9)).astype(np.float32) + np.float32(0.5)) * np.float32(1.0 / (1 << 23))
    return torch.from_numpy(u)


def _mass_above(p: torch.Tensor) -> torch.Tensor:
    """[B, V] -> [B, V]: for each entry, the total probability of entries strictly larger:
    the total minus the ascending cumulative sum up to the last entry equal to it. That entry's
    sorted position is the end of its run of equal values, found by a reversed running minimum
    (one 201k-token row on the CPU: 10.1 ms, of which the sort is most; 15.7 ms with a binary
    search per entry)."""
    asc, order = torch.sort(p, dim=-1)
    cum = torch.cumsum(asc, dim=-1)
    v = p.shape[-1]
    pos = torch.arange(v, device=p.device).expand_as(asc)
    run_end = torch.ones_like(asc, dtype=torch.bool)
    run_end[:, :-1] = asc[:, 1:] != asc[:, :-1]
    last_equal = torch.where(run_end, pos, v).flip(-1).cummin(-1).values.flip(-1)
    above_sorted = cum[:, -1:] - cum.gather(1, last_equal)
    return torch.empty_like(p).scatter_(1, order, above_sorted)


def filter_ref(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
    min_p: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The filtering half of `sample_ref`: (p [B, V] fp32, drop [B, V] bool)."""
    v = logits.shape[1]
    z = logits.float()
    greedy = temperature <= 0
    z = z / torch.where(greedy, 1.0, temperature.float())[:, None]
    neg_inf = torch.finfo(torch.float32).min
    k = top_k.long().clamp(0, v)
    if bool((k > 0).any()):  # each full-vocabulary sort costs ~30 ms per row on the CPU
        kth = torch.sort(z, dim=-1, descending=True).values.gather(1, (k - 1).clamp(min=0)[:, None])
        z = torch.where((k[:, None] > 0) & (z < kth), neg_inf, z)
    p = torch.softmax(z, dim=-1)
    top_p = top_p.float()[:, None]
    drop = torch.zeros_like(p, dtype=torch.bool)
    if bool((top_p < 1).any()):
        # top_p >= 1 keeps everything, also where the fp32 mass above rounds up to 1.
        drop = (_mass_above(p) >= top_p) & (top_p < 1)
    drop |= p < (min_p.float() * p.max(dim=-1).values)[:, None]
    drop |= p <= 0
    return p, drop


def sample_ref(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    seeds: torch.Tensor,
    offsets: torch.Tensor,
) -> torch.Tensor:
    """logits [B, V]; per-row temperature/top_p/min_p fp32, top_k int, seeds/offsets int64 -> [B] int64."""
    v = logits.shape[1]
    greedy = temperature <= 0
    p, drop = filter_ref(logits, temperature, top_k, top_p, min_p)
    u = uniform_ref(row_key(seeds, offsets), v)
    score = torch.log(p.clamp_min(1e-38)) - torch.log(-torch.log(u))
    score = score.masked_fill(drop, float("-inf"))
    sampled = score.argmax(dim=-1)
    return torch.where(greedy, logits.float().argmax(dim=-1), sampled)


# ---------------------------------------------------------------------------------------------
# Triton implementation
# ---------------------------------------------------------------------------------------------

@triton.jit
def _hash32_dev(x):
    """lowbias32 on uint32 (wrap-around multiplies), bit-identical to `hash32`."""
    x = x ^ (x >> 16)
    x = x * tl.full([], 0x7FEB352D, tl.uint32)
    x = x ^ (x >> 15)
    x = x * tl.full([], 0x846CA68B, tl.uint32)
    return x ^ (x >> 16)


@triton.jit
def _row_key_dev(seed, offset):
    """int64 seed and offset scalars -> the row's uint32 key, as `row_key`."""
    lo = seed.to(tl.uint32)  # truncation keeps the low 32 bits, as `& MASK32`
    hi = (seed >> 32).to(tl.uint32)
    return _hash32_dev(lo ^ _hash32_dev(hi ^ _hash32_dev(offset.to(tl.uint32))))


@triton.jit
def _uniform_dev(idx, key):
    """int32 token ids, uint32 key -> fp32 uniforms in (0, 1), bit-identical to `uniform_ref`."""
    # `_hash32_dev` written out: each nested jit call costs milliseconds in the interpreter.
    x = idx.to(tl.uint32) * tl.full([], 0x9E3779B9, tl.uint32) + key
    x = x ^ (x >> 16)
    x = x * tl.full([], 0x7FEB352D, tl.uint32)
    x = x ^ (x >> 15)
    x = x * tl.full([], 0x846CA68B, tl.uint32)
    x = x ^ (x >> 16)
    return ((x >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)


@triton.jit
def _row_mode(temp, top_k, top_p, min_p, V):
    """GREEDY (T <= 0), PLAIN (no filter) or FILTERED, decided per row on device."""
    filtered = ((top_k > 0) & (top_k < V)) | (top_p < 1.0) | (min_p > 0.0)
    return tl.where(temp <= 0.0, 0, tl.where(filtered, 2, 1))


@triton.jit
def _argmax_pass(row_ptr, start, end, lt, temp, key, ids_ptr, NOISE: tl.constexpr,
                 GATHERED: tl.constexpr, FAST_LOG: tl.constexpr, BLOCK: tl.constexpr):
    """(max, lowest token id of the max) of l (+ temp * G when NOISE) over [start, end), l >= lt.

    Token ids are the positions, or ids_ptr[position] for a GATHERED candidate list. Returns
    (-inf, 0) when nothing qualifies, like torch's argmax over an all -inf row. The score is
    l - T ln2 log2(-ln u) = l + T G: the inner log must be accurate (u near 1 gives the largest
    G), the outer one may be the hardware approximation (FAST_LOG, GPU only).
    """
    offs = tl.arange(0, BLOCK)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_i = tl.zeros([BLOCK], tl.int32)
    t_ln2 = temp * 0.6931471805599453
    # G <= 17.33 for every u the hash can give (u <= 1 - 2^-25): a block whose largest logit
    # plus T * 17.5 cannot reach the best score so far is skipped without computing its noise.
    t_gmax = temp * 17.5
    top = tl.full([], float("-inf"), tl.float32)
    for s in range(start, end, BLOCK):
        pos = s + offs
        ok = pos < end
        l = tl.load(row_ptr + pos, mask=ok, other=float("-inf")).to(tl.float32)
        l = tl.where(ok & (l >= lt), l, float("-inf"))
        if GATHERED:
            tok = tl.load(ids_ptr + pos, mask=ok, other=0)
        else:
            tok = pos
        if NOISE:
            if tl.max(l, 0) + t_gmax >= top:
                e = -tl.log(_uniform_dev(tok, key))
                if FAST_LOG:
                    score = l - t_ln2 * libdevice.fast_log2f(e)
                else:
                    score = l - t_ln2 * tl.log2(e)
                # Strictly greater keeps each lane's first id; gathered lists are not in id order.
                take = score > best
                if GATHERED:  # padding (-inf) never takes; its ids are not initialised
                    take = take | ((score == best) & (score > float("-inf")) & (tok < best_i))
                best = tl.where(take, score, best)
                best_i = tl.where(take, tok, best_i)
                top = tl.max(best, 0)
        else:
            take = l > best
            best = tl.where(take, l, best)
            best_i = tl.where(take, tok, best_i)
    top = tl.max(best, 0)
    return top, tl.min(tl.where(best == top, best_i, 2147483647), 0)


@triton.jit
def _sample_chunks_kernel(
    logits_ptr, stride_b, V, chunk,
    temp_ptr, topk_ptr, topp_ptr, minp_ptr, seed_ptr, off_ptr,
    part_val_ptr, part_idx_ptr, num_splits,
    BLOCK: tl.constexpr, FAST_LOG: tl.constexpr,
):
    """Grid (B, S): the argmax of one chunk of one row, per the row's mode."""
    b = tl.program_id(0)
    c = tl.program_id(1)
    row = logits_ptr + b.to(tl.int64) * stride_b
    start = c * chunk
    end = tl.minimum(start + chunk, V)
    temp = tl.load(temp_ptr + b)
    mode = _row_mode(temp, tl.load(topk_ptr + b), tl.load(topp_ptr + b), tl.load(minp_ptr + b), V)
    if mode == 1:
        key = _row_key_dev(tl.load(seed_ptr + b), tl.load(off_ptr + b))
        val, idx = _argmax_pass(row, start, end, float("-inf"), temp, key, row, True, False, FAST_LOG,
                                BLOCK)
    else:
        val, idx = _argmax_pass(row, start, end, float("-inf"), 1.0, 0, row, False, False, FAST_LOG,
                                BLOCK)
    tl.store(part_val_ptr + b * num_splits + c, val)
    tl.store(part_idx_ptr + b * num_splits + c, idx)


@triton.jit
def _window_floor(m, temp, top_p, min_p, V):
    """Lowest logit that can matter for a filtered row whose largest logit is m."""
    # The largest logit is always kept and scores at least m - 2.86 T (G >= -2.853 for every u
    # the hash can give), and no score exceeds l + 17.34 T: tokens below m - 20.5 T never win.
    floor = m - 20.5 * temp
    if (top_p < 1.0) & (top_p > 0.0):
        floor = tl.maximum(floor, m + temp * (tl.log((1.0 - top_p) / V) - 1.0))  # see filtered_threshold
    if min_p > 0.0:
        floor = tl.maximum(floor, m + temp * tl.log(min_p))
    return floor


@triton.jit
def _window_kernel(
    logits_ptr, stride_b, V, chunk,
    temp_ptr, topk_ptr, topp_ptr, minp_ptr,
    part_val_ptr, num_splits, part_mass_ptr, seg_count_ptr, cand_val_ptr, cand_id_ptr,
    SPLITS: tl.constexpr, SEG: tl.constexpr, BLOCK: tl.constexpr,
):
    """Grid (B, S), filtered rows only: copy the chunk's logits >= the row's window floor (and their
    ids) to its own SEG-long segment, in id order, padded with -inf; count them (past SEG the
    row falls back to full passes); and sum the chunk's mass 2^((l - m) * c2)."""
    b = tl.program_id(0)
    c = tl.program_id(1)
    temp = tl.load(temp_ptr + b)
    top_p = tl.load(topp_ptr + b)
    min_p = tl.load(minp_ptr + b)
    if _row_mode(temp, tl.load(topk_ptr + b), top_p, min_p, V) == 2:
        sj = tl.arange(0, SPLITS)
        m = tl.max(tl.load(part_val_ptr + b * num_splits + sj, mask=sj < num_splits,
                           other=float("-inf")), 0)
        floor = _window_floor(m, temp, top_p, min_p, V)
        c2 = 1.4426950408889634 / temp
        row = logits_ptr + b.to(tl.int64) * stride_b
        seg = (b * num_splits + c).to(tl.int64) * SEG
        offs = tl.arange(0, BLOCK)
        mass = tl.zeros([BLOCK], tl.float32)
        count = tl.zeros([], tl.int32)
        start = c * chunk
        end = tl.minimum(start + chunk, V)
        for s in range(start, end, BLOCK):
            idx = s + offs
            l = tl.load(row + idx, mask=idx < end, other=float("-inf")).to(tl.float32)
            mass += tl.exp2((l - m) * c2)
            inside = (l >= floor).to(tl.int32)
            pos = count + tl.cumsum(inside, 0) - 1
            keep = (inside > 0) & (pos < SEG)
            tl.store(cand_val_ptr + seg + pos, l, mask=keep)
            tl.store(cand_id_ptr + seg + pos, idx, mask=keep)
            count += tl.sum(inside, 0)
        for s in range(0, SEG, BLOCK):
            pos = s + offs
            tl.store(cand_val_ptr + seg + pos, float("-inf"), mask=(pos >= count) & (pos < SEG))
        tl.store(part_mass_ptr + b * num_splits + c, tl.sum(mass, 0))
        tl.store(seg_count_ptr + b * num_splits + c, count)


@triton.jit
def _pack_window(seg_val_ptr, seg_id_ptr, counts_ptr, num_splits, val_ptr, id_ptr, prefix_ptr,
                 SPLITS: tl.constexpr, SEG: tl.constexpr, BLOCK: tl.constexpr):
    """Copy the valid heads of a row's window segments to one dense list in chunk order (so id
    order: the result, and every sum over it, does not depend on scheduling); returns its length."""
    sj = tl.arange(0, SPLITS)
    counts = tl.load(counts_ptr + sj, mask=sj < num_splits, other=0)
    tl.store(prefix_ptr + sj, tl.cumsum(counts, 0) - counts)
    tl.debug_barrier()  # the prefix is read back by other threads
    offs = tl.arange(0, BLOCK)
    for f in range(0, num_splits * SEG, BLOCK):
        flat = f + offs
        c = flat // SEG
        j = flat - c * SEG
        live = flat < num_splits * SEG
        valid = live & (j < tl.load(counts_ptr + c, mask=live, other=0))
        dst = tl.load(prefix_ptr + c, mask=live, other=0) + j
        tl.store(val_ptr + dst, tl.load(seg_val_ptr + flat, mask=valid), mask=valid)
        tl.store(id_ptr + dst, tl.load(seg_id_ptr + flat, mask=valid), mask=valid)
    tl.debug_barrier()  # the packed list is read back by other threads
    return tl.sum(counts, 0)


@triton.jit
def _sample_finish_kernel(
    logits_ptr, stride_b, V,
    temp_ptr, topk_ptr, topp_ptr, minp_ptr, seed_ptr, off_ptr,
    part_val_ptr, part_idx_ptr, num_splits, part_mass_ptr, seg_count_ptr, cand_val_ptr, cand_id_ptr,
    win_val_ptr, win_id_ptr, prefix_ptr, scratch_ptr, out_ptr,
    SPLITS: tl.constexpr, SEG: tl.constexpr, BLOCK: tl.constexpr, NT: tl.constexpr,
    CAP: tl.constexpr, MAX_ITERS: tl.constexpr, FAST_LOG: tl.constexpr,
):
    """Grid (B,): reduce the chunk results; filtered rows find their threshold and sample, from
    their window when it fit its segments, else from full passes over the row."""
    b = tl.program_id(0)
    sj = tl.arange(0, SPLITS)
    in_row = sj < num_splits
    vals = tl.load(part_val_ptr + b * num_splits + sj, mask=in_row, other=float("-inf"))
    idxs = tl.load(part_idx_ptr + b * num_splits + sj, mask=in_row, other=2147483647)
    top = tl.max(vals, 0)
    token = tl.min(tl.where(vals == top, idxs, 2147483647), 0)
    temp = tl.load(temp_ptr + b)
    top_k = tl.load(topk_ptr + b)
    top_p = tl.load(topp_ptr + b)
    min_p = tl.load(minp_ptr + b)
    if _row_mode(temp, top_k, top_p, min_p, V) == 2:
        key = _row_key_dev(tl.load(seed_ptr + b), tl.load(off_ptr + b))
        scratch = scratch_ptr + b.to(tl.int64) * CAP
        counts = tl.load(seg_count_ptr + b * num_splits + sj, mask=in_row, other=0)
        total = tl.sum(tl.load(part_mass_ptr + b * num_splits + sj, mask=in_row, other=0.0), 0)
        # With top-k and top-p, S_k must be exact: the k-th logit has to lie in the window.
        use_k = (top_k > 0) & (top_k < V)
        fits = (tl.max(counts, 0) <= SEG) & ~(use_k & (top_p < 1.0) & (tl.sum(counts, 0) < top_k))
        if fits:
            seg_val = cand_val_ptr + b.to(tl.int64) * num_splits * SEG
            seg_id = cand_id_ptr + b.to(tl.int64) * num_splits * SEG
            cand = seg_val  # one chunk: its segment is already the dense list
            ids = seg_id
            n = tl.sum(counts, 0)
            if num_splits > 1:
                cand = win_val_ptr + b.to(tl.int64) * num_splits * SEG
                ids = win_id_ptr + b.to(tl.int64) * num_splits * SEG
                n = _pack_window(seg_val, seg_id, seg_count_ptr + b * num_splits, num_splits, cand, ids,
                                 prefix_ptr + b * SPLITS, SPLITS, SEG, BLOCK)
            thr = filtered_threshold(cand, n, V, top, temp, top_k, top_p, min_p, total, scratch,
                                      BLOCK, NT, CAP, MAX_ITERS)
            _, token = _argmax_pass(cand, 0, n, thr, temp, key, ids, True, True, FAST_LOG, BLOCK)
        else:
            row = logits_ptr + b.to(tl.int64) * stride_b
            thr = filtered_threshold(row, V, V, top, temp, top_k, top_p, min_p, -1.0, scratch,
                                      BLOCK, NT, CAP, MAX_ITERS)
            _, token = _argmax_pass(row, 0, V, thr, temp, key, row, True, False, FAST_LOG, BLOCK)
    tl.store(out_ptr + b, token.to(tl.int64))


@triton.jit
def _uniform_kernel(seed_ptr, off_ptr, out_ptr, V, BLOCK: tl.constexpr):
    b = tl.program_id(0)
    v0 = tl.program_id(1) * BLOCK
    idx = v0 + tl.arange(0, BLOCK)
    key = _row_key_dev(tl.load(seed_ptr + b), tl.load(off_ptr + b))
    tl.store(out_ptr + b.to(tl.int64) * V + idx, _uniform_dev(idx, key), mask=idx < V)


@dataclass
class SamplingRows:
    """Per-row sampling parameters of a batch, in the order `sample` takes them: temperature,
    top_p, min_p fp32; top_k int32; seeds, offsets int64 (all [B])."""

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor
    seeds: torch.Tensor
    offsets: torch.Tensor

    def args(self) -> tuple[torch.Tensor, ...]:
        return self.temperature, self.top_k, self.top_p, self.min_p, self.seeds, self.offsets


@dataclass(frozen=True)
class SampleLaunch:
    """Block sizes and search limits of `sample` (per device kind)."""

    block_chunk: int = 4096  # tokens per iteration in the chunk kernel
    warps_chunk: int = 8
    block_window: int = 2048  # tokens per iteration in the window kernel (a cumsum per block)
    block_finish: int = 1024  # tokens per iteration in the finish kernel ([block, NT] tiles)
    warps_finish: int = 8
    thresholds: int = 8  # NT: thresholds per search pass
    cap: int = 128  # bracket size that is gathered and ranked exactly
    max_iters: int = 16
    max_splits: int = 64
    window: int = 8192  # window tokens kept per row (split evenly over its chunks)


GPU_LAUNCH = SampleLaunch()
# Interpreter: fewer, smaller tiles so tests stay fast and still cross block boundaries.
CPU_LAUNCH = SampleLaunch(block_chunk=1024, block_window=1024, block_finish=1024, cap=64, max_splits=4,
                          window=512)


def default_splits(batch: int, num_sms: int | None) -> int:
    """Chunks per row when the caller does not choose: about 2 programs per SM, a power of two
    (num_sms None: the interpreter, capped by SampleLaunch.max_splits)."""
    if num_sms is None:
        return 1 << 30
    return triton.next_power_of_2(triton.cdiv(2 * num_sms, max(batch, 1)))


def _num_sms(device: torch.device) -> int | None:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else None


def split_classes(max_batch: int, device: torch.device) -> list[int]:
    """The smallest batch of each default launch layout up to max_batch: sampling once at each
    compiles every kernel variant `sample` can need for that many rows."""
    launch = GPU_LAUNCH if device.type == "cuda" else CPU_LAUNCH
    sms = _num_sms(device)
    first: dict[int, int] = {}
    for b in range(1, max_batch + 1):
        first.setdefault(min(default_splits(b, sms), launch.max_splits), b)
    return sorted(first.values())


@dataclass(frozen=True)
class _Layout:
    """How one call splits its rows: `splits` chunks of `chunk` tokens, `seg` window slots each."""

    splits: int
    chunk: int
    seg: int

    @classmethod
    def plan(cls, batch: int, vocab: int, launch: SampleLaunch, device: torch.device,
             num_splits: int | None) -> "_Layout":
        """Enough programs to fill the GPU at small batch, one per row at large batch.

        The default split count is a power of two: SPLITS and SEG are constexprs, so every
        distinct count is a Triton compile (1-3 s on the H200). Any count (2 * SMs / batch) gave
        a compile for most new row counts, e.g. inside the first prefill steps of a benchmark;
        powers of two leave at most log2(max_splits) + 1 classes, which warm-up compiles."""
        if num_splits is None:
            num_splits = min(default_splits(batch, _num_sms(device)), launch.max_splits)
        chunk = triton.cdiv(triton.cdiv(vocab, num_splits), launch.block_chunk) * launch.block_chunk
        splits = triton.cdiv(vocab, chunk)
        seg = launch.window // splits
        return cls(splits, chunk, seg // 16 * 16 if seg >= 16 else max(seg, 1))


@dataclass(frozen=True)
class _Workspace:
    """Per-call scratch of `sample` (B x S chunk results, window segments, search scratch)."""

    part_val: torch.Tensor
    part_idx: torch.Tensor
    part_mass: torch.Tensor
    seg_count: torch.Tensor
    cand_val: torch.Tensor
    cand_id: torch.Tensor
    win_val: torch.Tensor
    win_id: torch.Tensor
    prefix: torch.Tensor
    scratch: torch.Tensor

    @classmethod
    def allocate(cls, batch: int, layout: _Layout, launch: SampleLaunch,
                 device: torch.device) -> "_Workspace":
        s, seg = layout.splits, layout.seg
        f32, i32 = torch.float32, torch.int32
        # The packed window is only needed when a row has several chunks.
        packed = s * seg if s > 1 else 1
        return cls(
            part_val=torch.empty(batch, s, dtype=f32, device=device),
            part_idx=torch.empty(batch, s, dtype=i32, device=device),
            part_mass=torch.empty(batch, s, dtype=f32, device=device),
            seg_count=torch.empty(batch, s, dtype=i32, device=device),
            cand_val=torch.empty(batch, s, seg, dtype=f32, device=device),
            cand_id=torch.empty(batch, s, seg, dtype=i32, device=device),
            win_val=torch.empty(batch, packed, dtype=f32, device=device),
            win_id=torch.empty(batch, packed, dtype=i32, device=device),
            prefix=torch.empty(batch, triton.next_power_of_2(s), dtype=i32, device=device),
            scratch=torch.empty(batch, launch.cap, dtype=f32, device=device),
        )


def _check_vector(name: str, t: torch.Tensor, batch: int, device: torch.device, floating: bool) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.shape != (batch,):
        raise ValueError(f"{name} must have shape ({batch},), got {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, logits on {device}")
    if t.dtype.is_floating_point != floating or t.dtype == torch.bool:
        kind = "a floating" if floating else "an integer"
        raise TypeError(f"{name} must have {kind} dtype, got {t.dtype}")


def _check_sample_args(logits: torch.Tensor, params: dict[str, tuple[torch.Tensor, bool]],
                       out: torch.Tensor | None, num_splits: int | None) -> None:
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or logits.shape[1] == 0:
        raise ValueError("logits must be a [B, V] tensor with V >= 1")
    if logits.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"logits must be fp32, bf16 or fp16, got {logits.dtype}")
    if logits.shape[1] >= 2**31 - 1:
        raise ValueError(f"vocabulary of {logits.shape[1]} tokens does not fit int32 ids")
    for name, (t, floating) in params.items():
        _check_vector(name, t, logits.shape[0], logits.device, floating)
    if out is not None and (out.shape != (logits.shape[0],) or out.dtype != torch.int64
                            or out.device != logits.device):
        raise ValueError(f"out must be an int64 tensor of shape ({logits.shape[0]},) on {logits.device}")
    if num_splits is not None and num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    seeds: torch.Tensor,
    offsets: torch.Tensor,
    out: torch.Tensor | None = None,
    *,
    num_splits: int | None = None,
    launch: SampleLaunch | None = None,
) -> torch.Tensor:
    """`sample_ref` on device: logits [B, V] (fp32/bf16/fp16) -> token ids [B] int64.

    No host sync and no data-dependent shapes, so it can run inside a CUDA graph. `num_splits`
    (chunks per row) and `launch` override the defaults; tests use them to cover every path.
    """
    _check_sample_args(logits, {"temperature": (temperature, True), "top_k": (top_k, False),
                                "top_p": (top_p, True), "min_p": (min_p, True),
                                "seeds": (seeds, False), "offsets": (offsets, False)}, out, num_splits)
    batch, vocab = logits.shape
    device = logits.device
    out = torch.empty(batch, dtype=torch.int64, device=device) if out is None else out
    if batch == 0:
        return out
    logits = logits if logits.stride(1) == 1 else logits.contiguous()
    launch = launch or (GPU_LAUNCH if device.type == "cuda" else CPU_LAUNCH)
    fast_log = device.type == "cuda"  # libdevice calls do not exist in the interpreter
    lay = _Layout.plan(batch, vocab, launch, device, num_splits)
    ws = _Workspace.allocate(batch, lay, launch, device)
    params = (temperature.float(), top_k.int(), top_p.float(), min_p.float(), seeds.long(), offsets.long())
    split_p2 = triton.next_power_of_2(lay.splits)
    _sample_chunks_kernel[(batch, lay.splits)](
        logits, logits.stride(0), vocab, lay.chunk, *params, ws.part_val, ws.part_idx, lay.splits,
        BLOCK=launch.block_chunk, FAST_LOG=fast_log, num_warps=launch.warps_chunk)
    _window_kernel[(batch, lay.splits)](
        logits, logits.stride(0), vocab, lay.chunk, *params[:4], ws.part_val, lay.splits, ws.part_mass,
        ws.seg_count, ws.cand_val, ws.cand_id,
        SPLITS=split_p2, SEG=lay.seg, BLOCK=launch.block_window, num_warps=launch.warps_chunk)
    _sample_finish_kernel[(batch,)](
        logits, logits.stride(0), vocab, *params, ws.part_val, ws.part_idx, lay.splits, ws.part_mass,
        ws.seg_count, ws.cand_val, ws.cand_id, ws.win_val, ws.win_id, ws.prefix, ws.scratch, out,
        SPLITS=split_p2, SEG=lay.seg, BLOCK=launch.block_finish, NT=launch.thresholds, CAP=launch.cap,
        MAX_ITERS=launch.max_iters, FAST_LOG=fast_log, num_warps=launch.warps_finish)
    return out


def sample_uniforms(seeds: torch.Tensor, offsets: torch.Tensor, vocab: int) -> torch.Tensor:
    """The kernel's uniforms [B, vocab] fp32 for seeds/offsets [B]: must equal `uniform_ref`."""
    if seeds.shape != offsets.shape or seeds.dim() != 1:
        raise ValueError("seeds and offsets must be [B] tensors of the same shape")
    out = torch.empty(seeds.shape[0], vocab, dtype=torch.float32, device=seeds.device)
    block = 1024
    _uniform_kernel[(seeds.shape[0], triton.cdiv(vocab, block))](
        seeds.long(), offsets.long(), out, vocab, BLOCK=block)
    return out
