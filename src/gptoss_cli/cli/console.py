"""The CLI's two output sinks and how errors look.

stdout carries results only (answers, JSONL, paths, --json); everything else (progress, stats,
warnings, reasoning when piped) goes to stderr. Colour follows --color, NO_COLOR, FORCE_COLOR and
TERM=dumb; nothing animated is drawn when the stream is not a terminal.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

from rich.console import Console
from rich.markup import escape

COLOR_CHOICES = ("auto", "always", "never")


@dataclass
class Ui:
    """Both consoles plus the switches every command honours."""

    out: Console
    err: Console
    debug: bool = False
    verbose: bool = False  # --verbose: chat adds a timing block after each reply

    @property
    def interactive(self) -> bool:
        """Animated progress and live redraws only when stderr is a terminal."""
        return self.err.is_terminal

    def warn(self, message: str) -> None:
        self.err.print(f"[yellow]warning:[/] {escape(message)}", soft_wrap=True)

    def note(self, message: str) -> None:
        self.err.print(f"[dim]{escape(message)}[/]", soft_wrap=True)

    def error(self, message: str, hint: str = "") -> None:
        self.err.print(f"[bold red]error:[/] {escape(message)}", soft_wrap=True)
        if hint:
            self.err.print(f"[dim]hint: {escape(hint)}[/]", soft_wrap=True)


def plain_table(headers: list[str], rows: list[list[str]], right: bool = True) -> str:
    """Columns separated by two spaces, right-aligned (numbers) or left-aligned (names, paths):
    easy to read, grep and diff, the same in a pipe as on a terminal."""
    widths = [max([len(h), *(len(r[i]) for r in rows)]) for i, h in enumerate(headers)]
    align = str.rjust if right else str.ljust
    lines = ["  ".join(align(c, w) for c, w in zip(line, widths)).rstrip() for line in [headers, *rows]]
    return "\n".join(lines) + "\n"


def make_ui(color: str = "auto", debug: bool = False, verbose: bool = False) -> Ui:
    """Consoles bound to the current sys.stdout/sys.stderr (so test runners can capture them)."""
    if os.environ.get("TERM") == "dumb" and color == "auto":
        color = "never"
    kwargs: dict = {}
    if color == "never":
        kwargs = {"no_color": True, "color_system": None}
    elif color == "always":
        kwargs = {"force_terminal": True}
    out = Console(file=sys.stdout, highlight=False, soft_wrap=True, **kwargs)
    err = Console(file=sys.stderr, highlight=False, **kwargs)
    return Ui(out=out, err=err, debug=debug, verbose=verbose)
