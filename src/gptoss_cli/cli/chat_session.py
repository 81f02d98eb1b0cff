"""A chat conversation and its turns on the engine: state, prompt rendering, context budget,
per-turn stats, and saving/loading. No prompt_toolkit or Rich here, so it is testable alone.

Prefix reuse: the system message (with a date fixed when the session starts), the developer message
and every completed turn render to the same tokens turn after turn, so the engine's prefix cache only
prefills what is new. Completed turns keep their analysis in memory (and in saved JSON) but it is never
re-sent: `drop_finished_analysis` removes it before rendering, as the harmony format requires.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import re
from collections.abc import Iterator
from contextlib import closing
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Union

from ..runtime.api import SamplingParams
from .chat_store import ChatStore, new_conversation_id, now_text, write_private
from .json_answer import answer_problem, format_name
from .options import EFFORTS, REASONING_MODES
from .sampling_settings import SamplingSettings
from ..runtime.errors import GptossError, RequestError
from ..runtime.stop_strings import StopFilter, StopMatcher, check_stops, cut_at_stop, is_answer_text
from ..runtime.harmony import (
    Conversation,
    DeveloperConfig,
    Event,
    HarmonyStreamParser,
    Message,
    MessageStart,
    ParseError,
    ResponseFormat,
    SystemConfig,
    TextDelta,
    drop_finished_analysis,
    render_prompt,
)

TRUNCATE_MODES = ("none", "oldest")
DEFAULT_REPLY_RESERVE = 1024  # tokens kept free for the reply when --max-tokens is unset
SAVE_FORMAT = "gptoss-chat"
SAVE_VERSION = 1
# What `/set NAME VALUE` may change (see parse_setting for the value types).
SETTABLE = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed", "max_tokens", "stop", "context")
_FLOAT_SETTINGS = ("temperature", "top_p", "min_p", "repetition_penalty")
_ESCAPES = {"\\n": "\n", "\\t": "\t", "\\\\": "\\"}  # what `/set stop` unescapes


@dataclass
class ChatSettings(SamplingSettings):
    """Everything a user can change during a chat; saved with the conversation."""

    effort: str = "medium"
    developer: str | None = None
    reasoning: str = "collapse"  # show | collapse | hide
    context: int | None = None  # None: the engine's whole context
    truncate: str = "none"  # none | oldest
    raw: bool = False
    stats: bool = True
    stop: tuple[str, ...] = ()  # stop sequences: the answer ends before the first one completed
    json_schema: dict | None = None  # --json-schema: a response format every answer is checked against

    def __post_init__(self) -> None:
        self.stop = check_stops(self.stop)  # also a saved file's list
        check_choice("effort", self.effort, EFFORTS)
        check_choice("reasoning", self.reasoning, REASONING_MODES)
        check_choice("truncate", self.truncate, TRUNCATE_MODES)
        if self.context is not None and self.context < 16:
            raise ValueError("context must be at least 16 tokens")
        self.sampling(self.max_tokens)  # SamplingParams validates the sampling fields

    def sampling(self, max_tokens: int | None) -> SamplingParams:
        return SamplingParams(**(self.sampling_values() | {"max_tokens": max_tokens}))

    @classmethod
    def from_dict(cls, data: dict) -> ChatSettings:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


def unescape(text: str) -> str:
    """\\n, \\t and \\\\ in typed text as the characters they name (nothing else changes)."""
    return re.sub(r"\\[nt\\]", lambda m: _ESCAPES[m.group(0)], text)


def check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}, not {value!r}")


def parse_setting(name: str, text: str) -> object:
    """A /set value as its Python type; 'none' (or 'off', 'random', 'max') unsets the optional ones."""
    if name not in SETTABLE:
        raise ValueError(f"unknown setting {name!r}; one of {', '.join(SETTABLE)}")
    optional = name in ("seed", "max_tokens", "context")
    if optional and text.lower() in ("none", "off", "random", "max", "default"):
        return None
    try:
        return float(text) if name in _FLOAT_SETTINGS else int(text)
    except ValueError:
        kind = "a number" if name in _FLOAT_SETTINGS else "a whole number"
        extra = " (or none)" if optional else ""
        raise ValueError(f"{name} must be {kind}{extra}, not {text!r}") from None


# ---- turn events and results -------------------------------------------------------------------

@dataclass(frozen=True)
class RawToken:
    """One generated token, before its harmony events (for the raw view and live counters)."""

    token_id: int
    text: str  # special tokens as their names, e.g. <|channel|>
    time: float
    reasoning: bool  # the token belongs to an analysis message


@dataclass
class TurnStats:
    prompt_tokens: int
    cached_prompt_tokens: int
    generated_tokens: int
    reasoning_tokens: int
    ttft: float | None  # first token of any channel, seconds after the request arrived
    time_to_answer: float | None  # first final-channel text
    decode_seconds: float
    context_used: int
    context_limit: int
    finish_reason: str
    format_errors: int

    @property
    def decode_tokens_per_second(self) -> float | None:
        if self.generated_tokens < 2 or self.decode_seconds <= 0:
            return None
        return (self.generated_tokens - 1) / self.decode_seconds


@dataclass
class TurnResult:
    user: str
    messages: list[Message]  # the assistant messages the model wrote (analysis included)
    answer: str  # final-channel text, or the fallback text
    fallback_text: str | None  # output that was not harmony, shown and kept as the answer
    stats: TurnStats
    committed: bool  # added to the conversation
    cut_in_reasoning: bool  # max_tokens reached before any answer
    warnings: list[str] = field(default_factory=list)
    json_problem: str | None = None  # with --json-schema: why the answer does not satisfy it


@dataclass(frozen=True)
class TurnDone:
    result: TurnResult


TurnEvent = Union[RawToken, Event, TurnDone]


class Turn:
    """One reply in progress. Iterate for display events (the last one is TurnDone); the turn is
    committed to the conversation only when it completes. `cancel()` (or an exception while
    iterating, e.g. Ctrl+C) aborts the engine request and leaves the conversation unchanged."""

    def __init__(self, session: ChatSession, user: str, prompt_ids: list[int], params: SamplingParams,
                 dropped_turns: int) -> None:
        self.session = session
        self.user = user
        self.prompt_ids = prompt_ids
        self.params = params
        self.dropped_turns = dropped_turns
        self.result: TurnResult | None = None
        self._gen = self._run()

    def __iter__(self) -> Iterator[TurnEvent]:
        return self._gen

    def cancel(self) -> None:
        """Abort (Ctrl+C): the engine request is dropped and the message kept for /retry."""
        self._gen.close()
        if self.result is None:
            self.session.retry_text = self.user

    def _run(self) -> Iterator[TurnEvent]:
        tok = self.session.tokenizer
        stops = self.session.settings.stop
        parser, cut = HarmonyStreamParser(tok), StopFilter(stops)
        # Text before the first special token is not harmony: it can only become the fallback
        # answer, so a stop string in it ends the request too.
        plain = StopMatcher(stops) if stops else None
        tally = _Tally()
        raw = tok.stream_decoder()  # the raw view must not split UTF-8 characters either
        output = None
        stream = self.session.engine.stream(self.prompt_ids, self.params)
        with closing(stream):
            for event in stream:
                reasoning = tally.before(parser, event)
                t = event.token_id
                special = tok.is_special(t)
                text = raw.flush() + tok.decode([t]) if special else raw.push(t)
                yield RawToken(t, text, event.time, reasoning)
                for harmony_event in cut.feed(parser.feed(event.token_id)):
                    tally.after(harmony_event, event.time)
                    yield harmony_event
                if plain is not None:
                    if special:
                        plain = None  # harmony from here on: the StopFilter's answers count
                    else:
                        plain.push(text)
                if event.output is not None:
                    output = event.output
                elif cut.stopped or (plain is not None and plain.hit):  # a stop string: the request ends here
                    output = stream.end()
                    break
        for harmony_event in [] if cut.stopped else cut.feed(parser.finish()):
            tally.after(harmony_event, None)
            yield harmony_event
        messages = list(parser.messages) + ([cut.message] if cut.stopped else [])
        self.result = self.session.finish_turn(self, messages, tally, output)
        yield TurnDone(self.result)


@dataclass
class _Tally:
    """Counters gathered while a turn streams."""

    reasoning_tokens: int = 0
    header_tokens: int = 0  # tokens of a header not yet attributed to a channel
    first_answer_time: float | None = None
    format_errors: int = 0

    def before(self, parser: HarmonyStreamParser, event) -> bool:
        header = parser.current_header
        if header is not None:  # inside message content (the terminator counts too)
            reasoning = header.channel == "analysis"
            self.reasoning_tokens += reasoning
            return reasoning
        self.header_tokens += 1
        return False

    def after(self, event: Event, time: float | None) -> None:
        if isinstance(event, MessageStart):
            if event.channel == "analysis":
                self.reasoning_tokens += self.header_tokens
            self.header_tokens = 0
        elif isinstance(event, TextDelta) and is_answer_text(event.channel, event.recipient) \
                and self.first_answer_time is None:
            self.first_answer_time = time
        elif isinstance(event, ParseError):
            self.format_errors += 1


# ---- the session --------------------------------------------------------------------------------

class ChatSession:
    """The conversation, its settings, and how a user message becomes an engine request."""

    def __init__(self, engine, tokenizer, model_name: str, settings: ChatSettings | None = None,
                 store: ChatStore | None = None, today: str | None = None) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.settings = settings or ChatSettings()
        self.store = store
        self.today = today or dt.date.today().isoformat()  # fixed: the system prefix must not change
        self.messages: list[Message] = []
        self.retry_text: str | None = None  # a user message whose reply was interrupted or cut
        self.last_stats: TurnStats | None = None
        self.conversation_id = new_conversation_id()
        self.created = now_text()

    # -- prompt ------------------------------------------------------------------------------
    def system_config(self) -> SystemConfig:
        return SystemConfig(current_date=self.today, reasoning_effort=self.settings.effort)

    def developer_config(self) -> DeveloperConfig | None:
        s = self.settings
        formats = (ResponseFormat(format_name(s.json_schema), s.json_schema),) if s.json_schema is not None else ()
        if not s.developer and not formats:
            return None
        return DeveloperConfig(instructions=s.developer or None, response_formats=formats)

    def render(self, messages: list[Message] | None = None) -> list[int]:
        """Prompt ids for the next reply: finished turns without their analysis, then <|start|>assistant."""
        msgs = drop_finished_analysis(self.messages if messages is None else messages)
        return render_prompt(self.tokenizer, msgs, self.system_config(), self.developer_config(),
                             auto_drop_analysis=False)

    def prompt_text(self) -> str:
        """The next prompt as harmony text, special tokens included."""
        return self.tokenizer.decode(self.render())

    @property
    def context_limit(self) -> int:
        engine_limit = int(self.engine.max_context)
        return min(self.settings.context or engine_limit, engine_limit)

    def context_used(self) -> int:
        return len(self.render())

    def reply_reserve(self) -> int:
        return self.settings.max_tokens or min(DEFAULT_REPLY_RESERVE, self.context_limit // 4)

    # -- turns -------------------------------------------------------------------------------
    def start_turn(self, text: str) -> Turn:
        """Check the context budget (truncating if allowed) and prepare the request.

        Raises RequestError(code="context_length_exceeded") when the message cannot fit.
        """
        if not text.strip():
            raise ValueError("empty message")
        user = Message("user", text)
        history, dropped = self._fit(user)
        if dropped:
            self.messages = history
        prompt = self.render(history + [user])
        room = self.context_limit - len(prompt)
        max_tokens = room if self.settings.max_tokens is None else min(room, self.settings.max_tokens)
        return Turn(self, text, prompt, self.settings.sampling(max_tokens), dropped)

    def _fit(self, user: Message) -> tuple[list[Message], int]:
        """The history that fits with `user` and the reply reserve; oldest turns dropped if allowed."""
        history, dropped = list(self.messages), 0
        limit, reserve = self.context_limit, self.reply_reserve()
        while len(self.render(history + [user])) + reserve > limit:
            starts = turn_starts(history)
            if self.settings.truncate != "oldest" or not history:
                raise self._overflow(len(self.render(history + [user])), reserve, limit)
            cut = starts[1] if len(starts) > 1 else len(history)
            history, dropped = history[cut:], dropped + 1
        return history, dropped

    def _overflow(self, prompt: int, reserve: int, limit: int) -> RequestError:
        if not self.messages:
            hint = "shorten the message, lower --max-tokens, or raise --context"
        else:
            hint = "/clear to start over, /undo, lower --max-tokens, raise --context, or use --truncate oldest"
        return RequestError(f"the conversation needs {prompt} prompt + {reserve} reply tokens; "
                            f"the context is {limit}", hint, code="context_length_exceeded")

    def finish_turn(self, turn: Turn, messages: list[Message], tally: _Tally, output) -> TurnResult:
        """Stats, and the conversation update: called by the Turn once the engine is done, with the
        messages the model wrote (the answer cut at a stop string)."""
        answer = "".join(m.content for m in messages if is_answer(m))
        token_ids = list(output.token_ids) if output is not None else []
        fallback, stopped = None, False
        if not messages:  # nothing harmony-shaped at all: show what the model wrote, as text
            text = self.tokenizer.decode([t for t in token_ids if not self.tokenizer.is_special(t)])
            text, stopped = cut_at_stop(text, self.settings.stop)
            fallback = text.strip() or None
        if fallback is not None and tally.first_answer_time is None and output is not None:
            tally.first_answer_time = output.timings.first_token
        stats = self._stats(turn, tally, output, token_ids)
        if fallback is not None and stopped:
            stats = replace(stats, finish_reason="stop")
        replies = self._replies(messages, fallback)
        result = TurnResult(turn.user, messages, fallback or answer, fallback, stats, committed=bool(replies),
                            cut_in_reasoning=not replies and stats.finish_reason == "length")
        if replies:
            self.messages += [Message("user", turn.user), *replies]
            self.retry_text = None
            result.warnings += self.autosave()
            if self.settings.json_schema is not None:
                result.json_problem = answer_problem(result.answer, self.settings.json_schema)
        else:
            self.retry_text = turn.user
        self.last_stats = stats
        return result

    @staticmethod
    def _replies(messages: list[Message], fallback: str | None) -> list[Message]:
        """What a finished turn adds to the conversation (besides the user message)."""
        if fallback is not None:
            return [Message("assistant", fallback, channel="final")]
        if not any(m.channel != "analysis" and m.content.strip() for m in messages):
            return []  # only (cut) reasoning: nothing the next turn could build on
        return [m for m in messages if m.role == "assistant"]

    def _stats(self, turn: Turn, tally: _Tally, output, token_ids: list[int]) -> TurnStats:
        timings = output.timings if output is not None else None
        arrival = timings.arrival if timings else 0.0
        first = timings.first_token if timings else None
        finished = timings.finished if timings else None
        answer_at = tally.first_answer_time
        return TurnStats(
            prompt_tokens=len(turn.prompt_ids),
            cached_prompt_tokens=output.cached_prompt_tokens if output is not None else 0,
            generated_tokens=len(token_ids),
            reasoning_tokens=tally.reasoning_tokens,
            ttft=None if first is None else first - arrival,
            time_to_answer=None if answer_at is None else answer_at - arrival,
            decode_seconds=0.0 if first is None or finished is None else finished - first,
            context_used=len(turn.prompt_ids) + len(token_ids),
            context_limit=self.context_limit,
            finish_reason=(output.finish_reason if output is not None else None) or "stop",
            format_errors=tally.format_errors,
        )

    # -- editing -----------------------------------------------------------------------------
    def undo(self) -> str | None:
        """Remove the last exchange; returns its user text (None if there was none)."""
        starts = turn_starts(self.messages)
        if not starts:
            return None
        text = self.messages[starts[-1]].content
        self.messages = self.messages[: starts[-1]]
        self.retry_text = None
        return text

    def pop_for_retry(self) -> str | None:
        """The user message to send again: an interrupted one, else the last exchange (removed)."""
        if self.retry_text is not None:
            return self.retry_text
        return self.undo()

    def clear(self) -> None:
        """Start a new conversation with the same settings (autosaved under a new name)."""
        self.messages, self.retry_text, self.last_stats = [], None, None
        self.conversation_id, self.created = new_conversation_id(), now_text()

    def set_value(self, name: str, text: str) -> None:
        """`/set NAME VALUE`; ValueError with a user-facing message when the value is bad.
        `/set stop TEXT` adds a stop sequence (\\n and \\t typed as such), `/set stop none` clears them."""
        if name == "stop":
            added = () if text.lower() in ("none", "off") else (unescape(text),)
            self.settings = replace(self.settings, stop=(self.settings.stop + added) if added else ())
            return
        value = parse_setting(name, text)
        if name == "context" and value is not None and value > self.engine.max_context:
            raise ValueError(f"the model was loaded with a {self.engine.max_context}-token context; "
                             f"restart with --context {value} for more")
        self.settings = replace(self.settings, **{name: value})

    # -- persistence -------------------------------------------------------------------------
    def conversation(self) -> Conversation:
        return Conversation(tuple(self.messages), self.system_config(), self.developer_config())

    def to_dict(self) -> dict:
        return {
            "format": SAVE_FORMAT, "version": SAVE_VERSION, "id": self.conversation_id,
            "model": self.model_name, "created": self.created, "updated": now_text(),
            "settings": asdict(self.settings), "conversation": self.conversation().to_dict(),
        }

    def load_dict(self, data: dict, source: str) -> None:
        """Replace the conversation and settings with a saved one (the session date stays today)."""
        try:
            if not isinstance(data, dict) or data.get("format") != SAVE_FORMAT:
                raise ValueError("not a gptoss chat file")
            conv = Conversation.from_dict(data.get("conversation") or {})
            settings = ChatSettings.from_dict(data.get("settings") or {})
        except (TypeError, ValueError, KeyError) as e:
            raise GptossError(f"cannot load {source}: {e}", "give a .json file written by /save") from None
        if conv.system is not None and conv.system.reasoning_effort:
            settings = replace(settings, effort=conv.system.reasoning_effort)
        developer = conv.developer.instructions if conv.developer is not None else None
        # Display switches belong to this run, not to the file.
        self.settings = replace(settings, developer=developer, raw=self.settings.raw, stats=self.settings.stats,
                                reasoning=self.settings.reasoning, truncate=self.settings.truncate)
        if self.settings.context is not None and self.settings.context > self.engine.max_context:
            self.settings = replace(self.settings, context=None)
        self.messages = list(conv.messages)
        self.retry_text, self.last_stats = None, None
        self.conversation_id = str(data.get("id") or new_conversation_id())
        self.created = str(data.get("created") or now_text())

    def save(self, path: Path, reasoning: bool = False) -> Path:
        """/save: JSON (conversation + settings) or, for .md, a transcript, with the reasoning only
        when asked (`reasoning`; JSON always keeps the whole conversation)."""
        path = Path(path).expanduser()
        if path.suffix.lower() == ".md":
            text = markdown_transcript(self, reasoning)
        else:
            text = json.dumps(self.to_dict(), indent=1, ensure_ascii=False)
        write_private(path, text)
        return path

    def load(self, path: Path) -> None:
        path = Path(path).expanduser()
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise GptossError(f"{path}: no such file", "give the path of a file written by /save") from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise GptossError(f"cannot load {path}: {e}", "give a .json file written by /save") from None
        self.load_dict(data, str(path))

    def autosave(self) -> list[str]:
        """Write the conversation to the store; returns warnings instead of failing the chat."""
        if self.store is None or not self.messages:
            return []
        try:
            self.store.write(self.conversation_id, json.dumps(self.to_dict(), indent=1, ensure_ascii=False))
        except OSError as e:
            return [f"could not autosave the conversation: {e}"]
        return []


def is_answer(message: Message) -> bool:
    return message.role == "assistant" and is_answer_text(message.channel, message.recipient)


def turn_starts(messages: list[Message]) -> list[int]:
    """Index of each user message: where each exchange begins."""
    return [i for i, m in enumerate(messages) if m.role == "user"]


def markdown_transcript(session: ChatSession, reasoning: bool = False) -> str:
    """The conversation as Markdown: user messages, answers and tool calls; the reasoning (analysis
    channel) as a quoted block before the answer only with `reasoning`."""
    subtitle = f"*{session.created[:10]} · effort {session.settings.effort}*"
    lines = [f"# Chat with {session.model_name}", "", subtitle, ""]
    if session.settings.developer:
        lines += ["## Developer instructions", "", session.settings.developer, ""]
    speaker = None  # the heading the lines are under: one "## Assistant" per reply
    for m in session.messages:
        if m.role == "assistant" and not m.is_tool_call and (reasoning or m.channel != "analysis") \
                and speaker != "assistant":
            lines += ["## Assistant", ""]
            speaker = "assistant"
        if m.role == "user":
            lines += ["## You", "", m.content, ""]
            speaker = "user"
        elif m.is_tool_call:
            lines += [f"**Tool call** `{m.recipient}`:", "", "```json", m.content, "```", ""]
        elif m.role == "assistant" and m.channel == "analysis":
            if reasoning:
                lines += ["**Reasoning:**", "", *(f"> {line}".rstrip() for line in m.content.splitlines()), ""]
        elif m.role == "assistant":
            lines += [m.content, ""]
        elif m.role == "tool":
            lines += [f"**Tool result** `{m.name}`:", "", "```", m.content, "```", ""]
            speaker = "tool"
    return "\n".join(lines)


# ---- where things are stored --------------------------------------------------------------------

def human_tokens(n: int) -> str:
    """3.1k, 131k: compact token counts for the stats line and toolbar."""
    if n < 1000:
        return str(n)
    if n < 10_000:
        return f"{math.floor(n / 100) / 10:.1f}k"
    return f"{n // 1000}k"
