"""One batch line's trip through the engine: prepare the request, then turn the outcome into a record.

`prepare` renders the prompt and resolves sampling (a failure here is that line's error record);
`finished_record` parses what the engine generated into an ok record with usage and timing.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..runtime.api import RequestOutput, SamplingParams
from ..runtime.stop_strings import StopWatch
from .batch_input import BatchLine, LineError
from .batch_output import RecordContext, RecordOptions, Usage, error_record, ok_record, record_format
from .batch_request import RunDefaults, effort_for, prompt_ids, sampling_for, stop_for
from .batch_result import chat_completion, text_completion


@dataclass(frozen=True)
class JobSettings:
    """Everything about the run that shapes a record."""

    model: str
    defaults: RunDefaults
    fmt: str = "auto"  # auto | openai | simple
    fallback_kind: str | None = None  # the shape assumed for lines too broken to have one
    options: RecordOptions = RecordOptions()


@dataclass
class Job:
    seq: int  # position among the records this run writes
    line: BatchLine
    ctx: RecordContext
    prompt: list[int] | None = None
    params: SamplingParams | None = None
    started: bool = False  # at least one token came back
    stop: tuple[str, ...] = ()  # stop sequences
    watch: StopWatch | None = None  # tells when the answer reached one of them (the runner aborts)


def prepare(line: BatchLine, seq: int, settings: JobSettings, tokenizer) -> tuple[Job, LineError | None]:
    """The job for a line, plus the error that stops it from running (None when it can run)."""
    fmt = record_format(settings.fmt, line.kind or settings.fallback_kind)
    spec = line.request
    if spec is None:
        ctx = RecordContext(line.custom_id, line.number, fmt, settings.model)
        return Job(seq, line, ctx), line.error
    effort = effort_for(spec, settings.defaults)
    params = sampling_for(spec, settings.defaults)
    ctx = RecordContext(line.custom_id, line.number, fmt, settings.model, effort, params.seed)
    job = Job(seq, line, ctx, params=params, stop=stop_for(spec, settings.defaults))
    if job.stop:
        job.watch = StopWatch(tokenizer, job.stop, harmony=spec.kind != "text")
    try:
        job.prompt = prompt_ids(spec, tokenizer, effort)
    except (ValueError, TypeError, KeyError, AttributeError, RecursionError) as e:
        # One unrenderable line (say, a pathological tool schema) must not stop the others.
        return job, LineError("invalid_request", f"cannot render the prompt: {type(e).__name__}: {e}")
    return job, None


def failed_record(job: Job, error: LineError) -> dict:
    return error_record(job.ctx, error)


def finished_record(job: Job, output: RequestOutput, tokenizer, settings: JobSettings) -> dict:
    """The ok record for a request the engine finished."""
    ids = list(output.token_ids)
    finish = output.finish_reason or "stop"  # "abort": the runner stopped it at a stop sequence
    if job.line.kind == "text":
        completion = text_completion(tokenizer, ids, finish, job.params.stop_token_ids, job.stop)
    else:
        completion = chat_completion(tokenizer, ids, finish, job.stop)
    usage = Usage(len(output.prompt_token_ids), len(ids), completion.reasoning_tokens, output.cached_prompt_tokens)
    return ok_record(job.ctx, completion, usage, _timing(output), ids, settings.options)


def _timing(output: RequestOutput) -> dict[str, int] | None:
    t = output.timings
    if t.first_token is None or t.finished is None:
        return None
    return {"ttft_ms": round((t.first_token - t.arrival) * 1000), "e2e_ms": round((t.finished - t.arrival) * 1000)}
