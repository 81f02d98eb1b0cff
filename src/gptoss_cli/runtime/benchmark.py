"""The benchmark driver on the Engine API: seeded workloads, per-token timings, summary statistics.

For each batch size B: `warmup` untimed runs, then `repeat` timed runs; a run adds B requests at
once (max_tokens = output_len, ignore_eos by default) and steps the engine until all finish.
Every time comes from the engine's own timestamps (TokenEvent.time, RequestOutput.timings).
Random prompts are drawn fresh for every run from a seeded generator, so the engine's prefix cache
cannot turn a repeat into a cache hit. Metric names and definitions follow vLLM's benchmarks
(TPOT = (e2e - TTFT)/(n - 1), ITL = gaps between a request's tokens, std = population std).

% of roofline: the bytes a decode step must read (roofline.py) over the measured step time, against
the copy bandwidth measured on the same machine.
"""

from __future__ import annotations

import json
import math
import random
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .api import Engine, SamplingParams
from .machine import peak_memory, reset_peak_memory
from .errors import RequestError
from .roofline import decode_step_bytes

TEXT_VOCAB = 199_998  # ordinary BPE ids; random prompts never contain format tokens


@dataclass(frozen=True)
class BenchConfig:
    """What to run; validated on construction (ValueError names the bad field)."""

    batch_sizes: tuple[int, ...] = (1,)
    input_len: int = 128
    output_len: int = 256
    warmup: int = 1
    repeat: int = 3
    seed: int = 0
    percentiles: tuple[float, ...] = (50.0, 90.0, 99.0)
    ignore_eos: bool = True

    def __post_init__(self) -> None:
        checks = [
            (len(self.batch_sizes) > 0 and all(b >= 1 for b in self.batch_sizes), "batch sizes must be >= 1"),
            (self.input_len >= 1, "input_len must be >= 1"),
            (self.output_len >= 1, "output_len must be >= 1"),
            (self.warmup >= 0, "warmup must be >= 0"),
            (self.repeat >= 1, "repeat must be >= 1"),
            (0 <= self.seed < 2**62, "seed must be in [0, 2**62)"),
            (all(0 < p <= 100 for p in self.percentiles), "percentiles must be in (0, 100]"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)


# ---- statistics ------------------------------------------------------------------------------

@dataclass(frozen=True)
class Stat:
    """Summary of one metric's samples."""

    mean: float
    std: float
    median: float
    min: float
    max: float
    count: int
    percentiles: dict[float, float] = field(default_factory=dict)


def percentile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default), q in [0, 100]."""
    ordered = sorted(values)
    rank = q / 100 * (len(ordered) - 1)
    lo = math.floor(rank)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (rank - lo)


def scale_stat(stat: Stat, factor: float) -> Stat:
    """The summary of every sample multiplied by `factor` > 0."""
    return Stat(stat.mean * factor, stat.std * factor, stat.median * factor, stat.min * factor,
                stat.max * factor, stat.count, {p: v * factor for p, v in stat.percentiles.items()})


def summarize(values: Sequence[float], percentiles: Sequence[float] = ()) -> Stat | None:
    """None when there are no samples (e.g. TPOT of one-token outputs)."""
    if not values:
        return None
    return Stat(
        mean=statistics.fmean(values),
        std=statistics.pstdev(values) if len(values) > 1 else 0.0,
        median=percentile(values, 50),
        min=min(values),
        max=max(values),
        count=len(values),
        percentiles={float(p): percentile(values, p) for p in percentiles},
    )


# ---- workloads -------------------------------------------------------------------------------

def random_prompts(vocab_size: int, batch: int, input_len: int, seed: int, run: int) -> list[list[int]]:
    """`batch` prompts of uniform random text tokens; a fresh draw for every (seed, batch, run)."""
    rng = random.Random(f"gptoss-bench:{seed}:{batch}:{run}")
    high = min(vocab_size, TEXT_VOCAB) - 1
    return [[rng.randint(0, high) for _ in range(input_len)] for _ in range(batch)]


def read_prompt_file(path: str | Path) -> list[dict[str, Any]]:
    """JSONL of `{"prompt": str}` or `{"messages": [...]}` lines (blank lines skipped).

    Raises ValueError naming the line for anything else, before any model is loaded.
    """
    records = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{number}: not valid JSON ({e.msg})") from None
            records.append(_check_prompt_record(record, f"{path}:{number}"))
    if not records:
        raise ValueError(f"{path}: no prompts")
    return records


def _check_prompt_record(record: Any, where: str) -> dict[str, Any]:
    if isinstance(record, dict) and isinstance(record.get("prompt"), str):
        return record
    if isinstance(record, dict) and isinstance(record.get("messages"), list):
        return record
    raise ValueError(f'{where}: expected {{"prompt": "..."}} or {{"messages": [...]}}')


def render_prompt_records(records: Sequence[dict[str, Any]], tokenizer, effort: str = "medium") -> list[list[int]]:
    """Harmony prompt ids for each record, with `effort` in the system message."""
    from .harmony import Message, SystemConfig, from_openai_messages, render_prompt

    system = SystemConfig(reasoning_effort=effort)
    prompts = []
    for index, record in enumerate(records):
        if "prompt" in record:
            messages, developer = [Message("user", record["prompt"])], None
        else:
            try:
                messages, developer = from_openai_messages(record["messages"], record.get("tools"))
            except (TypeError, ValueError) as e:
                raise ValueError(f"prompt {index + 1}: {e}") from None
        prompts.append(render_prompt(tokenizer, messages, system, developer))
    return prompts


def _run_prompts(config: BenchConfig, vocab_size: int, prompt_set: Sequence[Sequence[int]] | None,
                 batch: int, run: int) -> list[list[int]]:
    if prompt_set is None:
        return random_prompts(vocab_size, batch, config.input_len, config.seed, run)
    start = run * batch
    return [list(prompt_set[(start + i) % len(prompt_set)]) for i in range(batch)]


# ---- one run: B requests at once -------------------------------------------------------------

@dataclass
class RequestTrace:
    """One request's timeline, in the engine's perf_counter seconds."""

    prompt_len: int
    cached_prompt_tokens: int
    arrival: float
    first_token: float
    finished: float
    token_times: list[float]
    token_ids: list[int]
    token_steps: list[int] = field(default_factory=list)  # which engine.step() call gave each token

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


def run_requests(engine: Engine, prompts: Sequence[Sequence[int]], params: Sequence[SamplingParams],
                 tag: str) -> list[RequestTrace]:
    """Add every prompt at once, step until all finish; traces in prompt order."""
    rids = [engine.add_request(p, sp, request_id=f"{tag}-{i}") for i, (p, sp) in enumerate(zip(prompts, params))]
    times: dict[str, list[float]] = {r: [] for r in rids}
    steps: dict[str, list[int]] = {r: [] for r in rids}
    traces: dict[str, RequestTrace] = {}
    step = 0
    try:
        while len(traces) < len(rids) and engine.has_unfinished():
            step += 1
            for event in engine.step():
                if event.request_id not in times:
                    continue
                times[event.request_id].append(event.time)
                steps[event.request_id].append(step)
                if event.output is not None:
                    traces[event.request_id] = _trace(event.output, times[event.request_id], steps[event.request_id])
    finally:
        for rid in rids:
            if rid not in traces:
                engine.abort(rid)
    if len(traces) < len(rids):
        raise RuntimeError("the engine stopped before every benchmark request finished")
    return [traces[r] for r in rids]


def _trace(output, token_times: list[float], token_steps: list[int]) -> RequestTrace:
    t = output.timings
    first = t.first_token if t.first_token is not None else token_times[0]
    return RequestTrace(len(output.prompt_token_ids), output.cached_prompt_tokens, t.arrival, first,
                        t.finished if t.finished is not None else token_times[-1], list(token_times),
                        list(output.token_ids), list(token_steps))


# ---- metrics of one run ----------------------------------------------------------------------

@dataclass
class RunMetrics:
    """Run-level numbers (one value per timed run)."""

    duration: float
    prefill_tok_s: float | None
    decode_tok_s: float | None  # all sequences, tokens after the last first token
    output_throughput: float
    total_token_throughput: float
    request_throughput: float
    decode_step_s: float | None  # mean step time while all B sequences decode
    decode_context: float | None  # mean tokens each sequence attends to in those steps


def run_metrics(traces: Sequence[RequestTrace]) -> RunMetrics:
    start = min(t.arrival for t in traces)
    end = max(t.finished for t in traces)
    last_first = max(t.first_token for t in traces)
    duration = max(end - start, 1e-12)
    prefilled = sum(t.prompt_len - t.cached_prompt_tokens for t in traces)
    outputs = sum(t.num_tokens for t in traces)
    inputs = sum(t.prompt_len for t in traces)
    decoded = sum(1 for t in traces for x in t.token_times if x > last_first)
    step_s, context = _decode_window(traces)
    return RunMetrics(
        duration=duration,
        prefill_tok_s=prefilled / (last_first - start) if last_first > start else None,
        decode_tok_s=decoded / (end - last_first) if decoded and end > last_first else None,
        output_throughput=outputs / duration,
        total_token_throughput=(inputs + outputs) / duration,
        request_throughput=len(traces) / duration,
        decode_step_s=step_s,
        decode_context=context,
    )


def _decode_window(traces: Sequence[RequestTrace]) -> tuple[float | None, float | None]:
    """(mean step time, mean attended context) over the first unbroken run of full decode steps.

    A full decode step gives every request of the run a token other than its first, so exactly B
    sequences decode in it. Its duration runs from the last token time of the step before; token j
    of a request attends to prompt_len + j positions. (None, None) if the batch never decoded whole
    (e.g. one-token outputs, or B above the engine's batch limit).
    """
    by_step: dict[int, list[tuple[float, int]]] = {}
    for t in traces:
        for j, (at, step) in enumerate(zip(t.token_times, t.token_steps)):
            by_step.setdefault(step, []).append((at, t.prompt_len + j if j else -1))
    order = sorted(by_step)
    full = [len(by_step[s]) == len(traces) and all(c >= 0 for _, c in by_step[s]) for s in order]
    if True not in full:
        return None, None
    first = full.index(True)
    last = full.index(False, first) if False in full[first:] else len(order)
    run = order[first:last]
    if first == 0:  # nothing before the run to time its first step from
        return None, None
    start = max(at for at, _ in by_step[order[first - 1]])
    end = max(at for s in run for at, _ in by_step[s])
    contexts = [c for s in run for _, c in by_step[s]]
    return (end - start) / len(run), statistics.fmean(contexts)


# ---- results ---------------------------------------------------------------------------------

@dataclass
class BenchResult:
    """Everything measured for one batch size (timed runs only)."""

    batch_size: int
    runs: int
    num_requests: int
    total_input_tokens: int
    total_output_tokens: int
    cached_prompt_tokens: int
    duration_s: float  # sum over timed runs
    ttft_s: Stat
    tpot_s: Stat | None
    itl_s: Stat | None
    e2e_s: Stat
    decode_tok_s_per_seq: Stat | None
    decode_tok_s: Stat | None
    prefill_tok_s: Stat | None
    output_throughput: Stat
    total_token_throughput: Stat
    request_throughput: Stat
    decode_step_s: Stat | None
    decode_context: float | None
    decode_step_bytes: float | None
    achieved_bandwidth_bytes_s: Stat | None  # decode_step_bytes / step time, one sample per run
    copy_bandwidth_bytes_s: float | None
    peak_memory_bytes: int | None
    memory_kind: str  # "gpu" (torch.cuda.max_memory_allocated) or "host" (process peak RSS)
    reasoning_tokens: Stat | None = None  # --prompts only: analysis-channel tokens per request
    time_to_answer_s: Stat | None = None  # --prompts only: arrival to the first final-channel text

    @property
    def roofline_fraction(self) -> Stat | None:
        """Achieved over measured copy bandwidth: 1.0 means every step ran at copy speed."""
        if self.achieved_bandwidth_bytes_s is None or not self.copy_bandwidth_bytes_s:
            return None
        return scale_stat(self.achieved_bandwidth_bytes_s, 1.0 / self.copy_bandwidth_bytes_s)

    @property
    def mean_input_len(self) -> float:
        return self.total_input_tokens / self.num_requests

    @property
    def mean_output_len(self) -> float:
        return self.total_output_tokens / self.num_requests

    def to_json_dict(self) -> dict[str, Any]:
        """Flat, vLLM-compatible keys (`mean_ttft_ms`, `output_throughput`, ...) plus ours."""
        d: dict[str, Any] = {
            "batch_size": self.batch_size,
            "runs": self.runs,
            "completed": self.num_requests,
            "duration": self.duration_s,
            "total_input_tokens": self.total_input_tokens,
            "total_output_tokens": self.total_output_tokens,
            "cached_prompt_tokens": self.cached_prompt_tokens,
            "mean_input_len": self.mean_input_len,
            "mean_output_len": self.mean_output_len,
        }
        for name in ("request_throughput", "output_throughput", "total_token_throughput",
                     "decode_tok_s_per_seq", "decode_tok_s", "prefill_tok_s", "roofline_fraction",
                     "achieved_bandwidth_bytes_s"):
            stat = getattr(self, name)
            d[name] = None if stat is None else stat.mean
            d[f"std_{name}"] = None if stat is None else stat.std
        for name, stat, scale in (("ttft", self.ttft_s, 1e3), ("tpot", self.tpot_s, 1e3), ("itl", self.itl_s, 1e3),
                                  ("e2el", self.e2e_s, 1e3), ("decode_step", self.decode_step_s, 1e3),
                                  ("time_to_answer", self.time_to_answer_s, 1e3)):
            d.update(_latency_keys(name, "ms", stat, scale))
        d.update(_latency_keys("reasoning_tokens", "", self.reasoning_tokens, 1.0))
        d.update({
            "decode_context": self.decode_context,
            "decode_step_bytes": self.decode_step_bytes,
            "copy_bandwidth_bytes_s": self.copy_bandwidth_bytes_s,
            "peak_memory_bytes": self.peak_memory_bytes,
            "memory_kind": self.memory_kind,
        })
        return d


def _latency_keys(name: str, unit: str, stat: Stat | None, scale: float) -> dict[str, float | None]:
    suffix = f"_{unit}" if unit else ""
    if stat is None:
        return {f"{k}_{name}{suffix}": None for k in ("mean", "median", "std")}
    out = {f"mean_{name}{suffix}": stat.mean * scale, f"median_{name}{suffix}": stat.median * scale,
           f"std_{name}{suffix}": stat.std * scale}
    for p, value in stat.percentiles.items():
        out[f"p{percentile_label(p)}_{name}{suffix}"] = value * scale
    return out


def percentile_label(p: float) -> str:
    """50 -> "50", 99.9 -> "99.9" (vLLM's key spelling)."""
    return str(int(p)) if float(p).is_integer() else str(p)


# ---- the driver ------------------------------------------------------------------------------

def run_benchmark(engine: Engine, config: BenchConfig, *, prompt_set: Sequence[Sequence[int]] | None = None,
                  tokenizer=None, copy_bandwidth_bytes_s: float | None = None,
                  on_progress: Callable[[str], None] | None = None) -> list[BenchResult]:
    """Run every batch size in `config`; one BenchResult each, in order.

    `prompt_set` replaces the random prompts (cycled through); with a `tokenizer` the outputs are
    also parsed as harmony to count reasoning tokens and time to the answer.
    """
    check_fits(engine, config, prompt_set)
    progress = on_progress or (lambda _message: None)
    results = []
    for batch in config.batch_sizes:
        reset_peak_memory()
        traces = []
        for run in range(config.warmup + config.repeat):
            warm = run < config.warmup
            label = f"warm-up {run + 1}/{config.warmup}" if warm else f"run {run - config.warmup + 1}/{config.repeat}"
            progress(f"batch {batch}: {label}")
            prompts = _run_prompts(config, engine.config.vocab_size, prompt_set, batch, run)
            params = [_params(config, batch, run, i) for i in range(batch)]
            run_traces = run_requests(engine, prompts, params, tag=f"bench-{batch}-{run}")
            if not warm:
                traces.append(run_traces)
        results.append(summarize_batch(engine, config, batch, traces, copy_bandwidth_bytes_s, tokenizer))
    return results


def check_fits(engine: Engine, config: BenchConfig, prompt_set: Sequence[Sequence[int]] | None) -> None:
    longest = config.input_len if prompt_set is None else max(len(p) for p in prompt_set)
    if longest + config.output_len > engine.max_context:
        raise RequestError(
            f"prompt ({longest}) + output ({config.output_len}) tokens exceed the context of {engine.max_context}",
            "lower --input-len/--output-len or use shorter prompts", code="context_length_exceeded")


def _params(config: BenchConfig, batch: int, run: int, index: int) -> SamplingParams:
    seed = random.Random(f"gptoss-bench-sampling:{config.seed}:{batch}:{run}:{index}").getrandbits(62)
    return SamplingParams(seed=seed, max_tokens=config.output_len, ignore_eos=config.ignore_eos)


def summarize_batch(engine: Engine, config: BenchConfig, batch: int, runs: Sequence[Sequence[RequestTrace]],
                    copy_bandwidth_bytes_s: float | None, tokenizer=None) -> BenchResult:
    """Pool per-request samples over the timed runs; run-level numbers become one sample per run."""
    pcts = config.percentiles
    requests = [t for run in runs for t in run]
    per_run = [run_metrics(run) for run in runs]
    roof = _roofline(engine, batch, per_run, pcts)
    memory, kind = peak_memory()
    answers = [answer_stats(tokenizer, t) for t in requests] if tokenizer is not None else []
    return BenchResult(
        batch_size=batch,
        runs=len(runs),
        num_requests=len(requests),
        total_input_tokens=sum(t.prompt_len for t in requests),
        total_output_tokens=sum(t.num_tokens for t in requests),
        cached_prompt_tokens=sum(t.cached_prompt_tokens for t in requests),
        duration_s=sum(m.duration for m in per_run),
        ttft_s=summarize([t.first_token - t.arrival for t in requests], pcts),
        tpot_s=summarize([(t.finished - t.first_token) / (t.num_tokens - 1) for t in requests
                          if t.num_tokens > 1], pcts),
        itl_s=summarize([b - a for t in requests for a, b in zip(t.token_times, t.token_times[1:])], pcts),
        e2e_s=summarize([t.finished - t.arrival for t in requests], pcts),
        decode_tok_s_per_seq=summarize([(t.num_tokens - 1) / (t.finished - t.first_token) for t in requests
                                        if t.num_tokens > 1 and t.finished > t.first_token], pcts),
        decode_tok_s=summarize([m.decode_tok_s for m in per_run if m.decode_tok_s is not None], pcts),
        prefill_tok_s=summarize([m.prefill_tok_s for m in per_run if m.prefill_tok_s is not None], pcts),
        output_throughput=summarize([m.output_throughput for m in per_run], pcts),
        total_token_throughput=summarize([m.total_token_throughput for m in per_run], pcts),
        request_throughput=summarize([m.request_throughput for m in per_run], pcts),
        memory_kind=kind,
        peak_memory_bytes=memory,
        copy_bandwidth_bytes_s=copy_bandwidth_bytes_s,
        reasoning_tokens=summarize([a[0] for a in answers], pcts),
        time_to_answer_s=summarize([a[1] for a in answers if a[1] is not None], pcts),
        **roof,
    )


def _roofline(engine: Engine, batch: int, per_run: Sequence[RunMetrics], pcts: Sequence[float]) -> dict[str, Any]:
    """Step time, the bytes a step must read at the mean context, and the bandwidth that implies."""
    timed = [m for m in per_run if m.decode_step_s is not None]
    if not timed:
        return dict(decode_step_s=None, decode_context=None, decode_step_bytes=None, achieved_bandwidth_bytes_s=None)
    context = statistics.fmean(m.decode_context for m in timed)
    step_bytes = decode_step_bytes(engine.config, batch, context)["total"]
    return dict(
        decode_step_s=summarize([m.decode_step_s for m in timed], pcts),
        decode_context=context,
        decode_step_bytes=step_bytes,
        achieved_bandwidth_bytes_s=summarize([step_bytes / m.decode_step_s for m in timed], pcts),
    )


def answer_stats(tokenizer, trace: RequestTrace) -> tuple[int, float | None]:
    """(tokens spent in analysis messages, seconds from arrival to the first final-channel text)."""
    from .harmony import HarmonyStreamParser, TextDelta

    parser = HarmonyStreamParser(tokenizer)
    reasoning, answer_at = 0, None
    for token, at in zip(trace.token_ids, trace.token_times):
        header = parser.current_header
        if header is not None and header.channel == "analysis":
            reasoning += 1
        events = parser.feed(token)
        if answer_at is None and any(isinstance(e, TextDelta) and e.channel == "final" and e.text for e in events):
            answer_at = at - trace.arrival
    return reasoning, answer_at


# ---- the machine: memory, copy bandwidth, environment ----------------------------------------
