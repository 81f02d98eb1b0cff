"""The harmony conversation as plain data: messages, tool definitions, system and developer settings.

Everything here is a frozen dataclass that converts to and from plain dicts (JSON-ready), so a chat
can be saved and resumed. Rendering lives in harmony_render.py, parsing in harmony_parse.py.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from typing import Any

ROLES = ("system", "developer", "user", "assistant", "tool")
REASONING_EFFORTS = ("low", "medium", "high")
DEFAULT_IDENTITY = "You are ChatGPT, a large language model trained by OpenAI."
DEFAULT_CHANNELS = ("analysis", "commentary", "final")
CONSTRAIN_JSON = "<|constrain|>json"  # content type of a JSON tool call, as the model writes it


@dataclass(frozen=True)
class Message:
    """One harmony message. Tool results: role "tool", name = the tool (e.g. "functions.get_weather")."""

    role: str
    content: str
    channel: str | None = None
    recipient: str | None = None
    content_type: str | None = None
    name: str | None = None

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"unknown message role {self.role!r}; expected one of {', '.join(ROLES)}")
        if not isinstance(self.content, str):
            raise TypeError(f"message content must be a string, got {type(self.content).__name__}")
        if self.role == "tool" and not self.name:
            raise ValueError("a tool message needs the tool's name, e.g. name='functions.get_weather'")

    @property
    def is_tool_call(self) -> bool:
        return self.role == "assistant" and self.recipient is not None

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Message:
        return cls(**_known_keys(cls, data, "message"))


@dataclass(frozen=True)
class ToolDef:
    """A function tool: `parameters` is a JSON schema (an object), or None for a tool without arguments."""

    name: str
    description: str = ""
    parameters: dict | None = None

    def to_dict(self) -> dict[str, Any]:
        out = {"name": self.name, "description": self.description}
        if self.parameters is not None:
            out["parameters"] = self.parameters
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ToolDef:
        return cls(**_known_keys(cls, data, "tool"))


@dataclass(frozen=True)
class ToolNamespace:
    """A group of tools rendered as `namespace NAME { ... }` (built-in tools such as browser or python)."""

    name: str
    description: str | None = None
    tools: tuple[ToolDef, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "description": self.description, "tools": [t.to_dict() for t in self.tools]}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ToolNamespace:
        data = _known_keys(cls, data, "tool namespace")
        data["tools"] = tuple(ToolDef.from_dict(t) for t in data.get("tools", ()))
        return cls(**data)


@dataclass(frozen=True)
class ResponseFormat:
    """A structured-output schema for the developer message's `# Response Formats` section."""

    name: str
    schema: dict
    description: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "schema": self.schema, "description": self.description}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ResponseFormat:
        return cls(**_known_keys(cls, data, "response format"))


@dataclass(frozen=True)
class SystemConfig:
    """The system message. Built-in tool namespaces are supplied by the caller (no text is bundled)."""

    model_identity: str | None = DEFAULT_IDENTITY
    knowledge_cutoff: str | None = "2024-06"
    current_date: str | None = None
    reasoning_effort: str | None = "medium"
    valid_channels: tuple[str, ...] = DEFAULT_CHANNELS
    channel_required: bool = True
    builtin_tools: tuple[ToolNamespace, ...] = ()

    def __post_init__(self) -> None:
        if self.reasoning_effort is not None and self.reasoning_effort not in REASONING_EFFORTS:
            raise ValueError(f"reasoning effort must be low, medium or high, not {self.reasoning_effort!r}")
        names = [ns.name for ns in self.builtin_tools]
        if len(set(names)) != len(names):
            raise ValueError(f"built-in tool namespaces must have distinct names, got {names}")

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["valid_channels"] = list(self.valid_channels)
        out["builtin_tools"] = [ns.to_dict() for ns in self.builtin_tools]
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SystemConfig:
        data = _known_keys(cls, data, "system config")
        if "valid_channels" in data:
            data["valid_channels"] = tuple(data["valid_channels"])
        data["builtin_tools"] = tuple(ToolNamespace.from_dict(ns) for ns in data.get("builtin_tools", ()))
        return cls(**data)


@dataclass(frozen=True)
class DeveloperConfig:
    """The developer message: instructions (the usual "system prompt"), function tools, response formats."""

    instructions: str | None = None
    tools: tuple[ToolDef, ...] = ()
    response_formats: tuple[ResponseFormat, ...] = ()

    @property
    def is_empty(self) -> bool:
        return self.instructions is None and not self.tools and not self.response_formats

    def to_dict(self) -> dict[str, Any]:
        return {
            "instructions": self.instructions,
            "tools": [t.to_dict() for t in self.tools],
            "response_formats": [r.to_dict() for r in self.response_formats],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DeveloperConfig:
        data = _known_keys(cls, data, "developer config")
        data["tools"] = tuple(ToolDef.from_dict(t) for t in data.get("tools", ()))
        data["response_formats"] = tuple(ResponseFormat.from_dict(r) for r in data.get("response_formats", ()))
        return cls(**data)


@dataclass(frozen=True)
class Conversation:
    """What a chat saves: the system and developer settings plus the messages so far."""

    messages: tuple[Message, ...] = ()
    system: SystemConfig | None = field(default_factory=SystemConfig)
    developer: DeveloperConfig | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "system": None if self.system is None else self.system.to_dict(),
            "developer": None if self.developer is None else self.developer.to_dict(),
            "messages": [m.to_dict() for m in self.messages],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Conversation:
        data = _known_keys(cls, data, "conversation")
        system, developer = data.get("system", {}), data.get("developer")
        return cls(
            messages=tuple(Message.from_dict(m) for m in data.get("messages", ())),
            system=None if system is None else SystemConfig.from_dict(system),
            developer=None if developer is None else DeveloperConfig.from_dict(developer),
        )

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), ensure_ascii=False, indent=1)

    @classmethod
    def from_json(cls, text: str) -> Conversation:
        return cls.from_dict(json.loads(text))


def _known_keys(cls, data: Any, what: str) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise TypeError(f"a {what} must be a JSON object, got {type(data).__name__}")
    allowed = {f.name for f in fields(cls)}
    unknown = set(data) - allowed
    if unknown:
        raise ValueError(f"unknown {what} field(s): {', '.join(sorted(unknown))}")
    return dict(data)
