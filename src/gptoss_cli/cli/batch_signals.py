"""Graceful stop for `gptoss run`: Ctrl+C (or SIGTERM) asks the batch to wind down.

First signal: stop submitting, finish what is generating, flush. Second: abort everything that is
left and flush what is done. The handlers live only while the batch loop runs, and only in the
main thread (Python delivers signals there); elsewhere signals keep their usual behaviour.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType


class StopRequests:
    """Counts stop signals while installed (a context manager)."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.count = 0
        self._previous: dict[int, object] = {}

    @property
    def stopping(self) -> bool:
        return self.count >= 1

    @property
    def aborting(self) -> bool:
        return self.count >= 2

    def request(self) -> None:
        """What a signal does; also callable directly (tests, other stop conditions)."""
        self.count += 1

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.request()

    def __enter__(self) -> StopRequests:
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
