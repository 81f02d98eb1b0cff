"""Stop sequences (OpenAI's `stop`): the answer ends where one of the caller's strings is first
completed, and that string is not part of it.

The engine works on token ids; stop strings are matched on decoded text, after the fact, by the
caller that decodes it. Only answer text is matched (a message on the final channel, or on none,
addressed to no tool): reasoning that mentions a stop string does not end the reply. Each message
is matched on its own text.

`StopMatcher` takes text in pieces and holds back the longest end of it that a stop string starts
with, so nothing it has released can turn out to be part of a stop string. `StopFilter` applies it to
the harmony parser's events; `StopWatch` to a request's tokens as they arrive, to tell the caller
when to abort the request.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from .harmony_parse import Event, HarmonyStreamParser, MessageEnd, MessageStart, TextDelta
from .harmony_types import Message

MAX_STOPS = 4  # as OpenAI's chat completions API


def check_stops(stops: Iterable[object]) -> tuple[str, ...]:
    """The stop strings as a tuple; ValueError for more than MAX_STOPS, a non-string or an empty one."""
    stops = tuple(stops)
    if len(stops) > MAX_STOPS:
        raise ValueError(f"at most {MAX_STOPS} stop sequences, got {len(stops)}")
    for s in stops:
        if not isinstance(s, str) or not s:
            raise ValueError(f"a stop sequence must be a non-empty string, got {s!r}")
    return stops


def is_answer_text(channel: str | None, recipient: str | None) -> bool:
    """Whether a message's text is answer text: final channel, or none at all (a model that skipped
    it still answered), and not addressed to a tool."""
    return channel in ("final", None) and recipient is None


def cut_at_stop(text: str, stops: Sequence[str]) -> tuple[str, bool]:
    """(text before the stop string that is completed first, whether one was): where generation
    would have stopped had the text arrived a character at a time. Of two that end together, the
    longer one is cut."""
    hits = [(i + len(s), i) for s, i in ((s, text.find(s)) for s in stops) if i >= 0]
    return (text[:min(hits)[1]], True) if hits else (text, False)


class StopMatcher:
    """Text in pieces -> the part that is safe to release; `hit` once a stop string appeared."""

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = check_stops(stops)
        self._keep = max((len(s) for s in self._stops), default=1) - 1
        self._pending = ""
        self.hit = False

    def push(self, text: str) -> str:
        """The text that can be released now: everything before a stop string once one is
        completed (then nothing more, ever), else all but the held-back tail."""
        if self.hit:
            return ""
        text, self.hit = cut_at_stop(self._pending + text, self._stops)
        if self.hit:
            self._pending = ""
            return text
        split = len(text) - self._partial(text)
        self._pending = text[split:]
        return text[:split]

    def _partial(self, text: str) -> int:
        """Length of the longest end of `text` that some stop string starts with (it stays back)."""
        for n in range(min(self._keep, len(text)), 0, -1):
            if any(s.startswith(text[-n:]) for s in self._stops):
                return n
        return 0

    def flush(self) -> str:
        """The held-back tail, at the end of the text (no stop string in it)."""
        tail, self._pending = self._pending, ""
        return tail


@dataclass
class _Answer:
    start: MessageStart
    matcher: StopMatcher
    released: list[str]


class StopFilter:
    """Harmony events in, the same events with answer text cut at the first stop string out.

    When a stop string appears, the answer message ends there: the filter emits a MessageEnd whose
    message holds the text before it (terminator None) and sets `stopped`; it drops every later
    event, and `message` is that cut message."""

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = check_stops(stops)
        self._answer: _Answer | None = None
        self.stopped = False
        self.message: Message | None = None

    def feed(self, events: Iterable[Event]) -> list[Event]:
        out: list[Event] = []
        for event in events:
            if self.stopped:
                break
            if isinstance(event, MessageStart):
                self._answer = None
                if self._stops and is_answer_text(event.channel, event.recipient):
                    self._answer = _Answer(event, StopMatcher(self._stops), [])
            elif isinstance(event, TextDelta) and self._answer is not None:
                self._release(out, self._answer.matcher.push(event.text))
                if self._answer.matcher.hit:
                    out.append(self._cut())
                continue
            elif isinstance(event, MessageEnd) and self._answer is not None:
                self._release(out, self._answer.matcher.flush())
                self._answer = None
            out.append(event)
        return out

    def _release(self, out: list[Event], text: str) -> None:
        if text:
            start = self._answer.start
            self._answer.released.append(text)
            out.append(TextDelta(start.channel, text, start.recipient))

    def _cut(self) -> MessageEnd:
        s = self._answer.start
        self.message = Message(s.role, "".join(self._answer.released), channel=s.channel, recipient=s.recipient,
                               content_type=s.content_type, name=s.name)
        self.stopped, self._answer = True, None
        return MessageEnd(self.message, None)


class StopWatch:
    """A request's generated tokens, one at a time -> whether its answer has reached a stop string.

    `harmony`: the output is harmony (chat requests; only answer text counts); otherwise it is raw
    text, all of which counts, special tokens as their names (as Tokenizer.decode writes them)."""

    def __init__(self, tokenizer, stops: Sequence[str], harmony: bool = True) -> None:
        self._tok = tokenizer
        self._parser = HarmonyStreamParser(tokenizer) if harmony else None
        self._filter = StopFilter(stops)
        self._decoder = None if harmony else tokenizer.stream_decoder()
        self._matcher = None if harmony else StopMatcher(stops)

    def feed(self, token_id: int) -> bool:
        if self._parser is not None:
            self._filter.feed(self._parser.feed(token_id))
            return self._filter.stopped
        tok = self._tok
        text = self._decoder.flush() + tok.decode([token_id]) if tok.is_special(token_id) else \
            self._decoder.push(token_id)
        self._matcher.push(text)
        return self._matcher.hit
