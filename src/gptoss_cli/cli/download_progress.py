"""Download progress on stderr: the hub's `Progress` protocol drawn for people.

On a terminal: a Rich display with a total bar and one bar per file in flight (bytes, rate, ETA).
Otherwise: one plain line per finished file and a status line at most every `log_interval` seconds.
Both warn once when no byte has arrived for `stall_after` seconds. Callbacks come from the
download's worker threads; a small ticker thread drives the periodic line and the stall check.
Imports no hub code, so it stays cheap to import and easy to test with a fake clock.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from rich.filesize import decimal as format_size
from rich.markup import escape
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)

from .console import Ui

_NAME_WIDTH = 40


def clock_text(seconds: float) -> str:
    """`02:05`, or `1:02:05` past an hour."""
    seconds = int(max(0.0, seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes:02d}:{secs:02d}"


def short_name(path: str, width: int = _NAME_WIDTH) -> str:
    """Keep the end of a long repo path: it is the part that tells shards apart."""
    return path if len(path) <= width else "…" + path[-(width - 1):]


@dataclass
class Tally:
    """What has arrived so far; every field is guarded by DownloadProgress's lock."""

    total_bytes: int = 0
    num_files: int = 0
    bytes_done: int = 0
    files_done: int = 0
    in_flight: dict[str, list[int]] = field(default_factory=dict)  # path -> [size, bytes received]

    def waiting_files(self) -> list[str]:
        """Files still expecting bytes (a file fully received may just be being hashed)."""
        return [path for path, (size, got) in self.in_flight.items() if got < size]


def status_text(tally: Tally, elapsed: float) -> str:
    """`1.2 GB/13.8 GB · 9% · 85.0 MB/s · ETA 02:28 · 2/7 files`."""
    pct = 100 * tally.bytes_done / tally.total_bytes if tally.total_bytes else 100.0
    rate = tally.bytes_done / elapsed if elapsed > 0 else 0.0
    left = max(0, tally.total_bytes - tally.bytes_done)
    eta = clock_text(left / rate) if rate > 0 else "?"
    return (f"{format_size(max(0, tally.bytes_done))}/{format_size(tally.total_bytes)} · {pct:.0f}% · "
            f"{format_size(int(rate))}/s · ETA {eta} · {tally.files_done}/{tally.num_files} files")


class DownloadProgress:
    """A hub `Progress` that draws on `ui.err`: Rich bars when interactive, plain lines otherwise.

    `tick_every=None` starts no ticker thread (tests call `tick()` themselves).
    """

    def __init__(self, ui: Ui, *, log_interval: float = 10.0, stall_after: float = 60.0,
                 tick_every: float | None = 1.0, clock: Callable[[], float] = time.monotonic) -> None:
        self._ui = ui
        self._clock = clock
        self._log_interval, self._stall_after, self._tick_every = log_interval, stall_after, tick_every
        self._lock = threading.Lock()
        self.tally = Tally()
        self._started = self._last_log = self._last_bytes = clock()
        self._stall_warned = False
        self._bars: _Bars | None = None
        self._stop = threading.Event()
        self._ticker: threading.Thread | None = None

    # --- the hub's Progress protocol (start/done on the calling thread, the rest on workers) ---

    def start(self, total_bytes: int, num_files: int) -> None:
        with self._lock:
            self.tally.total_bytes, self.tally.num_files = total_bytes, num_files
            self._started = self._last_log = self._last_bytes = self._clock()
        if num_files == 0:
            return
        if self._ui.interactive:
            self._bars = _Bars(self._ui, total_bytes, num_files)
        if self._tick_every:
            self._ticker = threading.Thread(target=self._tick_loop, name="gptoss-download-ticker", daemon=True)
            self._ticker.start()

    def file_start(self, path: str, size: int) -> None:
        with self._lock:
            self.tally.in_flight[path] = [size, 0]
        if self._bars is not None:
            self._bars.add_file(path, size)

    def advance(self, path: str, nbytes: int) -> None:
        with self._lock:
            self.tally.bytes_done += nbytes
            entry = self.tally.in_flight.get(path)
            if entry is not None:
                entry[1] += nbytes
            if nbytes > 0:
                self._last_bytes = self._clock()
                self._stall_warned = False
            file_bytes = entry[1] if entry is not None else 0
            total_bytes = self.tally.bytes_done
        if self._bars is not None:
            self._bars.advance(path, nbytes, file_bytes, total_bytes)

    def file_done(self, path: str) -> None:
        with self._lock:
            size = self.tally.in_flight.pop(path, [0, 0])[0]
            self.tally.files_done += 1
            done, total = self.tally.files_done, self.tally.num_files
        if self._bars is not None:
            self._bars.remove_file(path, done, total)
        self._ui.err.print(f"[dim]fetched[/] {escape(path)} [dim]({format_size(size)}, {done}/{total} files)[/]",
                           soft_wrap=True)

    def done(self) -> None:
        self._stop.set()
        if self._ticker is not None and self._ticker is not threading.current_thread():
            self._ticker.join()
        self._ticker = None
        if self._bars is not None:
            self._bars.stop()
            self._bars = None

    # --- periodic work ---

    def tick(self) -> None:
        """Warn about a stall; when not drawing bars, log a status line every `log_interval` seconds."""
        now = self._clock()
        with self._lock:
            stalled = self._stall_message(now)
            status = self._status_due(now)
        if stalled:
            self._ui.warn(stalled)
        if status:
            self._ui.note(status)

    def _stall_message(self, now: float) -> str | None:
        waiting = self.tally.waiting_files()
        if self._stall_warned or not waiting or now - self._last_bytes < self._stall_after:
            return None
        self._stall_warned = True
        names = ", ".join(short_name(p) for p in waiting[:3]) + (" …" if len(waiting) > 3 else "")
        return (f"no data received for {int(now - self._last_bytes)} s (waiting for {names}); "
                "check the connection, or press Ctrl+C and run the same command again to resume")

    def _status_due(self, now: float) -> str | None:
        if self._bars is not None or now - self._last_log < self._log_interval:
            return None
        if self.tally.files_done >= self.tally.num_files:
            return None
        self._last_log = now
        return status_text(self.tally, now - self._started)

    def _tick_loop(self) -> None:
        while not self._stop.wait(self._tick_every):
            self.tick()


class _Bars:
    """The Rich display: a total bar plus a bar per file in flight (removed when it finishes)."""

    def __init__(self, ui: Ui, total_bytes: int, num_files: int) -> None:
        self._progress = Progress(
            TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
            TimeRemainingColumn(), console=ui.err, transient=True, redirect_stdout=False, redirect_stderr=False,
        )
        self._files: dict[str, TaskID] = {}
        self._total = self._progress.add_task(self._total_label(0, num_files), total=total_bytes)
        self._progress.start()

    @staticmethod
    def _total_label(done: int, total: int) -> str:
        return f"[bold]total[/] ({done}/{total} files)"

    def add_file(self, path: str, size: int) -> None:
        self._files[path] = self._progress.add_task(escape(short_name(path)), total=size)

    def advance(self, path: str, nbytes: int, file_bytes: int, total_bytes: int) -> None:
        task = self._files.get(path)
        if nbytes >= 0:
            if task is not None:
                self._progress.advance(task, nbytes)
            self._progress.advance(self._total, nbytes)
            return
        # Bytes thrown away for a restart: a negative sample would make Rich show a negative speed,
        # so the rate estimate starts over instead.
        if task is not None:
            self._progress.reset(task, completed=max(0, file_bytes))
        self._progress.reset(self._total, completed=max(0, total_bytes))

    def remove_file(self, path: str, done: int, total: int) -> None:
        task = self._files.pop(path, None)
        if task is not None:
            self._progress.remove_task(task)
        self._progress.update(self._total, description=self._total_label(done, total))

    def stop(self) -> None:
        self._progress.stop()
