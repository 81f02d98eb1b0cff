"""Seeded generator of harmony conversations and completions for the comparison tests.

Everything is drawn from `random.Random(seed)`, so a failing seed reproduces. Conversations use
our dataclasses; `to_openai_harmony` maps them field by field onto openai-harmony's classes so the
library can render the same conversation independently.
"""

from __future__ import annotations

import random

from gptoss_cli.runtime.harmony import (
    CONSTRAIN_JSON,
    DEFAULT_IDENTITY,
    Conversation,
    DeveloperConfig,
    Message,
    SystemConfig,
    ToolDef,
    ToolNamespace,
)

WORDS = ["hello", "world", "The", "quick", "brown", "fox", "don't", "I'LL", "they're", "we've", "She'd",
         "naïve", "café", "Straße", "HTTPServer", "snake_case", "x", "a", "re-entry", "e\u0301t\u00e9"]
SCRIPTS = ["你好", "世界", "東京都", "こんにちは", "안녕하세요", "漢字テスト", "مرحبا", "नमस्ते", "Ελληνικά", "ﬁne", "Ǆ"]
EMOJI = ["🎉", "👍🏽", "👨‍👩‍👧", "🇯🇵", "😀😀", "🦀", "∑∫√"]
CODE = ["def f(x):\n    return x**2", "for (int i=0;i<n;++i) {}", '{"a": [1, 2.5, null]}', '<div class="x">',
        "SELECT * FROM t;", "a//b", "x /= 2\n", "```python\nprint('hi')\n```"]
SPACES = ["  ", "\t", "\n", "\n\n", "   \n  ", "\r\n", " \u00a0 ", "\u3000", "    ", "\n\n\n"]
DIGITS = ["12345678", "3.14159", "1,000,000", "0x1F", "2024-06-28", "007", "9" * 13]
MARKUP = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>final", "<|return|>", "<|call|>",
          "<|constrain|>json", "<|endoftext|>", "to=functions.x", "<|reserved_200100|>", "<|endofprompt|>"]
CORPUS_POOLS = (WORDS, SCRIPTS, EMOJI, CODE, SPACES, DIGITS, MARKUP)

PROPERTY_NAMES = ["location", "format", "query", "topn", "id", "ids", "options", "unit", "when", "mode", "x", "deep_nested"]
TOOL_NAMES = ["get_weather", "search", "lookup", "send_email", "compute", "noop", "get_location"]


def random_text(rng: random.Random, max_pieces: int = 8, markup: bool = True) -> str:
    pools = CORPUS_POOLS if markup else CORPUS_POOLS[:-1]
    pieces = [rng.choice(rng.choice(pools)) for _ in range(rng.randint(1, max_pieces))]
    return "".join(p + rng.choice(["", " ", " ", "\n"]) for p in pieces)


def short_text(rng: random.Random) -> str:
    """One-line text (descriptions): words and scripts, sometimes an extra line."""
    text = " ".join(rng.choice(rng.choice((WORDS, SCRIPTS, DIGITS))) for _ in range(rng.randint(1, 6)))
    return text + rng.choice(["", "", "", "\nsecond line", "\r\nwindows line", "\n"])


def random_default(rng: random.Random):
    return rng.choice(
        ["celsius", 'say "hi"', 3, -1, 0.5, 1e-7, 1.5e16, 2.0, 123456.0, True, None, [1, "a"], {"k": [1.25]}]
    )


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    kinds = ["string", "number", "integer", "boolean", "array", "enum", "types", "oneOf", "none"]
    if depth < 2:
        kinds += ["object", "object"]
    kind = rng.choice(kinds)
    if kind == "object":
        return random_object_schema(rng, depth + 1)
    if kind == "enum":
        return {"type": "string", "enum": rng.sample(["a", "b c", "celsius", "fahrenheit", "ünï"], rng.randint(1, 3))}
    if kind == "types":
        return {"type": rng.sample(["number", "string", "integer", "null", "boolean"], rng.randint(1, 3))}
    if kind == "oneOf":
        variants = [_decorate(rng, random_schema(rng, depth + 1), variant=True) for _ in range(rng.randint(1, 3))]
        return {"oneOf": variants}
    if kind == "array":
        return {"type": "array", "items": random_schema(rng, depth + 1)} if rng.random() < 0.7 else {"type": "array"}
    if kind == "none":
        return {"description": short_text(rng)} if rng.random() < 0.5 else {}
    return {"type": kind}


def _decorate(rng: random.Random, schema: dict, variant: bool = False) -> dict:
    if rng.random() < 0.4:
        schema["description"] = short_text(rng)
    if rng.random() < 0.25:
        schema["default"] = random_default(rng)
    if rng.random() < 0.15:
        schema["nullable"] = True
    if not variant and rng.random() < 0.1:
        schema["title"] = rng.choice(WORDS)
    if not variant and rng.random() < 0.1:
        schema["examples"] = rng.choice([["one", "two"], [1, "x"], []])
    return schema


def random_object_schema(rng: random.Random, depth: int = 0) -> dict:
    names = rng.sample(PROPERTY_NAMES, rng.randint(0, 4))
    props = {name: _decorate(rng, random_schema(rng, depth)) for name in names}
    # A oneOf property whose first variant repeats the property description exercises de-duplication.
    if names and rng.random() < 0.2:
        desc = short_text(rng)
        props[names[0]] = {"description": desc, "oneOf": [{"type": "string", "description": desc}, {"type": "number"}]}
    schema = {"type": "object", "properties": props}
    if names:
        schema["required"] = rng.sample(names, rng.randint(0, len(names)))
    if rng.random() < 0.2:
        schema["description"] = short_text(rng)
    return schema


def random_tool(rng: random.Random, name: str) -> ToolDef:
    roll = rng.random()
    params = None if roll < 0.2 else random_object_schema(rng) if roll < 0.85 else random_schema(rng, 1)
    return ToolDef(name, short_text(rng) if rng.random() < 0.9 else "", params)


def random_system(rng: random.Random, builtin: list[ToolNamespace]) -> SystemConfig:
    custom = ToolNamespace("toolbox", short_text(rng) if rng.random() < 0.5 else None,
                           tuple(random_tool(rng, n) for n in rng.sample(TOOL_NAMES, rng.randint(0, 2))))
    pool = [*builtin, custom]
    return SystemConfig(
        model_identity=rng.choice([DEFAULT_IDENTITY, DEFAULT_IDENTITY, None, short_text(rng)]),
        knowledge_cutoff=rng.choice(["2024-06", "2024-06", None, "2023-10"]),
        current_date=rng.choice([None, "2025-06-28", "2026-01-01", "1999-12-31"]),
        reasoning_effort=rng.choice(["low", "medium", "high", None]),
        valid_channels=rng.choice([("analysis", "commentary", "final"), ("analysis", "final"), ()]),
        channel_required=rng.random() < 0.8,
        builtin_tools=tuple(rng.sample(pool, rng.randint(0, len(pool))) if rng.random() < 0.4 else ()),
    )


def random_developer(rng: random.Random) -> DeveloperConfig | None:
    if rng.random() < 0.15:
        return None
    instructions = random_text(rng, 5) if rng.random() < 0.8 else None
    tools = tuple(random_tool(rng, n) for n in rng.sample(TOOL_NAMES, rng.randint(0, 4)))
    if instructions is None and not tools:
        return None
    return DeveloperConfig(instructions, tools)


def tool_call(rng: random.Random, name: str, markup: bool = True) -> list[Message]:
    """An assistant call and the tool's answer (function, browser or python style)."""
    style = rng.choice(["json", "constrain", "constrain", "browser", "python", "plain"])
    args = rng.choice(['{"location": "Tokyo"}', "{}", '{"q": "日本", "n": [1, 2]}', random_text(rng, 3, markup)])
    if style == "browser":
        call = Message("assistant", args, "analysis", "browser.search", CONSTRAIN_JSON)
        return [call, Message("tool", random_text(rng, 4, markup), "analysis", "assistant", name="browser.search")]
    if style == "python":
        call = Message("assistant", "print(1+1)", "analysis", "python", "code")
        return [call, Message("tool", "2\n", "analysis", "assistant", name="python")]
    content_type = {"json": "json", "constrain": CONSTRAIN_JSON, "plain": None}[style]
    call = Message("assistant", args, "commentary", f"functions.{name}", content_type)
    return [call, Message("tool", random_text(rng, 4, markup), "commentary", "assistant", name=f"functions.{name}")]


def assistant_turn(rng: random.Random, finish: bool = True, markup: bool = True) -> list[Message]:
    """What a model emits in one turn: reasoning, preambles, tool-call loops, then a final answer."""
    out = []
    for _ in range(rng.randint(0, 2)):
        if rng.random() < 0.7:
            out.append(Message("assistant", random_text(rng, 8, markup), "analysis"))
        if rng.random() < 0.2:
            out.append(Message("assistant", random_text(rng, 3, markup), "commentary"))
        if rng.random() < 0.1:  # a typed message to nobody: the header ends in a bare content type
            out.append(Message("assistant", '{"plan": 1}', "commentary", None, CONSTRAIN_JSON))
        out += tool_call(rng, rng.choice(TOOL_NAMES), markup)
    if rng.random() < 0.7:
        out.append(Message("assistant", random_text(rng, 8, markup), "analysis"))
    if finish:
        out.append(Message("assistant", random_text(rng, 8, markup), "final"))
    return out


def random_messages(rng: random.Random) -> list[Message]:
    messages = []
    turns = rng.randint(1, 4)
    for turn in range(turns):
        name = "bob" if rng.random() < 0.1 else None
        messages.append(Message("user", random_text(rng), name=name))
        last = turn == turns - 1
        if last and rng.random() < 0.5:
            break  # the usual prompt: the user has just spoken
        messages += assistant_turn(rng, finish=not last or rng.random() < 0.5)
    if rng.random() < 0.05:
        messages.insert(0, Message("developer", random_text(rng, 3)))
    return messages


def random_conversation(seed: int, builtin: list[ToolNamespace] = ()) -> Conversation:
    rng = random.Random(seed)
    system = random_system(rng, list(builtin)) if rng.random() < 0.9 else None
    return Conversation(tuple(random_messages(rng)), system, random_developer(rng))


def random_completion(seed: int, markup: bool = True) -> list[Message]:
    """Assistant messages as one completion, ending in a final answer or a tool call.

    With markup=False no text spells a special token, so any markup in parsed text is a leak.
    """
    rng = random.Random(seed)
    turn = assistant_turn(rng, finish=True, markup=markup)
    if rng.random() < 0.3:
        # Stop at a tool call: everything up to and including the first call.
        calls = [i for i, m in enumerate(turn) if m.is_tool_call]
        if calls:
            turn = turn[: calls[0] + 1]
    return [m for m in turn if m.role == "assistant"]


def to_openai_harmony(conv: Conversation):
    """The same conversation as openai-harmony objects (the independent renderer)."""
    import openai_harmony as oh

    messages = []
    if conv.system is not None:
        messages.append(oh.Message.from_role_and_content(oh.Role.SYSTEM, _oh_system(oh, conv.system)))
    if conv.developer is not None:
        dev = oh.DeveloperContent.new()
        if conv.developer.instructions is not None:
            dev = dev.with_instructions(conv.developer.instructions)
        if conv.developer.tools:
            dev = dev.with_function_tools([_oh_tool(oh, t) for t in conv.developer.tools])
        messages.append(oh.Message.from_role_and_content(oh.Role.DEVELOPER, dev))
    messages += [to_oh_message(m) for m in conv.messages]
    return oh.Conversation.from_messages(messages)


def to_oh_message(m: Message):
    import openai_harmony as oh

    msg = oh.Message.from_author_and_content(oh.Author(role=oh.Role(m.role), name=m.name), m.content)
    msg.channel, msg.recipient, msg.content_type = m.channel, m.recipient, m.content_type
    return msg


def _oh_system(oh, system: SystemConfig):
    efforts = {None: None, "low": oh.ReasoningEffort.LOW, "medium": oh.ReasoningEffort.MEDIUM,
               "high": oh.ReasoningEffort.HIGH}
    content = oh.SystemContent(
        model_identity=system.model_identity,
        reasoning_effort=efforts[system.reasoning_effort],
        conversation_start_date=system.current_date,
        knowledge_cutoff=system.knowledge_cutoff,
        channel_config=oh.ChannelConfig(
            valid_channels=list(system.valid_channels), channel_required=system.channel_required
        ),
    )
    for ns in system.builtin_tools:
        content = content.with_tools(
            oh.ToolNamespaceConfig(name=ns.name, description=ns.description, tools=[_oh_tool(oh, t) for t in ns.tools])
        )
    return content


def _oh_tool(oh, tool: ToolDef):
    return oh.ToolDescription.new(tool.name, tool.description, tool.parameters)


def namespace_from_oh(config) -> ToolNamespace:
    """openai-harmony's built-in tool config (browser, python) as our ToolNamespace."""
    tools = tuple(ToolDef(t.name, t.description, t.parameters) for t in config.tools)
    return ToolNamespace(config.name, config.description, tools)


def mutate(rng: random.Random, ids: list[int], specials: list[int], ordinary: list[int]) -> list[int]:
    """A malformed variant of a token stream: deletions, insertions, truncation, duplication."""
    ids = list(ids)
    for _ in range(rng.randint(1, 3)):
        op = rng.choice(["delete", "insert_special", "insert_text", "truncate", "duplicate"])
        at = rng.randrange(len(ids) + 1)
        if op == "delete" and ids:
            del ids[min(at, len(ids) - 1)]
        elif op == "insert_special":
            ids.insert(at, rng.choice(specials))
        elif op == "insert_text":
            ids[at:at] = rng.sample(ordinary, rng.randint(1, 3))
        elif op == "truncate":
            ids = ids[:at]
        elif op == "duplicate" and ids:
            start = rng.randrange(len(ids))
            ids[at:at] = ids[start : start + rng.randint(1, 5)]
    return ids
