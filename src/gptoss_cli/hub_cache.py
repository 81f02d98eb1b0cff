"""The local side of downloads: the Hugging Face cache layout we rely on (snapshots/<commit>,
refs/<revision>, blobs), streamed sha256 / git-blob-sha1 hashing, deleting a bad file so a re-run
fetches it again, and whether a folder looks like a complete checkpoint.
Sends no request and raises nothing of its own; `hub.py` decides what to fetch and raises.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

_CHUNK = 8 * 1024 * 1024


def repo_cache_dir(cache_dir: Path, repo_id: str) -> Path:
    """`<cache>/models--owner--name`, the folder huggingface_hub uses for a model repo."""
    return cache_dir / ("models--" + repo_id.replace("/", "--"))


def snapshot_dir(cache_dir: Path, repo_id: str, commit: str) -> Path:
    return repo_cache_dir(cache_dir, repo_id) / "snapshots" / commit


def write_ref(cache_dir: Path, repo_id: str, revision: str, commit: str) -> None:
    """Point refs/<revision> at `commit`, as snapshot_download does, so offline lookups by branch work.

    We download with the commit hash (every file from one commit), and then the library writes no ref.
    """
    if revision == commit:
        return
    ref = repo_cache_dir(cache_dir, repo_id) / "refs" / revision
    ref.parent.mkdir(parents=True, exist_ok=True)
    ref.write_text(commit)


def is_complete(path: Path, size: int) -> bool:
    """The file exists (a cache symlink must resolve) and has the expected size."""
    try:
        return path.stat().st_size == size
    except OSError:
        return False


def sha256_file(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def git_blob_sha1(path: Path) -> str:
    """Git's object id for a file: sha1 over `blob <size>\\0` followed by the bytes."""
    digest = hashlib.sha1(f"blob {path.stat().st_size}\0".encode())
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def find_problem(path: Path, size: int, sha256: str | None, blob_id: str | None) -> str | None:
    """Why the file at `path` is not the one the hub listed, or None when it matches.

    LFS files are checked against their sha256; small (non-LFS) files against the git blob id,
    which the hub also lists. Sizes are checked first because they are free.
    """
    try:
        actual_size = path.stat().st_size
    except OSError:
        return "missing after download"
    if actual_size != size:
        return f"size {actual_size} bytes, expected {size}"
    if sha256:
        got = sha256_file(path)
        if got != sha256.lower():
            return f"sha256 mismatch (got {got[:12]}…, expected {sha256[:12]}…)"
    elif blob_id:
        got = git_blob_sha1(path)
        if got != blob_id.lower():
            return f"git blob id mismatch (got {got[:12]}…, expected {blob_id[:12]}…)"
    return None


def discard(path: Path) -> None:
    """Delete a bad file so the next run downloads it again.

    In the cache the snapshot entry is a symlink to a blob; the blob must go too, or the library
    would find it, skip the download and link the same bad bytes again.
    """
    target = path.resolve() if path.is_symlink() else None
    path.unlink(missing_ok=True)
    if target is not None:
        target.unlink(missing_ok=True)


def existing_ancestor(path: Path) -> Path:
    """The nearest folder that exists, where a disk-space query can be made."""
    path = path.absolute()
    while not path.exists() and path.parent != path:
        path = path.parent
    return path


def looks_complete(folder: Path) -> bool:
    """A checkpoint folder with config.json and every safetensors shard its index names.

    Sizes are not checked here (that needs the hub); `download` verifies them.
    """
    if not (folder / "config.json").is_file():
        return False
    index = folder / "model.safetensors.index.json"
    if not index.is_file():
        return any(folder.glob("*.safetensors"))
    try:
        shards = set(json.loads(index.read_text()).get("weight_map", {}).values())
    except (OSError, ValueError):
        return False
    return bool(shards) and all(os.path.isfile(folder / s) for s in shards)


@dataclass(frozen=True)
class LocalCheckpoint:
    """One gpt-oss snapshot in the Hugging Face cache."""

    repo_id: str
    commit: str
    refs: tuple[str, ...]  # branch or tag names pointing at this commit (e.g. "main")
    path: Path  # the snapshot folder
    size: int  # bytes of the files the snapshot holds (each blob once)
    complete: bool  # config.json and every shard its index names are present


def local_checkpoints(cache_dir: Path) -> list[LocalCheckpoint]:
    """Every snapshot in `cache_dir` whose config.json says model_type gpt_oss, sorted by repo id;
    other models in a shared cache are not listed. Reads only the local folders."""
    found = []
    for repo in sorted(cache_dir.glob("models--*")):
        repo_id = repo.name.removeprefix("models--").replace("--", "/", 1)
        refs: dict[str, list[str]] = {}
        for ref in sorted((repo / "refs").glob("*")):
            try:
                refs.setdefault(ref.read_text().strip(), []).append(ref.name)
            except OSError:
                continue
        for snap in sorted((repo / "snapshots").glob("*")):
            if _model_type(snap / "config.json") == "gpt_oss":
                found.append(LocalCheckpoint(repo_id, snap.name, tuple(refs.get(snap.name, ())), snap,
                                             _snapshot_bytes(snap), looks_complete(snap)))
    return found


def _model_type(config: Path) -> str | None:
    try:
        data = json.loads(config.read_text())
    except (OSError, ValueError):
        return None
    return data.get("model_type") if isinstance(data, dict) else None


def _snapshot_bytes(folder: Path) -> int:
    """Sizes of the files under a snapshot, each resolved blob counted once (a dangling link: 0)."""
    seen, total = set(), 0
    for f in folder.rglob("*"):
        try:
            target = f.resolve()
            if target.is_file() and target not in seen:
                seen.add(target)
                total += target.stat().st_size
        except OSError:
            continue
    return total
