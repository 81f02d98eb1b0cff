"""Where chat state lives on disk, readable by the user only: the XDG data dir (conversations,
autosaved) and state dir (input history), or both in $GPTOSS_HOME when it is set. Nothing else is
written unless the user names a path."""

from __future__ import annotations

import datetime as dt
import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path

from ..runtime.errors import GptossError

def _xdg_dir(variable: str, default: str) -> Path:
    """$GPTOSS_HOME when set, else <$variable or ~/default>/gptoss."""
    if os.environ.get("GPTOSS_HOME"):
        return Path(os.environ["GPTOSS_HOME"]).expanduser()
    return Path(os.environ.get(variable) or str(Path.home() / default)) / "gptoss"


def data_dir() -> Path:
    return _xdg_dir("XDG_DATA_HOME", ".local/share")


def state_dir() -> Path:
    return _xdg_dir("XDG_STATE_HOME", ".local/state")


def history_path() -> Path:
    return state_dir() / "history"


def history_disabled(no_history_flag: bool) -> bool:
    return no_history_flag or os.environ.get("GPTOSS_NO_HISTORY", "") not in ("", "0")


def new_conversation_id() -> str:
    return dt.datetime.now().strftime("%Y%m%d-%H%M%S-") + secrets.token_hex(3)


def now_text() -> str:
    return dt.datetime.now().astimezone().isoformat(timespec="seconds")


def make_private_dir(path: Path) -> None:
    path.mkdir(parents=True, exist_ok=True, mode=0o700)


def write_private(path: Path, text: str) -> None:
    """Write atomically, readable by the user only (conversations can hold anything)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def touch_private(path: Path) -> Path:
    """Create a file (and its directory) with user-only permissions if it does not exist."""
    make_private_dir(path.parent)
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600))
    return path


@dataclass
class ChatStore:
    """Autosaved conversations: one JSON file per conversation in the XDG data dir."""

    root: Path = field(default_factory=lambda: data_dir() / "conversations")

    def path_for(self, conversation_id: str) -> Path:
        return self.root / f"{conversation_id}.json"

    def write(self, conversation_id: str, text: str) -> Path:
        make_private_dir(self.root)
        path = self.path_for(conversation_id)
        write_private(path, text)
        return path

    def latest(self) -> Path | None:
        if not self.root.is_dir():
            return None
        files = sorted(self.root.glob("*.json"), key=lambda p: (p.stat().st_mtime, p.name))
        return files[-1] if files else None

    def resolve(self, ref: str) -> Path:
        """A saved conversation by path or by id (the file name without .json)."""
        path = Path(ref).expanduser()
        if path.is_file():
            return path
        candidate = self.path_for(ref.removesuffix(".json"))
        if candidate.is_file():
            return candidate
        raise GptossError(f"no saved conversation {ref!r}", f"give a file path or an id from {self.root}")
