"""Where finished `gptoss run` records go: durable append-only files, in input order by default.

DurableFile appends whole lines with os.write on an O_APPEND descriptor and fsyncs at most every
`sync_interval` seconds and on close. Data handed to os.write survives the process being killed;
fsync covers power loss. If a write or fsync fails (disk full), the file is cut back to its last
complete line before the error is raised, so no torn record is left and --resume can continue.

RecordWriter keeps only out-of-order finished records in memory and writes each contiguous run
of records as soon as it is complete (`--unordered` writes each one at once).
"""

from __future__ import annotations

import errno
import os
import time
from pathlib import Path
from typing import IO, Protocol

from ..runtime.errors import GptossError
from .batch_output import encode_record


class OutputWriteError(GptossError):
    """An output file could not be written (disk full, I/O error)."""


class LineSink(Protocol):
    def write_lines(self, lines: list[bytes]) -> None: ...
    def close(self) -> None: ...


class DurableFile:
    """An append-only JSONL file that never keeps a partial line after a failed write."""

    def __init__(self, path: str | Path, sync_interval: float = 0.5) -> None:
        self.path = Path(path)
        self.sync_interval = sync_interval
        self._fd: int | None = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._size = os.fstat(self._fd).st_size
        self._synced = self._size
        self._last_sync = time.monotonic()

    def write_lines(self, lines: list[bytes]) -> None:
        if not lines:
            return
        data = b"".join(lines)
        try:
            self._write_all(data)
        except OSError as e:
            self._cut_back(self._size)
            raise self._error(e) from None
        self._size += len(data)
        if time.monotonic() - self._last_sync >= self.sync_interval:
            self.sync()

    def sync(self) -> None:
        if self._fd is None:
            return
        try:
            self._os_fsync(self._fd)
        except OSError as e:
            # What fsync could not persist is unknown: keep only what an earlier fsync confirmed.
            self._cut_back(self._synced)
            self._size = self._synced
            raise self._error(e) from None
        self._synced = self._size
        self._last_sync = time.monotonic()

    def close(self) -> None:
        if self._fd is None:
            return
        try:
            self.sync()
        finally:
            os.close(self._fd)
            self._fd = None

    def _write_all(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            written = self._os_write(self._fd, view)
            view = view[written:]

    # The two system calls are methods so tests can simulate a full disk.
    def _os_write(self, fd: int, data: memoryview) -> int:
        return os.write(fd, data)

    def _os_fsync(self, fd: int) -> None:
        os.fsync(fd)

    def _cut_back(self, size: int) -> None:
        try:
            os.ftruncate(self._fd, size)
        except OSError:
            pass  # resume drops a torn last line anyway

    def _error(self, e: OSError) -> OutputWriteError:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            return OutputWriteError(f"disk full while writing {self.path}",
                                    "free some space, then rerun the same command with --resume "
                                    "(every record written so far is complete and kept)")
        return OutputWriteError(f"cannot write {self.path}: {e.strerror or e}",
                                "fix the problem, then rerun the same command with --resume")


class StreamSink:
    """Records to a stream (stdout for `-o -`), flushed after every batch of lines."""

    def __init__(self, stream: IO) -> None:
        self._stream = stream

    def write_lines(self, lines: list[bytes]) -> None:
        if not lines:
            return
        data = b"".join(lines)
        binary = getattr(self._stream, "buffer", None)
        if binary is not None:
            self._stream.flush()
            binary.write(data)
            binary.flush()
        else:
            self._stream.write(data.decode("utf-8"))
            self._stream.flush()

    def close(self) -> None:
        pass


class RecordWriter:
    """Routes records to the output (or the error file) in `seq` order unless `ordered` is False."""

    def __init__(self, output: LineSink, errors: LineSink | None = None, ordered: bool = True) -> None:
        self._output = output
        self._errors = errors
        self._ordered = ordered
        self._buffer: dict[int, tuple[dict | None, bool]] = {}
        self.next_seq = 0  # the first record not yet written (ordered mode)
        self.written_ok = 0
        self.written_failed = 0

    @property
    def buffered(self) -> int:
        return len(self._buffer)

    def put(self, seq: int, record: dict | None, ok: bool = True) -> None:
        """Hand in record number `seq`; None marks a line that gets no record this run (aborted)."""
        if not self._ordered:
            self._write([(record, ok)])
            return
        if seq < self.next_seq or seq in self._buffer:
            raise ValueError(f"record {seq} was already handed in")
        self._buffer[seq] = (record, ok)
        ready = []
        while self.next_seq in self._buffer:
            ready.append(self._buffer.pop(self.next_seq))
            self.next_seq += 1
        self._write(ready)

    def _write(self, items: list[tuple[dict | None, bool]]) -> None:
        out, err = [], []
        for record, ok in items:
            if record is not None:
                (err if not ok and self._errors is not None else out).append((encode_record(record), ok))
        # Count only after the write succeeded: a failed write leaves nothing behind.
        self._output.write_lines([line for line, _ in out])
        self._count(out)
        if self._errors is not None:
            self._errors.write_lines([line for line, _ in err])
            self._count(err)

    def _count(self, lines: list[tuple[bytes, bool]]) -> None:
        for _, ok in lines:
            if ok:
                self.written_ok += 1
            else:
                self.written_failed += 1

    def close(self) -> None:
        """Close both sinks (fsync); records still waiting for an earlier one are not written."""
        try:
            self._output.close()
        finally:
            if self._errors is not None:
                self._errors.close()
