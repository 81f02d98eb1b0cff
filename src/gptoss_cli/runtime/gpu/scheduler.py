"""Continuous-batching policy: who runs this step, with how many tokens, and who is preempted.

Pure Python over KvManager (tested on the CPU). Each step every running sequence advances:
decoding sequences by their one pending token, prefilling ones by a chunk of their prompt,
with all chunks sharing a token budget so a long prompt never stalls running decodes for
more than one chunk. Waiting requests are admitted FIFO while blocks and batch rows allow.
When blocks run out, the most recently admitted sequence is preempted: its blocks are freed
and it is recomputed later from its tokens (prefix caching usually makes that cheap).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from .kv_manager import KvManager
from .sequence import Sequence, Status


@dataclass
class StepPlan:
    chunks: list[tuple[Sequence, int]]  # (sequence, tokens to compute), in batch order
    decode_only: bool  # every chunk is a single pending token: the CUDA-graph path


class Scheduler:
    def __init__(self, kv: KvManager, max_batch: int, max_step_tokens: int):
        self.kv = kv
        self.max_batch = max_batch
        self.max_step_tokens = max_step_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._free_rows = list(range(max_batch, 0, -1))  # row 0 is the padding row
        self._step = 0
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, request_id: str) -> Sequence | None:
        """Take a request out (abort): frees its blocks and row."""
        for seq in self.running:
            if seq.request_id == request_id:
                self.running.remove(seq)
                self._drop(seq)
                seq.status = Status.FINISHED
                return seq
        for seq in self.waiting:
            if seq.request_id == request_id:
                self.waiting.remove(seq)
                seq.status = Status.FINISHED
                return seq
        return None

    def finish(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._drop(seq)
        seq.status = Status.FINISHED

    # ---- planning ------------------------------------------------------------------------
    def schedule(self) -> StepPlan | None:
        self._step += 1
        self._admit()
        # Decodes first: they need one token each and max_step_tokens >= max_batch, so they always
        # fit; prefill chunks share what is left. (Planning prefills first let a step exceed the
        # budget, and the forward's fixed-size workspaces with it: the H200 load check, 2026-11-30.)
        decodes, prefills = [], []
        for seq in self.running:
            (decodes if seq.num_pending == 1 else prefills).append(seq)
        planned: list[tuple[Sequence, int]] = []
        budget = self.max_step_tokens
        for seq in decodes + prefills:
            if seq.status is not Status.RUNNING:
                continue  # preempted while planning an earlier sequence
            n = min(seq.num_pending, budget)
            if n <= 0:
                continue
            planned_before = len(planned)
            fits = self._make_room(seq, n, planned)
            if len(planned) != planned_before:  # preempted victims give their planned tokens back
                budget = self.max_step_tokens - sum(m for _, m in planned)
            if not fits:
                continue
            self.kv.reserve(seq, n)
            planned.append((seq, n))
            budget -= n
        if not planned:
            return None
        return StepPlan(planned, not prefills and len(planned) == len(decodes))

    def _admit(self) -> None:
        while self.waiting and self._free_rows and len(self.running) < self.max_batch:
            seq = self.waiting[0]
            seq.row = self._free_rows.pop()
            self.kv.attach_prefix(seq)
            first = min(seq.num_pending, max(1, self.max_step_tokens))
            if not self.kv.can_run(self.kv.step_cost(seq, first)):
                self.kv.free(seq)
                self._free_rows.append(seq.row)
                seq.row = -1
                break
            self.waiting.popleft()
            seq.out.cached_prompt_tokens = seq.num_computed if not seq.out.token_ids else seq.out.cached_prompt_tokens
            seq.status, seq.admitted_at = Status.RUNNING, self._step
            self.running.append(seq)

    def _make_room(self, seq: Sequence, n: int, planned: list[tuple[Sequence, int]]) -> bool:
        """Preempt the newest sequences until seq's next n tokens fit; False if seq itself went.
        A victim already planned this step leaves `planned` (its reservation went with its blocks)."""
        cost = self.kv.step_cost(seq, n)  # preempting others frees blocks, it does not change this
        while not self.kv.can_run(cost):
            victim = self.running[-1]
            self._preempt(victim)
            planned[:] = [c for c in planned if c[0] is not victim]
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._drop(seq)
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def _drop(self, seq: Sequence) -> None:
        self.kv.free(seq)
        if seq.row > 0:
            self._free_rows.append(seq.row)
            self._free_rows.sort(reverse=True)
        seq.row = -1
