"""Exit codes and the last line of defence: every failure becomes one line and a documented code.

0 ok · 1 error · 2 usage · 3 some batch records failed · 4 model or hardware precheck failed ·
130 interrupted. Tracebacks only with --debug (or GPTOSS_DEBUG=1), and never with locals, so
secrets such as HF_TOKEN cannot leak into one.
"""

from __future__ import annotations

OK = 0
ERROR = 1
USAGE = 2
PARTIAL_FAILURE = 3
PRECHECK_FAILED = 4
INTERRUPTED = 130


class UsageError(Exception):
    """A flag or argument combination that makes no sense; exit code 2."""

    def __init__(self, message: str, hint: str = "") -> None:
        super().__init__(message)
        self.hint = hint
