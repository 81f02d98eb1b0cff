"""`gptoss chat` end to end in a real pseudo-terminal: prompt, streamed reply and stats line,
Ctrl+C during a reply (SIGINT from the terminal) and right after Enter, Ctrl+D to quit. Rules that keep pexpect reliable:
Enter is "\\r", and every keystroke waits for the prompt (or output) it depends on."""

from __future__ import annotations

import os
import signal
import sys

import pytest

pexpect = pytest.importorskip("pexpect")
pytest.importorskip("prompt_toolkit")

# Everything after the prompt line is ours: prompt_toolkit switches bracketed paste off (ESC[?2004l)
# as it hands the terminal back, so the next visible character is the reply streaming.
REPLY_STARTED = r"\x1b\[\?2004l(?:\x1b\[[0-9;]*m)*[^\x1b]"


@pytest.mark.timeout(240)
@pytest.mark.skipif(sys.platform == "win32", reason="needs a POSIX pseudo-terminal")
def test_chat_in_a_real_terminal(tmp_path):
    env = dict(os.environ, PROMPT_TOOLKIT_NO_CPR="1", HOME=str(tmp_path), TERM="xterm",
               XDG_DATA_HOME=str(tmp_path / "data"), XDG_STATE_HOME=str(tmp_path / "state"))
    env.pop("GPTOSS_NO_HISTORY", None)
    # SIGINT back to its default in the child: a test run started in the background by a shell
    # inherits it ignored, and Python then never raises KeyboardInterrupt (CI failed so, session 8).
    child = pexpect.spawn(sys.executable, ["-m", "gptoss_cli", "chat", "--model", "random:tiny", "--max-tokens", "8",
                                           "--no-history"],
                          env=env, dimensions=(30, 100), encoding="utf-8", timeout=150,
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        child.expect(">>>")
        child.send("hello there\r")
        child.expect(r"8 tok \(\d+ reasoning\) · ctx \d+/131k")
        child.expect(">>>")

        child.send("/set max_tokens 500\r")  # long enough to be stopped mid-reply
        child.expect("max_tokens = 500")
        child.expect(">>>")
        child.send("/raw on\r")  # raw tokens stream visibly, so we know generation has begun
        child.expect("raw on")
        child.expect(">>>")
        child.send("tell me more\r")
        child.expect(REPLY_STARTED)
        # A visible character of the reply itself: what follows ESC[?2004l can still be
        # prompt_toolkit's own line end, and a Ctrl+C sent before it has restored the terminal's
        # signal keys arrives as a plain byte, so the reply runs on.
        child.expect(r"[^\s\x1b]")
        child.send("\x03")
        child.expect(r"\[interrupted\]")
        child.expect(">>>")

        # Enter and Ctrl+C in one write: prompt_toolkit reads both, returns at the Enter and keeps
        # the Ctrl+C as typeahead; the turn must not start (chat_keys.py), the message waits for /retry.
        child.send("and again\r\x03")
        child.expect(r"\[interrupted\]")
        child.expect(">>>")

        child.send("\x04")
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0, child.before
    # --no-history: neither input history nor conversations were written
    assert not (tmp_path / "data").exists() and not (tmp_path / "state").exists()
