"""`gptoss models`: the gpt-oss checkpoints on this machine, as `ollama list` shows its models.

Reads the Hugging Face cache only (no network, no torch): each snapshot whose config.json names
gpt_oss, with the name `-m` takes, its revision, size, whether every shard is there, and its
folder. The table is the command's result, so it goes to stdout; notes go to stderr.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import typer

from .app import app
from .console import plain_table
from .download import CacheDirOpt, JsonOpt
from .models import ALIASES, DEFAULT_MODEL

_HEADER = ["MODEL", "REVISION", "SIZE", "STATUS", "PATH"]


@app.command("models")
def models_command(ctx: typer.Context, cache_dir: CacheDirOpt = None, as_json: JsonOpt = False) -> None:
    """List the downloaded gpt-oss checkpoints: name for -m, revision, size, completeness, folder."""
    from huggingface_hub import constants

    from ..hub import format_bytes
    from ..hub_cache import local_checkpoints

    ui = ctx.obj
    cache = cache_dir or Path(constants.HF_HUB_CACHE)
    found = local_checkpoints(cache) if cache.is_dir() else []
    names = {repo: alias for alias, repo in ALIASES.items()}
    records = [{"model": names.get(c.repo_id, c.repo_id), "repo_id": c.repo_id, "revision": ",".join(c.refs),
                "commit": c.commit, "size_bytes": c.size, "complete": c.complete, "path": str(c.path)}
               for c in found]
    if as_json:
        print(json.dumps(records, indent=2))
        return
    if records:
        rows = [[r["model"], r["revision"] or r["commit"][:12], format_bytes(r["size_bytes"]),
                 "ready" if r["complete"] else "incomplete", r["path"]] for r in records]
        print(plain_table(_HEADER, rows, right=False), end="")
    else:
        ui.note(f"no gpt-oss checkpoint in {cache}")
    for r in records:
        if not r["complete"]:
            ui.note(f"{r['model']} is missing files: `gptoss download {r['model']}` completes it")
    missing = [alias for alias in ALIASES if alias not in {r["model"] for r in records if r["complete"]}]
    if missing:
        ui.note(f"not downloaded: {', '.join(missing)} (gptoss download {missing[0]}); "
                "random:tiny, random:20b and random:120b need no download")
    ui.note(f"default model: {os.environ.get('GPTOSS_MODEL') or DEFAULT_MODEL} (-m or GPTOSS_MODEL to change); "
            "folders from `download --local-dir` are not listed: pass them with -m DIR")

