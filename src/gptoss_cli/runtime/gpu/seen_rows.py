"""The repetition penalty's device state: one seen-set row (kernels.penalty) per block-table row,
and which sequence each row's bits were built for.

A sequence's row is built on the host from its tokens the first time it samples there (its
prompt; after a preemption, the tokens it recomputes too). From then on every sample adds its
id on the device (`mark_seen`, or the decode graph's advance launch), so the bits stay whole as
long as the row stays the sequence's. Sequences without a penalty never touch the bits.
"""

from __future__ import annotations

import torch

from ...kernels.penalty import seen_width, seen_words
from .sequence import Sequence


def has_penalty(seq: Sequence) -> bool:
    return seq.params.repetition_penalty != 1.0


class SeenRows:
    def __init__(self, rows: int, vocab: int, device: torch.device):
        self.vocab = vocab
        self.bits = torch.zeros(rows, seen_width(vocab), dtype=torch.int32, device=device)
        self._owner: dict[int, Sequence] = {}  # row -> the sequence its bits describe

    def prepare(self, seqs: list[Sequence]) -> None:
        """Before sampling `seqs`: build the rows of those with a penalty whose row holds another
        sequence's bits (or none yet). The copy is from pageable memory, so it has left the host
        buffer when this returns, and it is ordered before the step's kernels on the stream."""
        for seq in seqs:
            if has_penalty(seq) and self._owner.get(seq.row) is not seq:
                words = seen_words([t for t in seq.tokens if t >= 0], self.vocab)
                self.bits[seq.row].copy_(torch.from_numpy(words))
                self._owner[seq.row] = seq

    def holder(self, row: int) -> Sequence | None:
        """The sequence whose seen set row `row` holds (the last one built there)."""
        return self._owner.get(row)
