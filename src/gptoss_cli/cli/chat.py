"""`gptoss chat`: flags → a chat session, then one answer (one-shot) or the interactive chat.

    gptoss chat                          interactive chat with the default model
    gptoss chat 20b "question"           one answer, then exit (the first word names the model when it
                                         is 20b, 120b, random:NAME or a checkpoint dir and -m is not given)
    cat notes.txt | gptoss chat "sum up" stdin is put before the prompt (ollama semantics)
    gptoss chat -i "question"            answer, then stay in the chat
    gptoss chat --continue               resume the latest autosaved conversation

One-shot output: the answer on stdout; reasoning, tool calls and the stats line on stderr.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from . import errors
from .app import app
from .errors import UsageError
from .options import (
    DEFAULT_EFFORT,
    REASONING_MODES,
    ContextOpt,
    EffortOpt,
    MaxTokensOpt,
    MinPOpt,
    ModelOpt,
    RepetitionPenaltyOpt,
    SeedOpt,
    StopOpt,
    TemperatureOpt,
    TopKOpt,
    TopPOpt,
    check_stop,
    complete_choices,
    flag_message,
    option_typed,
)

# Flags that map 1:1 onto ChatSettings fields (so explicit ones can override a resumed chat's).
_SETTING_FLAGS = ("effort", "developer", "reasoning", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                  "seed", "max_tokens", "stop", "json_schema", "truncate", "raw", "stats")


@app.command(no_args_is_help=False)
def chat(
    ctx: typer.Context,
    prompt: Annotated[list[str] | None, typer.Argument(
        help="The message (one-shot). If the first word is 20b, 120b, random:NAME or a checkpoint directory "
             "and --model is not given, it names the model.", show_default=False)] = None,
    model: ModelOpt = None,
    interactive: Annotated[bool, typer.Option(
        "--interactive", "-i", help="Stay in the chat after answering the prompt (stdin is then not read).")] = False,
    effort: EffortOpt = DEFAULT_EFFORT,
    developer: Annotated[str | None, typer.Option(
        "--developer", "-s", help="Developer instructions (the system prompt): TEXT, or @FILE to read them.",
        show_default=False)] = None,
    reasoning: Annotated[str, typer.Option(
        autocompletion=complete_choices(REASONING_MODES),
        help="Reasoning display: show, collapse (folded to one line on a terminal) or hide.")] = "collapse",
    temperature: TemperatureOpt = 1.0,
    top_p: TopPOpt = 1.0,
    top_k: TopKOpt = 0,
    min_p: MinPOpt = 0.0,
    repetition_penalty: RepetitionPenaltyOpt = 1.0,
    seed: SeedOpt = None,
    max_tokens: MaxTokensOpt = None,
    stop: StopOpt = None,
    json_schema: Annotated[str | None, typer.Option(
        "--json-schema", help="Ask for answers in JSON following this JSON Schema file (a harmony response format); "
                              "a one-shot answer that is not valid exits 1.", show_default=False)] = None,
    context: ContextOpt = None,
    truncate: Annotated[str, typer.Option(
        help="When the conversation outgrows the context: none (refuse) or oldest (drop the oldest exchanges).")
    ] = "none",
    raw: Annotated[bool, typer.Option("--raw", help="Show the raw harmony tokens while streaming.")] = False,
    stats: Annotated[bool, typer.Option("--stats/--no-stats", help="Print a stats line after each reply.")] = True,
    resume_latest: Annotated[bool, typer.Option(
        "--continue", help="Resume the latest autosaved conversation.")] = False,
    resume: Annotated[str | None, typer.Option(
        "--resume", help="Resume a saved conversation: its id or a .json path.", show_default=False)] = None,
    no_history: Annotated[bool, typer.Option(
        "--no-history", help="Keep no input history and do not autosave (also GPTOSS_NO_HISTORY=1).")] = False,
) -> int:
    """Chat with gpt-oss: interactive, or one answer for a prompt given as arguments or on stdin.

    Examples: [bold]gptoss chat[/] · [bold]gptoss chat 20b "question"[/] · [bold]gptoss chat --continue[/]
    · [bold]cat notes.txt | gptoss chat "sum up"[/] (stdin goes first). In the chat, /help lists the commands.
    """
    from .chat_render import ChatRenderer
    from .chat_session import ChatSession, ChatSettings
    from .chat_store import ChatStore, history_disabled, history_path
    from .json_answer import read_schema, schema_checker_available
    from .models import load_model

    ui = ctx.obj
    model, words = split_model_argument(ctx, model, list(prompt or []))
    schema = read_schema(json_schema) if json_schema is not None else None
    try:
        settings = ChatSettings(effort=effort, developer=read_developer(developer),
                                reasoning=reasoning, temperature=temperature, top_p=top_p, top_k=top_k,
                                min_p=min_p, repetition_penalty=repetition_penalty, seed=seed,
                                max_tokens=max_tokens, stop=check_stop(stop),
                                truncate=truncate, raw=raw, stats=stats, json_schema=schema)
    except ValueError as e:
        raise UsageError(flag_message(str(e)), "see gptoss chat --help") from None
    if resume_latest and resume:
        raise UsageError("--continue and --resume cannot be combined", "use one of them")
    text = prompt_text(words, read_stdin=not interactive)
    if text is None and not interactive and not sys.stdin.isatty():
        raise UsageError("nothing to ask: stdin is not a terminal and no prompt was given",
                         'pass a prompt (gptoss chat "question"), pipe one in, or run in a terminal')
    stay = interactive or text is None
    run_repl = _repl() if stay else None  # before the slow model load: fail fast without prompt_toolkit
    no_store = history_disabled(no_history)

    loaded = load_model(ui, model, max_context=context, max_batch=1)
    store = None if no_store else ChatStore()
    session = ChatSession(loaded.engine, loaded.tokenizer, loaded.name, settings, store)
    if resume_latest or resume:
        _resume(ctx, ui, session, store or ChatStore(), resume, settings)
    renderer = ChatRenderer(ui, session)
    if session.settings.json_schema is not None and not schema_checker_available():
        ui.note("--json-schema: answers are checked for JSON syntax only (pip install jsonschema to check the schema)")

    if text is not None:
        result = renderer.run_turn(text)
        if result is None and not stay:
            return errors.INTERRUPTED
        if result is not None and result.json_problem is not None and not stay:
            return errors.ERROR
    if run_repl is None:
        return errors.OK
    return run_repl(ui, session, renderer, None if no_store else history_path())


def _repl():
    """The interactive loop; prompt_toolkit is needed only here."""
    try:
        from .chat_repl import run_repl
    except ImportError as e:
        from ..runtime.errors import GptossError

        raise GptossError(f"the interactive chat needs prompt_toolkit ({e})",
                          'pip install prompt_toolkit, or ask one question: gptoss chat "question"') from None
    return run_repl


def split_model_argument(ctx: typer.Context, model: str | None, words: list[str]) -> tuple[str | None, list[str]]:
    """`gptoss chat 20b "q"`: the first word is the model when -m was not typed and it names one."""
    from_flag = model is not None and option_typed(ctx, "model")
    if words and not from_flag and looks_like_model(words[0]):
        return words[0], words[1:]
    return model, words


def looks_like_model(word: str) -> bool:
    from .models import ALIASES

    if word in ALIASES or word.startswith("random:"):
        return True
    try:
        path = Path(word).expanduser()
        return path.is_dir() and (path / "config.json").is_file()
    except (OSError, ValueError):  # a long or odd prompt word is not a path
        return False


def read_developer(value: str | None) -> str | None:
    """--developer TEXT, or @FILE for the file's contents."""
    if value is None or not value.startswith("@"):
        return value
    from .text_files import TextFileError, read_text_file

    try:
        return read_text_file(value[1:]).strip() or None
    except TextFileError as e:
        raise UsageError(f"cannot read developer instructions from {value[1:]}: {e}",
                         "--developer takes TEXT or @FILE") from None


def prompt_text(words: list[str], read_stdin: bool) -> str | None:
    """Arguments joined by spaces, with piped stdin first (ollama semantics); None when empty."""
    parts = []
    if read_stdin and not sys.stdin.isatty():
        piped = sys.stdin.read()
        if piped.strip():
            parts.append(piped.rstrip())
    if words:
        parts.append(" ".join(words))
    text = "\n\n".join(parts)
    return text if text.strip() else None


def _resume(ctx: typer.Context, ui, session, store, ref: str | None, flags) -> None:
    """Load a saved conversation; settings typed on this command line win over the saved ones."""
    from dataclasses import replace

    from ..runtime.errors import GptossError

    path = store.resolve(ref) if ref else store.latest()
    if path is None:
        raise GptossError("there is no saved conversation to continue",
                          f"conversations are autosaved in {store.root}; start one with `gptoss chat`")
    session.load(path)
    explicit = {name: getattr(flags, name) for name in _SETTING_FLAGS if option_typed(ctx, name, env=True)}
    session.settings = replace(session.settings, **explicit)
    exchanges = sum(1 for m in session.messages if m.role == "user")
    ui.note(f"continuing {path.stem} ({exchanges} exchange(s))")
