"""`gptoss chat`: session logic on a scripted fake engine (harmony streams, tool calls, malformed
output, Ctrl+C, context budget, save/load), the slash commands through prompt_toolkit pipe input,
flag routing through the real entry point, and a few end-to-end runs on random:tiny."""

from __future__ import annotations

import io
import json
import os
import re
import stat
import time

import pytest
from rich.console import Console

from cli_helpers import run_cli
from gptoss_cli.cli import models as cli_models
from gptoss_cli.cli.chat_render import ChatRenderer, stats_line
from gptoss_cli.cli.chat_store import ChatStore
from gptoss_cli.cli.chat_session import (
    ChatSession,
    ChatSettings,
    RawToken,
    TurnDone,
    TurnStats,
    human_tokens,
    parse_setting,
)
from gptoss_cli.cli.console import Ui
from gptoss_cli.cli.models import LoadedModel
from gptoss_cli.runtime.api import Engine, RequestOutput, RequestTimings
from gptoss_cli.runtime.config import ModelConfig
from gptoss_cli.runtime.errors import RequestError
from gptoss_cli.runtime.harmony import Message, MessageStart, SystemConfig, TextDelta, ToolCall, render_prompt
from gptoss_cli.runtime.tokenizer import Tokenizer, load_o200k_base_ranks

pytestmark = pytest.mark.timeout(120)
ANSI = re.compile(r"\x1b\[")
SPECIAL = re.compile(r"(<\|[a-z_]+\|>)")
ESCAPES = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\r")


def plain(text: str) -> str:
    return ESCAPES.sub("", text)


# ---- fixtures and the scripted engine ------------------------------------------------------------

@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_ranks(load_o200k_base_ranks())


@pytest.fixture(autouse=True)
def _private_dirs(tmp_path, monkeypatch):
    """Never touch the real home: history and autosaves go to the test's tmp dir."""
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    monkeypatch.delenv("GPTOSS_NO_HISTORY", raising=False)
    monkeypatch.delenv("GPTOSS_MODEL", raising=False)


def ids(tok: Tokenizer, text: str) -> list[int]:
    """Harmony text with special tokens written by name -> token ids."""
    out: list[int] = []
    for piece in SPECIAL.split(text):
        if piece:
            out += [tok.encode_special(piece)] if SPECIAL.fullmatch(piece) else tok.encode(piece)
    return out


def reply(tok, analysis: str | None, final: str) -> list[int]:
    text = f"<|channel|>analysis<|message|>{analysis}<|end|><|start|>assistant" if analysis is not None else ""
    return ids(tok, text + f"<|channel|>final<|message|>{final}<|return|>")


class ScriptEngine(Engine):
    """Engine API over fixed token scripts (one per request, the last one repeats). Reports the
    prefix it could reuse like a prefix cache would: the longest common prefix with any earlier
    prompt + output. `interrupt_at` raises KeyboardInterrupt once, at that output index (Ctrl+C)."""

    def __init__(self, scripts: list[list[int]], max_context: int = 4096, interrupt_at: int | None = None):
        super().__init__()
        self.config = ModelConfig()
        self.max_context = max_context
        self.scripts = [list(s) for s in scripts]
        self.interrupt_at = interrupt_at
        self.prompts: list[list[int]] = []
        self.params = []
        self.aborted: list[str] = []
        self.seen: list[list[int]] = []
        self.active = None

    def _admit(self, request_id, prompt, params, seed):
        script = self.scripts.pop(0) if len(self.scripts) > 1 else list(self.scripts[0])
        reuse = max((_common(s, prompt) for s in self.seen), default=0)
        out = RequestOutput(request_id, prompt, cached_prompt_tokens=min(reuse, len(prompt) - 1),
                            timings=RequestTimings(time.perf_counter()))
        self.prompts.append(prompt)
        self.params.append(params)
        self.active = (out, script, self.max_new_tokens(len(prompt), params))
        return out

    def step(self):
        from gptoss_cli.runtime.api import TokenEvent

        out, script, max_new = self.active
        index = len(out.token_ids)
        if index == self.interrupt_at:
            self.interrupt_at = None  # one Ctrl+C
            raise KeyboardInterrupt
        token = script[index] if index < len(script) else tok_filler()
        now = time.perf_counter()
        out.token_ids.append(token)
        out.timings.first_token = out.timings.first_token or now
        reason = "stop" if token in (200002, 200012) else "length" if len(out.token_ids) >= max_new else None
        if reason is None:
            return [TokenEvent(out.request_id, token, index, now)]
        out.finish_reason, out.timings.finished = reason, now
        self.seen.append(out.prompt_token_ids + out.token_ids)
        self.active = None
        return [TokenEvent(out.request_id, token, index, now, reason, out)]

    def abort(self, request_id):
        if self.active and self.active[0].request_id == request_id:
            out = self.active[0]
            self.aborted.append(request_id)
            self.active = None
            out.finish_reason, out.timings.finished = "abort", time.perf_counter()
            self.seen.append(out.prompt_token_ids + out.token_ids)
            return out
        return None

    def has_unfinished(self):
        return self.active is not None


def tok_filler() -> int:
    return 1000  # an ordinary text token


def _common(a, b) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def make_ui(terminal: bool = False) -> tuple[Ui, io.StringIO, io.StringIO]:
    out, err = io.StringIO(), io.StringIO()
    opts = {"force_terminal": True, "color_system": "standard"} if terminal else {}
    ui = Ui(Console(file=out, width=100, highlight=False, soft_wrap=True, **opts),
            Console(file=err, width=100, highlight=False, **opts))
    return ui, out, err


def make_session(tok, scripts, store=None, **settings) -> tuple[ChatSession, ScriptEngine]:
    engine = ScriptEngine(scripts, max_context=settings.pop("engine_context", 4096),
                          interrupt_at=settings.pop("interrupt_at", None))
    session = ChatSession(engine, tok, "fake-model", ChatSettings(**settings), store, today="2025-01-02")
    return session, engine


# ---- turns ---------------------------------------------------------------------------------------

def test_turn_streams_channels_and_resends_only_final_answers(tok):
    first = reply(tok, "The user greets. Reply briefly.", "Hello! How can I help?")
    second = reply(tok, "Second thoughts.", "Fine, thanks.")
    session, engine = make_session(tok, [first, second])
    turn = session.start_turn("hi")
    events = list(turn)
    starts = [e for e in events if isinstance(e, MessageStart)]
    assert [s.channel for s in starts] == ["analysis", "final"]
    answer = "".join(e.text for e in events if isinstance(e, TextDelta) and e.channel == "final")
    assert answer == "Hello! How can I help?"
    assert sum(isinstance(e, RawToken) for e in events) == len(first)
    result = events[-1].result
    assert isinstance(events[-1], TurnDone) and result.committed and result.answer == answer
    # reasoning share: every token of the analysis message (header through <|end|>)
    assert result.stats.reasoning_tokens == len(ids(tok, "<|channel|>analysis<|message|>The user greets. "
                                                         "Reply briefly.<|end|>"))
    assert result.stats.generated_tokens == len(first) and result.stats.ttft is not None
    assert result.stats.time_to_answer >= result.stats.ttft

    # The next prompt: the first prompt unchanged, then only the final answer (ended by <|end|>).
    system = SystemConfig(current_date="2025-01-02", reasoning_effort="medium")
    expected = render_prompt(tok, [Message("user", "hi"), Message("assistant", answer, channel="final"),
                                   Message("user", "how are you?")], system)
    session.start_turn("how are you?")  # not run: only check the prompt it would send
    assert session.render(session.messages + [Message("user", "how are you?")]) == expected
    list(session.start_turn("how are you?"))
    assert engine.prompts[1] == expected
    assert engine.prompts[1][: len(engine.prompts[0])] == engine.prompts[0]
    assert "Second thoughts" not in session.prompt_text() and "The user greets" not in session.prompt_text()
    assert session.last_stats.cached_prompt_tokens >= len(engine.prompts[0])
    # Three turns later the prefix of every earlier prompt still holds.
    assert session.render()[: len(engine.prompts[1])] == engine.prompts[1]


def test_stop_sequence_ends_the_answer_and_the_request(tok):
    script = reply(tok, "Think STOP here.", "The answer STOP and more.")
    session, engine = make_session(tok, [script, reply(tok, None, "Next.")], stop=("STOP", "zz"))
    events = list(session.start_turn("hi"))
    answer = "".join(e.text for e in events if isinstance(e, TextDelta) and e.channel == "final")
    reasoning = "".join(e.text for e in events if isinstance(e, TextDelta) and e.channel == "analysis")
    assert (answer, reasoning) == ("The answer ", "Think STOP here.")  # reasoning is never matched
    result = events[-1].result
    assert result.committed and result.answer == "The answer " and result.stats.finish_reason == "stop"
    # The engine stopped at the token that completed "STOP": nothing after it was generated.
    cut = next(i for i in range(len(script)) if "The answer STOP" in tok.decode(script[:i + 1]))
    assert engine.aborted == ["req-0"] and result.stats.generated_tokens == cut + 1
    assert session.messages[-1] == Message("assistant", "The answer ", channel="final")
    list(session.start_turn("again"))  # the next prompt holds the answer as it was cut
    assert "<|channel|>final<|message|>The answer <|end|>" in tok.decode(engine.prompts[-1])


def test_tool_call_is_displayed_and_never_executed(tok):
    script = ids(tok, '<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>commentary '
                      'to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}<|call|>')
    session, engine = make_session(tok, [script])
    ui, out, err = make_ui()
    result = ChatRenderer(ui, session).run_turn("weather in Paris?")
    assert len(engine.prompts) == 1  # nothing ran the tool or sent a result back
    calls = [m for m in result.messages if m.is_tool_call]
    assert calls and calls[0].recipient == "functions.get_weather"
    assert "tool call → functions.get_weather" in err.getvalue() and "not executed" in err.getvalue()
    assert '"city": "Paris"' in err.getvalue()
    assert out.getvalue() == ""  # no answer on stdout
    # The call (and its reasoning) stay in history: the turn is still open for a tool result.
    assert [m.channel for m in session.messages] == [None, "analysis", "commentary"]


def test_tool_call_event_order(tok):
    script = ids(tok, "<|channel|>commentary to=functions.f <|constrain|>json<|message|>{}<|call|>")
    session, _ = make_session(tok, [script])
    events = list(session.start_turn("go"))
    assert any(isinstance(e, ToolCall) and e.recipient == "functions.f" for e in events)


def test_malformed_output_is_shown_as_plain_text(tok):
    # Cut off inside what the parser takes for a header: nothing harmony-shaped at all.
    script = tok.encode("just some words without any harmony")
    session, _ = make_session(tok, [script], max_tokens=len(script))
    ui, out, err = make_ui()
    result = ChatRenderer(ui, session).run_turn("hi")
    assert result.fallback_text == "just some words without any harmony"
    assert out.getvalue() == "just some words without any harmony\n"
    assert "not in the harmony format" in err.getvalue()
    assert session.messages[-1] == Message("assistant", result.fallback_text, channel="final")
    assert result.stats.format_errors >= 1 and "format error" in stats_line(result.stats)


def test_malformed_output_ends_at_a_stop_string(tok):
    # No harmony at all: the plain text is the answer, so a stop string ends the request there
    # (the fake engine would go on to max_tokens) and is not kept.
    script = tok.encode("first part STOP and the rest that never comes")
    session, engine = make_session(tok, [script], max_tokens=len(script), stop=("STOP",))
    ui, out, err = make_ui()
    result = ChatRenderer(ui, session).run_turn("hi")
    assert result.fallback_text == "first part"
    assert result.stats.finish_reason == "stop"
    assert result.stats.generated_tokens < len(script)
    assert session.messages[-1] == Message("assistant", "first part", channel="final")


def test_output_without_channel_is_still_the_answer(tok):
    script = tok.encode("plain words") + [200002]  # lenient parser: a header closed by <|return|>
    session, _ = make_session(tok, [script])
    ui, out, err = make_ui()
    result = ChatRenderer(ui, session).run_turn("hi")
    assert out.getvalue() == "plain words\n" and result.answer == "plain words" and result.committed


def test_limit_inside_reasoning_commits_nothing_and_warns(tok):
    script = ids(tok, "<|channel|>analysis<|message|>" + "thinking " * 30)
    session, _ = make_session(tok, [script], max_tokens=12)
    ui, out, err = make_ui()
    result = ChatRenderer(ui, session).run_turn("hard question")
    assert result.stats.finish_reason == "length" and result.stats.generated_tokens == 12
    assert result.cut_in_reasoning and not result.committed
    assert session.messages == [] and session.retry_text == "hard question"
    assert "still reasoning" in err.getvalue() and out.getvalue() == ""


@pytest.mark.parametrize("mode", ["show", "collapse", "hide"])
def test_reasoning_display_modes(tok, mode):
    script = reply(tok, "secret plan", "Answer.")
    session, _ = make_session(tok, [script], reasoning=mode)
    ui, out, err = make_ui(terminal=True)
    ChatRenderer(ui, session).run_turn("q")
    assert plain(out.getvalue()).endswith("Answer.\n")
    shown = plain(err.getvalue())
    assert ("secret plan" in shown) == (mode in ("show", "collapse"))  # collapse streams, then folds
    assert ("Thought for" in shown) == (mode == "collapse")
    assert "Answer." not in shown


def test_piped_output_is_plain(tok):
    session, _ = make_session(tok, [reply(tok, "plan", "**Answer**")], reasoning="show")
    ui, out, err = make_ui(terminal=False)
    ChatRenderer(ui, session).run_turn("q")
    assert out.getvalue() == "**Answer**\n"
    assert not ANSI.search(out.getvalue() + err.getvalue())
    assert "plan" in err.getvalue() and re.search(r"TTFT [\d.]+s · answer [\d.]+s", err.getvalue())


def test_ctrl_c_in_the_engine_aborts_and_keeps_the_conversation(tok):
    session, engine = make_session(tok, [reply(tok, "x", "first"), reply(tok, None, "never")])
    ui, out, err = make_ui()
    renderer = ChatRenderer(ui, session)
    renderer.run_turn("one")
    before = list(session.messages)
    engine.interrupt_at = 2
    assert renderer.run_turn("two") is None
    assert engine.aborted and session.messages == before
    assert "[interrupted]" in err.getvalue() and session.retry_text == "two"


def test_cancel_while_displaying_aborts_the_request(tok):
    session, engine = make_session(tok, [reply(tok, "thinking about it", "done")])
    turn = session.start_turn("q")
    iterator = iter(turn)
    for _ in range(3):
        next(iterator)
    turn.cancel()
    assert engine.aborted == ["req-0"] and session.messages == [] and session.retry_text == "q"


def test_context_overflow_is_refused_or_truncated(tok):
    session, engine = make_session(tok, [reply(tok, None, "ok " * 5)], engine_context=200, max_tokens=20)
    for i in range(3):
        list(session.start_turn(f"message number {i}"))
    long = "word " * 60
    with pytest.raises(RequestError) as info:
        session.start_turn(long)
    assert info.value.code == "context_length_exceeded" and "--truncate oldest" in info.value.hint
    assert len([m for m in session.messages if m.role == "user"]) == 3

    session.settings = ChatSettings(max_tokens=20, truncate="oldest")
    turn = session.start_turn(long)
    assert turn.dropped_turns >= 1
    assert len(turn.prompt_ids) + 20 <= 200
    ui, _, err = make_ui()
    ChatRenderer(ui, session).render_turn(turn)
    assert "dropped the" in err.getvalue() and "oldest" in err.getvalue()
    assert session.messages[0].content != "message number 0"
    with pytest.raises(RequestError):  # a single message that can never fit is still refused
        session.start_turn("word " * 400)


def test_max_tokens_is_capped_by_the_context(tok):
    session, engine = make_session(tok, [reply(tok, None, "ok")], engine_context=4096)
    session.set_value("context", "300")
    turn = session.start_turn("hi")
    assert turn.params.max_tokens == 300 - len(turn.prompt_ids)
    with pytest.raises(ValueError, match="restart with --context"):
        session.set_value("context", "5000")


def test_undo_and_retry(tok):
    session, engine = make_session(tok, [reply(tok, None, "a1"), reply(tok, None, "a2"), reply(tok, None, "a3")])
    list(session.start_turn("q1"))
    list(session.start_turn("q2"))
    assert session.pop_for_retry() == "q2"
    assert [m.content for m in session.messages] == ["q1", "a1"]
    assert session.undo() == "q1" and session.messages == [] and session.undo() is None


@pytest.mark.parametrize("name,text,ok", [
    ("temperature", "0.7", True), ("temperature", "-1", False), ("temperature", "hot", False),
    ("top_p", "0", False), ("top_p", "0.95", True), ("top_k", "2.5", False), ("top_k", "40", True),
    ("min_p", "1.5", False), ("seed", "none", True), ("seed", "-3", False), ("max_tokens", "0", False),
    ("max_tokens", "64", True), ("context", "8", False), ("context", "1024", True), ("nope", "1", False),
    ("repetition_penalty", "1.15", True), ("repetition_penalty", "0", False), ("repetition_penalty", "lots", False),
])
def test_set_validation(tok, name, text, ok):
    session, _ = make_session(tok, [[200002]])
    if ok:
        session.set_value(name, text)
        assert getattr(session.settings, name) == parse_setting(name, text)
    else:
        with pytest.raises(ValueError) as info:
            session.set_value(name, text)
        assert str(info.value)  # a message a user can read


def test_set_stop_adds_unescaped_sequences_and_none_clears_them(tok):
    session, _ = make_session(tok, [[200002]], stop=("END",))
    session.set_value("stop", "\\n\\n")
    session.set_value("stop", r"a\\nb")  # \\ is a backslash: a\nb stays literal
    assert session.settings.stop == ("END", "\n\n", "a\\nb")
    session.set_value("stop", "x")
    with pytest.raises(ValueError, match="at most 4"):
        session.set_value("stop", "y")
    session.set_value("stop", "none")
    assert session.settings.stop == ()


# ---- persistence ---------------------------------------------------------------------------------

def test_save_and_load_round_trip(tok, tmp_path):
    session, _ = make_session(tok, [reply(tok, "hidden reasoning", "Paris.")], effort="high",
                              developer="Answer tersely.", temperature=0.6, seed=5)
    list(session.start_turn("Capital of France?"))
    path = session.save(tmp_path / "chat.json")
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    data = json.loads(path.read_text())
    assert data["conversation"]["system"]["reasoning_effort"] == "high"
    assert data["conversation"]["developer"]["instructions"] == "Answer tersely."

    other, _ = make_session(tok, [[200002]])
    other.load(path)
    assert other.messages == session.messages
    assert (other.settings.effort, other.settings.developer, other.settings.temperature, other.settings.seed) == (
        "high", "Answer tersely.", 0.6, 5)
    assert other.render() == session.render()

    md = session.save(tmp_path / "chat.md").read_text()
    assert "Capital of France?" in md and "Paris." in md and "hidden reasoning" not in md
    md = session.save(tmp_path / "thinking.md", reasoning=True).read_text()
    assert md.index("## You") < md.index("## Assistant") < md.index("> hidden reasoning") < md.index("Paris.")
    assert md.count("## Assistant") == 1


def test_loading_a_bad_file_is_a_clear_error(tok, tmp_path):
    from gptoss_cli.runtime.errors import GptossError

    session, _ = make_session(tok, [[200002]])
    bad = tmp_path / "bad.json"
    for content in ["{not json", json.dumps({"format": "other"}),
                    json.dumps({"format": "gptoss-chat", "conversation": {"messages": [{"role": "robot",
                                                                                       "content": ""}]}})]:
        bad.write_text(content)
        with pytest.raises(GptossError, match="cannot load"):
            session.load(bad)
    with pytest.raises(GptossError, match="no such file"):
        session.load(tmp_path / "missing.json")


def test_autosave_is_private_and_latest_is_found(tok, tmp_path):
    store = ChatStore()
    assert store.root == tmp_path / "data" / "gptoss" / "conversations"
    session, _ = make_session(tok, [reply(tok, None, "one"), reply(tok, None, "two")], store=store)
    list(session.start_turn("first"))
    first_id = session.conversation_id
    session.clear()
    list(session.start_turn("second"))
    files = sorted(store.root.glob("*.json"))
    assert len(files) == 2
    assert all(stat.S_IMODE(f.stat().st_mode) == 0o600 for f in files)
    assert stat.S_IMODE(store.root.stat().st_mode) == 0o700
    os.utime(store.path_for(first_id), (1, 1))  # make the first one clearly older
    assert store.latest() == store.path_for(session.conversation_id)


# ---- formatting ----------------------------------------------------------------------------------

def test_stats_line_format():
    stats = TurnStats(prompt_tokens=3000, cached_prompt_tokens=2900, generated_tokens=512, reasoning_tokens=310,
                      ttft=0.21, time_to_answer=1.94, decode_seconds=511 / 143.2, context_used=3100,
                      context_limit=131072, finish_reason="stop", format_errors=0)
    assert stats_line(stats) == "TTFT 0.21s · answer 1.94s · 143.2 tok/s · 512 tok (310 reasoning) · ctx 3.1k/131k"
    assert [human_tokens(n) for n in (999, 1000, 3149, 32768)] == ["999", "1.0k", "3.1k", "32k"]


# ---- the REPL through prompt_toolkit -------------------------------------------------------------

def run_repl_with(session, keys: str, history=None) -> tuple[int, str, str]:
    from prompt_toolkit.application import create_app_session
    from prompt_toolkit.input import create_pipe_input
    from prompt_toolkit.output import DummyOutput

    from gptoss_cli.cli.chat_repl import run_repl

    ui, out, err = make_ui()
    with create_pipe_input() as pipe:
        pipe.send_text(keys)
        with create_app_session(input=pipe, output=DummyOutput()):
            code = run_repl(ui, session, ChatRenderer(ui, session), history)
    return code, out.getvalue(), err.getvalue()


def test_repl_slash_commands(tok):
    pytest.importorskip("prompt_toolkit")
    session, engine = make_session(tok, [reply(tok, None, "A1"), reply(tok, None, "A2"), reply(tok, None, "A3")])
    keys = ("/set temperature 0.5\r/set top_k many\r/effort high\r/reasoning loud\r/frobnicate\r"
            "/developer Be brief.\rhello\r/show prompt\r/retry\r/undo\r/show context\r/stats off\r"
            "/set stop \\n\\n\r/show settings\r/exit\r")
    code, out, err = run_repl_with(session, keys)
    assert code == 0
    assert 'stop = "\\n\\n"' in err and f'{"stop":<18} "\\n\\n"' in out
    assert "temperature = 0.5" in err and "top_k must be a whole number" in err
    assert "effort = high" in err and "reasoning must be one of show, collapse, hide" in err
    assert "unknown command /frobnicate" in err
    assert len(engine.prompts) == 2  # hello, then /retry sent it again
    assert engine.prompts[0] == engine.prompts[1]
    assert engine.params[0].temperature == 0.5
    text = tok.decode(engine.prompts[0])
    assert "Reasoning: high" in text and "# Instructions\n\nBe brief." in text
    assert "<|start|>user<|message|>hello<|end|><|start|>assistant" in out  # /show prompt
    assert "0 exchange(s)" in out  # after /undo
    assert session.settings.stats is False


def test_repl_read_sends_a_file_then_the_text_after_it(tok, tmp_path):
    pytest.importorskip("prompt_toolkit")
    notes = tmp_path / "notes.txt"
    notes.write_text("line one\nline two\n")
    (tmp_path / "bin.dat").write_bytes(b"\xff\xfe\x00")
    session, engine = make_session(tok, [reply(tok, None, "A1"), reply(tok, None, "A2")])
    keys = (f"/read {notes} sum it up\r/read {tmp_path / 'missing.txt'}\r/read {tmp_path / 'bin.dat'}\r/read\r"
            f"/read {notes}\r/exit\r")
    code, out, err = run_repl_with(session, keys)
    assert code == 0 and len(engine.prompts) == 2
    assert "<|start|>user<|message|>line one\nline two\n\nsum it up<|end|>" in tok.decode(engine.prompts[0])
    assert "<|start|>user<|message|>line one\nline two<|end|>" in tok.decode(engine.prompts[1])
    assert "missing.txt: no such file" in err and "not UTF-8 text" in err and "/read needs a file" in err
    assert "Traceback" not in err


def test_repl_edit_uses_the_editor(tok, tmp_path, monkeypatch):
    pytest.importorskip("prompt_toolkit")
    editor = tmp_path / "editor.sh"
    # The editor appends a line to whatever /edit put in the file.
    editor.write_text('#!/bin/sh\nprintf "%s\\n" "from the editor" >> "$1"\n')
    editor.chmod(0o755)
    monkeypatch.delenv("VISUAL", raising=False)
    monkeypatch.setenv("EDITOR", str(editor))
    session, engine = make_session(tok, [reply(tok, None, "A1")])
    code, out, err = run_repl_with(session, "/edit Draft:\r/exit\r")
    assert code == 0
    assert "<|start|>user<|message|>Draft:from the editor<|end|>" in tok.decode(engine.prompts[0])
    monkeypatch.setenv("EDITOR", "false")  # exits 1: nothing is sent
    code, out, err = run_repl_with(session, "/edit\r/exit\r")
    assert len(engine.prompts) == 1 and "exited with status 1" in err
    monkeypatch.delenv("EDITOR")
    code, out, err = run_repl_with(session, "/edit\r/exit\r")
    assert "no editor" in err and "Traceback" not in err


def test_ctrl_g_opens_the_typed_text_in_the_editor():
    # prompt_toolkit's Buffer.open_in_editor runs $VISUAL / $EDITOR on the typed text (after the
    # editor exits, asynchronously); the binding must call it without sending the text.
    pytest.importorskip("prompt_toolkit")
    from types import SimpleNamespace

    from prompt_toolkit.keys import Keys

    from gptoss_cli.cli.chat_repl import key_bindings

    calls = []
    buffer = SimpleNamespace(open_in_editor=lambda validate_and_handle=True: calls.append(validate_and_handle))
    (binding,) = [b for b in key_bindings().bindings if b.keys == (Keys.ControlG,)]
    binding.handler(SimpleNamespace(current_buffer=buffer))
    assert calls == [False]


def test_repl_multiline_input(tok):
    session, engine = make_session(tok, [reply(tok, None, "ok")])
    keys = '"""\rline one\rline two\r"""\rfirst\x1b\rsecond\r/developer """\rBe\rbrief.\r"""\r\x04'
    code, _, _ = run_repl_with(session, keys)
    assert code == 0
    users = [m.content for m in session.messages if m.role == "user"]
    assert users == ["line one\nline two", "first\nsecond"]
    assert session.settings.developer == "Be\nbrief."


def test_repl_keys_ctrl_c_and_ctrl_d(tok):
    session, _ = make_session(tok, [[200002]])
    code, _, err = run_repl_with(session, "typed\x03\x03\x04")
    assert code == 0 and err.count("Use /exit or Ctrl+D to quit") == 1
    code, _, _ = run_repl_with(session, "\x03\x03")
    assert code == 130


def test_repl_interrupted_turn_then_retry(tok):
    session, engine = make_session(tok, [reply(tok, "x", "first"), reply(tok, None, "again")], interrupt_at=1)
    code, out, err = run_repl_with(session, "question\r/retry\r\x04")
    assert code == 0 and "[interrupted]" in err
    assert [m.content for m in session.messages if m.role == "user"] == ["question"]
    assert "again" in out and len(engine.prompts) == 2 and engine.aborted


def test_repl_sigint_before_the_turn_starts_keeps_the_message_for_retry(tok, monkeypatch):
    # The terminal turned a Ctrl+C typed right after Enter into SIGINT while the REPL was between
    # the prompt and the turn (here: inside the typeahead check).
    from gptoss_cli.cli import chat_repl

    def sigint(_input):
        monkeypatch.setattr(chat_repl, "interrupt_pending", lambda _input: False)
        raise KeyboardInterrupt

    monkeypatch.setattr(chat_repl, "interrupt_pending", sigint)
    session, engine = make_session(tok, [reply(tok, None, "answer")])
    code, out, err = run_repl_with(session, "question\r/retry\r\x04")
    assert code == 0 and "[interrupted]" in err
    assert len(engine.prompts) == 1 and "answer" in out  # /retry sent the message that never ran
    assert [m.content for m in session.messages if m.role == "user"] == ["question"]


def test_gptoss_home_holds_conversations_and_history(tmp_path, monkeypatch):
    from gptoss_cli.cli.chat_store import history_path

    monkeypatch.setenv("GPTOSS_HOME", str(tmp_path / "home"))
    assert ChatStore().root == tmp_path / "home" / "conversations"
    assert history_path() == tmp_path / "home" / "history"


def test_repl_history_file_is_private(tok, tmp_path):
    from gptoss_cli.cli.chat_store import history_path

    session, _ = make_session(tok, [reply(tok, None, "ok")])
    path = history_path()
    run_repl_with(session, "remember me\r\x04", history=path)
    assert path == tmp_path / "state" / "gptoss" / "history"
    assert "remember me" in path.read_text()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_repl_save_clear_load_and_show(tok, tmp_path):
    session, engine = make_session(tok, [reply(tok, "private thoughts", "Saved answer.")])
    json_path, md_path = tmp_path / "c.json", tmp_path / "c.md"
    keys = (f"remember this\r/save {json_path}\r/save {md_path}\r/clear\r/show context\r/load {json_path}\r"
            "/show model\r/help\r/load /nope.json\r/exit\r")
    code, out, err = run_repl_with(session, keys)
    assert code == 0 and f"saved to {json_path}" in err and f"loaded 1 exchange(s) from {json_path}" in err
    assert "0 of" not in out and "0 exchange(s)" in out  # /show context after /clear
    assert [m.content for m in session.messages if m.role != "assistant" or m.channel == "final"] == [
        "remember this", "Saved answer."]
    assert "layers 24" in out and "/retry" in out and "/undo" in out  # /show model, /help
    assert "no saved conversation" in err
    assert "private thoughts" not in md_path.read_text() and "Saved answer." in md_path.read_text()
    assert stat.S_IMODE(json_path.stat().st_mode) == 0o600


def test_repl_save_with_reasoning(tok, tmp_path):
    session, _ = make_session(tok, [reply(tok, "private thoughts", "Saved answer.")])
    md_path, json_path = tmp_path / "my chat.md", tmp_path / "c.json"
    code, _, err = run_repl_with(session, f"hi\r/save {md_path} --with-reasoning\r/save {json_path} --with-reasoning\r"
                                          "/exit\r")
    assert code == 0 and f"saved to {md_path}" in err
    assert "> private thoughts" in md_path.read_text() and "Saved answer." in md_path.read_text()
    assert "--with-reasoning is for Markdown transcripts" in err and not json_path.exists()


def test_toolbar_text(tok):
    from gptoss_cli.cli.chat_render import toolbar_text

    session, _ = make_session(tok, [[200002]], effort="low", temperature=0.7)
    assert toolbar_text(session, 3100) == "fake-model · effort low · ctx 3.1k/4.0k · T=0.7"


def test_completion_of_slash_commands():
    from prompt_toolkit.document import Document

    from gptoss_cli.cli.chat_repl import SlashCompleter

    def complete(text):
        return [c.text for c in SlashCompleter().get_completions(Document(text), None)]

    assert "/set" in complete("/se") and "/show" in complete("/sh")
    assert complete("/effort h") == ["high"]
    assert "temperature" in complete("/set te")
    assert complete("hello") == []


# ---- the command line ----------------------------------------------------------------------------

class FakeLoader:
    """Stands in for models.load_model: records its arguments, hands out a ScriptEngine."""

    def __init__(self, tok, scripts, **engine_kwargs):
        self.tok, self.scripts, self.engine_kwargs = tok, scripts, engine_kwargs
        self.calls = []
        self.engine = None

    def __call__(self, ui, spec, **options):
        self.calls.append((spec, options))
        context = options.get("max_context") or 4096
        self.engine = ScriptEngine(self.scripts, max_context=context, **self.engine_kwargs)
        return LoadedModel(spec or "default", self.engine, self.tok, 0.0)


@pytest.fixture
def fake(tok, monkeypatch):
    loader = FakeLoader(tok, [reply(tok, "plan", "The answer.")])
    monkeypatch.setattr(cli_models, "load_model", loader)
    return loader


def test_one_shot_routes_flags(fake, tok, tmp_path):
    dev = tmp_path / "dev.txt"
    dev.write_text("Speak like a pirate.\n")
    result = run_cli(["chat", "-m", "random:x", "--effort", "high", "-s", f"@{dev}", "--temperature", "0.5",
                      "--top-p", "0.9", "--top-k", "5", "--min-p", "0.1", "--repetition-penalty", "1.3", "--seed", "7",
                      "--max-tokens", "50", "--context", "2048", "What", "is", "up?"])
    assert result.exit_code == 0, result.stderr
    assert result.stdout == "The answer.\n"
    assert "plan" in result.stderr and "TTFT" in result.stderr
    spec, options = fake.calls[0]
    assert spec == "random:x" and options["max_context"] == 2048
    p = fake.engine.params[0]
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.seed, p.max_tokens) == (0.5, 0.9, 5, 0.1, 7, 50)
    assert p.repetition_penalty == 1.3
    text = tok.decode(fake.engine.prompts[0])
    assert "Reasoning: high" in text and "# Instructions\n\nSpeak like a pirate." in text
    assert "<|start|>user<|message|>What is up?<|end|>" in text
    stopped = run_cli(["chat", "-m", "x", "--stop", " answer", "--no-stats", "q"])
    assert stopped.exit_code == 0 and stopped.stdout == "The\n" and fake.engine.aborted


def test_verbose_adds_ollamas_timing_block(fake, tok):
    plain = run_cli(["chat", "-m", "x", "--no-stats", "q"])
    assert plain.exit_code == 0 and "eval rate" not in plain.stderr
    result = run_cli(["--verbose", "chat", "-m", "x", "--no-stats", "q"])
    assert result.exit_code == 0, result.stderr
    assert result.stdout == "The answer.\n"  # the block is on stderr only
    lines = {line.split(":", 1)[0]: line.split(":", 1)[1].strip() for line in result.stderr.splitlines() if ":" in line}
    for name in ("total duration", "prompt eval count", "prompt eval duration", "prompt eval rate", "eval count",
                 "eval duration", "eval rate"):
        assert name in lines, name
    prompt = len(fake.engine.prompts[-1])
    assert lines["prompt eval count"].startswith(f"{prompt} token(s), 0 more from the prefix cache")


SCHEMA = {"title": "city facts", "type": "object", "properties": {"pop": {"type": "integer"}}, "required": ["pop"]}


@pytest.mark.parametrize("answer,code,problem", [
    ('{"pop": 5}', 0, None),
    ("The answer.", 1, "not valid JSON"),
    ('{"pop": "many"}', 1, "does not match the schema at pop: 'many' is not of type 'integer'"),
])
def test_json_schema_is_a_response_format_and_checks_the_answer(tok, monkeypatch, tmp_path, answer, code, problem):
    loader = FakeLoader(tok, [reply(tok, None, answer)])
    monkeypatch.setattr(cli_models, "load_model", loader)
    schema = tmp_path / "facts.json"
    schema.write_text(json.dumps(SCHEMA))
    result = run_cli(["chat", "-m", "x", "--json-schema", str(schema), "--no-stats", "Oslo?"])
    assert result.exit_code == code and result.stdout == answer + "\n"
    assert (problem in result.stderr) if problem else "--json-schema" not in result.stderr
    prompt = tok.decode(loader.engine.prompts[0])
    assert "# Response Formats\n\n## city_facts\n\n" in prompt and '"required":["pop"]' in prompt


def test_json_schema_without_jsonschema_checks_syntax_and_says_so(tok, monkeypatch, tmp_path):
    from gptoss_cli.cli import json_answer

    monkeypatch.setattr(json_answer, "schema_checker_available", lambda: False)
    monkeypatch.setattr(cli_models, "load_model", FakeLoader(tok, [reply(tok, None, '{"pop": "many"}')]))
    schema = tmp_path / "s.json"
    schema.write_text(json.dumps(SCHEMA))
    result = run_cli(["chat", "-m", "x", "--json-schema", str(schema), "--no-stats", "q"])
    assert result.exit_code == 0 and "JSON syntax only" in result.stderr


@pytest.mark.parametrize("content,needle", [(None, "no such file"), ("{oops", "not JSON (line 1"),
                                            ("[1, 2]", "must be a JSON object")])
def test_bad_json_schema_file_is_a_usage_error(fake, tmp_path, content, needle):
    path = tmp_path / "schema.json"
    if content is not None:
        path.write_text(content)
    result = run_cli(["chat", "-m", "x", "--json-schema", str(path), "q"])
    assert result.exit_code == 2 and needle in result.stderr and "Traceback" not in result.stderr
    assert not fake.calls  # before the model loads


def test_first_word_names_the_model(fake):
    assert run_cli(["chat", "120b", "hello", "there"]).exit_code == 0
    assert fake.calls[-1][0] == "120b"
    assert run_cli(["chat", "random:tiny", "--no-stats", "hello"]).exit_code == 0
    assert fake.calls[-1][0] == "random:tiny"
    assert run_cli(["chat", "-m", "20b", "120b", "rocks"]).exit_code == 0  # -m given: all words are the prompt
    assert fake.calls[-1][0] == "20b"


def test_piped_stdin_is_prepended(fake, tok):
    result = run_cli(["chat", "-m", "x", "--reasoning", "hide", "--no-stats", "summarise"], input="some notes\n")
    assert result.exit_code == 0 and result.stdout == "The answer.\n"
    assert "plan" not in result.stderr and "TTFT" not in result.stderr
    assert "<|message|>some notes\n\nsummarise<|end|>" in tok.decode(fake.engine.prompts[0])
    assert run_cli(["chat", "-m", "x"], input="only stdin").exit_code == 0
    assert "<|message|>only stdin<|end|>" in tok.decode(fake.engine.prompts[0])


@pytest.mark.parametrize("args,needle", [
    (["--effort", "extreme", "q"], "effort"),
    (["--reasoning", "loud", "q"], "reasoning"),
    (["--truncate", "newest", "q"], "truncate"),
    (["--developer", "@/no/such/file", "q"], "cannot read"),
    (["--temperature", "-1", "q"], "temperature"),
    ([], "nothing to ask"),
    (["--continue", "--resume", "x", "q"], "cannot be combined"),
    (["--stop", "", "q"], "--stop"),
    (["--stop", "a", "--stop", "b", "--stop", "c", "--stop", "d", "--stop", "e", "q"], "at most 4"),
])
def test_usage_errors(fake, args, needle):
    result = run_cli(["chat", "-m", "x", *args], input="")
    assert result.exit_code == 2 and needle in result.stderr and "Traceback" not in result.stderr


def test_context_overflow_exits_with_a_clear_message(fake):
    result = run_cli(["chat", "-m", "x", "--context", "64", "word " * 80])
    assert result.exit_code == 1
    assert "context" in result.stderr and "Traceback" not in result.stderr


def test_interrupted_one_shot_exits_130(tok, monkeypatch):
    loader = FakeLoader(tok, [reply(tok, "plan", "x")], interrupt_at=2)
    monkeypatch.setattr(cli_models, "load_model", loader)
    result = run_cli(["chat", "-m", "x", "q"])
    assert result.exit_code == 130 and "[interrupted]" in result.stderr and loader.engine.aborted


def test_continue_resumes_the_latest_conversation(tok, monkeypatch, tmp_path):
    loader = FakeLoader(tok, [reply(tok, None, "Blue."), reply(tok, None, "Green.")])
    monkeypatch.setattr(cli_models, "load_model", loader)
    assert run_cli(["chat", "-m", "x", "--effort", "low", "favourite colour?"]).exit_code == 0
    result = run_cli(["chat", "-m", "x", "--continue", "and another?"])
    assert result.exit_code == 0 and "continuing" in result.stderr
    text = tok.decode(loader.engine.prompts[0])
    assert "favourite colour?" in text and "Blue." in text and "Reasoning: low" in text
    assert len(list((tmp_path / "data" / "gptoss" / "conversations").glob("*.json"))) == 1
    # an explicit flag wins over the saved setting
    run_cli(["chat", "-m", "x", "--continue", "--effort", "high", "third?"])
    assert "Reasoning: high" in tok.decode(loader.engine.prompts[0])


def test_resume_by_id_and_raw_output(tok, monkeypatch, tmp_path):
    loader = FakeLoader(tok, [reply(tok, "plan", "First.")])
    monkeypatch.setattr(cli_models, "load_model", loader)
    assert run_cli(["chat", "-m", "x", "--raw", "one"]).exit_code == 0
    saved = next((tmp_path / "data" / "gptoss" / "conversations").glob("*.json"))
    raw = run_cli(["chat", "-m", "x", "--resume", saved.stem, "--raw", "two"])
    assert raw.exit_code == 0
    assert raw.stdout.startswith("<|channel|>analysis<|message|>plan<|end|>") and "<|return|>" in raw.stdout
    assert "<|message|>one<|end|>" in tok.decode(loader.engine.prompts[0])
    missing = run_cli(["chat", "-m", "x", "--resume", "nope", "q"])
    assert missing.exit_code == 1 and "no saved conversation 'nope'" in missing.stderr


def test_no_history_writes_nothing(fake, tmp_path, monkeypatch):
    assert run_cli(["chat", "-m", "x", "--no-history", "q"]).exit_code == 0
    monkeypatch.setenv("GPTOSS_NO_HISTORY", "1")
    assert run_cli(["chat", "-m", "x", "q"]).exit_code == 0
    assert not (tmp_path / "data").exists() and not (tmp_path / "state").exists()
    result = run_cli(["chat", "-m", "x", "--continue", "q"])
    assert result.exit_code == 1 and "no saved conversation" in result.stderr


def test_one_shot_needs_no_prompt_toolkit(fake, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "prompt_toolkit", None)  # import prompt_toolkit now fails
    monkeypatch.delitem(sys.modules, "gptoss_cli.cli.chat_repl", raising=False)
    assert run_cli(["chat", "-m", "x", "q"]).exit_code == 0
    result = run_cli(["chat", "-m", "x", "-i", "q"])
    assert result.exit_code == 1 and "needs prompt_toolkit" in result.stderr and result.stdout == ""


def test_interactive_flag_runs_the_repl_through_main(fake):
    from prompt_toolkit.application import create_app_session
    from prompt_toolkit.input import create_pipe_input
    from prompt_toolkit.output import DummyOutput

    with create_pipe_input() as pipe:
        pipe.send_text("/show settings\r/bye\r")
        with create_app_session(input=pipe, output=DummyOutput()):
            result = run_cli(["chat", "-m", "x", "-i", "--no-history", "--temperature", "0.3", "first"])
    assert result.exit_code == 0, result.stderr
    assert result.stdout.startswith("The answer.\n")
    assert re.search(r"temperature\s+0.3", result.stdout)


# ---- end to end on random:tiny (real tokenizer, random weights, CPU engine) ------------------------

def test_one_shot_on_random_tiny_is_plain_and_autosaved(tmp_path):
    result = run_cli(["chat", "-m", "random:tiny", "--max-tokens", "4", "--seed", "3", "Hello"],
                     env={"NO_COLOR": "1"})
    assert result.exit_code == 0, result.stderr
    assert result.stdout.strip() and result.stdout.endswith("\n")
    assert not ANSI.search(result.stdout + result.stderr)
    assert re.search(r"4 tok \(\d+ reasoning\) · ctx \d+/131k", result.stderr)
    saved = list((tmp_path / "data" / "gptoss" / "conversations").glob("*.json"))
    assert len(saved) == 1 and stat.S_IMODE(saved[0].stat().st_mode) == 0o600


def test_second_turn_reuses_the_first_prompt_on_random_tiny(tok):
    from gptoss_cli.runtime.cpu_engine import CpuEngine
    from gptoss_cli.runtime.random_checkpoint import random_weights

    engine = CpuEngine(random_weights("tiny", seed=0), max_context=1024)
    session = ChatSession(engine, tok, "random:tiny", ChatSettings(max_tokens=2, seed=1))
    first = session.start_turn("Hi there")
    list(first)
    assert first.result.committed
    second = session.start_turn("And again")
    list(second)
    assert second.result.stats.cached_prompt_tokens >= len(first.prompt_ids)
    assert second.prompt_ids[: len(first.prompt_ids)] == first.prompt_ids
