"""`gptoss download` through the real entry point against the in-process fake hub, plus the
progress renderer on a fake clock."""

from __future__ import annotations

import io
import json
import logging
import os
import shutil
import subprocess
import sys
import threading
from types import SimpleNamespace

import huggingface_hub
import pytest
from fake_hub import FakeHub
from rich.console import Console

from cli_helpers import run_cli
from gptoss_cli import hub
from gptoss_cli.cli import models
from gptoss_cli.cli.console import Ui
from gptoss_cli.cli.download_progress import DownloadProgress, short_name, status_text

REPO = "openai/gpt-oss-20b"
GOOD_TOKEN = "hf_GoodTokenAbcdef0123456789"
BAD_TOKEN = "hf_SecretBadToken9876543210"
SHARDS = ("model-00000-of-00001.safetensors", "model-00001-of-00001.safetensors")
MiB = 1 << 20


def _repo_files() -> dict[str, bytes]:
    index = {"metadata": {}, "weight_map": {"a": SHARDS[0], "b": SHARDS[1]}}
    return {
        "README.md": b"# tiny\n",
        "config.json": json.dumps({"model_type": "gpt_oss", "num_hidden_layers": 2,
                                   "noise": os.urandom(4).hex()}).encode(),
        "tokenizer.json": os.urandom(5_001),
        "model.safetensors.index.json": json.dumps(index).encode(),
        SHARDS[0]: os.urandom(200_003),
        SHARDS[1]: os.urandom(64 * 1024),
        "original/model.safetensors": os.urandom(1_000),
        "metal/model.bin": os.urandom(777),
    }


ROOT_FILES = {p for p in _repo_files() if not p.startswith(("original/", "metal/"))}


@pytest.fixture(autouse=True)
def _isolated_hub_env(monkeypatch, tmp_path):
    """Tests decide token and endpoint; the machine's login, HF_* variables and cache never leak in."""
    for var in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_ENDPOINT", "HF_HUB_OFFLINE", "GPTOSS_MODEL"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # restored after the test, unlike the command's
    monkeypatch.setattr(huggingface_hub.constants, "HF_TOKEN_PATH", str(tmp_path / "no-token-here"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "default-cache"))


@pytest.fixture
def fake():
    with FakeHub(REPO, _repo_files(), lfs={*SHARDS, "original/model.safetensors", "metal/model.bin"}) as server:
        yield server


def _download(fake: FakeHub, tmp_path, *args: str, model: str = "20b", env=None):
    return run_cli(["download", model, "--endpoint", fake.url, "--cache-dir", str(tmp_path / "cache"), *args],
                   env=env)


def _snapshot(fake: FakeHub, tmp_path):
    return tmp_path / "cache" / "models--openai--gpt-oss-20b" / "snapshots" / fake.commit


def _resolves(fake: FakeHub) -> list:
    return [r for r in fake.requests if "/resolve/" in r.path]


def _error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error:")]


# --- the happy path --------------------------------------------------------------------------


def test_download_verifies_files_and_prints_the_path_last(fake, tmp_path):
    result = _download(fake, tmp_path)
    assert result.exit_code == 0, result.stderr
    path = _snapshot(fake, tmp_path)
    assert result.stdout.splitlines() == [str(path)]
    for name in ROOT_FILES:
        assert (path / name).read_bytes() == fake.files[name]
        assert f"fetched {name}" in result.stderr
    assert not (path / "original").exists() and not (path / "metal").exists()
    assert f"downloaded {len(ROOT_FILES)} files" in result.stderr
    assert hub.find_local_model("20b", cache_dir=tmp_path / "cache") == path
    listed = run_cli(["models", "--cache-dir", str(tmp_path / "cache")])
    assert listed.exit_code == 0 and listed.stdout.splitlines()[1].split()[0] == "20b"
    assert listed.stdout.splitlines()[1].split()[-2:] == ["ready", str(path)]


def test_rerun_skips_complete_files_without_requests(fake, tmp_path):
    first = _download(fake, tmp_path, "--include", "config.json")
    assert first.exit_code == 0, first.stderr
    before = len(_resolves(fake))
    second = _download(fake, tmp_path)
    assert second.exit_code == 0, second.stderr
    assert len(_resolves(fake)) - before == 2 * (len(ROOT_FILES) - 1)  # HEAD + GET per missing file only
    assert "1 were already complete" in second.stderr

    before = len(fake.requests)
    third = _download(fake, tmp_path)
    assert third.exit_code == 0 and third.stdout.splitlines()[-1] == str(_snapshot(fake, tmp_path))
    assert "already complete" in third.stderr
    assert not any("/resolve/" in r.path for r in fake.requests[before:])


def test_default_cache_is_where_chat_and_run_look(fake, tmp_path):
    result = run_cli(["download", "20b", "--endpoint", fake.url])
    assert result.exit_code == 0, result.stderr
    path = tmp_path / "default-cache" / "models--openai--gpt-oss-20b" / "snapshots" / fake.commit
    assert result.stdout.splitlines()[-1] == str(path)
    assert models.resolve_model("20b") == str(path)
    assert "gptoss chat --model 20b" in result.stderr


def test_local_dir_and_quiet_print_only_the_path(fake, tmp_path):
    target = tmp_path / "gpt-oss-20b"
    result = run_cli(["download", "20b", "--endpoint", fake.url, "--local-dir", str(target), "--quiet"])
    assert result.exit_code == 0, result.stderr
    assert result.stdout == f"{target}\n" and result.stderr == ""
    assert {str(p.relative_to(target)) for p in target.rglob("*") if p.is_file() and ".cache" not in p.parts} \
        == ROOT_FILES


@pytest.mark.parametrize("args, expected", [
    (["--include", "*.json", "--exclude", "config.json"], {"model.safetensors.index.json", "tokenizer.json"}),
    (["--include", "original/*"], {"original/model.safetensors"}),
    (["--exclude", "*.safetensors", "--exclude", "README.md"],
     {"config.json", "model.safetensors.index.json", "tokenizer.json"}),
])
def test_include_and_exclude_select_files(fake, tmp_path, args, expected):
    result = _download(fake, tmp_path, *args, "--json")
    assert result.exit_code == 0, result.stderr
    summary = json.loads(result.stdout)
    assert {f["path"] for f in summary["files"]} == expected
    fetched = {r.path.split(f"/resolve/{fake.commit}/", 1)[1] for r in fake.file_requests("GET")}
    assert fetched == expected


def test_json_summary_parses_and_marks_skipped_files(fake, tmp_path):
    result = _download(fake, tmp_path, "--json")
    assert result.exit_code == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["path"] == str(_snapshot(fake, tmp_path)) and summary["commit"] == fake.commit
    assert summary["repo_id"] == REPO and summary["dry_run"] is False
    assert {f["action"] for f in summary["files"]} == {"download"}
    assert summary["bytes_to_download"] == summary["total_bytes"] == sum(len(fake.files[p]) for p in ROOT_FILES)
    shard = next(f for f in summary["files"] if f["path"] == SHARDS[0])
    assert shard["sha256"] == fake.etag(SHARDS[0]) and shard["size"] == len(fake.files[SHARDS[0]])

    again = json.loads(_download(fake, tmp_path, "--json").stdout)
    assert {f["action"] for f in again["files"]} == {"skip"} and again["bytes_to_download"] == 0


def test_interactive_progress_on_a_terminal(fake, tmp_path):
    result = run_cli(["--color", "always", "download", "20b", "--endpoint", fake.url,
                      "--cache-dir", str(tmp_path / "cache"), "--max-workers", "2"])
    assert result.exit_code == 0, result.stderr
    assert result.stdout.splitlines()[-1].endswith(str(_snapshot(fake, tmp_path)))
    assert "total" in result.stderr


def test_verify_rehashes_files_already_present(fake, tmp_path):
    assert _download(fake, tmp_path).exit_code == 0
    target = _snapshot(fake, tmp_path) / SHARDS[1]
    data = bytearray(target.read_bytes())
    data[100] ^= 0x01  # same size: only a hash can tell
    target.write_bytes(bytes(data))
    assert _download(fake, tmp_path).exit_code == 0
    result = _download(fake, tmp_path, "--verify")
    assert result.exit_code == 1 and SHARDS[1] in _error_lines(result.stderr)[0]
    assert _download(fake, tmp_path).exit_code == 0
    assert target.read_bytes() == fake.files[SHARDS[1]]


# --- dry run ---------------------------------------------------------------------------------


def test_dry_run_lists_sizes_and_transfers_nothing(fake, tmp_path):
    assert _download(fake, tmp_path, "--include", "config.json").exit_code == 0
    before = len(fake.requests)
    result = _download(fake, tmp_path, "--dry-run")
    assert result.exit_code == 0, result.stderr
    assert not any("/resolve/" in r.path for r in fake.requests[before:])
    rows = {line.split()[0]: line for line in result.stdout.splitlines()}
    for name in ROOT_FILES:
        assert hub.format_bytes(len(fake.files[name])) in rows[name]
        assert ("complete" if name == "config.json" else "download") in rows[name]
    left = sum(len(fake.files[p]) for p in ROOT_FILES - {"config.json"})
    assert f"to download: {hub.format_bytes(left)}" in result.stdout
    assert "original/model.safetensors" not in result.stdout
    assert sorted(p.name for p in _snapshot(fake, tmp_path).iterdir()) == ["config.json"]

    summary = json.loads(_download(fake, tmp_path, "--dry-run", "--json").stdout)
    assert summary["dry_run"] is True and summary["bytes_to_download"] == left
    assert summary["enough_disk_space"] is True


# --- failures --------------------------------------------------------------------------------


def test_corrupted_file_fails_with_one_line_naming_it(fake, tmp_path):
    fake.corrupt.add(SHARDS[0])
    result = _download(fake, tmp_path)
    assert result.exit_code == 1 and result.stdout == ""
    lines = _error_lines(result.stderr)
    assert len(lines) == 1 and SHARDS[0] in lines[0] and "sha256" in lines[0]
    assert "hint:" in result.stderr and "Traceback" not in result.stderr
    assert not (_snapshot(fake, tmp_path) / SHARDS[0]).exists()


def test_missing_repo_is_explained(fake, tmp_path):
    result = _download(fake, tmp_path, model="someone/missing")
    assert result.exit_code == 1 and result.stdout == ""
    assert "someone/missing" in _error_lines(result.stderr)[0] and "not found" in result.stderr
    assert "hint:" in result.stderr and "HF_TOKEN" in result.stderr


def test_gated_repo_hints_and_the_token_never_shows(fake, tmp_path):
    fake.gated, fake.tokens = True, {GOOD_TOKEN}
    result = _download(fake, tmp_path, "--max-workers", "1")
    assert result.exit_code == 1 and "gated" in result.stderr and "licence" in result.stderr

    result = _download(fake, tmp_path, "--max-workers", "1", "--token", BAD_TOKEN)
    assert result.exit_code == 1 and "not been granted" in result.stderr and "licence" in result.stderr
    assert BAD_TOKEN not in result.stdout + result.stderr

    result = _download(fake, tmp_path, env={"HF_TOKEN": GOOD_TOKEN})
    assert result.exit_code == 0, result.stderr
    assert GOOD_TOKEN not in result.stdout + result.stderr
    assert {r.token for r in fake.file_requests("GET")} == {GOOD_TOKEN}


def test_not_enough_disk_space_is_refused_before_any_transfer(fake, tmp_path, monkeypatch):
    usage = SimpleNamespace(total=10**12, used=10**12 - 1_000, free=1_000)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage)
    result = _download(fake, tmp_path)
    assert result.exit_code == 1 and "not enough disk space" in result.stderr and "--local-dir" in result.stderr
    assert _resolves(fake) == []

    result = _download(fake, tmp_path, "--dry-run")
    assert result.exit_code == 0 and "not enough disk space" in result.stderr
    assert json.loads(_download(fake, tmp_path, "--dry-run", "--json").stdout)["enough_disk_space"] is False


def test_ctrl_c_exits_130_with_a_resume_hint(fake, tmp_path, monkeypatch):
    def interrupted(**kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(hub, "hf_hub_download", interrupted)
    result = _download(fake, tmp_path)
    assert result.exit_code == 130 and result.stdout == ""
    assert "run the same command again to resume" in result.stderr


@pytest.mark.parametrize("args, code, words", [
    (["download", "20b", "--local-dir", "a", "--cache-dir", "b"], 2, "not both"),
    (["download", "random:tiny"], 2, "needs no download"),
    (["download", "20b", "--max-workers", "0"], 2, "max-workers"),
    (["download", "a/b/c"], 1, "neither a model alias nor"),
])
def test_flag_mistakes_are_one_line_errors(args, code, words):
    result = run_cli(args)
    assert result.exit_code == code and words in result.stderr
    assert "Traceback" not in result.stderr and result.stdout == ""


def test_library_resume_warnings_hidden_unless_debug(tmp_path):
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("huggingface_hub")
    logger.addHandler(handler)
    big = os.urandom(11 * MiB)  # over one 10 MiB read chunk: the library retries in-process with Range
    try:
        for debug in (False, True):
            with FakeHub(REPO, {"config.json": b"{}", "model.safetensors": big}, lfs={"model.safetensors"}) as fake:
                fake.truncate_once["model.safetensors"] = 10 * MiB + 1
                result = run_cli((["--debug"] if debug else []) + ["download", "20b", "--endpoint", fake.url,
                                                                    "--local-dir", str(tmp_path / str(debug))])
                assert result.exit_code == 0, result.stderr
            resumed = [r for r in records if "resume" in r.getMessage()]
            assert bool(resumed) == debug
    finally:
        logger.removeHandler(handler)


def test_cli_import_stays_free_of_huggingface_hub_and_torch():
    code = "import sys, gptoss_cli.cli; print(sorted({'huggingface_hub', 'torch'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# --- the progress renderer -------------------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _ui(terminal: bool = False) -> tuple[Ui, io.StringIO]:
    err = io.StringIO()
    console = Console(file=err, force_terminal=terminal, width=120, color_system=None, highlight=False)
    return Ui(out=Console(file=io.StringIO()), err=console), err


def _progress(terminal: bool = False):
    ui, err = _ui(terminal)
    clock = FakeClock()
    return DownloadProgress(ui, tick_every=None, clock=clock), clock, err


def test_plain_status_line_at_most_every_ten_seconds():
    progress, clock, err = _progress()
    progress.start(1000, 2)
    progress.file_start("a.bin", 600)
    for at, expect_lines in ((5, 0), (10, 1), (15, 1), (19.9, 1), (20, 2), (21, 2)):
        clock.now = 1000 + at
        progress.advance("a.bin", 10)
        progress.tick()
        assert err.getvalue().count("files") == expect_lines, at
    assert err.getvalue().splitlines()[-1].startswith("50 bytes/1.0 kB · 5% · 2 bytes/s · ETA")
    progress.done()


def test_stall_warning_once_per_stall_and_not_while_hashing():
    progress, clock, err = _progress(terminal=True)
    progress.start(1000, 1)
    progress.file_start("big.safetensors", 1000)
    progress.advance("big.safetensors", 400)
    clock.now += 59
    progress.tick()
    assert "no data received" not in err.getvalue()
    clock.now += 1
    progress.tick()
    progress.tick()
    assert err.getvalue().count("no data received for 60 s") == 1 and "big.safetensors" in err.getvalue()
    progress.advance("big.safetensors", 600)  # everything arrived: the file is being hashed now
    clock.now += 120
    progress.tick()
    assert err.getvalue().count("no data received") == 1
    progress.done()


def test_restart_and_threads_keep_the_tally_exact():
    progress, _, _ = _progress(terminal=True)
    progress.start(8 * 1000, 8)
    names = [f"shard-{i}.safetensors" for i in range(8)]

    def worker(name: str) -> None:
        progress.file_start(name, 1000)
        for _ in range(50):
            progress.advance(name, 10)
        progress.advance(name, -300)  # the library threw bytes away to restart
        for _ in range(80):
            progress.advance(name, 10)
        progress.file_done(name)

    threads = [threading.Thread(target=worker, args=(n,)) for n in names]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    progress.done()
    assert progress.tally.bytes_done == 8 * 1000 and progress.tally.files_done == 8
    assert progress.tally.in_flight == {}


def test_helpers_shorten_names_and_format_status():
    assert short_name("a" * 10) == "a" * 10
    long = "original/" + "x" * 60 + "-00001-of-00002.safetensors"
    assert len(short_name(long)) == 40 and short_name(long).endswith("-00001-of-00002.safetensors")
    progress, _, _ = _progress()
    progress.tally.total_bytes, progress.tally.bytes_done, progress.tally.num_files = 4000, 1000, 3
    assert status_text(progress.tally, 10.0) == "1.0 kB/4.0 kB · 25% · 100 bytes/s · ETA 00:30 · 0/3 files"
    assert "ETA ?" in status_text(progress.tally, 0.0)
