"""Progress of a `gptoss run` on stderr: a Rich bar on a terminal, a plain line every ~10 s otherwise.

Shown: records done of the total, percent, requests/s, output tokens/s, errors, elapsed and ETA.
The clock is injectable so the plain-log cadence can be tested without sleeping.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from rich.progress import BarColumn, Progress, TextColumn

from .console import Ui


@dataclass
class Counts:
    total: int
    done: int = 0
    failed: int = 0
    out_tokens: int = 0


def _clock_text(seconds: float) -> str:
    seconds = int(max(0, seconds))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m:02d}:{s:02d}"


def progress_text(counts: Counts, elapsed: float) -> str:
    """`412/1000 · 41% · 6.8 req/s · 2,950 out tok/s · errors 3 · 01:02 < 01:25`."""
    pct = 100 * counts.done / counts.total if counts.total else 100.0
    rate = counts.done / elapsed if elapsed > 0 else 0.0
    tok_rate = counts.out_tokens / elapsed if elapsed > 0 else 0.0
    left = counts.total - counts.done
    eta = _clock_text(left / rate) if rate > 0 else "?"
    return (f"{counts.done}/{counts.total} · {pct:.0f}% · {rate:.1f} req/s · {tok_rate:,.0f} out tok/s · "
            f"errors {counts.failed} · {_clock_text(elapsed)} < {eta}")


class BatchProgress:
    """Feed it finished records and generated tokens; it redraws or logs as appropriate."""

    def __init__(self, ui: Ui, total: int, log_interval: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.counts = Counts(total)
        self._ui = ui
        self._clock = clock
        self._start = clock()
        self._interval = log_interval
        self._last_log = self._start
        self._bar: Progress | None = None
        self._task = None

    def __enter__(self) -> BatchProgress:
        if self._ui.interactive and self.counts.total:
            self._bar = Progress(TextColumn("run"), BarColumn(), TextColumn("{task.fields[text]}"),
                                 console=self._ui.err, transient=True)
            self._bar.start()
            self._task = self._bar.add_task("run", total=self.counts.total, text=self._text())
        return self

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None

    @property
    def elapsed(self) -> float:
        return self._clock() - self._start

    def tokens(self, n: int) -> None:
        self.counts.out_tokens += n

    def record(self, ok: bool) -> None:
        self.counts.done += 1
        self.counts.failed += not ok

    def tick(self) -> None:
        """Called once per engine step: redraw the bar, or log a line when the interval has passed."""
        if self._bar is not None:
            self._bar.update(self._task, completed=self.counts.done, text=self._text())
            return
        now = self._clock()
        if now - self._last_log >= self._interval:
            self._last_log = now
            self._ui.err.print(f"[dim]{self._text()}[/]", soft_wrap=True)

    def _text(self) -> str:
        return progress_text(self.counts, self.elapsed)
