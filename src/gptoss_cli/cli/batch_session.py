"""A whole `gptoss run`, in order: checks, validation pre-pass, resume, model, batch loop, summary.

Everything a user can get wrong (paths, flags, bad lines with --strict, a busy or mismatched
output) is reported before the model loads. Exit codes: 0 all records ok, 3 some failed (0 with
--allow-failures), 130 interrupted (after flushing and printing the resume hint); usage errors
(2) and fatal errors (1) are raised and mapped by cli/__init__.py.
"""

from __future__ import annotations

import io
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from rich.markup import escape

from ..runtime.errors import GptossError
from . import errors
from .batch_input import BatchLine
from .batch_jobs import JobSettings
from .batch_output import FORMATS, RecordOptions
from .batch_progress import BatchProgress
from .batch_request import RunDefaults
from .batch_resume import OutputLock, PriorRecords, RunMeta, check_resumable, read_prior_records, write_meta
from .batch_runner import BatchRunner, RunOutcome
from .batch_scan import InputScan, replay, scan_input
from .batch_signals import StopRequests
from .batch_writer import DurableFile, RecordWriter, StreamSink
from .console import Ui
from .errors import UsageError

STDIO = "-"
MAX_SHOWN_ERRORS = 20


@dataclass(frozen=True)
class RunOptions:
    input: str
    output: str = STDIO
    fmt: str = "auto"
    error_file: str | None = None
    resume: bool = False
    retry_errors: bool = False
    force: bool = False
    ordered: bool = True
    window: int = 1024
    model: str | None = None
    defaults: RunDefaults = field(default_factory=RunDefaults)
    context: int | None = None
    reasoning: str = "include"
    token_ids: bool = False
    strict: bool = False
    allow_failures: bool = False
    limit: int | None = None
    log_interval: float = 10.0


@dataclass
class _Totals:
    """Counts for the summary and the exit code."""

    skipped: int = 0  # records an earlier run already wrote
    skipped_failed: int = 0  # ... of which failed (still failures of the output as a whole)


@dataclass
class _Plan:
    """What the pre-model phase settled: the input, what is already done, where records go."""

    source: IO[bytes]
    prior: PriorRecords
    totals: _Totals
    scan: InputScan
    writer: RecordWriter


@dataclass
class _Result:
    outcome: RunOutcome
    interrupted: bool
    seconds: float


def run_batch(ui: Ui, opts: RunOptions) -> int:
    from .models import DEFAULT_MODEL, model_display_name, resolve_model

    check_options(opts)
    out_path = None if opts.output == STDIO else Path(opts.output)
    err_path = None if opts.error_file is None else Path(opts.error_file)
    for path in (out_path, err_path):
        if path is not None:
            check_writable(path)
    check_input(opts.input)
    resolved = resolve_model(opts.model)
    model_name = model_display_name(opts.model or os.environ.get("GPTOSS_MODEL") or DEFAULT_MODEL)
    with ExitStack() as stack:
        plan = _plan(ui, opts, stack, out_path, err_path, resolved, model_name)
        if plan.scan.todo == 0:
            return _nothing_to_do(ui, opts, plan.totals)
        result = _execute(ui, opts, plan, model_name)
    return _finish(ui, opts, plan, result)


def _plan(ui: Ui, opts: RunOptions, stack: ExitStack, out_path: Path | None, err_path: Path | None,
          resolved_model: str, model_name: str) -> _Plan:
    """Lock the outputs, read what an earlier run wrote, validate the input, settle the sidecar."""
    source = stack.enter_context(open_input(opts.input))
    for path in (out_path, err_path):
        if path is not None:
            stack.enter_context(OutputLock(path))
    prior = _prior_records(ui, opts, out_path, err_path)
    totals = _Totals()
    scan = scan_input(source, opts.limit, _skip_rule(prior, opts, totals))
    report_scan(ui, opts, scan, model_name)
    sampling = {k: v for k, v in opts.defaults.to_dict().items() if k != "effort"}
    meta = RunMeta(scan.sha256, resolved_model, opts.defaults.effort, sampling, opts.fmt, opts.reasoning)
    if out_path is not None:
        _settle_meta(ui, opts, out_path, prior, meta)
    return _Plan(source, prior, totals, scan, _open_writer(stack, opts, out_path, err_path))


def _execute(ui: Ui, opts: RunOptions, plan: _Plan, model_name: str) -> _Result:
    """Load the model (only if some line can run) and drive the batch loop."""
    loaded = _load(ui, opts) if plan.scan.valid else None
    engine, tokenizer = (loaded.engine, loaded.tokenizer) if loaded is not None else (None, None)
    settings = JobSettings(model_name, opts.defaults, opts.fmt, plan.scan.first_kind,
                           RecordOptions(opts.reasoning == "include", opts.token_ids))
    plan.source.seek(0)
    lines = _lines_to_run(replay(plan.source, plan.scan, opts.limit), plan.prior, opts)
    start = time.perf_counter()
    with StopRequests() as stop, BatchProgress(ui, plan.scan.todo, opts.log_interval) as progress:
        runner = BatchRunner(engine, tokenizer, plan.writer, progress, settings, stop, opts.window, opts.ordered)
        outcome = _run(runner, lines)
        plan.writer.close()
    return _Result(outcome, stop.stopping, time.perf_counter() - start)


# ---- checks before anything runs ---------------------------------------------------------------

def check_options(opts: RunOptions) -> None:
    if opts.fmt not in FORMATS:
        raise UsageError(f"--format must be one of {', '.join(FORMATS)}, not {opts.fmt!r}")
    if opts.reasoning not in ("include", "omit"):
        raise UsageError(f"--reasoning must be include or omit, not {opts.reasoning!r}")
    if opts.output == STDIO and (opts.resume or opts.retry_errors):
        raise UsageError("--resume needs an output file; stdout cannot be resumed", "pass -o FILE.jsonl")
    if opts.error_file == STDIO:
        raise UsageError("--error-file must be a file (stdout carries the results)")
    if opts.limit is not None and opts.limit < 0:
        raise UsageError("--limit must be >= 0")
    if opts.window < 1:
        raise UsageError("--max-concurrency must be >= 1")
    paths = [p for p in (opts.output, opts.error_file) if p not in (None, STDIO)]
    if opts.input != STDIO and any(_same_path(opts.input, p) for p in paths):
        raise UsageError("the output would overwrite the input", "choose another -o / --error-file")
    if len(paths) == 2 and _same_path(*paths):
        raise UsageError("--error-file must differ from the output file")


def _same_path(a: str, b: str) -> bool:
    return os.path.abspath(a) == os.path.abspath(b)


def check_writable(path: Path) -> None:
    """A clear UsageError now rather than a crash after the model has loaded."""
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise UsageError(f"cannot write {path}: directory {parent} does not exist", f"create it first: mkdir -p {parent}")
    if path.is_dir():
        raise UsageError(f"cannot write {path}: it is a directory", "give a file name, e.g. -o results.jsonl")
    if not os.access(parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise UsageError(f"cannot write {path}: permission denied")


def check_input(name: str) -> None:
    if name == STDIO:
        return
    path = Path(name)
    if not path.exists():
        raise UsageError(f"input file {name} does not exist")
    if path.is_dir():
        raise UsageError(f"input {name} is a directory; give a JSONL file (or - for stdin)")


@contextmanager
def open_input(name: str) -> Iterator[IO[bytes]]:
    """A seekable binary stream (the input is read twice): the file itself, or a temporary copy
    of stdin or of a pipe given as a path (e.g. `<(zcat in.jsonl.gz)`)."""
    with ExitStack() as stack:
        if name == STDIO:
            raw = getattr(sys.stdin, "buffer", None) or io.BytesIO(sys.stdin.read().encode("utf-8"))
        else:
            raw = stack.enter_context(open(name, "rb"))
            if raw.seekable():
                yield raw
                return
        spool = stack.enter_context(tempfile.TemporaryFile())
        shutil.copyfileobj(raw, spool)
        spool.seek(0)
        yield spool


# ---- resume ------------------------------------------------------------------------------------

def _prior_records(ui: Ui, opts: RunOptions, out_path: Path | None, err_path: Path | None) -> PriorRecords:
    """Existing records (resume), or a check that we are not about to clobber some."""
    prior = PriorRecords()
    for path in (out_path, err_path):
        if path is None or not path.exists() or path.stat().st_size == 0:
            continue
        if not (opts.resume or opts.retry_errors):
            if not opts.force:
                raise UsageError(f"{path} already exists and is not empty",
                                 "add --resume to continue it, or --force to start it over")
            os.truncate(path, 0)
            continue
        found = read_prior_records(path)
        if found.torn_bytes:
            _warn(ui, f"{path}: dropped a torn last line ({found.torn_bytes} bytes) left by an interrupted run")
        if found.unreadable:
            _warn(ui, f"{path}: {found.unreadable} line(s) are not batch records (left as they are)")
        _merge(prior, found)
    return prior


def _merge(into: PriorRecords, other: PriorRecords) -> None:
    into.ok_ids |= other.ok_ids
    into.failed_ids = (into.failed_ids | other.failed_ids) - into.ok_ids
    into.failed_lines |= other.failed_lines
    into.records += other.records
    into.unreadable += other.unreadable


def _skip_rule(prior: PriorRecords, opts: RunOptions, totals: _Totals):
    def skip(line: int, custom_id: str, has_error: bool) -> bool:
        skipped = prior.should_skip(line, custom_id, has_error, opts.retry_errors)
        if skipped:
            totals.skipped += 1
            totals.skipped_failed += custom_id not in prior.ok_ids or has_error
        return skipped

    return skip


def _lines_to_run(lines: Iterator[BatchLine], prior: PriorRecords, opts: RunOptions) -> Iterator[BatchLine]:
    for line in lines:
        if not prior.should_skip(line.number, line.custom_id, line.error is not None, opts.retry_errors):
            yield line


def _settle_meta(ui: Ui, opts: RunOptions, out_path: Path, prior: PriorRecords, meta: RunMeta) -> None:
    if opts.resume or opts.retry_errors:
        old = check_resumable(out_path, prior, meta, opts.force)
        if prior.records:
            _note(ui, f"resuming {out_path}: {prior.records} record(s) already there")
        if old == meta:
            return
    write_meta(out_path, meta)


# ---- reporting ---------------------------------------------------------------------------------

def report_scan(ui: Ui, opts: RunOptions, scan: InputScan, model_name: str) -> None:
    """Every bad line (up to a screenful) with its number, once-per-key warnings, then --strict."""
    for number, error in list(scan.errors.items())[:MAX_SHOWN_ERRORS]:
        ui.err.print(f"[yellow]line {number}:[/] {escape(error.message)} [dim]({error.code})[/]", soft_wrap=True)
    hidden = len(scan.errors) - MAX_SHOWN_ERRORS
    if hidden > 0:
        _note(ui, f"… and {hidden} more invalid line(s)")
    for key, note in scan.notes.items():
        more = f" (and {note.count - 1} more line(s))" if note.count > 1 else ""
        _warn(ui, f"line {note.first_line}: {key}{more}")
    for model, line in scan.models.items():
        if not _same_model(model, model_name):
            _warn(ui, f"line {line} asks for model {model}; every line runs on {model_name}")
    if not scan.errors:
        return
    if opts.strict:
        raise UsageError(f"{len(scan.errors)} of {scan.records} input line(s) are invalid (--strict)",
                         "fix them, or drop --strict to write error records for them and run the rest")
    _warn(ui, f"{len(scan.errors)} of {scan.records} input line(s) are invalid; they get error records")


def _note(ui: Ui, text: str) -> None:
    # soft_wrap: log lines must stay one line each when stderr is a file or a pipe.
    ui.err.print(f"[dim]{escape(text)}[/]", soft_wrap=True)


def _warn(ui: Ui, text: str) -> None:
    ui.err.print(f"[yellow]warning:[/] {escape(text)}", soft_wrap=True)


def _same_model(requested: str, running: str) -> bool:
    def norm(name: str) -> str:
        return name.rsplit("/", 1)[-1].lower()

    return norm(requested) == norm(running)


def _nothing_to_do(ui: Ui, opts: RunOptions, totals: _Totals) -> int:
    if totals.skipped:
        _note(ui, f"nothing to do: all {totals.skipped} record(s) are already in {opts.output}")
    else:
        _note(ui, "nothing to do: the input has no records")
    return _exit_code(opts, totals.skipped_failed)


def _open_writer(stack: ExitStack, opts: RunOptions, out_path: Path | None, err_path: Path | None) -> RecordWriter:
    """Open (create) the outputs now, so an unwritable file fails before the model loads."""
    output = StreamSink(sys.stdout) if out_path is None else DurableFile(out_path)
    stack.callback(output.close)
    errors_sink = None if err_path is None else DurableFile(err_path)
    if errors_sink is not None:
        stack.callback(errors_sink.close)
    return RecordWriter(output, errors_sink, opts.ordered)


def _run(runner: BatchRunner, lines: Iterator[BatchLine]) -> RunOutcome:
    try:
        return runner.run(lines)
    except (GptossError, KeyboardInterrupt):
        raise
    except Exception as e:
        # The records already written are whole; say so instead of only "internal error".
        raise GptossError(f"the engine failed: {type(e).__name__}: {e}",
                          "the records written so far are complete: rerun with --resume "
                          "(add --debug for the traceback)") from e


def _load(ui: Ui, opts: RunOptions):
    from .models import load_model

    options = {} if opts.context is None else {"max_context": opts.context}
    return load_model(ui, opts.model, **options)


def _finish(ui: Ui, opts: RunOptions, plan: _Plan, result: _Result) -> int:
    writer, outcome, seconds = plan.writer, result.outcome, result.seconds
    ok, failed = writer.written_ok, writer.written_failed
    rate = outcome.out_tokens / seconds if seconds > 0 else 0.0
    where = "stdout" if opts.output == STDIO else opts.output
    skipped = plan.totals.skipped
    earlier = f" ({skipped} already done)" if skipped else ""
    _note(ui, f"{ok + failed} record(s) written{earlier}: {ok} ok, {failed} failed · {outcome.prompt_tokens:,} prompt tok · "
              f"{outcome.out_tokens:,} out tok · {seconds:.1f}s · {rate:,.1f} out tok/s → {where}")
    if result.interrupted:
        left = plan.scan.todo - ok - failed
        _warn(ui, f"interrupted: {left} record(s) not written")
        if left and opts.output != STDIO:
            _note(ui, "to finish, run the same command again with --resume")
        return errors.INTERRUPTED
    return _exit_code(opts, failed + plan.totals.skipped_failed)


def _exit_code(opts: RunOptions, failed: int) -> int:
    return errors.PARTIAL_FAILURE if failed and not opts.allow_failures else errors.OK

