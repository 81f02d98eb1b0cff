"""The engine API every caller uses, whichever engine (CPU reference or GPU) runs underneath.

Level 1: `add_request` / `abort` / `step()` -> TokenEvents (continuous batching is the engine's
business). Level 2: `stream()` for one request. Level 3: `generate()` for many.
Timestamps come from the engine (time.perf_counter) so callers' stats are the engine's own.
"""

from __future__ import annotations

import itertools
import math
import secrets
import time
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from .config import ModelConfig
from .errors import RequestError

DEFAULT_STOP_IDS = (200002, 200012, 199999)  # <|return|>, <|call|>, <|endoftext|>


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling; validated on construction (ValueError names the bad field)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # vLLM's: a seen token's logit l becomes l / r if l > 0, else l * r; 1 = off
    seed: int | None = None
    max_tokens: int | None = None  # None: up to the context limit
    stop_token_ids: tuple[int, ...] = DEFAULT_STOP_IDS
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        checks = [
            (math.isfinite(self.temperature) and self.temperature >= 0, "temperature must be >= 0"),
            (math.isfinite(self.top_p) and 0 < self.top_p <= 1, "top_p must be in (0, 1]"),
            (self.top_k >= 0, "top_k must be >= 0 (0 disables it)"),
            (math.isfinite(self.min_p) and 0 <= self.min_p <= 1, "min_p must be in [0, 1]"),
            (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0,
             "repetition_penalty must be > 0 (1 disables it)"),
            (self.max_tokens is None or self.max_tokens >= 1, "max_tokens must be >= 1"),
            (self.seed is None or 0 <= self.seed < 2**63, "seed must be in [0, 2**63)"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)


@dataclass
class RequestTimings:
    """perf_counter seconds, stamped by the engine."""

    arrival: float
    first_token: float | None = None
    finished: float | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    cached_prompt_tokens: int = 0
    timings: RequestTimings = field(default_factory=lambda: RequestTimings(time.perf_counter()))


def record_token(out: RequestOutput, token: int, params: SamplingParams, max_new: int,
                 now: float) -> TokenEvent:
    """Append a sampled token to `out` and build its event, deciding whether the request ends
    (a stop token unless ignore_eos, or max_new tokens); the same rule for every engine."""
    out.token_ids.append(token)
    if out.timings.first_token is None:
        out.timings.first_token = now
    reason = None
    if token in params.stop_token_ids and not params.ignore_eos:
        reason = "stop"
    elif len(out.token_ids) >= max_new:
        reason = "length"
    index = len(out.token_ids) - 1
    if reason is None:
        return TokenEvent(out.request_id, token, index, now)
    out.finish_reason, out.timings.finished = reason, now
    return TokenEvent(out.request_id, token, index, now, reason, out)


@dataclass(frozen=True)
class TokenEvent:
    """One generated token. A request's last event has `finish_reason` and its full `output`;
    the engine forgets the request after emitting it."""

    request_id: str
    token_id: int
    index: int
    time: float
    finish_reason: str | None = None  # "stop" | "length"
    output: RequestOutput | None = None


class Engine(ABC):
    """Common surface of the CPU and GPU engines."""

    config: ModelConfig
    max_context: int

    def __init__(self) -> None:
        self._ids = itertools.count()

    # ---- level 1 -------------------------------------------------------------------------
    @abstractmethod
    def _admit(self, request_id: str, prompt: list[int], params: SamplingParams, seed: int) -> RequestOutput: ...

    @abstractmethod
    def abort(self, request_id: str) -> RequestOutput | None:
        """Drop a request now (between steps); returns its partial output (finish_reason "abort")."""

    @abstractmethod
    def step(self) -> list[TokenEvent]:
        """Advance every running request by one token (prefilling new ones as needed)."""

    @abstractmethod
    def has_unfinished(self) -> bool: ...

    def add_request(self, prompt_token_ids: Sequence[int], params: SamplingParams,
                    request_id: str | None = None) -> str:
        """Queue a request; raises RequestError for a prompt the engine can never run."""
        prompt = [int(t) for t in prompt_token_ids]
        if not prompt:
            raise RequestError("empty prompt", "give at least one token", code="empty_prompt")
        if len(prompt) >= self.max_context:
            raise RequestError(
                f"prompt is {len(prompt)} tokens; context is {self.max_context}",
                "shorten the prompt or raise --context", code="context_length_exceeded")
        vocab = self.config.vocab_size
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise RequestError(f"token id out of range 0..{vocab - 1}", "", code="invalid_token")
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        self._admit(rid, prompt, params, seed)
        return rid

    def max_new_tokens(self, prompt_len: int, params: SamplingParams) -> int:
        room = self.max_context - prompt_len
        return room if params.max_tokens is None else min(room, params.max_tokens)

    # ---- levels 2 and 3 ------------------------------------------------------------------
    def stream(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> RequestStream:
        """Generate for one request, yielding its tokens (RequestStream: closing it aborts the
        request, `end()` stops it where it is and keeps its output)."""
        return RequestStream(self, prompt_token_ids, params)

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[RequestOutput]:
        """Run many prompts together (continuous batching); outputs in prompt order."""
        rids = [self.add_request(p, params) for p in prompts]
        done: dict[str, RequestOutput] = {}
        while self.has_unfinished():
            for event in self.step():
                if event.output is not None:
                    done[event.request_id] = event.output
        return [done[r] for r in rids]


@dataclass
class _StreamState:
    request_id: str | None = None  # set when the first event is asked for
    done: bool = False


def _stream_events(engine: Engine, prompt: Sequence[int], params: SamplingParams,
                   state: _StreamState) -> Iterator[TokenEvent]:
    state.request_id = rid = engine.add_request(prompt, params)
    try:
        while not state.done:
            for event in engine.step():
                if event.request_id == rid:
                    state.done = event.finish_reason is not None
                    yield event
    finally:
        if not state.done:
            state.done = True
            engine.abort(rid)


class RequestStream:
    """One request's TokenEvents, as Engine.stream hands them out; the request is queued when the
    first one is asked for. Closing the stream (or dropping it unfinished) aborts the request;
    `end()` is the caller's own stop (a stop string in the decoded text, say): the request is
    dropped after the last event taken and its output kept. The events come from a generator
    that does not refer back to the stream, so dropping the stream finalises it at once."""

    def __init__(self, engine: Engine, prompt: Sequence[int], params: SamplingParams) -> None:
        self._engine = engine
        self._state = _StreamState()
        self._events = _stream_events(engine, prompt, params, self._state)

    def __iter__(self) -> RequestStream:
        return self

    def __next__(self) -> TokenEvent:
        return next(self._events)

    def close(self) -> None:
        self._events.close()

    def end(self) -> RequestOutput | None:
        """Stop the request now (between steps): its output so far, finish_reason "stop"; None if
        it had not started or had already finished."""
        state = self._state
        if state.done or state.request_id is None:
            return None
        state.done = True
        out = self._engine.abort(state.request_id)
        if out is not None:
            out.finish_reason = "stop"
        return out
