"""The interactive chat: a prompt_toolkit prompt (multiline, history, completion, toolbar) and the
slash commands. Imported only when a chat is interactive, so one-shot chat runs without prompt_toolkit.

Keys: Enter sends; Alt+Enter (or Esc then Enter) inserts a newline; text opened with \"\"\" continues
until the closing \"\"\"; pasted text keeps its newlines. Ctrl+C stops a reply (the conversation is
kept; also when pressed right after Enter, see chat_keys.py), clears a typed line, and on an empty prompt prints how to quit (twice in a row: quit, 130).
Ctrl+D on an empty prompt quits. Ctrl+G opens the typed text in $VISUAL / $EDITOR (as /edit does).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from prompt_toolkit import PromptSession
from prompt_toolkit.completion import Completer, Completion, PathCompleter
from prompt_toolkit.document import Document
from prompt_toolkit.history import FileHistory, History, InMemoryHistory
from prompt_toolkit.key_binding import KeyBindings
from prompt_toolkit.output import ColorDepth

from ..runtime.errors import GptossError
from . import errors
from .chat_keys import interrupt_pending
from .chat_render import ChatRenderer, context_text, model_text, settings_text, stops_text, toolbar_text
from .chat_session import SETTABLE, ChatSession, check_choice
from .chat_store import ChatStore, make_private_dir, touch_private
from .console import Ui
from .options import EFFORTS, REASONING_MODES
from .text_files import TextFileError, read_text_file

BLOCK = '"""'
EXIT = "exit"  # what a command returns to end the chat


@dataclass(frozen=True)
class Send:
    """A command asked to send this text as the next user message (/retry)."""

    text: str


@dataclass(frozen=True)
class Command:
    handler: Callable[[ChatSession, ChatRenderer, str], object]
    usage: str
    help: str
    choices: tuple[str, ...] = ()  # completions for the first argument


# ---- slash commands ------------------------------------------------------------------------------

def _help(session: ChatSession, out: ChatRenderer, arg: str) -> None:
    lines = [f"{c.usage:<34} {c.help}" for c in COMMANDS.values()]
    lines += ["", "Enter sends · Alt+Enter or Esc Enter: new line · \"\"\" … \"\"\" for a multi-line message · "
              "Ctrl+G: $EDITOR",
              "Ctrl+C stops a reply · Ctrl+D or /exit quits · Tab completes commands"]
    out.show("\n".join(lines))


def _set(session: ChatSession, out: ChatRenderer, arg: str) -> None:
    name, _, value = arg.strip().partition(" ")
    if not name:
        out.show(settings_text(session))
        return
    if name in ("effort", "reasoning"):
        COMMANDS[f"/{name}"].handler(session, out, value)
        return
    if not value.strip():
        out.ui.error(f"/set {name} needs a value", f"e.g. /set {name} {_example(name)}")
        return
    try:
        session.set_value(name, value.strip())
    except ValueError as e:
        out.ui.error(str(e), f"usage: /set {{{','.join(SETTABLE)}}} VALUE")
        return
    shown = getattr(session.settings, name)
    out.note(f"{name} = {stops_text(shown) if name == 'stop' else 'default' if shown is None else shown}")


def _example(name: str) -> str:
    return {"temperature": "0.7", "top_p": "0.95", "top_k": "40", "min_p": "0.05", "repetition_penalty": "1.1",
            "seed": "42", "max_tokens": "2048", "stop": "\\n\\n", "context": "8192"}.get(name, "VALUE")


def _effort(session: ChatSession, out: ChatRenderer, arg: str) -> None:
    _choose(session, out, "effort", arg, EFFORTS,
            "the next reply re-reads the conversation (the system message changed)")


def _reasoning(session: ChatSession, out: ChatRenderer, arg: str) -> None:
    _choose(session, out, "reasoning", arg, REASONING_MODES, "")


def _choose(session: ChatSession, out: ChatRenderer, name: str, arg: str, choices: tuple[str, ...],
            after: str) -> None:
    value = arg.strip()
    if not value:
        out.show(f"{name}: {getattr(session.settings, name)} (one of {', '.join(choices)})")
        return
    try:
        check_choice(name, value, choices)
    except ValueError as e:
        out.ui.error(str(e))
        return
    session.settings = replace(session.settings, **{name: value})
    out.note(f"{name} = {value}" + (f"; {after}" if after else ""))


def _developer(session: ChatSession, out: ChatRenderer, arg: str) -> None:
    text = unwrap_block(arg.strip())
    if not text:
        current = session.settings.developer
        out.show(current if current else "(no developer instructions; /developer TEXT sets them)")
        return
    if text.lower() in ("off", "none", "clear"):
        session.settings = replace(session.settings, developer=None)
        out.note("developer instructions removed")
        return
    session.settings = replace(session.settings, developer=text)
    out.note("developer instructions set; the next reply re-reads the conversation")


def _show(session: ChatSession, out: ChatRenderer, arg: str) -> None:
    what = arg.strip() or "settings"
    views = {"settings": settings_text, "prompt": ChatSession.prompt_text, "context": context_text,
             "model": model_text}
    if what not in views:
        out.ui.error(f"/show {what}: one of {', '.join(views)}")
        return
    out.show(views[what](session))


def _switch(name: str) -> Callable[[ChatSession, ChatRenderer, str], None]:
    def handler(session: ChatSession, out: ChatRenderer, arg: str) -> None:
        value = arg.strip().lower()
        if value not in ("on", "off", ""):
            out.ui.error(f"/{name} takes on or off")
            return
        new = (not getattr(session.settings, name)) if not value else value == "on"
        session.settings = replace(session.settings, **{name: new})
        out.note(f"{name} {'on' if new else 'off'}")
    return handler


WITH_REASONING = "--with-reasoning"


def _save(session: ChatSession, out: ChatRenderer, arg: str) -> None:
    words = arg.split(" ")  # not split(): a path may hold runs of spaces
    reasoning = WITH_REASONING in words
    target = " ".join(word for word in words if word != WITH_REASONING).strip()
    if reasoning and not target.lower().endswith(".md"):
        out.ui.error(f"{WITH_REASONING} is for Markdown transcripts", "e.g. /save chat.md --with-reasoning "
                     "(a .json file always keeps the reasoning)")
        return
    try:
        if target:
            path = Path(target)
        else:
            path = (session.store or ChatStore()).path_for(session.conversation_id)
            make_private_dir(path.parent)
        saved = session.save(path, reasoning)
    except OSError as e:
        out.ui.error(f"cannot save to {target or 'the conversations folder'}: {e.strerror or e}")
        return
    out.note(f"saved to {saved}")


def _load(session: ChatSession, out: ChatRenderer, arg: str) -> None:
    target = arg.strip()
    if not target:
        out.ui.error("/load needs a file", "e.g. /load chat.json (a file written by /save)")
        return
    try:
        session.load((session.store or ChatStore()).resolve(target))
    except GptossError as e:
        out.ui.error(str(e), e.hint)
        return
    exchanges = sum(1 for m in session.messages if m.role == "user")
    out.note(f"loaded {exchanges} exchange(s) from {target}")


def _clear(session: ChatSession, out: ChatRenderer, arg: str) -> None:
    session.clear()
    out.note("started a new conversation (settings kept)")


def _retry(session: ChatSession, out: ChatRenderer, arg: str) -> Send | None:
    text = session.pop_for_retry()
    if text is None:
        out.note("nothing to retry yet")
        return None
    out.note(f"retrying: {_first_line(text)}")
    return Send(text)


def _read(session: ChatSession, out: ChatRenderer, arg: str) -> Send | None:
    """/read PATH [TEXT]: send the file's text, then TEXT after a blank line (as piped stdin goes first)."""
    target, _, question = arg.strip().partition(" ")
    if not target:
        out.ui.error("/read needs a file", "e.g. /read notes.txt sum this up")
        return None
    try:
        text = read_text_file(target)
    except TextFileError as e:
        out.ui.error(f"/read {target}: {e}", "give the path of a readable UTF-8 text file")
        return None
    message = "\n\n".join(p for p in (text.strip("\n"), question.strip()) if p)
    if not message.strip():
        out.ui.error(f"/read {target}: the file is empty", "give a file with some text")
        return None
    out.note(f"read {target} ({len(text):,} characters)")
    return Send(message)


def _edit(session: ChatSession, out: ChatRenderer, arg: str) -> Send | None:
    """/edit: write the message in $VISUAL or $EDITOR (a temporary file); it is sent when saved non-empty."""
    text, problem = edit_text(arg)
    if problem is not None:
        out.ui.error(problem, "set $EDITOR (e.g. export EDITOR=nano), or type the message with \"\"\" … \"\"\"")
        return None
    text = text.strip("\n")
    if not text.strip():
        out.note("empty message: nothing sent")
        return None
    return Send(text)


def edit_text(initial: str) -> tuple[str, str | None]:
    """(text, None) after editing `initial` in the user's editor, or ("", why it could not run)."""
    import os
    import shlex
    import subprocess
    import tempfile

    editor = os.environ.get("VISUAL") or os.environ.get("EDITOR")
    if not editor:
        return "", "no editor: $VISUAL and $EDITOR are not set"
    fd, name = tempfile.mkstemp(prefix="gptoss-", suffix=".md")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(initial)
        try:
            code = subprocess.call([*shlex.split(editor), name])
        except OSError as e:
            return "", f"cannot start the editor {editor!r}: {e.strerror or e}"
        if code != 0:
            return "", f"the editor {editor!r} exited with status {code}: nothing sent"
        with open(name, encoding="utf-8", errors="replace") as f:
            return f.read(), None
    finally:
        os.unlink(name)


def _undo(session: ChatSession, out: ChatRenderer, arg: str) -> None:
    text = session.undo()
    if text is None:
        out.note("nothing to undo")
        return
    for warning in session.autosave():
        out.ui.warn(warning)
    out.note(f"removed the last exchange: {_first_line(text)}")


def _exit(session: ChatSession, out: ChatRenderer, arg: str) -> str:
    return EXIT


COMMANDS: dict[str, Command] = {
    "/help": Command(_help, "/help", "this list"),
    "/set": Command(_set, "/set NAME VALUE", "temperature, top_p, top_k, min_p, repetition_penalty, seed, "
                    "max_tokens, stop (adds one; none clears), context",
                    SETTABLE + ("effort", "reasoning")),
    "/effort": Command(_effort, "/effort low|medium|high", "reasoning effort", EFFORTS),
    "/reasoning": Command(_reasoning, "/reasoning show|collapse|hide", "how reasoning is displayed", REASONING_MODES),
    "/developer": Command(_developer, '/developer TEXT|"""…"""|off', "developer instructions (system prompt)",
                          ("off",)),
    "/show": Command(_show, "/show settings|prompt|context|model", "inspect the chat",
                     ("settings", "prompt", "context", "model")),
    "/stats": Command(_switch("stats"), "/stats on|off", "the per-turn stats line", ("on", "off")),
    "/raw": Command(_switch("raw"), "/raw on|off", "show raw harmony tokens while streaming", ("on", "off")),
    "/save": Command(_save, "/save [PATH.json|PATH.md [--with-reasoning]]",
                     "save the conversation (.md: transcript, reasoning only with --with-reasoning)"),
    "/load": Command(_load, "/load PATH.json|ID", "resume a saved conversation"),
    "/clear": Command(_clear, "/clear", "start a new conversation"),
    "/read": Command(_read, "/read PATH [TEXT]", "send a text file (then TEXT) as the message"),
    "/edit": Command(_edit, "/edit [TEXT]", "write the message in $EDITOR (also Ctrl+G at the prompt)"),
    "/retry": Command(_retry, "/retry", "regenerate the last reply (alias /regen)"),
    "/undo": Command(_undo, "/undo", "remove the last exchange"),
    "/exit": Command(_exit, "/exit", "quit (aliases /bye, /quit; or Ctrl+D)"),
}
ALIASES = {"/regen": "/retry", "/bye": "/exit", "/quit": "/exit", "/system": "/developer", "/?": "/help"}


def handle_line(line: str, session: ChatSession, out: ChatRenderer) -> object:
    """One submitted line: a slash command's outcome (EXIT, Send or None), or Send for a message."""
    if not line.startswith("/"):
        text = unwrap_block(line).strip()
        return Send(text) if text else None
    name, _, arg = line.partition(" ")
    if "\n" in name:
        name, _, rest = name.partition("\n")
        arg = rest + (" " + arg if arg else "")
    command = COMMANDS.get(ALIASES.get(name, name))
    if command is None:
        out.ui.warn(f"unknown command {name}; /help lists the commands (start with a space to send it as text)")
        return None
    return command.handler(session, out, arg)


def needs_more(text: str) -> bool:
    """An open \"\"\" block: Enter adds a line instead of sending."""
    return text.count(BLOCK) % 2 == 1


def unwrap_block(text: str) -> str:
    """\"\"\"text\"\"\" -> text (one newline after the opening and before the closing quotes dropped)."""
    stripped = text.strip()
    if len(stripped) >= 6 and stripped.startswith(BLOCK) and stripped.endswith(BLOCK):
        inner = stripped[3:-3]
        return inner.removeprefix("\n").removesuffix("\n")
    return text


def _first_line(text: str, width: int = 60) -> str:
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line if len(line) <= width else line[: width - 1] + "…"


# ---- prompt_toolkit ------------------------------------------------------------------------------

class SlashCompleter(Completer):
    """Commands after a leading '/', their first argument, and file paths for /save and /load."""

    def __init__(self) -> None:
        self._paths = PathCompleter(expanduser=True)

    def get_completions(self, document, complete_event):
        text = document.text_before_cursor
        if not text.startswith("/") or "\n" in text:
            return
        if " " not in text:
            for name in list(COMMANDS) + list(ALIASES):
                if name.startswith(text):
                    yield Completion(name, -len(text), display_meta=COMMANDS[ALIASES.get(name, name)].help)
            return
        name, _, arg = text.partition(" ")
        name = ALIASES.get(name, name)
        if name in ("/save", "/load", "/read"):
            yield from self._paths.get_completions(Document(arg, len(arg)), complete_event)
        elif name in COMMANDS and " " not in arg:
            for choice in COMMANDS[name].choices:
                if choice.startswith(arg):
                    yield Completion(choice, -len(arg))


def key_bindings() -> KeyBindings:
    kb = KeyBindings()

    @kb.add("enter")
    def _enter(event) -> None:
        buf = event.current_buffer
        state = buf.complete_state
        if state is not None and state.current_completion is not None:
            buf.apply_completion(state.current_completion)
        elif needs_more(buf.text):
            buf.insert_text("\n")
        else:
            buf.validate_and_handle()

    @kb.add("escape", "enter")
    def _newline(event) -> None:
        event.current_buffer.insert_text("\n")

    @kb.add("c-g")
    def _editor(event) -> None:
        # prompt_toolkit runs $VISUAL / $EDITOR on the typed text and puts the result back.
        event.current_buffer.open_in_editor(validate_and_handle=False)

    @kb.add("c-c")
    def _interrupt(event) -> None:
        if event.current_buffer.text:
            event.current_buffer.reset()  # like a shell: drop the typed line, stay at the prompt
        else:
            event.app.exit(exception=KeyboardInterrupt, style="class:aborting")

    return kb


def make_history(path: Path | None) -> History:
    """Input history in the XDG state dir (mode 0600), or only in memory."""
    if path is None:
        return InMemoryHistory()
    try:
        return FileHistory(str(touch_private(path)))
    except OSError:
        return InMemoryHistory()


def make_prompt_session(session: ChatSession, ui: Ui, history: History, context_used: Callable[[], int]):
    kwargs = {}
    if ui.err.no_color or ui.err.color_system is None:
        kwargs["color_depth"] = ColorDepth.DEPTH_1_BIT
    if not sys.stdout.isatty() and sys.stderr.isatty():
        from prompt_toolkit.output import create_output

        kwargs["output"] = create_output(stdout=sys.stderr)  # keep stdout for answers only
    return PromptSession(
        multiline=True,
        key_bindings=key_bindings(),
        history=history,
        completer=SlashCompleter(),
        complete_while_typing=True,
        bottom_toolbar=lambda: toolbar_text(session, context_used()),
        prompt_continuation=lambda width, line_number, wrap_count: "... ".rjust(width),
        enable_history_search=False,
        **kwargs,
    )


def run_repl(ui: Ui, session: ChatSession, renderer: ChatRenderer, history_file: Path | None) -> int:
    """Read, run, repeat; returns the exit code."""
    used = [session.context_used()]
    prompt = make_prompt_session(session, ui, make_history(history_file), lambda: used[0])
    ui.note(f"{session.model_name} · effort {session.settings.effort} · /help for commands, Ctrl+D to quit")
    idle_interrupts = 0
    while True:
        try:
            line = prompt.prompt(">>> ")
        except KeyboardInterrupt:
            idle_interrupts += 1
            if idle_interrupts >= 2:
                return errors.INTERRUPTED
            ui.note("Use /exit or Ctrl+D to quit (Ctrl+C again to force quit)")
            continue
        except EOFError:
            return errors.OK
        idle_interrupts = 0
        unsent = None  # a message between Enter and its turn: kept for /retry if Ctrl+C lands there
        try:
            outcome = handle_line(line, session, renderer)
            if outcome == EXIT:
                return errors.OK
            if isinstance(outcome, Send):
                unsent = outcome.text
                if interrupt_pending(prompt.app.input):
                    # Ctrl+C right after Enter, before the terminal raised it as SIGINT (chat_keys.py)
                    session.retry_text = unsent
                    renderer.interrupted()
                else:
                    send(renderer, outcome.text)  # from here on the turn keeps the message itself
                unsent = None
            used[0] = session.context_used()
        except KeyboardInterrupt:  # Ctrl+C during a slow command, or as SIGINT before the turn began
            if unsent is not None:
                session.retry_text = unsent
            renderer.interrupted()


def send(renderer: ChatRenderer, text: str) -> None:
    """One turn in the REPL: errors and Ctrl+C are reported, the chat goes on."""
    try:
        renderer.run_turn(text)
    except GptossError as e:
        renderer.ui.error(str(e), e.hint)
