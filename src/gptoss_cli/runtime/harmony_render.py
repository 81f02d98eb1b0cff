"""Conversation → prompt token ids in the harmony format, token-exact with openai-harmony.

A message is `<|start|>` header `<|message|>` content terminator. Format tokens are inserted by id;
every piece of text (role, recipient, channel, content) is encoded on its own as ordinary text, the
way the reference renderer does it, so the ids match and typed special-token strings stay text.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence

from gptoss_cli.runtime.harmony_schema import schema_to_typescript
from gptoss_cli.runtime.harmony_types import Conversation, DeveloperConfig, Message, SystemConfig, ToolNamespace
from gptoss_cli.runtime.tokenizer import CALL, CHANNEL, CONSTRAIN, END, MESSAGE, START, Tokenizer

DEFAULT_SYSTEM = SystemConfig()
_CONSTRAIN_TEXT = "<|constrain|>"
_FUNCTIONS_NOTE = "Calls to these tools must go to the commentary channel: 'functions'."


def render_message(tokenizer: Tokenizer, message: Message) -> list[int]:
    """One message, from `<|start|>` to its terminator (`<|call|>` for assistant tool calls, else `<|end|>`)."""
    ids = [START]
    if message.role == "tool":
        ids += tokenizer.encode(message.name)
    else:
        ids += tokenizer.encode(message.role)
        if message.name is not None:
            ids += tokenizer.encode(f":{message.name}")
    if message.recipient is not None and message.recipient != "all":
        ids += tokenizer.encode(f" to={message.recipient}")
    if message.channel is not None:
        ids += [CHANNEL, *tokenizer.encode(message.channel)]
    if message.content_type is not None:
        ids += _content_type_ids(tokenizer, message.content_type)
    ids += [MESSAGE, *tokenizer.encode(message.content)]
    ids.append(CALL if message.role == "assistant" and message.recipient is not None else END)
    return ids


def _content_type_ids(tokenizer: Tokenizer, content_type: str) -> list[int]:
    if content_type.startswith(_CONSTRAIN_TEXT):
        rest = content_type[len(_CONSTRAIN_TEXT) :]
        return [*tokenizer.encode(" "), CONSTRAIN, *(tokenizer.encode(rest) if rest else [])]
    return tokenizer.encode(f" {content_type}")


def render_conversation(
    tokenizer: Tokenizer,
    messages: Sequence[Message],
    system: SystemConfig | None = DEFAULT_SYSTEM,
    developer: DeveloperConfig | None = None,
    *,
    auto_drop_analysis: bool = True,
) -> list[int]:
    """System message, developer message (unless empty), then the messages; no generation prompt.

    auto_drop_analysis reproduces openai-harmony exactly: when the last assistant message is on the
    `final` channel, `analysis` messages before the *first* `final` message are left out. Analysis
    after an earlier final answer is kept; use `drop_finished_analysis` to drop every finished turn's.
    """
    if auto_drop_analysis:
        messages = drop_analysis_like_harmony(messages)
    ids: list[int] = []
    for message in _header_messages(system, developer):
        ids += render_message(tokenizer, message)
    for message in messages:
        ids += render_message(tokenizer, message)
    return ids


def render_prompt(
    tokenizer: Tokenizer,
    messages: Sequence[Message],
    system: SystemConfig | None = DEFAULT_SYSTEM,
    developer: DeveloperConfig | None = None,
    *,
    auto_drop_analysis: bool = True,
    next_role: str = "assistant",
) -> list[int]:
    """The prompt for the next turn: the rendered conversation followed by `<|start|>assistant`."""
    ids = render_conversation(tokenizer, messages, system, developer, auto_drop_analysis=auto_drop_analysis)
    return ids + [START, *tokenizer.encode(next_role)]


def render_conversation_prompt(
    tokenizer: Tokenizer, conversation: Conversation, *, auto_drop_analysis: bool = True
) -> list[int]:
    """`render_prompt` for a saved Conversation."""
    return render_prompt(
        tokenizer,
        conversation.messages,
        conversation.system,
        conversation.developer,
        auto_drop_analysis=auto_drop_analysis,
    )


def drop_analysis_like_harmony(messages: Sequence[Message]) -> list[Message]:
    """openai-harmony's auto_drop_analysis (see render_conversation)."""
    last_assistant = next((m for m in reversed(messages) if m.role == "assistant"), None)
    if last_assistant is None or last_assistant.channel != "final":
        return list(messages)
    first_final = next(i for i, m in enumerate(messages) if m.channel == "final")
    return [m for i, m in enumerate(messages) if not (i < first_final and m.channel == "analysis")]


def drop_finished_analysis(messages: Sequence[Message]) -> list[Message]:
    """The format guide's rule: drop the analysis of every turn that ended with a final answer.

    Analysis after the last `final` assistant message belongs to the turn still in progress (e.g.
    reasoning before a tool call) and is kept, since the model continues from it.
    """
    finals = [i for i, m in enumerate(messages) if m.role == "assistant" and m.channel == "final"]
    last_final = finals[-1] if finals else -1
    return [m for i, m in enumerate(messages) if not (i < last_final and m.channel == "analysis")]


def _header_messages(system: SystemConfig | None, developer: DeveloperConfig | None) -> list[Message]:
    out = []
    has_functions = developer is not None and bool(developer.tools)
    if system is not None:
        out.append(Message("system", system_text(system, has_functions)))
    if developer is not None and not developer.is_empty:
        out.append(Message("developer", developer_text(developer)))
    return out


def system_text(system: SystemConfig, has_function_tools: bool = False) -> str:
    """The system message's content: identity and dates, reasoning, built-in tools, channels."""
    top = [system.model_identity] if system.model_identity is not None else []
    if system.knowledge_cutoff is not None:
        top.append(f"Knowledge cutoff: {system.knowledge_cutoff}")
    if system.current_date is not None:
        top.append(f"Current date: {system.current_date}")
    sections = ["\n".join(top)] if top else []
    if system.reasoning_effort is not None:
        sections.append(f"Reasoning: {system.reasoning_effort}")
    if system.builtin_tools:
        sections.append(tools_section(system.builtin_tools))
    if system.valid_channels:
        channels = f"# Valid channels: {', '.join(system.valid_channels)}."
        if system.channel_required:
            channels += " Channel must be included for every message."
        if has_function_tools:
            channels += "\n" + _FUNCTIONS_NOTE
        sections.append(channels)
    return "\n\n".join(sections)


def developer_text(developer: DeveloperConfig) -> str:
    """The developer message's content: instructions, function tools, response formats."""
    sections = []
    if developer.instructions is not None:
        sections += ["# Instructions", developer.instructions]
    if developer.tools:
        sections.append(tools_section([ToolNamespace("functions", None, developer.tools)]))
    if developer.response_formats:
        sections.append("# Response Formats")
        for fmt in developer.response_formats:
            comment = "".join(f"// {line}\n" for line in rust_lines(fmt.description or ""))
            schema = json.dumps(fmt.schema, ensure_ascii=False, separators=(",", ":"))
            sections.append(f"## {fmt.name}\n\n{comment}{schema}")
    return "\n\n".join(sections)


def tools_section(namespaces: Iterable[ToolNamespace]) -> str:
    """`# Tools` with one `## name` block per namespace, in name order (as the reference sorts them)."""
    blocks = ["# Tools"]
    for ns in sorted(namespaces, key=lambda ns: ns.name):
        blocks.append("\n".join(_namespace_lines(ns)))
    return "\n\n".join(blocks)


def _namespace_lines(ns: ToolNamespace) -> list[str]:
    lines = [f"## {ns.name}\n"]
    for line in rust_lines(ns.description or ""):
        # A namespace with tools carries its description as comments; a bare one as prose.
        lines.append(f"// {line}" if ns.tools else line)
    if not ns.tools:
        return lines
    lines.append(f"namespace {ns.name} {{\n")
    for tool in ns.tools:
        lines += [f"// {line}" for line in rust_lines(tool.description)]
        if tool.parameters is None:
            lines.append(f"type {tool.name} = () => any;\n")
        else:
            lines.append(f"type {tool.name} = (_: {schema_to_typescript(tool.parameters)}) => any;\n")
    lines.append(f"}} // namespace {ns.name}")
    return lines


def rust_lines(text: str) -> list[str]:
    """Split like Rust's `str::lines`: on \\n only, one trailing \\r dropped, no empty last line."""
    if not text:
        return []
    pieces = text.split("\n")
    if pieces[-1] == "":
        pieces.pop()
    return [p[:-1] if p.endswith("\r") else p for p in pieces]
