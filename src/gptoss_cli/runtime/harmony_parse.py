"""Model output ids → harmony messages, token by token, as events a chat display can consume.

States: expect_start → header (tokens up to `<|message|>`) → content (until `<|end|>`, `<|return|>`
or `<|call|>`) → expect_start. A parser made with a role starts in `header`, because the prompt
already ended with `<|start|>assistant`. Header text is interpreted exactly as openai-harmony does
(see `parse_header`), so well-formed output gives the same messages.

The parser is lenient: it never raises, and special tokens never reach the text. Where the model
breaks the format it reports a ParseError event and recovers:
- `<|start|>` inside a header restarts the header; inside content it closes the open message first;
- `<|channel|>` inside content closes the open message and opens a new assistant header;
- any other special token inside a header or content is dropped;
- a terminator inside a header closes the message with the header's leftover words as its text
  (only for the prompt-opened first message, as openai-harmony's non-strict mode does);
- ordinary tokens outside a message are dropped until the next `<|start|>`;
- `<|endoftext|>` (a generation stop in generation_config.json) closes the open message.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Union

from gptoss_cli.runtime.harmony_types import ROLES, Message
from gptoss_cli.runtime.tokenizer import (
    CHANNEL,
    CONSTRAIN,
    ENDOFTEXT,
    GENERATION_STOP_IDS,
    MESSAGE,
    MESSAGE_END_IDS,
    START,
    StreamDecoder,
    Tokenizer,
)

_CHANNEL_TEXT = "<|channel|>"
_CONSTRAIN_TEXT = "<|constrain|>"
# Rust's char::is_whitespace (Unicode White_Space), which the reference uses to trim headers.
_UNICODE_WS = (
    "\t\n\x0b\x0c\r \x85\xa0\u1680"
    "\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008\u2009\u200a"
    "\u2028\u2029\u202f\u205f\u3000"
)
_ASCII_WS = " \t\n\x0c\r"  # Rust's split_ascii_whitespace (no vertical tab)
_CLOSERS = (*MESSAGE_END_IDS, ENDOFTEXT)


@dataclass(frozen=True)
class MessageStart:
    """A header is complete; text for this message follows."""

    role: str
    channel: str | None
    recipient: str | None
    content_type: str | None
    name: str | None = None


@dataclass(frozen=True)
class TextDelta:
    """Newly decoded text of the open message (whole characters only)."""

    channel: str | None
    text: str
    recipient: str | None = None


@dataclass(frozen=True)
class MessageEnd:
    """A message is complete; its content is the concatenation of its deltas."""

    message: Message
    terminator: int | None  # the closing token id; None when the output stopped mid-message


@dataclass(frozen=True)
class ToolCall:
    """An assistant message with a recipient closed by a terminator: the caller may run the tool."""

    recipient: str
    arguments_text: str
    channel: str | None
    content_type: str | None = None


@dataclass(frozen=True)
class ParseError:
    """The model broke the format here; the parser has recovered (see the module docstring)."""

    description: str


Event = Union[MessageStart, TextDelta, MessageEnd, ToolCall, ParseError]


@dataclass
class Header:
    """The fields of a message header."""

    role: str
    channel: str | None = None
    recipient: str | None = None
    content_type: str | None = None
    name: str | None = None


@dataclass
class _OpenMessage:
    header: Header
    decoder: StreamDecoder
    parts: list[str] = field(default_factory=list)


class HarmonyStreamParser:
    """Feed generated ids one at a time; get MessageStart / TextDelta / MessageEnd / ToolCall / ParseError."""

    def __init__(self, tokenizer: Tokenizer, role: str | None = "assistant") -> None:
        self._tok = tokenizer
        self._next_role = role
        self._state = "header" if role is not None else "expect_start"
        self._header: list[int] = []
        self._open: _OpenMessage | None = None
        self._dropping = False
        self.messages: list[Message] = []
        self.stopped = False  # a generation stop token (<|return|>, <|call|>, <|endoftext|>) was seen

    @property
    def state(self) -> str:
        return self._state

    @property
    def current_header(self) -> Header | None:
        return None if self._open is None else self._open.header

    def feed(self, token_id: int) -> list[Event]:
        if not self._tok.is_valid(token_id):
            return [_problem(f"token id {token_id!r} is outside the vocabulary (ignored)")]
        token_id = operator.index(token_id)  # numpy / torch integers compare and hash like ints
        if token_id in GENERATION_STOP_IDS:
            self.stopped = True
        if self._state == "expect_start":
            return self._feed_outside(token_id)
        if self._state == "header":
            return self._feed_header(token_id)
        return self._feed_content(token_id)

    def finish(self) -> list[Event]:
        """End of output: closes an open message (terminator None); a half header is reported."""
        events: list[Event] = []
        if self._state == "content":
            events += self._close(None)
        elif self._state == "header" and self._header:
            events.append(_problem("output ended inside a message header (dropped)"))
        self._reset_outside()
        return events

    def _feed_outside(self, token_id: int) -> list[Event]:
        if token_id == START:
            self._dropping = False
            self._start_header(None)
            return []
        if token_id == ENDOFTEXT:
            return []
        if self._dropping:
            return []
        self._dropping = True
        return [_problem(f"{self._describe(token_id)} outside a message (dropped until the next ‹start›)")]

    def _feed_header(self, token_id: int) -> list[Event]:
        if token_id == MESSAGE:
            return self._open_message()
        if token_id == START:
            self._start_header(None)
            return [_problem("‹start› inside a message header; the header starts over")]
        if token_id in _CLOSERS:
            return self._close_in_header(token_id)
        if token_id in (CHANNEL, CONSTRAIN) or not self._tok.is_special(token_id):
            self._header.append(token_id)
            return []
        return [_problem(f"{self._describe(token_id)} inside a message header (dropped)")]

    def _feed_content(self, token_id: int) -> list[Event]:
        if token_id in _CLOSERS:
            return self._close(token_id)
        if token_id == START:
            events = [_problem("message not closed before ‹start›")] + self._close(None)
            self._start_header(None)
            return events
        if token_id == CHANNEL:
            events = [_problem("message not closed before ‹channel›")] + self._close(None)
            self._start_header("assistant")
            self._header.append(CHANNEL)
            return events
        if self._tok.is_special(token_id):
            return [_problem(f"{self._describe(token_id)} inside message text (dropped)")]
        assert self._open is not None
        text = self._open.decoder.push(token_id)
        return self._text(text)

    def _start_header(self, role: str | None) -> None:
        self._state, self._header, self._next_role = "header", [], role

    def _reset_outside(self) -> None:
        self._state, self._header, self._next_role, self._open = "expect_start", [], None, None

    def _open_message(self) -> list[Event]:
        header, problems = parse_header(self._tok.decode(self._header), self._next_role)
        self._open = _OpenMessage(header, self._tok.stream_decoder())
        self._state, self._header, self._next_role = "content", [], None
        events: list[Event] = [_problem(p) for p in problems]
        events.append(_start_event(header))
        return events

    def _text(self, text: str) -> list[Event]:
        if not text:
            return []
        assert self._open is not None
        self._open.parts.append(text)
        header = self._open.header
        return [TextDelta(header.channel, text, header.recipient)]

    def _close(self, terminator: int | None) -> list[Event]:
        assert self._open is not None
        events = self._text(self._open.decoder.flush())
        message = _to_message(self._open.header, "".join(self._open.parts))
        self.messages.append(message)
        events.append(MessageEnd(message, terminator))
        if message.is_tool_call:
            if terminator in MESSAGE_END_IDS:
                events.append(ToolCall(message.recipient, message.content, message.channel, message.content_type))
            else:
                events.append(_problem(f"tool call to {message.recipient} was not terminated (not executed)"))
        self._reset_outside()
        return events

    def _close_in_header(self, terminator: int) -> list[Event]:
        events: list[Event] = [_problem("message header ended without ‹message›")]
        if self._next_role is not None and self._header:
            header, text, problems = parse_header_as_text(self._tok.decode(self._header), self._next_role)
            if header is not None:
                message = _to_message(header, text)
                self.messages.append(message)
                events.append(_start_event(header))
                if text:
                    events.append(TextDelta(header.channel, text, header.recipient))
                events.append(MessageEnd(message, terminator))
            events += [_problem(p) for p in problems]
        self._reset_outside()
        return events

    def _describe(self, token_id: int) -> str:
        if self._tok.is_special(token_id):
            return self._tok.decode([token_id])
        return "text"


def parse_completion(tokenizer: Tokenizer, ids: Iterable[int], role: str | None = "assistant") -> list[Message]:
    """All messages in a finished completion (batch mode); malformed parts are recovered as above."""
    parser = HarmonyStreamParser(tokenizer, role)
    for token_id in ids:
        parser.feed(token_id)
    parser.finish()
    return parser.messages


def parse_header(text: str, role: str | None) -> tuple[Header, list[str]]:
    """Interpret a decoded header like openai-harmony; returns the header and what was wrong with it.

    `role` is known when the prompt opened the message; otherwise the first word names it (an
    unknown first word followed by more words is a tool, e.g. `functions.f to=assistant`). The last
    word is the recipient if it starts with `to=` (or is the only word), else the content type,
    and then the word before it is the recipient.
    """
    channel, parts, problems = _split_header(text)
    role, name = _take_role(parts, role, problems)
    header = Header(role, channel, name=name)
    if parts:
        last = parts.pop()
        if last.startswith("to="):
            header.recipient = last[3:]
        elif not parts and not last.startswith(_CONSTRAIN_TEXT):
            header.recipient = last
        else:
            header.content_type = last
            if parts:
                before = parts.pop()
                header.recipient = before[3:] if before.startswith("to=") else before
    if parts:
        problems.append(f"unexpected words in message header: {' '.join(parts)!r} (ignored)")
    return header, problems


def parse_header_as_text(text: str, role: str) -> tuple[Header | None, str, list[str]]:
    """A header cut short by a terminator: channel and role are read, every other word is content."""
    channel, parts, problems = _split_header(text)
    if problems:
        return None, "", problems
    role, name = _take_role(parts, role, problems)
    words = [w for p in parts if (w := p.replace(_CONSTRAIN_TEXT, "").replace(_CHANNEL_TEXT, ""))]
    return Header(role, channel, name=name), " ".join(words), problems


def _split_header(text: str) -> tuple[str | None, list[str], list[str]]:
    channel, problems = None, []
    at = text.find(_CHANNEL_TEXT)
    if at >= 0:
        rest = text[at + len(_CHANNEL_TEXT) :]
        end = next((i for i, c in enumerate(rest) if c in _UNICODE_WS or c == "<"), len(rest))
        if end == 0:
            problems.append("‹channel› without a channel name")
        channel = rest[:end] or None
        text = text[:at] + rest[end:]
    text = text.strip(_UNICODE_WS)
    if _CONSTRAIN_TEXT in text:
        # "to=x<|constrain|>json" must split into a recipient and a content type.
        text = text.replace(_CONSTRAIN_TEXT, " " + _CONSTRAIN_TEXT).strip(_UNICODE_WS)
    parts = [p for p in _split_ascii_ws(text) if p]
    return channel, parts, problems


def _split_ascii_ws(text: str) -> list[str]:
    for ws in _ASCII_WS[1:]:
        text = text.replace(ws, " ")
    return text.split(" ")


def _take_role(parts: list[str], role: str | None, problems: list[str]) -> tuple[str, str | None]:
    """Pop the role word(s) from `parts`; returns (role, tool name or None)."""
    name = None
    if role is None:
        if not parts:
            problems.append("message header without a role (taken as assistant)")
            return "assistant", None
        word = parts[0]
        if word in ROLES:
            role = word
            name = word if word == "tool" else None
        elif len(parts) > 1 or word.startswith("to="):
            role, name = "tool", parts.pop(0)
        else:
            problems.append(f"unknown role {word!r} in message header (taken as assistant)")
            role = "assistant"
            parts.pop(0)
    if parts and parts[0] == role:
        parts.pop(0)
    return role, name


def _start_event(header: Header) -> MessageStart:
    return MessageStart(header.role, header.channel, header.recipient, header.content_type, header.name)


def _problem(description: str) -> ParseError:
    # Diagnostics may be shown next to the answer; they never carry raw markup either.
    return ParseError(description.replace("<|", "‹").replace("|>", "›"))


def _to_message(header: Header, text: str) -> Message:
    # A tool header opened by the caller's role has no name; Message requires one.
    name = header.name if header.role != "tool" else header.name or "tool"
    return Message(header.role, text, header.channel, header.recipient, header.content_type, name)
