"""The engine on the plain-torch reference model: the path used when there is no GPU.

Continuous batching in its simplest form: every step feeds each running sequence its pending
tokens (a prompt chunk, or the last sampled token), samples where a sequence's input is fully
consumed, and admits waiting requests up to `max_batch`. Finished sequences leave their KV in
a small prefix cache, so a chat turn that extends an earlier conversation only prefills its
new tokens.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from dataclasses import dataclass

import torch

from ..kernels.sampling import sample_ref
from .api import Engine, RequestOutput, RequestTimings, SamplingParams, TokenEvent
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
                 prefill_chunk: int = 2048, prefix_cache_tokens: int = 65536):
        super().__init__()
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
        p = [s.params for s in seqs]
        f32 = lambda xs: torch.tensor(xs, dtype=torch.float32)  # noqa: E731
        i64 = lambda xs: torch.tensor(xs, dtype=torch.int64)  # noqa: E731
        tokens = sample_ref(logits, f32([x.temperature for x in p]), i64([x.top_k for x in p]),
                            f32([x.top_p for x in p]), f32([x.min_p for x in p]),
                            i64([s.seed for s in seqs]), i64([len(s.out.token_ids) for s in seqs]))
        return tokens.tolist()

    def _emit(self, seq: _Seq, token: int) -> TokenEvent:
        out, now = seq.out, time.perf_counter()
        out.token_ids.append(token)
        if out.timings.first_token is None:
            out.timings.first_token = now
        reason = None
        if token in seq.params.stop_token_ids and not seq.params.ignore_eos:
            reason = "stop"
        elif len(out.token_ids) >= seq.max_new:
            reason = "length"
        if reason is None:
            seq.pending = [token]
            return TokenEvent(out.request_id, token, len(out.token_ids) - 1, now)
        out.finish_reason, out.timings.finished = reason, now
        del self._running[out.request_id]
        self.prefix_cache.put(out.prompt_token_ids + out.token_ids, seq.cache)
        return TokenEvent(out.request_id, token, len(out.token_ids) - 1, now, reason, out)
