"""The validation pre-pass over a `gptoss run` input, and the second (run) pass that replays it.

The pre-pass reads the input once before the model loads: it hashes every byte (for the resume
sidecar), validates every line up to --limit, finds duplicate ids and collects once-per-key
warnings. It keeps only small per-line facts (the ids seen, the errors), so memory grows with
the number of lines, not their size. The run pass parses the lines again, one at a time.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import IO

from .batch_input import MAX_LINE_BYTES, BatchLine, LineError, parse_line, read_raw_lines

_HASH_CHUNK = 1 << 20


@dataclass
class Note:
    """A warning shown once per key: where it first appeared and how often."""

    first_line: int
    count: int = 1


@dataclass
class InputScan:
    sha256: str = ""
    records: int = 0  # lines that produce a record (blank and comment lines excluded)
    todo: int = 0  # records this run will write (resume skips the rest)
    valid: int = 0  # records with a runnable request among `todo`
    errors: dict[int, LineError] = field(default_factory=dict)  # line number -> why it cannot run
    notes: dict[str, Note] = field(default_factory=dict)
    models: dict[str, int] = field(default_factory=dict)  # requested model -> first line
    first_kind: str | None = None  # shape of the first readable line, for unreadable lines' records


# (line number, custom id, has an error) -> whether an earlier run already wrote its record
SkipRule = Callable[[int, str, bool], bool]


class _HashingReader:
    """A binary stream wrapper that hashes everything read through it."""

    def __init__(self, stream: IO[bytes]) -> None:
        self._stream = stream
        self.digest = hashlib.sha256()

    def readline(self, size: int = -1) -> bytes:
        data = self._stream.readline(size)
        self.digest.update(data)
        return data

    def drain(self) -> None:
        while chunk := self._stream.read(_HASH_CHUNK):
            self.digest.update(chunk)


def scan_input(stream: IO[bytes], limit: int | None = None, skip: SkipRule | None = None,
               max_line_bytes: int = MAX_LINE_BYTES) -> InputScan:
    """Validate every line (up to `limit` records) and hash the whole stream."""
    reader = _HashingReader(stream)
    scan = InputScan()
    seen: dict[str, int] = {}
    for line in iter_lines(reader, limit, max_line_bytes):
        scan.records += 1
        line = _check_duplicate(line, seen)
        if line.error is not None:
            scan.errors[line.number] = line.error
        _collect(scan, line)
        if skip is None or not skip(line.number, line.custom_id, line.error is not None):
            scan.todo += 1
            scan.valid += line.error is None
    reader.drain()
    scan.sha256 = reader.digest.hexdigest()
    return scan


def iter_lines(stream, limit: int | None = None, max_line_bytes: int = MAX_LINE_BYTES) -> Iterator[BatchLine]:
    """Parsed non-blank lines, at most `limit` of them."""
    count = 0
    for raw in read_raw_lines(stream, max_line_bytes):
        if limit is not None and count >= limit:
            return
        line = parse_line(raw, max_line_bytes)
        if line is not None:
            count += 1
            yield line


def replay(stream: IO[bytes], scan: InputScan, limit: int | None = None,
           max_line_bytes: int = MAX_LINE_BYTES) -> Iterator[BatchLine]:
    """The run pass: the same lines again, with the pre-pass's verdicts (duplicates) applied."""
    for line in iter_lines(stream, limit, max_line_bytes):
        error = scan.errors.get(line.number)
        yield line if error is None or line.error == error else line.with_error(error)


def _check_duplicate(line: BatchLine, seen: dict[str, int]) -> BatchLine:
    first = seen.setdefault(line.custom_id, line.number)
    if first == line.number or line.error is not None:
        return line
    return line.with_error(LineError("duplicate_custom_id", f"custom_id {line.custom_id!r} is already used on line {first}",
                                     "custom_id"))


def _collect(scan: InputScan, line: BatchLine) -> None:
    if scan.first_kind is None and line.kind is not None:
        scan.first_kind = line.kind
    for key in line.notes:
        note = scan.notes.get(key)
        if note is None:
            scan.notes[key] = Note(line.number)
        else:
            note.count += 1
    model = line.request.model if line.request is not None else None
    if model is not None and model not in scan.models and len(scan.models) < 8:
        scan.models[model] = line.number
