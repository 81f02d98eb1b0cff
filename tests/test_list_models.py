"""`gptoss models`: the gpt-oss snapshots of a Hugging Face cache layout, built here by hand."""

from __future__ import annotations

import json

import pytest
from cli_helpers import run_cli

from gptoss_cli.hub_cache import local_checkpoints


def _snapshot(cache, repo_id, commit, files, refs=("main",)):
    """A cache entry as huggingface_hub writes it: blobs, a snapshot of symlinks, refs."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snap = repo / "snapshots" / commit
    for name, data in files.items():
        blob = repo / "blobs" / f"{commit}-{name.replace('/', '_')}"
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snap / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(blob)
    for ref in refs:
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return snap


def _checkpoint(shards=("a.safetensors", "b.safetensors"), present=None, model_type="gpt_oss"):
    index = {"weight_map": {f"w{i}": s for i, s in enumerate(shards)}}
    files = {"config.json": json.dumps({"model_type": model_type}).encode(),
             "model.safetensors.index.json": json.dumps(index).encode()}
    files |= {s: b"x" * 1000 for s in (shards if present is None else present)}
    return files


@pytest.fixture
def cache(tmp_path):
    c = tmp_path / "hub"
    _snapshot(c, "openai/gpt-oss-20b", "c" * 40, _checkpoint())
    _snapshot(c, "openai/gpt-oss-120b", "d" * 40, _checkpoint(present=["a.safetensors"]))  # one shard missing
    _snapshot(c, "someone/gpt-oss-20b-finetune", "e" * 40, _checkpoint(), refs=())
    _snapshot(c, "meta/llama", "f" * 40, _checkpoint(model_type="llama"))
    return c


def test_local_checkpoints_lists_gpt_oss_snapshots_only(cache):
    found = {c.repo_id: c for c in local_checkpoints(cache)}
    assert set(found) == {"openai/gpt-oss-20b", "openai/gpt-oss-120b", "someone/gpt-oss-20b-finetune"}
    small = found["openai/gpt-oss-20b"]
    assert small.complete and small.refs == ("main",) and small.commit == "c" * 40
    config_bytes = len(json.dumps({"model_type": "gpt_oss"}))
    assert small.size == 2000 + config_bytes + len(_checkpoint()["model.safetensors.index.json"])
    assert not found["openai/gpt-oss-120b"].complete
    assert found["someone/gpt-oss-20b-finetune"].refs == ()
    assert local_checkpoints(cache / "missing") == []


def test_models_command_table_and_notes(cache):
    result = run_cli(["models", "--cache-dir", str(cache)])
    assert result.exit_code == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].split() == ["MODEL", "REVISION", "SIZE", "STATUS", "PATH"]
    rows = {line.split()[0]: line.split() for line in lines[1:]}
    assert rows["20b"][1:3] == ["main", "2.1"] and rows["20b"][4] == "ready"
    assert rows["20b"][-1] == str(cache / "models--openai--gpt-oss-20b" / "snapshots" / ("c" * 40))
    assert rows["120b"][4] == "incomplete" and rows["someone/gpt-oss-20b-finetune"][1] == "e" * 12
    assert "llama" not in result.stdout
    assert "`gptoss download 120b` completes it" in result.stderr
    assert "not downloaded: 120b" in result.stderr  # an incomplete snapshot is not a usable model


def test_models_json_and_an_empty_cache(cache, tmp_path):
    result = run_cli(["models", "--cache-dir", str(cache), "--json"])
    assert result.exit_code == 0, result.stderr
    records = json.loads(result.stdout)
    assert {r["model"] for r in records} == {"20b", "120b", "someone/gpt-oss-20b-finetune"}
    assert next(r for r in records if r["model"] == "20b")["complete"] is True
    empty = run_cli(["models", "--cache-dir", str(tmp_path / "nothing")])
    assert empty.exit_code == 0 and empty.stdout == ""
    assert "no gpt-oss checkpoint in" in empty.stderr and "not downloaded: 20b, 120b" in empty.stderr
