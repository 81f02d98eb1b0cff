"""How a chat turn looks: channels streamed with Rich, tool calls, the per-turn stats line, and the
text of /show and the toolbar.

The answer (final channel) streams plain to stdout; everything else goes to stderr: reasoning dim
(shown, folded to one line on a terminal, or hidden), preambles and tool calls, notices, stats.
Streaming never uses a live re-layout for the answer, so long answers do not jitter.
"""

from __future__ import annotations

import json

from rich.live import Live
from rich.panel import Panel
from rich.text import Text

from .chat_session import (
    ChatSession,
    RawToken,
    Turn,
    TurnDone,
    TurnResult,
    TurnStats,
    human_tokens,
)
from .console import Ui
from ..runtime.harmony import MessageEnd, MessageStart, TextDelta, ToolCall
from ..runtime.stop_strings import is_answer_text

REASONING_STYLE = "dim italic"
_TAIL_LINES = 3  # lines of reasoning visible while it is folded


class ChatRenderer:
    """Draws turns and command output for one session (its settings are read live)."""

    def __init__(self, ui: Ui, session: ChatSession) -> None:
        self.ui = ui
        self.session = session

    def run_turn(self, text: str) -> TurnResult | None:
        """Send one message and draw the reply; None when Ctrl+C stopped it (the conversation is
        unchanged and the message is kept for /retry). RequestError (e.g. context overflow) propagates."""
        turn = None
        try:
            turn = self.session.start_turn(text)
            return self.render_turn(turn)
        except KeyboardInterrupt:
            # A second Ctrl+C while cancelling propagates: a forced quit (exit 130).
            if turn is not None:
                turn.cancel()
            else:
                self.session.retry_text = text
            self.interrupted()
            return None

    def render_turn(self, turn: Turn) -> TurnResult | None:
        """Stream one turn; the caller handles KeyboardInterrupt (see `interrupted`)."""
        if turn.dropped_turns:
            self.ui.warn(f"dropped the {turn.dropped_turns} oldest exchange(s) to fit the "
                         f"{self.session.context_limit}-token context (--truncate oldest)")
        view = TurnView(self.ui, self.session.settings.reasoning, self.session.settings.raw)
        try:
            for event in turn:
                view.handle(event)
        finally:
            view.close()
        if turn.result is not None:
            self.after_turn(turn.result)
        return turn.result

    def after_turn(self, result: TurnResult) -> None:
        for warning in result.warnings:
            self.ui.warn(warning)
        if result.cut_in_reasoning:
            self.ui.warn("the token limit was reached while the model was still reasoning, so there is no answer; "
                         "raise --max-tokens (/set max_tokens N) and /retry")
        elif result.stats.finish_reason == "length":
            self.ui.warn(f"the answer was cut at {result.stats.generated_tokens} tokens (max tokens or context)")
        if result.json_problem is not None:
            self.ui.warn(f"--json-schema: {result.json_problem}")
        if self.session.settings.stats:
            self.ui.err.print(Text(stats_line(result.stats), style="dim"), soft_wrap=True)
        if self.ui.verbose:
            self.ui.err.print(Text(verbose_block(result.stats), style="dim"), soft_wrap=True)

    def interrupted(self) -> None:
        self.ui.err.print(Text("[interrupted]", style="yellow"))

    def show(self, text: str) -> None:
        """Command output (/show, /help): a result, so stdout."""
        self.ui.out.print(Text(text), soft_wrap=True)

    def note(self, text: str) -> None:
        self.ui.note(text)


class TurnView:
    """The display state of one streaming turn."""

    def __init__(self, ui: Ui, reasoning: str, raw: bool) -> None:
        self.ui = ui
        self.raw = raw
        self.reasoning = reasoning
        self.fold = reasoning == "collapse" and ui.err.is_terminal
        self.kind: str | None = None  # what the open message is being shown as
        self.answer_open = False
        self.answer_ends_line = True
        self.err_ends_line = True
        self.block_tokens = 0
        self.block_text = ""
        self.block_start: float | None = None
        self.last_time: float | None = None
        self.live: Live | None = None

    # -- dispatch ------------------------------------------------------------------------------
    def handle(self, event) -> None:
        if isinstance(event, RawToken):
            self._token(event)
        elif self.raw:
            if isinstance(event, TurnDone):
                self._end_answer()
        elif isinstance(event, MessageStart):
            self._start(event)
        elif isinstance(event, TextDelta):
            self._text(event)
        elif isinstance(event, MessageEnd):
            self._end()
        elif isinstance(event, ToolCall):
            self._tool_call(event)
        elif isinstance(event, TurnDone):
            self._done(event.result)

    def close(self) -> None:
        """Leave the terminal tidy, also after Ctrl+C."""
        self._stop_live()
        self._end_answer()
        self._end_err_line()

    # -- tokens --------------------------------------------------------------------------------
    def _token(self, event: RawToken) -> None:
        if self.block_start is None:
            self.block_start = self.last_time if self.last_time is not None else event.time
        self.last_time = event.time
        if event.reasoning:
            self.block_tokens += 1
        if self.raw:
            self._write_answer(event.text)

    # -- messages ------------------------------------------------------------------------------
    def _start(self, event: MessageStart) -> None:
        if event.role != "assistant" or event.recipient is not None:
            self.kind = None  # tool calls are shown whole when they end; other roles are not shown
        elif event.channel == "analysis":
            self.kind = "reasoning"
            self._start_reasoning()
        elif is_answer_text(event.channel, event.recipient):
            self.kind = "answer"
            self._end_err_line()
        else:
            self.kind = "preamble"
            self._end_answer()

    def _text(self, event: TextDelta) -> None:
        if self.kind == "answer":
            self.answer_open = True
            self._write_answer(event.text)
        elif self.kind == "reasoning":
            self._reasoning_text(event.text)
        elif self.kind == "preamble":
            self._write_err(event.text, "cyan")

    def _end(self) -> None:
        if self.kind == "reasoning":
            self._end_reasoning()
        elif self.kind == "preamble":
            self._end_err_line()
        self.kind, self.block_start, self.block_tokens = None, None, 0

    # -- reasoning -----------------------------------------------------------------------------
    def _start_reasoning(self) -> None:
        self._end_answer()
        self.block_text = ""
        if self.reasoning == "hide":
            return
        if self.fold:
            self.live = Live(self._folded(), console=self.ui.err, transient=True, refresh_per_second=8)
            self.live.start()
        else:
            self._end_err_line()
            self.ui.err.print(Text("Thinking…", style="dim"))

    def _reasoning_text(self, text: str) -> None:
        if self.reasoning == "hide":
            return
        if self.live is not None:
            self.block_text = (self.block_text + text)[-2000:]
            self.live.update(self._folded())
        else:
            self._write_err(text, REASONING_STYLE)

    def _folded(self) -> Text:
        tail = [line for line in self.block_text.splitlines() if line.strip()][-_TAIL_LINES:]
        width = max(20, self.ui.err.width - 2)
        lines = [f"Thinking… ({self.block_tokens} tokens)"] + [line[-width:] for line in tail]
        return Text("\n".join(lines), style="dim")

    def _end_reasoning(self) -> None:
        if self.reasoning == "hide":
            return
        if self.live is not None:
            self._stop_live()
            seconds = (self.last_time or 0.0) - (self.block_start or self.last_time or 0.0)
            self.ui.err.print(Text(f"Thought for {seconds:.1f}s ({self.block_tokens} tokens)", style="dim"))
        else:
            self._end_err_line()
            self.ui.err.print()

    def _stop_live(self) -> None:
        if self.live is not None:
            self.live.stop()
            self.live = None

    # -- tool calls and the end ----------------------------------------------------------------
    def _tool_call(self, event: ToolCall) -> None:
        self._stop_live()
        self._end_answer()
        self._end_err_line()
        args = pretty_arguments(event.arguments_text)
        if self.ui.err.is_terminal:
            self.ui.err.print(Panel(Text(args), title=f"tool call → {event.recipient}", title_align="left",
                                    subtitle="not executed", subtitle_align="right", border_style="cyan"))
        else:
            self.ui.err.print(Text(f"[tool call → {event.recipient}] {args} (not executed)"), soft_wrap=True)

    def _done(self, result: TurnResult) -> None:
        self._stop_live()
        if result.fallback_text is not None:
            self._end_err_line()
            self._write_answer(result.fallback_text)
            self._end_answer()
            self.ui.note("(the model's output was not in the harmony format; shown as plain text)")
        self._end_answer()

    # -- low-level writes ----------------------------------------------------------------------
    def _write_answer(self, text: str) -> None:
        if not text:
            return
        self.answer_open = True
        self.ui.out.print(text, end="", markup=False, highlight=False, emoji=False, soft_wrap=True)
        self.answer_ends_line = text.endswith("\n")

    def _end_answer(self) -> None:
        if self.answer_open and not self.answer_ends_line:
            self.ui.out.print()
        self.answer_open, self.answer_ends_line = False, True

    def _write_err(self, text: str, style: str) -> None:
        if not text:
            return
        self.ui.err.print(Text(text, style=style), end="", soft_wrap=True)
        self.err_ends_line = text.endswith("\n")

    def _end_err_line(self) -> None:
        if not self.err_ends_line:
            self.ui.err.print()
        self.err_ends_line = True


def pretty_arguments(text: str) -> str:
    try:
        return json.dumps(json.loads(text), indent=2, ensure_ascii=False)
    except (ValueError, TypeError):
        return text


def stats_line(stats: TurnStats) -> str:
    """`TTFT 0.21s · answer 1.94s · 143.2 tok/s · 512 tok (310 reasoning) · ctx 3.1k/131k`."""
    parts = []
    if stats.ttft is not None:
        parts.append(f"TTFT {stats.ttft:.2f}s")
    if stats.time_to_answer is not None:
        parts.append(f"answer {stats.time_to_answer:.2f}s")
    rate = stats.decode_tokens_per_second
    if rate is not None:
        parts.append(f"{rate:.1f} tok/s")
    parts.append(f"{stats.generated_tokens} tok ({stats.reasoning_tokens} reasoning)")
    parts.append(f"ctx {human_tokens(stats.context_used)}/{human_tokens(stats.context_limit)}")
    if stats.format_errors:
        parts.append(f"{stats.format_errors} format error{'s' if stats.format_errors > 1 else ''}")
    return " · ".join(parts)


def verbose_block(stats: TurnStats) -> str:
    """ollama's --verbose summary, in its words: durations, counts and rates of the prompt (the
    tokens actually computed, after the prefix cache) and of the generated tokens."""
    ttft = stats.ttft or 0.0
    computed = stats.prompt_tokens - stats.cached_prompt_tokens
    rows = [("total duration", f"{ttft + stats.decode_seconds:.3f}s"),
            ("prompt eval count", f"{computed} token(s), {stats.cached_prompt_tokens} more from the prefix cache"),
            ("prompt eval duration", f"{ttft:.3f}s"),
            ("prompt eval rate", f"{computed / ttft:.2f} tokens/s" if ttft > 0 else "n/a"),
            ("eval count", f"{stats.generated_tokens} token(s), {stats.reasoning_tokens} of them reasoning"),
            ("eval duration", f"{stats.decode_seconds:.3f}s")]
    rate = stats.decode_tokens_per_second
    rows.append(("eval rate", f"{rate:.2f} tokens/s" if rate is not None else "n/a"))
    return "\n".join(f"{name + ':':<22}{value}" for name, value in rows)


def toolbar_text(session: ChatSession, context_used: int) -> str:
    """`gpt-oss-20b · effort medium · ctx 3.1k/131k · T=1.0`."""
    s = session.settings
    parts = [session.model_name, f"effort {s.effort}",
             f"ctx {human_tokens(context_used)}/{human_tokens(session.context_limit)}", f"T={s.temperature:g}"]
    if s.raw:
        parts.append("raw")
    return " · ".join(parts)


def settings_text(session: ChatSession) -> str:
    s = session.settings
    rows = [
        ("model", session.model_name), ("effort", s.effort), ("reasoning", s.reasoning),
        ("temperature", f"{s.temperature:g}"), ("top_p", f"{s.top_p:g}"), ("top_k", str(s.top_k or "off")),
        ("min_p", f"{s.min_p:g}"), ("repetition_penalty", "off" if s.repetition_penalty == 1 else f"{s.repetition_penalty:g}"),
        ("seed", "random" if s.seed is None else str(s.seed)),
        ("max_tokens", "up to the context" if s.max_tokens is None else str(s.max_tokens)),
        ("stop", stops_text(s.stop)),
        ("context", str(session.context_limit)), ("truncate", s.truncate),
        ("raw", "on" if s.raw else "off"), ("stats", "on" if s.stats else "off"),
        ("developer", "(none)" if not s.developer else _one_line(s.developer)),
    ]
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}} {value}" for name, value in rows)


def stops_text(stops: tuple[str, ...]) -> str:
    """Stop sequences as typed with /set stop (JSON string quoting: newlines show as \\n)."""
    return ", ".join(json.dumps(s, ensure_ascii=False) for s in stops) or "(none)"


def context_text(session: ChatSession) -> str:
    used, limit = session.context_used(), session.context_limit
    exchanges = sum(1 for m in session.messages if m.role == "user")
    lines = [f"{used} of {limit} tokens used ({100 * used / limit:.1f}%), {exchanges} exchange(s)",
             f"{session.reply_reserve()} tokens are kept free for each reply"]
    if session.last_stats is not None:
        st = session.last_stats
        lines.append(f"last turn: {st.prompt_tokens} prompt tokens, {st.cached_prompt_tokens} reused from the "
                     f"prefix cache, {st.generated_tokens} generated")
    return "\n".join(lines)


def model_text(session: ChatSession) -> str:
    cfg = session.engine.config
    engine = type(session.engine).__name__
    return "\n".join([
        f"{session.model_name} on {engine}",
        f"layers {cfg.num_hidden_layers} · hidden {cfg.hidden_size} · experts {cfg.num_local_experts} "
        f"(top {cfg.num_experts_per_tok}) · vocab {cfg.vocab_size}",
        f"context {session.engine.max_context} tokens (chat limit {session.context_limit})",
    ])


def _one_line(text: str, width: int = 60) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= width else flat[: width - 1] + "…"
