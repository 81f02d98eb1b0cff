"""A Ctrl+C typed in the moment between Enter and the reply.

prompt_toolkit reads the terminal in raw mode, where Ctrl+C is a plain byte, and hands it back in
its normal mode (Ctrl+C raises SIGINT) only after the prompt returns. A Ctrl+C typed in between
was delivered to the *next* prompt: the reply ran to its end and then the empty prompt printed
the quit hint. It can wait in two places: prompt_toolkit's typeahead buffer (read together with
the Enter) or the terminal's input queue (typed after the last read, before the mode switch).
`interrupt_pending` looks in both before a turn starts; every other key stays typeahead for the
next prompt.
"""

from __future__ import annotations

import os

from prompt_toolkit.input import Input
from prompt_toolkit.input.typeahead import get_typeahead, store_typeahead
from prompt_toolkit.input.vt100_parser import Vt100Parser
from prompt_toolkit.key_binding import KeyPress
from prompt_toolkit.keys import Keys


def interrupt_pending(app_input: Input) -> bool:
    """Whether a Ctrl+C is waiting; it is consumed with everything typed before it."""
    keys = get_typeahead(app_input) + _parse(_queued_bytes(app_input))
    last = max((i for i, k in enumerate(keys) if k.key == Keys.ControlC), default=None)
    store_typeahead(app_input, keys if last is None else keys[last + 1:])
    return last is not None


def _parse(data: bytes) -> list[KeyPress]:
    keys: list[KeyPress] = []
    if data:
        Vt100Parser(keys.append).feed_and_flush(data.decode("utf-8", "replace"))
    return keys


def _queued_bytes(app_input: Input) -> bytes:
    """What waits in the terminal's input queue, read without blocking (nothing off a terminal)."""
    try:
        fd = app_input.fileno()
    except (AttributeError, NotImplementedError, ValueError):
        return b""
    if not os.isatty(fd):
        return b""
    return read_queued(fd)


def read_queued(fd: int) -> bytes:
    """Read the bytes queued on terminal `fd` now: non-canonical with VMIN = VTIME = 0 makes them
    readable without waiting for a line end; the terminal's settings are restored after."""
    import termios

    old = termios.tcgetattr(fd)
    now = list(old)
    now[3] &= ~termios.ICANON
    now[6] = list(old[6])
    now[6][termios.VMIN] = 0
    now[6][termios.VTIME] = 0
    chunks = []
    try:
        termios.tcsetattr(fd, termios.TCSANOW, now)
        while chunk := os.read(fd, 4096):
            chunks.append(chunk)
    finally:
        termios.tcsetattr(fd, termios.TCSANOW, old)
    return b"".join(chunks)
