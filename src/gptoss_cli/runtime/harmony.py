"""The harmony chat format of gpt-oss: one import for conversation data, rendering and parsing.

- harmony_types.py   Message, ToolDef, ToolNamespace, ResponseFormat, SystemConfig, DeveloperConfig, Conversation
- harmony_render.py  conversation → prompt ids (token-exact with openai-harmony), analysis dropping
- harmony_schema.py  JSON schema → the TypeScript-like tool signatures
- harmony_parse.py   generated ids → events (streaming) or messages (batch), lenient
- harmony_openai.py  OpenAI-style chat messages and tools → harmony
openai-harmony itself is only a test dependency; nothing here imports it.
"""

from __future__ import annotations

from gptoss_cli.runtime.harmony_openai import conversation_from_openai, from_openai_messages, tool_from_openai
from gptoss_cli.runtime.harmony_parse import (
    Event,
    HarmonyStreamParser,
    MessageEnd,
    MessageStart,
    ParseError,
    TextDelta,
    ToolCall,
    parse_completion,
)
from gptoss_cli.runtime.harmony_render import (
    DEFAULT_SYSTEM,
    developer_text,
    drop_analysis_like_harmony,
    drop_finished_analysis,
    render_conversation,
    render_conversation_prompt,
    render_message,
    render_prompt,
    system_text,
)
from gptoss_cli.runtime.harmony_types import (
    CONSTRAIN_JSON,
    DEFAULT_CHANNELS,
    DEFAULT_IDENTITY,
    REASONING_EFFORTS,
    Conversation,
    DeveloperConfig,
    Message,
    ResponseFormat,
    SystemConfig,
    ToolDef,
    ToolNamespace,
)
from gptoss_cli.runtime.tokenizer import GENERATION_STOP_IDS, MESSAGE_END_IDS, STOP_TOKEN_IDS


__all__ = [
    "CONSTRAIN_JSON",
    "DEFAULT_CHANNELS",
    "DEFAULT_IDENTITY",
    "DEFAULT_SYSTEM",
    "GENERATION_STOP_IDS",
    "MESSAGE_END_IDS",
    "REASONING_EFFORTS",
    "STOP_TOKEN_IDS",
    "Conversation",
    "DeveloperConfig",
    "Event",
    "HarmonyStreamParser",
    "Message",
    "MessageEnd",
    "MessageStart",
    "ParseError",
    "ResponseFormat",
    "SystemConfig",
    "TextDelta",
    "ToolCall",
    "ToolDef",
    "ToolNamespace",
    "conversation_from_openai",
    "developer_text",
    "drop_analysis_like_harmony",
    "drop_finished_analysis",
    "from_openai_messages",
    "parse_completion",
    "render_conversation",
    "render_conversation_prompt",
    "render_message",
    "render_prompt",
    "system_text",
    "tool_from_openai",
]
