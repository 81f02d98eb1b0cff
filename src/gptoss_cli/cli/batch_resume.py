"""Making `gptoss run` safe to stop and restart: the output lock, the meta sidecar, resume state.

- `<out>.lock`: an fcntl.flock held for the whole run, so a second run on the same output is
  refused (the kernel releases it when the process dies, even on SIGKILL).
- `<out>.meta.json`: the input's sha256, the model, effort and sampling defaults; --resume refuses
  an output written for another input or configuration unless --force.
- Prior records: the existing output is read back (a torn last line, from a crash mid-write, is
  cut off), giving the ids that already succeeded or failed and the lines that failed.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from .. import __version__
from ..runtime.errors import GptossError
from .batch_output import verdict
from .errors import UsageError

# Settings that change what a record contains; a resumed run must use the same ones.
_MATCHED = {"input_sha256": "input", "model": "model", "effort": "--effort", "sampling": "sampling defaults"}


class OutputBusyError(GptossError):
    """Another process holds the output's lock."""


@dataclass
class PriorRecords:
    ok_ids: set[str] = field(default_factory=set)
    failed_ids: set[str] = field(default_factory=set)
    failed_lines: set[int] = field(default_factory=set)
    records: int = 0
    unreadable: int = 0  # complete lines in the middle that are not records (left alone)
    torn_bytes: int = 0  # bytes of a torn last line that were cut off

    def should_skip(self, line: int, custom_id: str, has_error: bool, retry_errors: bool) -> bool:
        """Whether an earlier run already wrote this line's record (and it should stand)."""
        if has_error:
            # Lines rejected before running fail the same way every time: one record is enough.
            return line in self.failed_lines
        if custom_id in self.ok_ids:
            return True
        return custom_id in self.failed_ids and not retry_errors


@dataclass(frozen=True)
class RunMeta:
    input_sha256: str
    model: str
    effort: str
    sampling: dict
    format: str = "auto"
    reasoning: str = "include"
    version: str = __version__

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> RunMeta:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


def meta_path(output: Path) -> Path:
    return output.with_name(output.name + ".meta.json")


def lock_path(output: Path) -> Path:
    return output.with_name(output.name + ".lock")


class OutputLock:
    """An exclusive, non-blocking flock on `<out>.lock` (no-op where fcntl does not exist)."""

    def __init__(self, output: Path) -> None:
        self.path = lock_path(output)
        self._fd: int | None = None

    def __enter__(self) -> OutputLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def acquire(self) -> None:
        try:
            import fcntl
        except ImportError:
            return
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise OutputBusyError(f"another `gptoss run` is writing {self.path.name[:-5]} (it holds {self.path})",
                                      "wait for it to finish, or write to a different --output") from None
            # A run that just finished may have unlinked the file we opened: lock the live one.
            if _same_file(fd, self.path):
                self._fd = fd
                return
            os.close(fd)

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            os.unlink(self.path)
        except OSError:
            pass
        os.close(self._fd)
        self._fd = None


def _same_file(fd: int, path: Path) -> bool:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    own = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)


def read_prior_records(path: Path, repair: bool = True) -> PriorRecords:
    """What an earlier run wrote; with `repair`, a torn (unterminated) last line is cut off the file."""
    prior = PriorRecords()
    if not path.exists():
        return prior
    offset = 0
    with open(path, "rb") as f:
        for raw in f:
            if not raw.endswith(b"\n"):
                # Only the last line can lack its newline: a write cut short by a crash.
                prior.torn_bytes = len(raw)
                break
            offset += len(raw)
            found = verdict(_parse(raw))
            if found is None:
                prior.unreadable += 1
            else:
                prior.records += 1
                _remember(prior, found)
    if prior.torn_bytes and repair:
        os.truncate(path, offset)
    return prior


def _parse(raw: bytes):
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None


def _remember(prior: PriorRecords, found) -> None:
    if found.custom_id is None:
        return
    if found.ok:
        prior.ok_ids.add(found.custom_id)
        prior.failed_ids.discard(found.custom_id)
    else:
        prior.failed_ids.add(found.custom_id)
        if found.line is not None:
            prior.failed_lines.add(found.line)


def read_meta(output: Path) -> RunMeta | None:
    path = meta_path(output)
    if not path.exists():
        return None
    try:
        return RunMeta.from_dict(json.loads(path.read_text(encoding="utf-8")))
    except (OSError, ValueError, TypeError):
        return None


def write_meta(output: Path, meta: RunMeta) -> None:
    """Atomically replace the sidecar (a crash leaves the old one or the new one, never half)."""
    path = meta_path(output)
    fd, tmp = tempfile.mkstemp(prefix=path.name, suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(meta.to_dict(), f, indent=1)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def meta_differences(old: RunMeta, new: RunMeta) -> list[str]:
    """Human-readable differences in the settings a resumed run must keep."""
    out = []
    for key, label in _MATCHED.items():
        a, b = getattr(old, key), getattr(new, key)
        if a != b:
            if key == "input_sha256":
                out.append(f"the input changed (sha256 {a[:12]}… then, {b[:12]}… now)")
            elif key == "sampling":
                changed = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
                out.append("sampling defaults changed: " + ", ".join(f"{k} {a.get(k)} → {b.get(k)}" for k in changed))
            else:
                out.append(f"{label} was {a}, now {b}")
    return out


def check_resumable(output: Path, prior: PriorRecords, new: RunMeta, force: bool) -> RunMeta | None:
    """Refuse (UsageError) to resume an output written for another input or config, unless `force`."""
    old = read_meta(output)
    if prior.records == 0 and prior.unreadable == 0:
        return old
    if old is None:
        if not force:
            raise UsageError(f"{output} has records but no readable {meta_path(output).name}, so it cannot be "
                             "checked against this input", "add --force to resume it anyway")
        return None
    problems = meta_differences(old, new)
    if problems and not force:
        raise UsageError(f"{output} was written by a different run: " + "; ".join(problems),
                         "use a new --output, or add --force to resume it anyway")
    return old
