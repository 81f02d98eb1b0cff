"""Typed errors the runtime raises for problems a user can fix.

The CLI maps each class to a one-line message and an exit code; the runtime never prints.
Every error carries a `hint` saying how to fix the problem.
"""

from __future__ import annotations


class GptossError(Exception):
    """Base class: `str(e)` is the one-line message, `e.hint` the fix."""

    exit_code = 1

    def __init__(self, message: str, hint: str = "") -> None:
        super().__init__(message)
        self.hint = hint


class CheckpointError(GptossError):
    """The checkpoint directory is missing, incomplete, corrupted or not gpt-oss."""

    exit_code = 4


class ModelSpecError(GptossError):
    """A model argument (alias, path, random:NAME) that cannot be resolved."""

    exit_code = 4


class TokenizerError(GptossError):
    """tokenizer.json is missing or not an o200k-style byte-level BPE."""

    exit_code = 4


class HardwareError(GptossError):
    """The model does not fit, or the GPU cannot run our kernels."""

    exit_code = 4


class RequestError(GptossError):
    """One request is invalid (too long, bad sampling values); others are unaffected."""

    def __init__(self, message: str, hint: str = "", code: str = "invalid_request") -> None:
        super().__init__(message, hint)
        self.code = code
