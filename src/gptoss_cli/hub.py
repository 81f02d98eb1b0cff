"""`gptoss download`'s engine: model name → repo → file plan → verified files on disk.

Uses huggingface_hub (0.30 … 2.x) for listing and transfer. Never prints: progress goes to a
`Progress` callback and failures become a `DownloadError` with a one-line message and a hint.
Local checks (cache layout, hashing, deleting bad files): `hub_cache.py`; what a failure means:
`hub_errors.py`.
"""

from __future__ import annotations

import fnmatch
import inspect
import re
import shutil
import threading
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, as_completed
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Protocol

from huggingface_hub import HfApi, constants, get_token, hf_hub_download, try_to_load_from_cache
from huggingface_hub.hf_api import RepoFile
from tqdm import tqdm as _tqdm

from gptoss_cli import hub_cache, hub_errors
from gptoss_cli.runtime.errors import GptossError

ALIASES = MappingProxyType({"20b": "openai/gpt-oss-20b", "120b": "openai/gpt-oss-120b"})
# The loader reads the HF-format root; these are other formats of the same weights (3x the bytes).
DEFAULT_EXCLUDE = ("original/*", "metal/*")

_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9._-]{1,96}$")


class DownloadError(GptossError):
    """A download that cannot proceed: bad name, auth, missing repo/file, network, disk, checksum."""


class ChecksumError(DownloadError):
    """A downloaded file does not match the hub's size/hash; it has been deleted."""

    def __init__(self, message: str, hint: str = "", path: str = "") -> None:
        super().__init__(message, hint)
        self.path = path


class _Cancelled(Exception):
    """Raised inside a worker's progress callback to stop its transfer (Ctrl-C or a fatal error)."""


def resolve_repo(name: str) -> str:
    """`20b`/`120b` → the official repo id; an `owner/name` repo id is returned unchanged."""
    key = name.strip()
    if key.lower() in ALIASES:
        return ALIASES[key.lower()]
    if _REPO_ID.match(key) and "--" not in key and ".." not in key:
        return key
    raise DownloadError(
        f"'{name}' is neither a model alias nor a Hugging Face repo id",
        hint="use 20b, 120b or a repo id such as openai/gpt-oss-20b",
    )


@dataclass(frozen=True)
class RemoteFile:
    """One file of the repo at the planned commit, as the hub lists it."""

    path: str
    size: int
    sha256: str | None  # LFS files only
    is_lfs: bool
    blob_id: str | None = None  # git object id (sha1), listed for every file


@dataclass(frozen=True)
class DownloadPlan:
    """What `download` will fetch, and where; built by `plan_download` without transferring data."""

    repo_id: str
    revision: str
    commit: str
    files: tuple[RemoteFile, ...]
    destination: Path  # the snapshot folder in the cache, or local_dir
    complete: frozenset[str]  # paths already on disk with the right size when planned
    endpoint: str | None = None
    token: str | bool | None = field(default=None, repr=False, compare=False)
    local_dir: Path | None = None
    cache_dir: Path | None = None

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def bytes_complete(self) -> int:
        return sum(f.size for f in self.files if f.path in self.complete)

    @property
    def bytes_to_download(self) -> int:
        return self.total_bytes - self.bytes_complete

    @property
    def pending_files(self) -> tuple[RemoteFile, ...]:
        return tuple(f for f in self.files if f.path not in self.complete)


class Progress(Protocol):
    """Download events for a renderer (a total bar plus one bar per file; it computes rate and ETA).

    Calls come from worker threads. `start` counts only the files this run transfers. `advance`
    is exact and may be negative when the hub library discards bytes to restart a transfer.
    `file_done` follows a successful verification; `done` is called last, also after a failure.
    """

    def start(self, total_bytes: int, num_files: int) -> None: ...
    def file_start(self, path: str, size: int) -> None: ...
    def advance(self, path: str, nbytes: int) -> None: ...
    def file_done(self, path: str) -> None: ...
    def done(self) -> None: ...


class _NoProgress:
    def start(self, total_bytes: int, num_files: int) -> None:
        pass

    def file_start(self, path: str, size: int) -> None:
        pass

    def advance(self, path: str, nbytes: int) -> None:
        pass

    def file_done(self, path: str) -> None:
        pass

    def done(self) -> None:
        pass


# ---------------------------------------------------------------------------------------------
# Planning


def plan_download(
    repo_id: str,
    include: Sequence[str] | None = None,
    exclude: Sequence[str] | None = None,
    revision: str = "main",
    endpoint: str | None = None,
    token: str | bool | None = None,
    local_dir: str | Path | None = None,
    cache_dir: str | Path | None = None,
) -> DownloadPlan:
    """List the repo at `revision`, select files and see what is already on disk. No file data moves.

    `token=None` lets huggingface_hub use HF_TOKEN or the saved login. Without `include`, every file
    except DEFAULT_EXCLUDE (and `exclude`) is selected; with it, only matching files minus `exclude`.
    """
    repo_id = resolve_repo(repo_id)
    commit, remote = _list_remote(hub_errors.HubRequest(repo_id, revision, endpoint=endpoint), token)
    files = select_files(remote, include, exclude)
    if not files:
        raise DownloadError(
            f"no file of {repo_id} matches the include/exclude patterns",
            hint=f"the repo has {len(remote)} files; check --include/--exclude (globs such as '*.json', 'original/*')",
        )
    local = Path(local_dir).expanduser() if local_dir is not None else None
    cache = Path(cache_dir).expanduser() if cache_dir is not None else Path(constants.HF_HUB_CACHE)
    destination = local if local is not None else hub_cache.snapshot_dir(cache, repo_id, commit)
    complete = frozenset(f.path for f in files if hub_cache.is_complete(destination / f.path, f.size))
    return DownloadPlan(repo_id, revision, commit, files, destination, complete, endpoint, token, local, cache)


def select_files(
    files: Iterable[RemoteFile], include: Sequence[str] | None = None, exclude: Sequence[str] | None = None
) -> tuple[RemoteFile, ...]:
    """Glob selection like `hf download` (`*` crosses `/`; a pattern ending in `/` means the folder)."""
    excludes = list(exclude or ())
    if not include:
        excludes += DEFAULT_EXCLUDE
    return tuple(
        f for f in files if (not include or _matches(f.path, include)) and not _matches(f.path, excludes)
    )


def _matches(path: str, patterns: Iterable[str]) -> bool:
    return any(fnmatch.fnmatchcase(path, p + "*" if p.endswith("/") else p) for p in patterns)


def _list_remote(req: hub_errors.HubRequest, token: str | bool | None) -> tuple[str, list[RemoteFile]]:
    """Resolve the revision to a commit, then list that commit, so every file comes from one commit."""
    api = HfApi(endpoint=req.endpoint, token=token)
    with _explained_failures(req, token):
        commit = api.model_info(req.repo_id, revision=req.revision).sha
        entries = list(api.list_repo_tree(req.repo_id, recursive=True, revision=commit or req.revision))
    if not commit:
        raise DownloadError(f"the hub did not say which commit '{req.revision}' of {req.repo_id} is")
    return commit, [_remote_file(e) for e in entries if isinstance(e, RepoFile)]


def _remote_file(entry: RepoFile) -> RemoteFile:
    sha256 = getattr(entry.lfs, "sha256", None) if entry.lfs is not None else None
    return RemoteFile(entry.path, int(entry.size), sha256, entry.lfs is not None, entry.blob_id)


def check_disk_space(plan: DownloadPlan) -> None:
    """Refuse before starting when the destination's disk cannot hold what is left to download."""
    need = plan.bytes_to_download
    if need == 0:
        return
    target = plan.local_dir if plan.local_dir is not None else hub_cache.repo_cache_dir(plan.cache_dir, plan.repo_id)
    where = hub_cache.existing_ancestor(target)
    free = shutil.disk_usage(where).free
    if free < need:
        raise DownloadError(
            f"not enough disk space: need {format_bytes(need)} free in {where}, have {format_bytes(free)}",
            hint="free some space, or download to another disk with --local-dir DIR (or HF_HUB_CACHE=DIR)",
        )


def format_bytes(n: int) -> str:
    """Decimal units, as disk vendors and the hub's web page count: 13.8 GB."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


# ---------------------------------------------------------------------------------------------
# Downloading


def download(
    plan: DownloadPlan, progress: Progress | None = None, max_workers: int = 8, verify_existing: bool = False
) -> Path:
    """Fetch the plan's missing files in parallel, verify each, and return the destination folder.

    Files already complete are skipped without a request. Every file fetched now is checked
    (size, then sha256 for LFS files or the git blob id for the others); `verify_existing` also
    rehashes the skipped ones. A bad file is deleted, so re-running fetches it again.
    Partial files resume only where huggingface_hub supports it (within one run in 1.x/2.x).
    """
    if max_workers < 1:
        raise ValueError(f"max_workers must be at least 1, got {max_workers}")
    progress = progress if progress is not None else _NoProgress()
    check_disk_space(plan)
    pending = [f for f in plan.files if not hub_cache.is_complete(plan.destination / f.path, f.size)]
    present = [f for f in plan.files if f not in pending] if verify_existing else []
    progress.start(sum(f.size for f in pending), len(pending))
    try:
        _run_jobs(plan, pending, present, progress, max_workers)
    finally:
        progress.done()
    if plan.local_dir is None:
        hub_cache.write_ref(plan.cache_dir, plan.repo_id, plan.revision, plan.commit)
    return plan.destination


def _run_jobs(
    plan: DownloadPlan, pending: list[RemoteFile], present: list[RemoteFile], progress: Progress, max_workers: int
) -> None:
    """Run downloads (largest first) and re-verifications; stop everything on a fatal error or Ctrl-C.

    A checksum failure is not fatal to the other files: they finish, so a re-run has less to do.
    """
    cancel = threading.Event()
    jobs = [(_download_one, f) for f in sorted(pending, key=lambda f: -f.size)]
    jobs += [(_verify_one, f) for f in present]
    failures: list[BaseException] = []
    with ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="gptoss-download") as pool:
        futures = [pool.submit(job, plan, f, progress, cancel) for job, f in jobs]
        try:
            for fut in as_completed(futures):
                exc = None if fut.cancelled() else fut.exception()
                if exc is not None:
                    failures.append(exc)
                    if not isinstance(exc, ChecksumError):
                        _stop(cancel, futures)
        except BaseException:
            _stop(cancel, futures)
            raise
    _raise_failures(failures)


def _stop(cancel: threading.Event, futures: list[Future]) -> None:
    cancel.set()
    for fut in futures:
        fut.cancel()


def _raise_failures(failures: list[BaseException]) -> None:
    real = [e for e in failures if not isinstance(e, _Cancelled)]
    fatal = [e for e in real if not isinstance(e, ChecksumError)]
    if fatal:
        raise fatal[0]
    if len(real) == 1:
        raise real[0]
    if real:
        names = ", ".join(sorted(e.path for e in real if isinstance(e, ChecksumError)))
        raise ChecksumError(f"{len(real)} files failed verification and were deleted: {names}", hint=real[0].hint)


def _download_one(plan: DownloadPlan, f: RemoteFile, progress: Progress, cancel: threading.Event) -> None:
    progress.file_start(f.path, f.size)
    counter = _ByteCounter(f.path, progress, cancel)
    req = hub_errors.HubRequest(plan.repo_id, plan.revision, f.path, plan.endpoint)
    with _explained_failures(req, plan.token):
        local = Path(hf_hub_download(**_fetch_kwargs(plan, f, counter)))
    # Libraries without byte callbacks (0.x), or a blob that was only linked: count it now.
    counter.move_to(f.size)
    _verify(plan, f, local)
    progress.file_done(f.path)


def _verify_one(plan: DownloadPlan, f: RemoteFile, progress: Progress, cancel: threading.Event) -> None:
    if not cancel.is_set():
        _verify(plan, f, plan.destination / f.path)


def _fetch_kwargs(plan: DownloadPlan, f: RemoteFile, counter: _ByteCounter) -> dict:
    # The commit, not the branch: every file comes from the commit that was planned.
    kwargs: dict = dict(repo_id=plan.repo_id, filename=f.path, revision=plan.commit, endpoint=plan.endpoint)
    kwargs["token"] = plan.token
    if plan.local_dir is not None:
        kwargs["local_dir"] = plan.local_dir
    else:
        kwargs["cache_dir"] = plan.cache_dir
    if "tqdm_class" in inspect.signature(hf_hub_download).parameters:  # 1.x+; 0.x has no byte callback
        kwargs["tqdm_class"] = counter.bar_class()
    return kwargs


def _verify(plan: DownloadPlan, f: RemoteFile, path: Path) -> None:
    problem = hub_cache.find_problem(path, f.size, f.sha256, f.blob_id)
    if problem is None:
        return
    hub_cache.discard(path)
    raise ChecksumError(
        f"{f.path} is corrupt: {problem}; the file was deleted",
        hint="run the download again to fetch it again; if this repeats, a proxy, mirror or disk is damaging data",
        path=f.path,
    )


class _ByteCounter:
    """Turns the hub library's progress-bar calls for one file into exact `advance` events."""

    def __init__(self, path: str, progress: Progress, cancel: threading.Event) -> None:
        self.path, self.progress, self.cancel = path, progress, cancel
        self.reported = 0

    def add(self, nbytes: int) -> None:
        """Called by the library mid-transfer, so this is also where a cancelled transfer stops."""
        if self.cancel.is_set():
            raise _Cancelled(self.path)
        self._report(nbytes)

    def move_to(self, position: int) -> None:
        self._report(position - self.reported)

    def _report(self, nbytes: int) -> None:
        if nbytes:
            self.reported += nbytes
            self.progress.advance(self.path, nbytes)

    def bar_class(self) -> type:
        """A silent tqdm subclass for `tqdm_class=`: the library drives it, we forward the bytes."""
        counter = self

        class _ForwardingBar(_tqdm):
            def __init__(self, *args, **kwargs) -> None:
                kwargs.pop("name", None)  # only huggingface_hub's own tqdm accepts it
                kwargs["disable"] = True  # the caller's Progress renders; no stray bar on stderr
                super().__init__(*args, **kwargs)

            def update(self, n: float | None = 1) -> bool | None:
                counter.add(int(n or 0))
                return super().update(n)

            # Having these makes the library route network-byte counts (Xet: before dedup and
            # decompression) here instead of into a second bar, which would count bytes twice.
            def update_transfer(self, n: float | None = 1) -> None:
                pass

            def set_transfer_postfix_str(self, s: str = "", refresh: bool = True) -> None:
                pass

        return _ForwardingBar


# ---------------------------------------------------------------------------------------------
# Finding what is already downloaded


def find_local_model(
    name_or_repo: str, cache_dir: str | Path | None = None, local_dir: str | Path | None = None, revision: str = "main"
) -> Path | None:
    """The downloaded checkpoint folder for an alias or repo id, or None. Makes no network request.

    `local_dir` (a `download --local-dir` target) wins when it holds a checkpoint; otherwise the
    HF cache snapshot that refs/<revision> points to, if config.json and every shard are there.
    """
    if local_dir is not None and hub_cache.looks_complete(Path(local_dir)):
        return Path(local_dir)
    repo_id = resolve_repo(name_or_repo)
    hit = try_to_load_from_cache(repo_id, "config.json", cache_dir=cache_dir, revision=revision)
    if not isinstance(hit, str):  # None, or the library's "known not to exist" marker
        return None
    folder = Path(hit).parent
    return folder if hub_cache.looks_complete(folder) else None


# ---------------------------------------------------------------------------------------------
# Errors: huggingface_hub / network / disk exceptions → one-line DownloadError with a hint


@contextmanager
def _explained_failures(req: hub_errors.HubRequest, token: str | bool | None) -> Iterator[None]:
    try:
        yield
    except (DownloadError, _Cancelled):
        raise
    except Exception as exc:
        err = translate_hub_error(
            exc, req.repo_id, revision=req.revision, filename=req.filename, endpoint=req.endpoint, token=token
        )
        if err is None:
            raise
        raise err from exc


def translate_hub_error(
    exc: BaseException,
    repo_id: str,
    *,
    revision: str = "main",
    filename: str | None = None,
    endpoint: str | None = None,
    token: str | bool | None = None,
) -> DownloadError | None:
    """The DownloadError explaining `exc`, or None when it is not a hub, network or disk problem.

    The token (given, or found by huggingface_hub) is scrubbed from the text; it is never shown.
    """
    secret = _effective_token(token)
    req = hub_errors.HubRequest(repo_id, revision, filename, endpoint)
    found = hub_errors.explain_failure(exc, req, has_token=secret is not None)
    if found is None:
        return None
    message, hint = found
    return DownloadError(hub_errors.scrub(message, secret), hub_errors.scrub(hint, secret))


def _effective_token(token: str | bool | None) -> str | None:
    if isinstance(token, str) and token:
        return token
    if token is False:
        return None
    try:
        return get_token()
    except Exception:  # a broken token file must not hide the real error
        return None
