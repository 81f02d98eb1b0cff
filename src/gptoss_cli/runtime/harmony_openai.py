"""OpenAI-style chat messages and function tools → harmony messages and a developer config.

Mapping (the batch `run` command and chat feed requests through this):
- `system` and `developer` messages → the developer message's instructions (joined by a blank line);
- `user` → user message; content may be a string or a list of text parts;
- `assistant` → `reasoning` (or `reasoning_content` / `thinking`) as an analysis message, then either
  `content` as the final answer, or, with `tool_calls`, `content` as a commentary preamble followed
  by one `to=functions.NAME` commentary call per tool call with `<|constrain|>json` arguments;
- `tool` → a message from `functions.NAME` to the assistant on commentary; NAME comes from `name`,
  else from the call whose id is `tool_call_id`, else from the latest call;
- `tools` → function tools (`{"type": "function", "function": {...}}` or the flat form).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from gptoss_cli.runtime.harmony_types import (
    CONSTRAIN_JSON,
    Conversation,
    DeveloperConfig,
    Message,
    SystemConfig,
    ToolDef,
)

_REASONING_KEYS = ("reasoning", "reasoning_content", "thinking")
_TEXT_PART_TYPES = ("text", "input_text", "output_text")


def conversation_from_openai(
    messages: Sequence[dict[str, Any]],
    tools: Sequence[dict[str, Any]] | None = None,
    system: SystemConfig | None = None,
) -> Conversation:
    """A Conversation for an OpenAI-style request; `system` defaults to SystemConfig()."""
    harmony_messages, developer = from_openai_messages(messages, tools)
    return Conversation(tuple(harmony_messages), SystemConfig() if system is None else system, developer)


def from_openai_messages(
    messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None = None
) -> tuple[list[Message], DeveloperConfig | None]:
    """Harmony messages plus the developer config (None when there are no instructions and no tools)."""
    if not isinstance(messages, (list, tuple)):
        raise TypeError("messages must be a list of {'role': ..., 'content': ...} objects")
    instructions: list[str] = []
    out: list[Message] = []
    call_names: dict[str, str] = {}
    for index, raw in enumerate(messages):
        if not isinstance(raw, dict) or "role" not in raw:
            raise ValueError(f"message {index} must be an object with a 'role'")
        role = raw["role"]
        if role in ("system", "developer"):
            instructions.append(_text(raw.get("content"), index))
        elif role == "user":
            out.append(Message("user", _text(raw.get("content"), index)))
        elif role == "assistant":
            out += _assistant(raw, index, call_names)
        elif role == "tool":
            out.append(_tool_result(raw, index, call_names))
        else:
            raise ValueError(
                f"message {index}: unknown role {role!r}; expected system, developer, user, assistant or tool"
            )
    tool_defs = tuple(tool_from_openai(t) for t in tools or ())
    if not instructions and not tool_defs:
        return out, None
    return out, DeveloperConfig("\n\n".join(instructions) if instructions else None, tool_defs)


def tool_from_openai(raw: dict[str, Any]) -> ToolDef:
    """`{"type": "function", "function": {name, description, parameters}}` (or the flat form) → ToolDef."""
    if not isinstance(raw, dict):
        raise ValueError(f"a tool must be an object, got {type(raw).__name__}")
    if raw.get("type", "function") != "function":
        raise ValueError(f"only function tools are supported, got type {raw.get('type')!r}")
    spec = raw.get("function", raw)
    name = spec.get("name") if isinstance(spec, dict) else None
    if not isinstance(name, str) or not name:
        raise ValueError("a function tool needs a 'name'")
    parameters = spec.get("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        raise ValueError(f"tool {name}: 'parameters' must be a JSON schema object")
    return ToolDef(name, spec.get("description") or "", parameters)


def _assistant(raw: dict[str, Any], index: int, call_names: dict[str, str]) -> list[Message]:
    out = []
    reasoning = next((raw[k] for k in _REASONING_KEYS if raw.get(k)), None)
    if reasoning is not None:
        out.append(Message("assistant", _text(reasoning, index), channel="analysis"))
    content = _text(raw.get("content"), index)
    calls = raw.get("tool_calls") or []
    if not calls:
        if content or reasoning is None:
            out.append(Message("assistant", content, channel="final"))
        return out
    if content:
        out.append(Message("assistant", content, channel="commentary"))
    for call in calls:
        name, arguments = _call(call, index)
        if isinstance(call.get("id"), str):
            call_names[call["id"]] = name
        call_names[""] = name  # the latest call answers a tool message without an id
        out.append(Message("assistant", arguments, "commentary", f"functions.{name}", CONSTRAIN_JSON))
    return out


def _call(call: Any, index: int) -> tuple[str, str]:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ValueError(f"message {index}: each tool call needs function.name")
    arguments = fn.get("arguments", "{}")
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return fn["name"], arguments


def _tool_result(raw: dict[str, Any], index: int, call_names: dict[str, str]) -> Message:
    name = raw.get("name") or call_names.get(raw.get("tool_call_id") or "") or call_names.get("")
    if not name:
        raise ValueError(f"message {index}: a tool result needs a 'name' or a 'tool_call_id' of an earlier call")
    return Message("tool", _text(raw.get("content"), index), "commentary", "assistant", name=f"functions.{name}")


def _text(content: Any, index: int) -> str:
    """A string, None (empty), or a list of text parts joined together."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            is_text = isinstance(part, dict) and part.get("type") in _TEXT_PART_TYPES
            if not is_text or not isinstance(part.get("text"), str):
                raise ValueError(f"message {index}: only text content parts are supported")
            texts.append(part["text"])
        return "".join(texts)
    raise ValueError(f"message {index}: content must be a string or a list of text parts")
