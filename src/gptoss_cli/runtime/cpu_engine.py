"""The engine on the plain-torch reference model: the path used when there is no GPU.

Continuous batching in its simplest form: every step feeds each running sequence its pending
tokens (a prompt chunk, or the last sampled token), samples where a sequence's input is fully
consumed, and admits waiting requests up to `max_batch`. Finished sequences leave their KV in
a small prefix cache, so a chat turn that extends an earlier conversation only prefills its
new tokens.
"""

from __future__ import annotations

import os
import time
from collections import OrderedDict, deque
from dataclasses import dataclass

import torch

from ..kernels.penalty import apply_penalty_mask_ref
from ..kernels.sampling import row_key, sample_ref, uniform_ref
from .api import Engine, RequestOutput, RequestTimings, SamplingParams, TokenEvent, record_token
from .checkpoint import ModelWeights
from .model_ref import ReferenceModel, SequenceCache


@dataclass
class _Seq:
    out: RequestOutput
    params: SamplingParams
    seed: int
    max_new: int
    cache: SequenceCache | None = None
    pending: list[int] | None = None  # tokens not yet run through the model


class PrefixCache:
    """Finished sequences' KV, keyed by their tokens; LRU within a token budget."""

    def __init__(self, max_tokens: int):
        self.max_tokens = max_tokens
        self._entries: OrderedDict[tuple[int, ...], SequenceCache] = OrderedDict()

    def put(self, tokens: list[int], cache: SequenceCache) -> None:
        if not 0 < cache.length <= self.max_tokens:
            return
        self._entries[tuple(tokens[: cache.length])] = cache
        self._entries.move_to_end(tuple(tokens[: cache.length]))
        while sum(c.length for c in self._entries.values()) > self.max_tokens:
            self._entries.popitem(last=False)

    def lookup(self, prompt: list[int]) -> tuple[int, SequenceCache | None]:
        """Longest shared prefix (leaving at least one prompt token to run) and its cache."""
        best, best_cache, best_key = 0, None, None
        for key, cache in self._entries.items():
            n = _common_prefix(key, prompt)
            if n > best:
                best, best_cache, best_key = n, cache, key
        best = min(best, len(prompt) - 1)
        if best_cache is None or best <= 0:
            return 0, None
        self._entries.move_to_end(best_key)
        return best, best_cache.truncated_copy(best)


def _set_threads(threads: int | None) -> None:
    """Torch's CPU thread count (a process setting). On 2-vCPU machines OpenMP's fork/join costs
    more than it saves (measured on CI's kind: index_add_ 44 ms vs 0.005 ms, a 64x2880x5760
    matmul 41 ms vs 30 ms, with 2 threads vs 1), so small machines get one thread."""
    if threads is None and (os.cpu_count() or 1) <= 2:
        threads = 1
    if threads is not None:
        torch.set_num_threads(threads)


def _unfiltered(p: SamplingParams) -> bool:
    return p.temperature <= 0 or (p.top_k == 0 and p.top_p >= 1.0 and p.min_p == 0.0)


def _sample_unfiltered(logits: torch.Tensor, params: list[SamplingParams], seqs: list["_Seq"]) -> list[int]:
    """sample_ref without filters, skipping its two full-vocabulary sorts: argmax(z/T + Gumbel)
    picks the same token as argmax(log softmax(z/T) + Gumbel) (the two differ by a constant)."""
    out = []
    for row, x, seq in zip(logits.float(), params, seqs):
        if x.temperature <= 0:
            out.append(int(row.argmax()))
            continue
        key = row_key(torch.tensor([seq.seed]), torch.tensor([len(seq.out.token_ids)]))
        u = uniform_ref(key, row.shape[0])[0]
        out.append(int((row / x.temperature - torch.log(-torch.log(u))).argmax()))
    return out


def _penalised(logits: torch.Tensor, seqs: list[_Seq]) -> torch.Tensor:
    """The logits with each row's repetition penalty applied over its prompt and generated tokens
    (kernels.penalty's meaning); the same tensor when no row has one."""
    rows = [i for i, s in enumerate(seqs) if s.params.repetition_penalty != 1.0]
    if not rows:
        return logits
    seen = torch.zeros(len(rows), logits.shape[1], dtype=torch.bool)
    for j, i in enumerate(rows):
        seen[j, seqs[i].out.prompt_token_ids + seqs[i].out.token_ids] = True
    penalty = torch.tensor([seqs[i].params.repetition_penalty for i in rows], dtype=torch.float32)
    logits = logits.clone()
    logits[rows] = apply_penalty_mask_ref(logits[rows], seen, penalty)
    return logits


def _common_prefix(a: tuple[int, ...], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class CpuEngine(Engine):
    """Engine API over ReferenceModel (fp32 on CPU)."""

    def __init__(self, weights: ModelWeights, max_context: int | None = None, max_batch: int = 64,
                 prefill_chunk: int = 2048, prefix_cache_tokens: int = 65536, threads: int | None = None):
        super().__init__()
        _set_threads(threads)
        self.model = ReferenceModel(weights)
        self.config = weights.config
        self.max_context = min(max_context or self.config.max_position_embeddings,
                               self.config.max_position_embeddings)
        self.max_batch = max_batch
        self.prefill_chunk = prefill_chunk
        self.prefix_cache = PrefixCache(prefix_cache_tokens)
        self._waiting: deque[_Seq] = deque()
        self._running: dict[str, _Seq] = {}

    def _admit(self, request_id, prompt, params, seed) -> RequestOutput:
        out = RequestOutput(request_id, prompt, timings=RequestTimings(time.perf_counter()))
        self._waiting.append(_Seq(out, params, seed, self.max_new_tokens(len(prompt), params)))
        return out

    def has_unfinished(self) -> bool:
        return bool(self._waiting or self._running)

    def abort(self, request_id: str) -> RequestOutput | None:
        seq = self._running.pop(request_id, None)
        if seq is None:
            seq = next((s for s in self._waiting if s.out.request_id == request_id), None)
            if seq is None:
                return None
            self._waiting.remove(seq)
        seq.out.finish_reason = "abort"
        seq.out.timings.finished = time.perf_counter()
        return seq.out

    def step(self) -> list[TokenEvent]:
        self._schedule()
        batch = self._build_batch()
        if not batch:
            return []
        logits = self.model.forward([(ids, seq.cache) for seq, ids in batch])
        ready = [(i, seq) for i, (seq, _) in enumerate(batch) if not seq.pending]
        if not ready:
            return []
        tokens = self._sample(logits[[i for i, _ in ready]], [seq for _, seq in ready])
        return [self._emit(seq, tok) for (_, seq), tok in zip(ready, tokens)]

    def _schedule(self) -> None:
        while self._waiting and len(self._running) < self.max_batch:
            seq = self._waiting.popleft()
            prompt = seq.out.prompt_token_ids
            reused, cache = self.prefix_cache.lookup(prompt)
            seq.cache = cache or self.model.new_cache()
            seq.out.cached_prompt_tokens = reused
            seq.pending = prompt[reused:]
            self._running[seq.out.request_id] = seq

    def _build_batch(self) -> list[tuple[_Seq, list[int]]]:
        """Each running sequence's next input; prompt chunks share a token budget."""
        batch, budget = [], self.prefill_chunk
        for seq in self._running.values():
            take = len(seq.pending) if len(seq.pending) == 1 else min(len(seq.pending), budget)
            if take == 0:
                continue
            if len(seq.pending) > 1:
                budget -= take
            batch.append((seq, seq.pending[:take]))
            seq.pending = seq.pending[take:]
        return batch

    def _sample(self, logits: torch.Tensor, seqs: list[_Seq]) -> list[int]:
        """Rows without top-k/top-p/min-p take a sort-free path; the rest go through the twin."""
        logits = _penalised(logits, seqs)
        tokens: list[int] = [0] * len(seqs)
        plain = [i for i, s in enumerate(seqs) if _unfiltered(s.params)]
        filtered = [i for i in range(len(seqs)) if i not in set(plain)]
        for i, tok in zip(plain, _sample_unfiltered(logits[plain], [seqs[i].params for i in plain],
                                                     [seqs[i] for i in plain])):
            tokens[i] = tok
        if filtered:
            rows = [seqs[i] for i in filtered]
            p = [s.params for s in rows]
            f32 = lambda xs: torch.tensor(xs, dtype=torch.float32)  # noqa: E731
            i64 = lambda xs: torch.tensor(xs, dtype=torch.int64)  # noqa: E731
            picked = sample_ref(logits[filtered], f32([x.temperature for x in p]), i64([x.top_k for x in p]),
                                f32([x.top_p for x in p]), f32([x.min_p for x in p]),
                                i64([s.seed for s in rows]), i64([len(s.out.token_ids) for s in rows]))
            for i, tok in zip(filtered, picked.tolist()):
                tokens[i] = tok
        return tokens

    def _emit(self, seq: _Seq, token: int) -> TokenEvent:
        event = record_token(seq.out, token, seq.params, seq.max_new, time.perf_counter())
        if event.finish_reason is None:
            seq.pending = [token]
        else:
            del self._running[seq.out.request_id]
            self.prefix_cache.put(seq.out.prompt_token_ids + seq.out.token_ids, seq.cache)
        return event
