"""Reading a text file the user named (--developer @FILE, --json-schema FILE, /read FILE): the text,
or one short reason the caller puts in its one-line error."""

from __future__ import annotations

from pathlib import Path


class TextFileError(Exception):
    """Why a user's file could not be read as text, e.g. "no such file"."""


def read_text_file(path: str | Path) -> str:
    """The UTF-8 text of `path` (~ expanded); TextFileError for a missing, unreadable or non-UTF-8 file."""
    try:
        return Path(path).expanduser().read_text(encoding="utf-8")
    except FileNotFoundError:
        raise TextFileError("no such file") from None
    except IsADirectoryError:
        raise TextFileError("a directory, not a file") from None
    except UnicodeDecodeError:
        raise TextFileError("not UTF-8 text") from None
    except OSError as e:
        raise TextFileError(f"cannot read it ({e.strerror or e})") from None
