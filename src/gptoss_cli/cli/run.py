"""`gptoss run`: batch generation from a JSONL file (the options; the work is in batch_session.py)."""

from __future__ import annotations

from typing import Annotated

import typer

from .app import app
from .errors import UsageError
from .options import (
    DEFAULT_EFFORT,
    ContextOpt,
    EffortOpt,
    MaxTokensOpt,
    MinPOpt,
    ModelOpt,
    RepetitionPenaltyOpt,
    SeedOpt,
    StopOpt,
    TemperatureOpt,
    TopKOpt,
    TopPOpt,
    check_effort,
    check_stop,
    flag_message,
)

_EPILOG = (
    "Input lines: OpenAI Batch requests ({custom_id, method, url, body}), {\"messages\": [...]}, "
    "{\"prompt\": ..., \"developer\": ...} or raw {\"text\": ...}; per-line sampling keys (and stop) override "
    "the flags. "
    "Exit codes: 0 all ok, 3 some records failed, 2 usage error, 1 fatal error, 130 interrupted."
)


@app.command("run", epilog=_EPILOG)
def run_command(
    ctx: typer.Context,
    input: Annotated[str, typer.Argument(help="Input JSONL file, or - for stdin.", metavar="INPUT")],
    output: Annotated[str, typer.Option("--output", "-o", help="Output JSONL file, or - for stdout.")] = "-",
    fmt: Annotated[str, typer.Option("--format", help="Record shape: auto (follows each line), openai or simple.")] = "auto",
    error_file: Annotated[str | None, typer.Option(
        "--error-file", help="Write failed records here instead of to the output.")] = None,
    resume: Annotated[bool, typer.Option("--resume", help="Continue an earlier run: skip records already written.")] = False,
    retry_errors: Annotated[bool, typer.Option(
        "--retry-errors", help="Like --resume, and also redo the records that failed.")] = False,
    force: Annotated[bool, typer.Option(
        "--force", help="Resume an output written for another input or config, or start a non-empty one over.")] = False,
    unordered: Annotated[bool, typer.Option("--unordered", help="Write records as they finish, not in input order.")] = False,
    max_concurrency: Annotated[int, typer.Option(
        "--max-concurrency", min=1, help="Most requests handed to the engine at once.")] = 1024,
    model: ModelOpt = None,
    effort: EffortOpt = DEFAULT_EFFORT,
    max_tokens: MaxTokensOpt = None,
    temperature: TemperatureOpt = 1.0,
    top_p: TopPOpt = 1.0,
    top_k: TopKOpt = 0,
    min_p: MinPOpt = 0.0,
    repetition_penalty: RepetitionPenaltyOpt = 1.0,
    seed: SeedOpt = None,
    stop: StopOpt = None,
    context: ContextOpt = None,
    reasoning: Annotated[str, typer.Option("--reasoning", help="include or omit the reasoning (analysis) text.")] = "include",
    token_ids: Annotated[bool, typer.Option("--token-ids", help="Add the generated token ids to each record.")] = False,
    strict: Annotated[bool, typer.Option("--strict", help="Stop before loading the model if any line is invalid.")] = False,
    allow_failures: Annotated[bool, typer.Option("--allow-failures", help="Exit 0 even if some records failed.")] = False,
    limit: Annotated[int | None, typer.Option("--limit", min=0, help="Only the first N records of the input.")] = None,
) -> int:
    """Generate a completion for every line of a JSONL file (continuous batching, resumable)."""
    # Imported here so `gptoss --help` does not load the runtime (harmony, tiktoken).
    from .batch_request import RunDefaults
    from .batch_session import RunOptions, run_batch

    try:
        defaults = RunDefaults(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                               repetition_penalty=repetition_penalty, seed=seed, max_tokens=max_tokens,
                               effort=check_effort(effort), stop=check_stop(stop))
    except ValueError as e:
        raise UsageError(flag_message(str(e)), "see gptoss run --help") from None
    options = RunOptions(
        input=input, output=output, fmt=fmt, error_file=error_file, resume=resume or retry_errors,
        retry_errors=retry_errors, force=force, ordered=not unordered, window=max_concurrency, model=model,
        defaults=defaults,
        context=context, reasoning=reasoning, token_ids=token_ids, strict=strict, allow_failures=allow_failures,
        limit=limit,
    )
    return run_batch(ctx.obj, options)
