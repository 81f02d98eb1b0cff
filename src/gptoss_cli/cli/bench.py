"""`gptoss bench`: latency, throughput and % of roofline per batch size (cli-ux.md §4.4).

Thin: flags → BenchConfig, then runtime/benchmark.py does the work. The table is the result
(stdout; plain text when stdout is not a terminal); progress goes to stderr; --json/--csv write
files (`--json -` prints the JSON on stdout and moves the table to stderr).
"""

from __future__ import annotations

import csv
import io
import json
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from .app import app
from .console import Ui, plain_table
from .errors import UsageError
from .options import DEFAULT_EFFORT, EffortOpt, ModelOpt, check_effort, option_typed

ModelArg = Annotated[str | None, typer.Argument(
    metavar="MODEL", show_default=False, help="Same as --model (20b, 120b, a directory, random:20b, ...).")]
BatchOpt = Annotated[str, typer.Option(
    "--batch", "-b", help="Batch sizes to sweep, comma-separated, e.g. 1,16,64.")]
InputLenOpt = Annotated[int, typer.Option("--input-len", help="Prompt tokens per request (random prompts).", min=1)]
OutputLenOpt = Annotated[int, typer.Option("--output-len", help="Tokens generated per request.", min=1)]
WarmupOpt = Annotated[int, typer.Option(help="Untimed runs per batch size before the timed ones.", min=0)]
RepeatOpt = Annotated[int, typer.Option(help="Timed runs per batch size.", min=1)]
PromptsOpt = Annotated[Path | None, typer.Option(
    "--prompts", metavar="FILE",
    help='JSONL of {"prompt": ...} or {"messages": [...]} lines instead of random prompts.')]
BenchSeedOpt = Annotated[int, typer.Option(help="Seed for the random prompts and the sampling.", min=0)]
PercentilesOpt = Annotated[str, typer.Option(help="Latency percentiles to report, comma-separated.")]
JsonOpt = Annotated[Path | None, typer.Option(
    "--json", metavar="FILE", help="Write results as JSON (vLLM key names plus an env block); - for stdout.")]
CsvOpt = Annotated[Path | None, typer.Option("--csv", metavar="FILE", help="Write one CSV row per batch size.")]
IgnoreEosOpt = Annotated[bool, typer.Option(
    "--ignore-eos/--no-ignore-eos", help="Always generate --output-len tokens, even past a stop token.")]


@app.command()
def bench(
    ctx: typer.Context,
    model_arg: ModelArg = None,
    model: ModelOpt = None,
    batch: BatchOpt = "1",
    input_len: InputLenOpt = 128,
    output_len: OutputLenOpt = 256,
    warmup: WarmupOpt = 1,
    repeat: RepeatOpt = 3,
    prompts: PromptsOpt = None,
    effort: EffortOpt = DEFAULT_EFFORT,
    seed: BenchSeedOpt = 0,
    percentiles: PercentilesOpt = "50,90,99",
    json_file: JsonOpt = None,
    csv_file: CsvOpt = None,
    ignore_eos: IgnoreEosOpt = True,
) -> None:
    """Measure TTFT, TPOT, ITL, throughput, peak memory and % of the memory-bandwidth roofline.

    Example: gptoss bench random:20b --batch 1,16,64 --input-len 128 --output-len 256
    """
    from ..runtime.benchmark import BenchConfig

    ui: Ui = ctx.obj
    spec = _model_spec(model_arg, model, option_typed(ctx, "model"))
    _check_effort(effort)
    try:
        config = BenchConfig(parse_int_list(batch, "--batch"), input_len, output_len, warmup, repeat, seed,
                             parse_percentiles(percentiles), ignore_eos)
    except ValueError as e:
        raise UsageError(str(e)) from None
    records = _read_prompts(prompts)
    report = _run(ui, spec, config, records, effort)
    _emit(ui, report, config, json_file, csv_file)


def _model_spec(model_arg: str | None, model: str | None, model_typed: bool) -> str | None:
    """The positional model wins over a --model that came from GPTOSS_MODEL or the config file;
    two different models typed on the command line are a mistake."""
    if model_arg and model and model_arg != model and model_typed:
        raise UsageError(f"two models given: {model_arg} and --model {model}", "give the model once")
    return model_arg or model


def _check_effort(effort: str) -> None:
    # One line and exit code 2, like the other flags of this command.
    try:
        check_effort(effort)
    except typer.BadParameter as e:
        raise UsageError(f"--effort: {e.message}") from None


def parse_int_list(text: str, flag: str) -> tuple[int, ...]:
    """"1,16,64" -> (1, 16, 64); UsageError for anything but positive integers."""
    values = []
    for part in text.split(","):
        part = part.strip()
        if not part.isdigit() or int(part) < 1:
            raise UsageError(f"{flag}: {part!r} is not a positive integer (expected e.g. 1,16,64)")
        values.append(int(part))
    return tuple(values)


def parse_percentiles(text: str) -> tuple[float, ...]:
    values = []
    for part in text.split(","):
        try:
            value = float(part)
        except ValueError:
            value = math.nan
        if not 0 < value <= 100:
            raise UsageError(f"--percentiles: {part.strip()!r} is not a number in (0, 100] (expected e.g. 50,90,99)")
        values.append(value)
    return tuple(values)


def _read_prompts(path: Path | None) -> list[dict] | None:
    from ..runtime.benchmark import read_prompt_file

    if path is None:
        return None
    try:
        return read_prompt_file(path)
    except OSError as e:
        raise UsageError(f"--prompts: cannot read {path}: {e.strerror or e}") from None
    except ValueError as e:
        raise UsageError(f"--prompts: {e}") from None


# ---- running ---------------------------------------------------------------------------------

def _run(ui: Ui, spec: str | None, config, records: list[dict] | None, effort: str) -> dict[str, Any]:
    """Load, run, measure the copy bandwidth; the JSON-ready report."""
    from ..runtime.benchmark import render_prompt_records, run_benchmark
    from ..runtime.machine import environment_info
    from ..runtime.loading import default_device
    from .models import load_model

    # On a GPU, measure before the engine claims memory for its KV cache; on the host, after the
    # run, so the copy buffers stay out of the peak RSS reported per batch size.
    on_gpu = default_device() == "cuda"
    bandwidth = _copy_bandwidth(ui) if on_gpu else None
    context = None if records is not None else config.input_len + config.output_len
    loaded = load_model(ui, spec, max_context=context, max_batch=max(config.batch_sizes))
    prompt_set = None
    if records is not None:
        try:
            prompt_set = render_prompt_records(records, loaded.tokenizer, effort)
        except ValueError as e:
            raise UsageError(f"--prompts: {e}") from None
    with _progress(ui) as progress:
        results = run_benchmark(loaded.engine, config, prompt_set=prompt_set,
                                tokenizer=loaded.tokenizer if records is not None else None,
                                copy_bandwidth_bytes_s=bandwidth, on_progress=progress)
    if bandwidth is None:
        bandwidth = _copy_bandwidth(ui)
        results = [replace(r, copy_bandwidth_bytes_s=bandwidth) for r in results]
    env = environment_info(loaded.name, config.seed, **_settings(config, effort, records is not None))
    return {"env": env, "results": results}


def _copy_bandwidth(ui: Ui) -> float:
    from ..runtime.machine import measure_copy_bandwidth

    ui.note("measuring copy bandwidth …")
    return measure_copy_bandwidth()


def _settings(config, effort: str, real_prompts: bool) -> dict[str, Any]:
    from ..runtime.api import SamplingParams

    sampling = SamplingParams()  # the benchmark samples with the defaults
    return {
        "workload": "prompts" if real_prompts else "random",
        "input_len": None if real_prompts else config.input_len,
        "output_len": config.output_len,
        "warmup": config.warmup,
        "repeat": config.repeat,
        "ignore_eos": config.ignore_eos,
        "effort": effort,
        "sampling": {"temperature": sampling.temperature, "top_p": sampling.top_p},
        "percentiles": list(config.percentiles),
    }


@contextmanager
def _progress(ui: Ui) -> Iterator[Callable[[str], None]]:
    """A spinner on a terminal, one stderr line per run otherwise."""
    if not ui.interactive:
        yield ui.note
        return
    with ui.err.status("benchmarking …") as status:
        yield lambda message: status.update(message)


# ---- output ----------------------------------------------------------------------------------

def _emit(ui: Ui, report: dict[str, Any], config, json_file: Path | None, csv_file: Path | None) -> None:
    results, env = report["results"], report["env"]
    rows = [r.to_json_dict() for r in results]
    table_console = ui.err if str(json_file) == "-" else ui.out
    render_table(table_console, results, config.percentiles, f"gptoss bench · {env['model']} · {env['gpu']}")
    _explain(ui, results)
    document = {"env": env, "results": rows}
    if json_file is not None:
        text = json.dumps(finite(document), indent=2) + "\n"
        if str(json_file) == "-":
            write_text(ui.out, text)
        else:
            _write(json_file, text, "--json")
            ui.note(f"wrote {json_file}")
    if csv_file is not None:
        _write(csv_file, to_csv(env, rows), "--csv")
        ui.note(f"wrote {csv_file}")


def _write(path: Path, text: str, flag: str) -> None:
    try:
        path.write_text(text, encoding="utf-8")
    except OSError as e:
        raise UsageError(f"{flag}: cannot write {path}: {e.strerror or e}") from None


def finite(value: Any) -> Any:
    """NaN/inf become null: JSON has no spelling for them."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [finite(v) for v in value]
    return value


def to_csv(env: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    buffer = io.StringIO()
    head = {"model": env.get("model"), "gpu": env.get("gpu")}
    writer = csv.DictWriter(buffer, fieldnames=[*head, *rows[0]], lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({**head, **finite(row)})
    return buffer.getvalue()


def table_columns(results, percentiles) -> list[tuple[str, Callable]]:
    """(header, cell) pairs shared by the Rich and the plain table."""
    from ..runtime.benchmark import percentile_label

    high = max(percentiles)
    label = percentile_label(high)
    kind = results[0].memory_kind if results else "gpu"
    return [
        ("batch", lambda r: str(r.batch_size)),
        ("in", lambda r: f"{r.mean_input_len:.0f}"),
        ("out", lambda r: f"{r.mean_output_len:.0f}"),
        ("TTFT p50 ms", lambda r: _ms(r.ttft_s, None)),
        (f"TTFT p{label} ms", lambda r: _ms(r.ttft_s, high)),
        ("TPOT p50 ms", lambda r: _ms(r.tpot_s, None)),
        (f"ITL p{label} ms", lambda r: _ms(r.itl_s, high)),
        ("decode tok/s/seq", lambda r: _rate(r.decode_tok_s_per_seq)),
        ("out tok/s", lambda r: _rate(r.output_throughput)),
        ("prefill tok/s", lambda r: _rate(r.prefill_tok_s)),
        ("e2e p50 s", lambda r: "-" if r.e2e_s is None else f"{r.e2e_s.median:.2f}"),
        (f"peak {'GPU' if kind == 'gpu' else 'host'} GB", lambda r: _gb(r.peak_memory_bytes)),
        ("% roofline", lambda r: "-" if r.roofline_fraction is None else f"{100 * r.roofline_fraction.mean:.1f}"),
    ]


def _ms(stat, p: float | None) -> str:
    if stat is None:
        return "-"
    value = stat.median if p is None else stat.percentiles[float(p)]
    return f"{value * 1e3:.1f}"


def _rate(stat) -> str:
    if stat is None:
        return "-"
    text = f"{stat.mean:,.1f}"
    return f"{text} ± {stat.std:,.1f}" if stat.count > 1 else text


def _gb(value: int | None) -> str:
    return "-" if value is None else f"{value / 1e9:.2f}"


def render_table(console, results, percentiles, title: str = "gptoss bench") -> None:
    """A Rich table on a terminal; plain aligned text (no title) for pipes and files."""
    columns = table_columns(results, percentiles)
    cells = [[cell(r) for _, cell in columns] for r in results]
    if console.is_terminal:
        table = Table(title=title, title_justify="left")
        for header, _ in columns:
            table.add_column(header, justify="right")
        for row in cells:
            table.add_row(*row)
        console.print(table)
        return
    write_text(console, plain_table([h for h, _ in columns], cells))


def write_text(console, text: str) -> None:
    """Exact text, no Rich markup or wrapping; flushed so that nothing waits in a buffer."""
    console.file.write(text)
    console.file.flush()


def _explain(ui: Ui, results) -> None:
    """What the roofline column means, and anything that skews the numbers."""
    bandwidth = next((r.copy_bandwidth_bytes_s for r in results if r.copy_bandwidth_bytes_s), None)
    if bandwidth:
        where = "GPU device-to-device" if results[0].memory_kind == "gpu" else "host memcpy"
        ui.note(f"copy bandwidth {bandwidth / 1e9:.1f} GB/s ({where}, read + write); % roofline = bytes a decode "
                "step must read (weights touched + KV) / measured step time / copy bandwidth")
    cached = sum(r.cached_prompt_tokens for r in results)
    if cached:
        ui.warn(f"{cached} prompt tokens came from the prefix cache (shared prompt prefixes); "
                "prefill tok/s counts only the tokens actually prefilled")
