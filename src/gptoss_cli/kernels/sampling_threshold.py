"""Exact filter thresholds of one sampling row on the device (top-k, top-p, min-p), for the finish
kernel of sampling.py (its module docstring, step 3, has the method).

A threshold is found by bracket search over the row's logits: each pass counts tokens and sums
their probability mass above NT thresholds inside the bracket, keeps the sub-bracket where the
rule flips, and stops when one distinct value is left or few enough tokens remain to gather and
rank exactly. No sorting, no host synchronisation, fixed shapes (CUDA-graph safe).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _bracket_stats(row_ptr, V, m, c2, lo, hi, taus, BLOCK: tl.constexpr, NT: tl.constexpr):
    """One pass over a row: count and mass (e = 2^((l - m) * c2)) above each of taus [NT], and
    count, mass, min and max of the tokens in the bracket (lo, hi], and the total mass."""
    offs = tl.arange(0, BLOCK)
    cnt = tl.zeros([BLOCK, NT], tl.float32)  # fp32 counts are exact below 2^24
    mass = tl.zeros([BLOCK, NT], tl.float32)
    b_cnt = tl.zeros([BLOCK], tl.float32)
    b_mass = tl.zeros([BLOCK], tl.float32)
    b_min = tl.full([BLOCK], float("inf"), tl.float32)
    b_max = tl.full([BLOCK], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK], tl.float32)
    for s in range(0, V, BLOCK):
        idx = s + offs
        l = tl.load(row_ptr + idx, mask=idx < V, other=float("-inf")).to(tl.float32)
        e = tl.exp2((l - m) * c2)
        above = l[:, None] > taus[None, :]
        cnt += above.to(tl.float32)
        mass += tl.where(above, e[:, None], 0.0)
        inside = (l > lo) & (l <= hi)
        b_cnt += inside.to(tl.float32)
        b_mass += tl.where(inside, e, 0.0)
        b_min = tl.minimum(b_min, tl.where(inside, l, float("inf")))
        b_max = tl.maximum(b_max, tl.where(inside, l, float("-inf")))
        total += e
    return (tl.sum(cnt, 0), tl.sum(mass, 0), tl.sum(b_cnt, 0), tl.sum(b_mass, 0),
            tl.min(b_min, 0), tl.max(b_max, 0), tl.sum(total, 0))


@triton.jit
def _gather_bracket(row_ptr, V, lo, hi, dst_ptr, CAP: tl.constexpr, BLOCK: tl.constexpr):
    """Write the logits in (lo, hi] to dst[0:CAP] in row order (at most CAP are kept)."""
    offs = tl.arange(0, BLOCK)
    base = tl.zeros([], tl.int32)
    for s in range(0, V, BLOCK):
        idx = s + offs
        l = tl.load(row_ptr + idx, mask=idx < V, other=float("-inf")).to(tl.float32)
        inside = ((l > lo) & (l <= hi)).to(tl.int32)
        pos = base + tl.cumsum(inside, 0) - 1
        tl.store(dst_ptr + pos, l, mask=(inside > 0) & (pos < CAP))
        base += tl.sum(inside, 0)


@triton.jit
def _rank_bracket(dst_ptr, n, m, c2, hi, cnt_hi, mass_hi, k_lim, target, CAP: tl.constexpr):
    """Exact answer among the n <= CAP gathered values: the smallest v with count(l > v) < k_lim
    and mass(l > v) < target (hi if none), and mass(l >= v)."""
    j = tl.arange(0, CAP)
    valid = j < n
    v = tl.load(dst_ptr + j, mask=valid, other=float("-inf"))
    e = tl.where(valid, tl.exp2((v - m) * c2), 0.0)
    greater = v[None, :] > v[:, None]  # [i, j]: v_j > v_i
    cnt_gt = cnt_hi + tl.sum(greater.to(tl.float32), 1)
    mass_gt = mass_hi + tl.sum(tl.where(greater, e[None, :], 0.0), 1)
    keep = valid & (cnt_gt < k_lim) & (mass_gt < target)
    best = tl.min(tl.where(keep, v, float("inf")), 0)
    best = tl.where(best == float("inf"), hi, best)
    return best, mass_hi + tl.sum(tl.where(valid & (v >= best), e, 0.0), 0)


@triton.jit
def _search(
    row_ptr, V, m, c2, lo, hi, k_lim, top_p, norm, use_total, dst_ptr,
    BLOCK: tl.constexpr, NT: tl.constexpr, CAP: tl.constexpr, MAX_ITERS: tl.constexpr,
):
    """Smallest logit v in (lo, hi] with count(l > v) < k_lim and mass(l > v) < top_p * S, where
    S = total mass when use_total, else norm. Returns (v, mass(l >= v)).

    Invariant: the predicate holds at hi and fails at lo, so the answer is in (lo, hi]. Each pass
    splits the bracket at NT thresholds; it ends when the bracket holds one distinct value, or at
    most CAP tokens (gathered and ranked exactly). After MAX_ITERS passes (only reachable with more
    than CAP tokens within a few ulps of each other) the answer falls back to hi.
    """
    frac = (tl.arange(0, NT) + 1).to(tl.float32) / (NT + 1)
    jj = tl.arange(0, NT)
    cnt_hi = tl.zeros([], tl.float32)
    mass_hi = tl.zeros([], tl.float32)
    n_in = tl.zeros([], tl.float32)
    target = top_p * norm
    state = tl.zeros([], tl.int32)  # 0 splitting, 1 one distinct value left, 2 gather
    answer = hi
    mass_ge = mass_hi
    it = 0
    while (state == 0) & (it < MAX_ITERS):
        taus = lo + (hi - lo) * frac
        cnt, mass, b_cnt, b_mass, b_min, b_max, total = _bracket_stats(
            row_ptr, V, m, c2, lo, hi, taus, BLOCK, NT)
        target = tl.where(use_total, top_p * total, top_p * norm)
        holds = (cnt < k_lim) & (mass < target)
        first = tl.min(tl.where(holds, jj, NT), 0)
        single = b_min == b_max
        answer = tl.where(single, b_min, answer)
        mass_ge = tl.where(single, mass_hi + b_mass, mass_ge)
        # New bracket: (last threshold that fails, first that holds]; the sums pick one entry.
        at_hi = jj == first
        at_lo = jj == first - 1
        cnt_lo = tl.where(first > 0, tl.sum(tl.where(at_lo, cnt, 0.0), 0), cnt_hi + b_cnt)
        lo = tl.where(first > 0, tl.sum(tl.where(at_lo, taus, 0.0), 0), lo)
        hi = tl.where(first < NT, tl.sum(tl.where(at_hi, taus, 0.0), 0), hi)
        cnt_hi = tl.where(first < NT, tl.sum(tl.where(at_hi, cnt, 0.0), 0), cnt_hi)
        mass_hi = tl.where(first < NT, tl.sum(tl.where(at_hi, mass, 0.0), 0), mass_hi)
        n_in = cnt_lo - cnt_hi
        state = tl.where(single, 1, tl.where(n_in <= CAP, 2, 0))
        it += 1
    if state == 2:
        _gather_bracket(row_ptr, V, lo, hi, dst_ptr, CAP, BLOCK)
        tl.debug_barrier()  # the gathered values are read back by other threads
        answer, mass_ge = _rank_bracket(dst_ptr, n_in.to(tl.int32), m, c2, hi, cnt_hi, mass_hi,
                                        k_lim, target, CAP)
    if state == 0:
        answer = hi
        mass_ge = mass_hi
    return answer, mass_ge


@triton.jit
def filtered_threshold(
    row_ptr, n, V, m, temp, top_k, top_p, min_p, total, dst_ptr,
    BLOCK: tl.constexpr, NT: tl.constexpr, CAP: tl.constexpr, MAX_ITERS: tl.constexpr,
):
    """The lowest kept logit of a filtered row (top-k, then top-p on the renormalised top-k set,
    and min-p), or +inf when nothing is kept. row_ptr[0:n] holds the whole row (n = V) or its
    window (-inf padded; exact for every threshold inside the window); `total` is the row's mass
    sum(2^((l - m) * c2)), or < 0 to sum it over row_ptr[0:n] during the search."""
    c2 = 1.4426950408889634 / temp  # e = exp((l - m) / T) = 2^((l - m) * c2)
    # Tokens with z < max(z) - 90 have p < 1e-39: they add nothing to any mass and can never win
    # the Gumbel race (G < 17.4 for every u the hash can produce), so searches start there.
    floor = m - 90.0 * temp
    use_k = (top_k > 0) & (top_k < V)
    k_lim = tl.where(use_k, top_k.to(tl.float32), float("inf"))
    thr = float("-inf")
    norm = total
    if use_k:
        v_k, norm = _search(row_ptr, n, m, c2, floor, m, k_lim, float("inf"), 1.0, False, dst_ptr,
                            BLOCK, NT, CAP, MAX_ITERS)
        thr = v_k
    if top_p < 1.0:
        if top_p > 0.0:
            # Tokens with p < (1 - top_p) / V are always dropped (their total mass is below
            # 1 - top_p), so the top-p threshold lies above; the margin of e covers rounding.
            lo_p = tl.maximum(floor, m + temp * (tl.log((1.0 - top_p) / V) - 1.0))
            # Below v_k the count condition already fails, so any lo just under v_k is valid.
            lo_k = thr - (tl.abs(thr) + 1.0) * 1e-6
            lo = tl.where(use_k, tl.maximum(lo_p, lo_k), lo_p)
            v_p, _ = _search(row_ptr, n, m, c2, lo, m, k_lim, top_p, norm, norm < 0.0, dst_ptr,
                             BLOCK, NT, CAP, MAX_ITERS)
            thr = tl.maximum(thr, v_p)
        else:
            thr = float("inf")
    if min_p > 0.0:
        thr = tl.maximum(thr, m + temp * tl.log(min_p))
    return thr
