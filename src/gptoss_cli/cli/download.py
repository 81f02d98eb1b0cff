"""`gptoss download`: fetch a checkpoint from the Hugging Face hub (cli-ux.md §2.1).

Thin over `gptoss_cli.hub`, the engine (plan → disk check → verified files). This module turns the
flags into a plan, shows it (--dry-run) or runs it with progress on stderr, and ends with the
checkpoint folder on the last line of stdout (or a JSON summary with --json). huggingface_hub is
imported inside the command only, so `gptoss --help` stays fast.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Annotated

import typer
from rich.markup import escape

from . import errors
from .app import app
from .console import Ui
from .download_progress import DownloadProgress, clock_text
from .errors import UsageError

if TYPE_CHECKING:
    from ..hub import DownloadPlan

ModelArg = Annotated[str, typer.Argument(
    metavar="MODEL", help="20b, 120b, or a Hugging Face repo id such as openai/gpt-oss-20b.")]
IncludeOpt = Annotated[list[str] | None, typer.Option(
    "--include", metavar="PATTERN", show_default=False,
    help="Only files matching this glob (repeatable), e.g. 'original/*'; replaces the default selection.")]
ExcludeOpt = Annotated[list[str] | None, typer.Option(
    "--exclude", metavar="PATTERN", show_default=False, help="Skip files matching this glob (repeatable).")]
RevisionOpt = Annotated[str, typer.Option(help="Branch, tag or commit to download.")]
LocalDirOpt = Annotated[Path | None, typer.Option(
    "--local-dir", metavar="DIR", help="Write plain files into DIR instead of the Hugging Face cache.")]
CacheDirOpt = Annotated[Path | None, typer.Option(
    "--cache-dir", metavar="DIR",
    help="Hugging Face cache folder (default: $HF_HUB_CACHE, else ~/.cache/huggingface/hub).")]
EndpointOpt = Annotated[str | None, typer.Option(
    envvar="HF_ENDPOINT", show_envvar=True, metavar="URL", help="Hub or mirror URL (default: huggingface.co).")]
TokenOpt = Annotated[str | None, typer.Option(
    metavar="TOKEN", show_default=False,
    help="Hugging Face token for gated or private repos. Prefer setting HF_TOKEN: a flag ends up in shell "
         "history. Default: HF_TOKEN, else the saved `hf auth login`.")]
MaxWorkersOpt = Annotated[int, typer.Option("--max-workers", min=1, help="Files downloaded in parallel.")]
VerifyOpt = Annotated[bool, typer.Option(
    "--verify", help="Also re-hash the files already present (sha256 / git blob id), not just their sizes.")]
DryRunOpt = Annotated[bool, typer.Option(
    "--dry-run", help="List the files, their sizes and what is already complete; transfer nothing.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print a JSON summary on stdout instead of the path.")]
QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help="No progress or summary: only the result and errors.")]


@app.command()
def download(
    ctx: typer.Context,
    model: ModelArg = "20b",
    include: IncludeOpt = None,
    exclude: ExcludeOpt = None,
    revision: RevisionOpt = "main",
    local_dir: LocalDirOpt = None,
    cache_dir: CacheDirOpt = None,
    endpoint: EndpointOpt = None,
    token: TokenOpt = None,
    max_workers: MaxWorkersOpt = 8,
    verify: VerifyOpt = False,
    dry_run: DryRunOpt = False,
    json_output: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Download a model (by default the files the loader needs); re-running skips what is complete.

    Examples: gptoss download 20b · gptoss download 120b --dry-run ·
    gptoss download 20b --include 'original/*' --local-dir ./gpt-oss-20b
    """
    ui: Ui = ctx.obj
    _check_flags(model, local_dir, cache_dir)
    hub = _import_hub()
    with _library_logging(ui.debug):
        plan = hub.plan_download(model, include, exclude, revision, endpoint, token, local_dir, cache_dir)
        if dry_run:
            _show_plan(ui, hub, plan, json_output)
            return
        if not quiet:
            _announce(ui, hub, plan, verify)
        started = time.monotonic()
        path = _run(ui, hub, plan, max_workers, verify, quiet)
        seconds = time.monotonic() - started
    if json_output:
        _print_result(ui, json.dumps(plan_summary(plan, dry_run=False, seconds=round(seconds, 3))))
    else:
        if not quiet:
            default_cache = local_dir is None and cache_dir is None
            _report_done(ui, hub, plan, seconds, model, default_cache)
        _print_result(ui, str(path))


def _check_flags(model: str, local_dir: Path | None, cache_dir: Path | None) -> None:
    if model.startswith("random:"):
        raise UsageError(f"{model} needs no download",
                         f"random checkpoints are generated on the fly: use `gptoss chat --model {model}`")
    if local_dir is not None and cache_dir is not None:
        raise UsageError("give either --local-dir or --cache-dir, not both",
                         "--local-dir writes plain files into a folder; --cache-dir picks the Hugging Face cache")


def _import_hub() -> ModuleType:
    # Only our progress should draw; huggingface_hub reads this variable when it is first imported.
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    from .. import hub

    return hub


@contextmanager
def _library_logging(debug: bool) -> Iterator[None]:
    """Silence huggingface_hub's warnings ("Trying to resume download...") unless --debug.

    Our progress shows restarts, and every failure that matters reaches the user as a DownloadError.
    """
    logger = logging.getLogger("huggingface_hub")
    previous = logger.level
    if not debug:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(previous)


def _run(ui: Ui, hub: ModuleType, plan: DownloadPlan, max_workers: int, verify: bool, quiet: bool) -> Path:
    """The transfer itself; Ctrl+C ends with exit code 130 and says how to carry on."""
    progress = None if quiet else DownloadProgress(ui)
    try:
        return hub.download(plan, progress, max_workers=max_workers, verify_existing=verify)
    except KeyboardInterrupt:
        ui.note("interrupted: complete files are kept; run the same command again to resume")
        raise typer.Exit(errors.INTERRUPTED) from None


# ---------------------------------------------------------------------------------------------
# What is shown


def plan_summary(plan: DownloadPlan, *, dry_run: bool, **extra) -> dict:
    """The --json object: the plan, one entry per file with `action` skip or download, plus `extra`."""
    files = [{"path": f.path, "size": f.size, "sha256": f.sha256,
              "action": "skip" if f.path in plan.complete else "download"} for f in plan.files]
    return {"repo_id": plan.repo_id, "revision": plan.revision, "commit": plan.commit,
            "path": str(plan.destination), "dry_run": dry_run, "files": files,
            "total_bytes": plan.total_bytes, "bytes_to_download": plan.bytes_to_download, **extra}


def _show_plan(ui: Ui, hub: ModuleType, plan: DownloadPlan, json_output: bool) -> None:
    """--dry-run: the plan is the result, so it goes to stdout; a disk-space problem is a warning."""
    disk_problem = _disk_problem(hub, plan)
    if json_output:
        _print_result(ui, json.dumps(plan_summary(plan, dry_run=True, enough_disk_space=disk_problem is None)))
        return
    fmt = hub.format_bytes
    width = max(len(f.path) for f in plan.files)
    ui.out.print(f"[bold]{'file':<{width}}  {'size':>9}  status[/]", highlight=False)
    for f in plan.files:
        status = "[green]complete[/]" if f.path in plan.complete else "download"
        padding = " " * (width - len(f.path))  # measured before escaping, which adds backslashes
        ui.out.print(f"{escape(f.path)}{padding}  {fmt(f.size):>9}  {status}", highlight=False)
    ui.out.print(f"{len(plan.files)} files, {fmt(plan.total_bytes)}; already complete: {len(plan.complete)} files, "
                 f"{fmt(plan.bytes_complete)}; to download: {fmt(plan.bytes_to_download)}", highlight=False)
    ui.out.print(f"destination: {escape(str(plan.destination))}", highlight=False, soft_wrap=True)
    if disk_problem:
        ui.warn(f"the download would fail: {disk_problem}")


def _disk_problem(hub: ModuleType, plan: DownloadPlan) -> str | None:
    try:
        hub.check_disk_space(plan)
    except hub.DownloadError as e:
        return str(e)
    return None


def _announce(ui: Ui, hub: ModuleType, plan: DownloadPlan, verify: bool) -> None:
    fmt = hub.format_bytes
    done = f"; {len(plan.complete)} already complete" if plan.complete else ""
    _info(ui, f"{plan.repo_id} @ {plan.revision} ({plan.commit[:7]}): {len(plan.files)} files, "
              f"{fmt(plan.total_bytes)}{done} → {plan.destination}")
    if verify and plan.complete:
        ui.note(f"re-hashing the {len(plan.complete)} files already present ({fmt(plan.bytes_complete)} to read)")


def _report_done(
    ui: Ui, hub: ModuleType, plan: DownloadPlan, seconds: float, model: str, default_cache: bool
) -> None:
    fmt = hub.format_bytes
    fetched = plan.pending_files
    if not fetched:
        ui.note(f"all {len(plan.files)} files were already complete ({fmt(plan.total_bytes)})")
    else:
        rate = plan.bytes_to_download / seconds if seconds > 0 else 0.0
        skipped = f"; {len(plan.complete)} were already complete" if plan.complete else ""
        took = f"{seconds:.1f} s" if seconds < 60 else clock_text(seconds)
        ui.note(f"downloaded {len(fetched)} files, {fmt(plan.bytes_to_download)} in {took} "
                f"({fmt(int(rate))}/s){skipped}")
    _suggest_use(ui, plan, model, default_cache)


def _suggest_use(ui: Ui, plan: DownloadPlan, model: str, default_cache: bool) -> None:
    """How chat/run/bench find this checkpoint: by name from the default cache, else by path."""
    from ..hub_cache import looks_complete

    if not looks_complete(plan.destination):
        return
    by_name = default_cache and plan.revision == "main"
    _info(ui, f"use it: gptoss chat --model {model.strip() if by_name else plan.destination}")


def _info(ui: Ui, text: str) -> None:
    """A dim stderr line that may hold a long path: never wrapped, so it can be copied."""
    ui.err.print(f"[dim]{escape(text)}[/]", soft_wrap=True)


def _print_result(ui: Ui, text: str) -> None:
    """A line of the command's result on stdout, printed literally (paths may hold '[' or ':')."""
    ui.out.print(text, markup=False, emoji=False, highlight=False, soft_wrap=True)
