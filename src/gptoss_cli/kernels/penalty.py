"""Repetition penalty (vLLM's, after CTRL): logits of tokens a sequence has already seen are pushed down.

Meaning (`apply_penalty_ref`): in each row b whose penalty r is not 1, every token id i in the
row's seen set (its prompt and each token sampled so far) gets l_i / r when l_i > 0, else l_i * r,
computed in fp32 and rounded once to the logits dtype. r > 1 discourages repeats, r < 1 favours them.

The seen sets live on the device as one bit per vocabulary id and table row: `seen` [rows, W]
int32, W = ceil(V / 32), bit i % 32 of word i // 32. The host builds a row's words from its
token ids once (`seen_words`, when the row first samples for the sequence), `mark_seen` sets the
sampled ids' bits after every sample (inside the decode graph it is part of `advance_decode`'s
launch, `mark_bits`), and `apply_penalty` rewrites the logits in place before `sample`. Rows whose
penalty is 1 read no bits and write nothing: the decode graph carries the launch for every batch,
at the cost of one early exit per program.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

BLOCK = 4096  # vocabulary ids per program of `apply_penalty` (50 programs per row of o200k)


def seen_width(vocab: int) -> int:
    """int32 words per row of a seen-set buffer."""
    return triton.cdiv(vocab, 32)


def seen_words(token_ids, vocab: int) -> np.ndarray:
    """The seen-set words [W] int32 of a sequence's token ids (ids outside [0, vocab) are errors)."""
    ids = np.asarray(token_ids, dtype=np.int64)
    if ids.size and (ids.min() < 0 or ids.max() >= vocab):
        raise ValueError(f"token ids must lie in [0, {vocab})")
    words = np.zeros(seen_width(vocab), dtype=np.uint32)
    np.bitwise_or.at(words, ids >> 5, np.left_shift(np.uint32(1), (ids & 31).astype(np.uint32)))
    return words.view(np.int32)


def seen_mask_ref(seen: torch.Tensor, rows: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B, V] bool: whether each id is in the seen set of table row rows[b]."""
    ids = torch.arange(vocab, device=seen.device)
    words = seen.index_select(0, rows)[:, ids >> 5]
    return ((words >> (ids & 31)) & 1).bool()


def apply_penalty_mask_ref(logits: torch.Tensor, mask: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
    """The penalised logits (a new tensor in logits' dtype): mask [B, V] bool, penalty [B]."""
    lf = logits.float()
    r = penalty.float()[:, None]
    hit = mask & (r != 1.0)
    return torch.where(hit, torch.where(lf > 0, lf / r, lf * r), lf).to(logits.dtype)


def apply_penalty_ref(logits: torch.Tensor, seen: torch.Tensor, rows: torch.Tensor, penalty: torch.Tensor) -> None:
    """In place, as `apply_penalty`: logits [B, V], rows [B] (table rows), penalty [B]."""
    logits.copy_(apply_penalty_mask_ref(logits, seen_mask_ref(seen, rows, logits.shape[1]), penalty))


def mark_seen_ref(seen: torch.Tensor, rows: torch.Tensor, ids: torch.Tensor, penalty: torch.Tensor) -> None:
    """In place, as `mark_seen`: set bit ids[b] of row rows[b] where penalty[b] != 1."""
    on = penalty != 1.0
    r, t = rows[on], ids[on]
    bit = torch.ones_like(t, dtype=torch.int32) << (t & 31).to(torch.int32)  # bit 31 wraps to the sign bit
    seen[r, t >> 5] = seen[r, t >> 5] | bit


@triton.jit
def mark_bits(seen_ptr, width, rows, ids, penalty, mask):
    """Set bit ids of table row rows where penalty != 1 (vectors of one batch; distinct rows, so no
    two lanes touch the same word). Shared by `mark_seen` and the decode graph's advance launch."""
    on = mask & (penalty != 1.0)
    ptr = seen_ptr + rows * width + (ids >> 5)
    word = tl.load(ptr, mask=on, other=0)
    tl.store(ptr, word | (1 << (ids & 31)).to(tl.int32), mask=on)


@triton.jit
def _mark_kernel(seen_ptr, width, rows_ptr, ids_ptr, pen_ptr, n, BLOCK_B: tl.constexpr):
    i = tl.arange(0, BLOCK_B)
    ok = i < n
    rows = tl.load(rows_ptr + i, mask=ok, other=0)
    ids = tl.load(ids_ptr + i, mask=ok, other=0)
    pen = tl.load(pen_ptr + i, mask=ok, other=1.0)
    mark_bits(seen_ptr, width, rows, ids, pen, ok)


@triton.jit
def _apply_kernel(logits_ptr, stride_b, vocab, seen_ptr, width, rows_ptr, pen_ptr, BLOCK_V: tl.constexpr):
    b = tl.program_id(0)
    r = tl.load(pen_ptr + b)
    if r != 1.0:
        ids = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
        ok = ids < vocab
        row = tl.load(rows_ptr + b)
        # 32 lanes read each word: one transaction per warp, from L1.
        words = tl.load(seen_ptr + row * width + (ids >> 5), mask=ok, other=0)
        hit = ok & (((words >> (ids & 31)) & 1) != 0)
        ptr = logits_ptr + b.to(tl.int64) * stride_b + ids
        lf = tl.load(ptr, mask=hit, other=0.0).to(tl.float32)
        # div_rn: the twin's IEEE division (Triton's default fp32 division is approximate).
        out = tl.where(lf > 0, tl.math.div_rn(lf, r), lf * r)
        tl.store(ptr, out.to(logits_ptr.dtype.element_ty), mask=hit)


def _check(seen: torch.Tensor, rows: torch.Tensor, penalty: torch.Tensor, batch: int, width: int) -> None:
    if seen.dim() != 2 or seen.dtype != torch.int32 or not seen.is_contiguous() or seen.shape[1] != width:
        raise ValueError(f"seen must be a contiguous int32 [rows, {width}] tensor, got {seen.dtype} {tuple(seen.shape)}")
    if rows.shape != (batch,) or rows.dtype != torch.int64 or not rows.is_contiguous():
        raise ValueError(f"rows must be a contiguous int64 [{batch}] tensor")
    if penalty.shape != (batch,) or penalty.dtype != torch.float32 or not penalty.is_contiguous():
        raise ValueError(f"penalty must be a contiguous float32 [{batch}] tensor")
    if not seen.device == rows.device == penalty.device:
        raise ValueError("seen, rows and penalty must be on one device")


def apply_penalty(logits: torch.Tensor, seen: torch.Tensor, rows: torch.Tensor, penalty: torch.Tensor) -> None:
    """`apply_penalty_ref` on device, in place: logits [B, V] (unit stride along V), seen [rows, W]
    int32, rows [B] int64, penalty [B] float32 (> 0). No host sync: capturable."""
    batch, vocab = logits.shape
    _check(seen, rows, penalty, batch, seen_width(vocab))
    if logits.stride(1) != 1 or logits.device != seen.device:
        raise ValueError("logits must have unit stride along V and live on seen's device")
    if batch:
        _apply_kernel[(batch, triton.cdiv(vocab, BLOCK))](
            logits, logits.stride(0), vocab, seen, seen.shape[1], rows, penalty, BLOCK_V=BLOCK, num_warps=4)


def mark_seen(seen: torch.Tensor, rows: torch.Tensor, ids: torch.Tensor, penalty: torch.Tensor) -> None:
    """`mark_seen_ref` on device: rows, ids [B] int64 (distinct rows where penalty != 1; ids are
    sampled, so inside the vocabulary the bits were sized for)."""
    batch = ids.shape[0]
    _check(seen, rows, penalty, batch, seen.shape[-1])
    if ids.shape != (batch,) or ids.dtype != torch.int64 or ids.device != seen.device:
        raise ValueError(f"ids must be an int64 [{batch}] tensor on seen's device")
    if batch:
        _mark_kernel[(1,)](seen, seen.shape[1], rows, ids, penalty, batch,
                           BLOCK_B=triton.next_power_of_2(batch), num_warps=1)
