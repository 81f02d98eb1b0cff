"""gptoss_cli.hub against the in-process fake hub: selection, skip/resume, checksums, errors, disk."""

from __future__ import annotations

import collections
import errno
import hashlib
import json
import logging
import os
import shutil
import socket
import threading
from pathlib import Path
from types import SimpleNamespace

import huggingface_hub
import pytest
from fake_hub import FakeHub

from gptoss_cli import hub
from gptoss_cli.hub import (
    ALIASES,
    ChecksumError,
    DownloadError,
    DownloadPlan,
    RemoteFile,
    check_disk_space,
    download,
    find_local_model,
    plan_download,
    resolve_repo,
    select_files,
    translate_hub_error,
)
from gptoss_cli.runtime.errors import GptossError

REPO = "openai/gpt-oss-tiny"
MiB = 1 << 20
HF_MAJOR = int(huggingface_hub.__version__.split(".")[0])
GOOD_TOKEN = "hf_GoodTokenAbcdef0123456789"
BAD_TOKEN = "hf_SecretBadToken9876543210"
SHARDS = ("model-00000-of-00001.safetensors", "model-00001-of-00001.safetensors")
LFS = {*SHARDS, "original/model.safetensors", "metal/model.bin"}


def _repo_files() -> dict[str, bytes]:
    """Fresh random contents each test; odd sizes and one exactly 64 KiB."""
    index = {"metadata": {}, "weight_map": {"a": SHARDS[0], "b": SHARDS[1]}}
    return {
        ".gitattributes": b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n",
        "README.md": b"# tiny\n",
        "config.json": json.dumps({"num_hidden_layers": 2, "noise": os.urandom(4).hex()}).encode(),
        "tokenizer.json": os.urandom(5_001),
        "model.safetensors.index.json": json.dumps(index).encode(),
        SHARDS[0]: os.urandom(200_003),
        SHARDS[1]: os.urandom(64 * 1024),
        "original/config.json": b"{}",
        "original/model.safetensors": os.urandom(1_000),
        "metal/model.bin": os.urandom(777),
    }


ROOT_FILES = {p for p in _repo_files() if not p.startswith(("original/", "metal/"))}


class Recorder:
    """A Progress that records events (thread-safe enough: list.append is atomic)."""

    def __init__(self) -> None:
        self.events: list[tuple] = []

    def start(self, total_bytes: int, num_files: int) -> None:
        self.events.append(("start", total_bytes, num_files))

    def file_start(self, path: str, size: int) -> None:
        self.events.append(("file_start", path, size))

    def advance(self, path: str, nbytes: int) -> None:
        self.events.append(("advance", path, nbytes))

    def file_done(self, path: str) -> None:
        self.events.append(("file_done", path))

    def done(self) -> None:
        self.events.append(("done",))

    def bytes_for(self) -> dict[str, int]:
        totals: dict[str, int] = collections.Counter()
        for event in self.events:
            if event[0] == "advance":
                totals[event[1]] += event[2]
        return dict(totals)

    def named(self, kind: str) -> list[tuple]:
        return [e for e in self.events if e[0] == kind]


@pytest.fixture(autouse=True)
def _no_ambient_token(monkeypatch, tmp_path):
    """Tests decide the token; never pick up the machine's login or environment."""
    for var in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_TOKEN_PATH", str(tmp_path / "no-token-here"))


@pytest.fixture
def fake():
    with FakeHub(REPO, _repo_files(), lfs=set(LFS)) as server:
        yield server


def _plan(fake: FakeHub, tmp_path, mode: str = "cache", **kwargs):
    where = {"local_dir": tmp_path / "model"} if mode == "local_dir" else {"cache_dir": tmp_path / "cache"}
    return plan_download(REPO, endpoint=fake.url, **where, **kwargs)


def _assert_no_secret(err: BaseException, secret: str) -> None:
    for text in (str(err), getattr(err, "hint", ""), repr(err)):
        assert secret not in text


# --- names and selection -------------------------------------------------------------------


@pytest.mark.parametrize("name, repo", [
    ("20b", "openai/gpt-oss-20b"), ("120B", "openai/gpt-oss-120b"),
    (" openai/gpt-oss-20b ", "openai/gpt-oss-20b"), ("me/my.model_v2-x", "me/my.model_v2-x"),
])
def test_resolve_repo_accepts_aliases_and_repo_ids(name, repo):
    assert resolve_repo(name) == repo
    assert ALIASES["20b"] == "openai/gpt-oss-20b"


@pytest.mark.parametrize("name", ["", "gpt", "a/b/c", "/abs/path", "./rel", "owner/", "a--b/c", "x/y..z",
                                  "owner/na me"])
def test_resolve_repo_rejects_other_names_with_a_hint(name):
    with pytest.raises(DownloadError) as info:
        resolve_repo(name)
    assert isinstance(info.value, GptossError) and info.value.exit_code == 1
    assert "20b" in info.value.hint and "/" in info.value.hint


@pytest.mark.parametrize("include, exclude, expected", [
    (None, None, {"config.json", "w.safetensors", "README.md"}),
    ([], ["*.md"], {"config.json", "w.safetensors"}),
    (["original/*"], None, {"original/w.safetensors", "original/config.json"}),
    (["original/"], ["*.json"], {"original/w.safetensors"}),
    (["*.json"], None, {"config.json", "original/config.json"}),
    (["*.json"], ["original/*"], {"config.json"}),
    (["metal/*", "README.md"], None, {"metal/model.bin", "README.md"}),
])
def test_select_files_patterns_and_default_excludes(include, exclude, expected):
    paths = ["config.json", "w.safetensors", "README.md", "original/w.safetensors", "original/config.json",
             "metal/model.bin"]
    files = [RemoteFile(p, 1, None, False) for p in paths]
    assert {f.path for f in select_files(files, include, exclude)} == expected


# --- planning (dry run) --------------------------------------------------------------------


def test_plan_lists_loader_files_and_totals_without_downloading(fake, tmp_path):
    plan = _plan(fake, tmp_path)
    assert {f.path for f in plan.files} == ROOT_FILES
    assert plan.commit == fake.commit and plan.revision == "main"
    assert plan.total_bytes == sum(len(fake.files[p]) for p in ROOT_FILES)
    assert plan.bytes_complete == 0 and plan.bytes_to_download == plan.total_bytes
    by_path = {f.path: f for f in plan.files}
    assert by_path[SHARDS[0]].is_lfs and by_path[SHARDS[0]].sha256 == fake.etag(SHARDS[0])
    assert not by_path["config.json"].is_lfs and by_path["config.json"].sha256 is None
    assert plan.destination == tmp_path / "cache" / "models--openai--gpt-oss-tiny" / "snapshots" / fake.commit
    assert fake.file_requests("GET") == [] and fake.file_requests("HEAD") == []
    assert GOOD_TOKEN not in repr(_plan(fake, tmp_path, token=GOOD_TOKEN))


def test_plan_include_and_nothing_matching(fake, tmp_path):
    plan = _plan(fake, tmp_path, include=["original/*"])
    assert {f.path for f in plan.files} == {"original/config.json", "original/model.safetensors"}
    with pytest.raises(DownloadError, match="match"):
        _plan(fake, tmp_path, include=["no-such-file*"])


def test_plan_counts_files_already_complete(fake, tmp_path):
    download(_plan(fake, tmp_path, include=["config.json", SHARDS[1]]))
    plan = _plan(fake, tmp_path)
    assert plan.complete == {"config.json", SHARDS[1]}
    assert plan.bytes_complete == len(fake.files["config.json"]) + len(fake.files[SHARDS[1]])
    assert {f.path for f in plan.pending_files} == ROOT_FILES - plan.complete


# --- downloading -----------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["cache", "local_dir"])
def test_download_verifies_reports_progress_and_rerun_skips(fake, tmp_path, mode):
    plan = _plan(fake, tmp_path, mode)
    rec = Recorder()
    path = download(plan, rec, max_workers=3)
    assert path == plan.destination
    for p in ROOT_FILES:
        assert (path / p).read_bytes() == fake.files[p]
    assert rec.events[0] == ("start", plan.total_bytes, len(ROOT_FILES)) and rec.events[-1] == ("done",)
    assert rec.bytes_for() == {p: len(fake.files[p]) for p in ROOT_FILES}
    assert {e[1] for e in rec.named("file_done")} == ROOT_FILES
    assert len(fake.file_requests("GET")) == len(ROOT_FILES)

    before = len(fake.requests)
    again = _plan(fake, tmp_path, mode)
    assert again.bytes_to_download == 0
    rec2 = Recorder()
    assert download(again, rec2) == path
    assert rec2.events == [("start", 0, 0), ("done",)]
    assert not any("/resolve/" in r.path for r in fake.requests[before:])  # no HEAD, no GET
    local_dir = tmp_path / "model" if mode == "local_dir" else None
    assert find_local_model(REPO, cache_dir=tmp_path / "cache", local_dir=local_dir) == plan.destination


def test_interrupted_transfer_resumes_and_progress_stays_exact(tmp_path):
    big = os.urandom(11 * MiB + 5)  # over one 10 MiB read chunk, so the resume can use Range
    with FakeHub(REPO, {"config.json": b"{}", "model.safetensors": big}, lfs={"model.safetensors"}) as fake:
        fake.truncate_once["model.safetensors"] = 10 * MiB + MiB // 2
        rec = Recorder()
        try:
            path = download(_plan(fake, tmp_path), rec)
        except DownloadError as err:  # 0.x does not retry inside a call; the re-run resumes instead
            assert HF_MAJOR == 0, err
            path = download(_plan(fake, tmp_path), rec)
        assert (path / "model.safetensors").read_bytes() == big
        gets = fake.file_requests("GET", "model.safetensors")
        assert len(gets) == 2 and gets[0].range is None
        if HF_MAJOR >= 1:
            assert gets[1].range == f"bytes={10 * MiB}-"
            assert rec.bytes_for()["model.safetensors"] == len(big)


@pytest.mark.parametrize("mode, bad, kind", [("cache", SHARDS[0], "sha256"), ("cache", "tokenizer.json", "blob id"),
                                             ("local_dir", SHARDS[1], "sha256")])
def test_corrupted_file_is_caught_deleted_and_refetched(fake, tmp_path, mode, bad, kind):
    fake.corrupt.add(bad)
    plan = _plan(fake, tmp_path, mode)
    rec = Recorder()
    with pytest.raises(ChecksumError) as info:
        download(plan, rec)
    assert bad in str(info.value) and kind in str(info.value) and info.value.path == bad
    assert not (plan.destination / bad).exists()
    blobs = tmp_path / "cache" / "models--openai--gpt-oss-tiny" / "blobs"
    assert not (blobs / fake.etag(bad)).exists()
    for other in ROOT_FILES - {bad}:  # a checksum failure does not stop the other files
        assert (plan.destination / other).read_bytes() == fake.files[other]
    assert ("file_done", bad) not in rec.events and rec.events[-1] == ("done",)

    fake.corrupt.clear()
    again = _plan(fake, tmp_path, mode)
    assert [f.path for f in again.pending_files] == [bad]
    download(again)
    assert (plan.destination / bad).read_bytes() == fake.files[bad]
    assert len(fake.file_requests("GET", bad)) == 2


def test_verify_existing_rehashes_skipped_files(fake, tmp_path):
    plan = _plan(fake, tmp_path)
    download(plan)
    target = plan.destination / SHARDS[1]
    data = bytearray(target.read_bytes())
    data[12345] ^= 0x01  # same size: only a hash can tell
    target.write_bytes(bytes(data))
    download(_plan(fake, tmp_path))  # size-only check of complete files: no error
    with pytest.raises(ChecksumError, match=SHARDS[1]):
        download(_plan(fake, tmp_path), verify_existing=True)
    assert not target.exists()
    download(_plan(fake, tmp_path), verify_existing=True)
    assert target.read_bytes() == fake.files[SHARDS[1]]


def test_disk_space_refused_before_any_transfer(fake, tmp_path, monkeypatch):
    plan = _plan(fake, tmp_path)
    usage = SimpleNamespace(total=10**12, used=10**12 - 1_000, free=1_000)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage)
    with pytest.raises(DownloadError) as info:
        check_disk_space(plan)
    assert f"need {hub.format_bytes(plan.bytes_to_download)} free in" in str(info.value)
    assert "have 1.0 kB" in str(info.value)
    assert str(tmp_path) in str(info.value) and "--local-dir" in info.value.hint
    with pytest.raises(DownloadError, match="disk space"):
        download(plan)
    assert fake.file_requests("HEAD") == [] and fake.file_requests("GET") == []


def test_find_local_model_needs_every_shard(fake, tmp_path):
    cache = tmp_path / "cache"
    assert find_local_model("openai/gpt-oss-tiny", cache_dir=cache) is None
    plan = _plan(fake, tmp_path)
    download(plan)
    assert find_local_model(REPO, cache_dir=cache) == plan.destination
    (plan.destination / SHARDS[1]).unlink()
    assert find_local_model(REPO, cache_dir=cache) is None
    assert find_local_model("20b", cache_dir=cache) is None


# --- errors --------------------------------------------------------------------------------


def test_missing_repo_and_missing_file(fake, tmp_path):
    with pytest.raises(DownloadError) as info:
        plan_download("someone/missing", endpoint=fake.url, cache_dir=tmp_path)
    assert "someone/missing" in str(info.value) and "not found" in str(info.value)
    assert "HF_TOKEN" in info.value.hint
    with pytest.raises(DownloadError, match="revision 'v9' not found"):
        _plan(fake, tmp_path, revision="v9")

    plan = _plan(fake, tmp_path)
    del fake.files["tokenizer.json"]  # gone between listing and download
    with pytest.raises(DownloadError) as info:
        download(plan, max_workers=1)
    assert "tokenizer.json" in str(info.value) and "not found" in str(info.value)


def test_gated_repo_without_token_wrong_token_and_right_token(fake, tmp_path):
    fake.gated, fake.tokens = True, {GOOD_TOKEN}
    with pytest.raises(DownloadError) as info:
        download(_plan(fake, tmp_path), max_workers=1)
    assert "gated" in str(info.value) and "HF_TOKEN" in info.value.hint and "licence" in info.value.hint

    with pytest.raises(DownloadError) as info:
        download(_plan(fake, tmp_path, token=BAD_TOKEN), max_workers=1)
    assert "not been granted" in str(info.value) and "licence" in info.value.hint
    _assert_no_secret(info.value, BAD_TOKEN)

    path = download(_plan(fake, tmp_path, token=GOOD_TOKEN))
    assert (path / SHARDS[0]).read_bytes() == fake.files[SHARDS[0]]
    assert {r.token for r in fake.file_requests("GET")} == {GOOD_TOKEN}


def test_private_repo_token_missing_rejected_or_from_hf_token(fake, tmp_path, monkeypatch):
    fake.private, fake.tokens = True, {GOOD_TOKEN}
    with pytest.raises(DownloadError) as info:
        _plan(fake, tmp_path)
    assert "not found" in str(info.value) and "set HF_TOKEN" in info.value.hint

    monkeypatch.setenv("HF_TOKEN", BAD_TOKEN)
    with pytest.raises(DownloadError) as info:
        _plan(fake, tmp_path)
    assert "token was rejected" in str(info.value) and "HF_TOKEN" in info.value.hint
    _assert_no_secret(info.value, BAD_TOKEN)

    monkeypatch.setenv("HF_TOKEN", GOOD_TOKEN)
    assert download(_plan(fake, tmp_path)).is_dir()


def test_unreachable_endpoint_is_explained(tmp_path):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(DownloadError) as info:
        plan_download("20b", endpoint=f"http://user:{BAD_TOKEN}@127.0.0.1:{port}", cache_dir=tmp_path)
    assert f"127.0.0.1:{port}" in str(info.value) and "HF_ENDPOINT" in info.value.hint
    _assert_no_secret(info.value, BAD_TOKEN)


@pytest.mark.parametrize("exc, words", [
    (OSError(errno.ENOSPC, "No space left on device", "/data/blob"), ["disk full", "/data/blob"]),
    (ConnectionResetError("peer reset"), ["connection to", "failed", "ConnectionResetError"]),
    (TimeoutError(), ["connection to", "TimeoutError"]),
])
def test_translate_os_level_errors(exc, words):
    err = translate_hub_error(exc, REPO, endpoint="https://hub.example")
    assert err is not None and "\n" not in str(err)
    for word in words:
        assert word in str(err)
    assert translate_hub_error(ValueError("a bug"), REPO) is None


@pytest.mark.parametrize("secret, given", [("custom-secret-9f8e7d", True), (BAD_TOKEN, True), (BAD_TOKEN, False)])
def test_token_scrubbed_even_when_a_library_message_carries_it(secret, given):
    exc = ConnectionError(f"refused, header Bearer {secret}")
    err = translate_hub_error(exc, REPO, token=secret if given else None)
    assert err is not None and "refused" in str(err)
    _assert_no_secret(err, secret)


def test_progress_callbacks_may_come_from_several_threads(fake, tmp_path):
    seen: set[str] = set()

    class ThreadNames(Recorder):
        def advance(self, path: str, nbytes: int) -> None:
            seen.add(threading.current_thread().name)
            super().advance(path, nbytes)

    download(_plan(fake, tmp_path), ThreadNames(), max_workers=4)
    assert seen and all(name.startswith("gptoss-download") for name in seen)
    with pytest.raises(ValueError):
        download(_plan(fake, tmp_path), max_workers=0)
    assert hub.DEFAULT_EXCLUDE == ("original/*", "metal/*")


def test_xet_style_progress_counts_each_byte_once(tmp_path, monkeypatch):
    """Xet downloads report disk bytes and network bytes; only disk bytes may reach Progress."""
    xet = pytest.importorskip("huggingface_hub.utils._xet_progress_reporting")
    if not hasattr(xet, "XetDownloadProgressReporter"):
        pytest.skip("this huggingface_hub has no two-bar Xet progress reporter")
    data = os.urandom(123_457)
    sha = hashlib.sha256(data).hexdigest()
    plan = DownloadPlan(REPO, "main", "c" * 40, (RemoteFile("w.safetensors", len(data), sha, True),),
                        tmp_path, frozenset(), local_dir=tmp_path)

    def fake_hf_hub_download(*, repo_id, filename, revision, endpoint, token, local_dir, tqdm_class=None):
        with xet.XetDownloadProgressReporter(reconstruction_desc="r", total=len(data), log_level=logging.WARNING,
                                             tqdm_class=tqdm_class) as reporter:
            for done in (len(data) // 3, len(data)):
                reporter.update_progress(SimpleNamespace(
                    total_bytes_completed=done, total_transfer_bytes_completed=done // 2, total_bytes=len(data),
                    total_bytes_completion_rate=None, total_transfer_bytes_completion_rate=None))
        (Path(local_dir) / filename).write_bytes(data)
        return str(Path(local_dir) / filename)

    monkeypatch.setattr(hub, "hf_hub_download", fake_hf_hub_download)
    rec = Recorder()
    download(plan, rec)
    advances = [e[2] for e in rec.named("advance")]
    assert advances == [len(data) // 3, len(data) - len(data) // 3]


@pytest.mark.skipif(HF_MAJOR == 0, reason="0.x reports no bytes mid-transfer, so it cannot be stopped there")
def test_fatal_error_stops_transfers_in_flight(tmp_path, monkeypatch):
    big = os.urandom(25 * MiB)
    with FakeHub(REPO, {"config.json": b"{}", "model.safetensors": big}, lfs={"model.safetensors"}) as fake:
        plan = _plan(fake, tmp_path)
        del fake.files["config.json"]  # this one fails while the big one is in flight
        stopped = threading.Event()
        real_stop = hub._stop
        monkeypatch.setattr(hub, "_stop", lambda *args: (real_stop(*args), stopped.set()))

        class WaitForStop(Recorder):
            def advance(self, path: str, nbytes: int) -> None:
                super().advance(path, nbytes)
                if path == "model.safetensors":
                    assert stopped.wait(30)

        rec = WaitForStop()
        with pytest.raises(DownloadError, match="config.json not found"):
            download(plan, rec, max_workers=2)
        assert not (plan.destination / "model.safetensors").exists()
        assert ("file_done", "model.safetensors") not in rec.events
        assert rec.bytes_for().get("model.safetensors", 0) < len(big)
