"""Generated token ids → what a batch record reports: answer, reasoning, tool calls, finish reason.

Chat requests are parsed as harmony: the `final` channel is the answer (commentary preambles stand
in when there is no final message), `analysis` is the reasoning, and terminated commentary messages
addressed to `functions.NAME` become OpenAI tool calls (returned, never executed). Raw text
requests are decoded as they are, without the stop token. With stop sequences the answer (all of a
raw completion) ends before the first one (runtime/stop_strings.py) and finishes with "stop".
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..runtime.harmony import HarmonyStreamParser, ToolCall
from ..runtime.stop_strings import StopFilter, cut_at_stop

_FUNCTIONS = "functions."


@dataclass
class Completion:
    content: str | None
    reasoning: str | None
    finish_reason: str  # "stop" | "length" | "tool_calls"
    tool_calls: list[dict] = field(default_factory=list)
    reasoning_tokens: int = 0


def chat_completion(tokenizer, token_ids: list[int], engine_finish: str, stops: Sequence[str] = ()) -> Completion:
    """Parse a harmony completion; `engine_finish` is the engine's "stop" or "length" (or "abort":
    the caller stopped it at one of `stops`)."""
    parser = HarmonyStreamParser(tokenizer)
    cut = StopFilter(stops)
    calls: list[ToolCall] = []
    reasoning_tokens = 0
    for token_id in token_ids:
        header = parser.current_header
        if header is not None and header.channel == "analysis":
            reasoning_tokens += 1
        calls += [e for e in cut.feed(parser.feed(token_id)) if isinstance(e, ToolCall)]
        if cut.stopped:
            break
    if not cut.stopped:
        cut.feed(parser.finish())
    messages = [m for m in parser.messages if m.role == "assistant"] + ([cut.message] if cut.stopped else [])
    final = [m.content for m in messages if m.channel == "final"]
    preambles = [m.content for m in messages if m.channel == "commentary" and m.recipient is None]
    analysis = [m.content for m in messages if m.channel == "analysis"]
    tool_calls = [_openai_tool_call(c) for c in calls]
    text = "".join(final) if final else "".join(preambles)
    last_is_call = bool(messages) and messages[-1].is_tool_call and bool(calls)
    finish = "tool_calls" if engine_finish == "stop" and last_is_call else engine_finish
    if cut.stopped:
        finish = "stop"
    return Completion(
        content=text if text or not tool_calls else None,
        reasoning="".join(analysis) if analysis else None,
        finish_reason=finish,
        tool_calls=tool_calls,
        reasoning_tokens=reasoning_tokens,
    )


def text_completion(tokenizer, token_ids: list[int], engine_finish: str, stop_ids: tuple[int, ...],
                    stops: Sequence[str] = ()) -> Completion:
    """A raw completion: the decoded ids, minus the stop token that ended it, cut before the first
    of `stops`."""
    ids = token_ids[:-1] if engine_finish == "stop" and token_ids and token_ids[-1] in stop_ids else token_ids
    text, hit = cut_at_stop(tokenizer.decode(ids), stops)
    return Completion(content=text, reasoning=None, finish_reason="stop" if hit else engine_finish)


def _openai_tool_call(call: ToolCall) -> dict:
    name = call.recipient[len(_FUNCTIONS):] if call.recipient.startswith(_FUNCTIONS) else call.recipient
    return {
        "id": f"call_{secrets.token_hex(12)}",
        "type": "function",
        "function": {"name": name, "arguments": call.arguments_text},
    }
