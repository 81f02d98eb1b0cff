"""chat_keys.interrupt_pending: a Ctrl+C typed between Enter and the reply is found in
prompt_toolkit's typeahead or in the terminal's queue; other keys stay typeahead."""

from __future__ import annotations

import fcntl
import os
import struct
import sys
import termios
import time
import tty

import pytest
from prompt_toolkit.input.typeahead import get_typeahead, store_typeahead
from prompt_toolkit.key_binding import KeyPress
from prompt_toolkit.keys import Keys

from gptoss_cli.cli.chat_keys import interrupt_pending, read_queued


class FakeInput:
    """The two things interrupt_pending asks of prompt_toolkit's input."""

    def __init__(self, fd: int | None = None):
        self.fd = fd

    def typeahead_hash(self) -> str:
        return f"fake-{id(self)}"

    def fileno(self) -> int:
        if self.fd is None:
            raise NotImplementedError
        return self.fd


def _keys(inp) -> list:
    return [k.key for k in get_typeahead(inp)]


def test_ctrl_c_in_typeahead_is_consumed_with_what_came_before():
    inp = FakeInput()
    store_typeahead(inp, [KeyPress("x"), KeyPress(Keys.ControlC, "\x03"), KeyPress("a"), KeyPress("b")])
    assert interrupt_pending(inp)
    assert _keys(inp) == ["a", "b"]  # typed after the Ctrl+C: still for the next prompt


def test_other_typeahead_is_kept_and_no_interrupt():
    inp = FakeInput()
    store_typeahead(inp, [KeyPress("h"), KeyPress("i")])
    assert not interrupt_pending(inp)
    assert _keys(inp) == ["h", "i"]
    assert not interrupt_pending(inp) and _keys(inp) == []


def _wait_queued(fd: int, n: int) -> None:
    deadline = time.monotonic() + 5
    while struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0" * 4))[0] < n:
        assert time.monotonic() < deadline, "the pseudo-terminal never queued the bytes"
        time.sleep(0.01)


@pytest.mark.skipif(sys.platform == "win32", reason="needs a POSIX pseudo-terminal")
def test_bytes_queued_in_raw_mode_are_read_after_the_switch_back():
    # What prompt_toolkit leaves behind: bytes that arrived in raw mode, then the terminal back in
    # canonical mode with signals on, so the queued Ctrl+C is data and no line end follows it.
    controller, terminal = os.openpty()
    try:
        cooked = termios.tcgetattr(terminal)
        tty.setraw(terminal)
        os.write(controller, b"ok\x03z")
        _wait_queued(terminal, 4)  # the line discipline takes the bytes in asynchronously
        termios.tcsetattr(terminal, termios.TCSANOW, cooked)
        inp = FakeInput(terminal)
        assert interrupt_pending(inp)
        assert _keys(inp) == ["z"]
        assert termios.tcgetattr(terminal) == cooked  # settings restored
        os.write(controller, b"later\n")
        assert read_queued(terminal) == b"later\n"
    finally:
        os.close(controller)
        os.close(terminal)
