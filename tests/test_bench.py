"""`gptoss bench` and runtime/benchmark.py.

The driver runs against a scripted engine whose clock is known exactly (so TTFT, TPOT, ITL, step
time and % of roofline have closed-form answers), statistics are checked against numpy, flag
handling goes through the real CLI with a fake engine, and one end-to-end run uses random:tiny.
"""

import json
import math
import random

import numpy as np
import pytest

from cli_helpers import run_cli
from gptoss_cli.runtime import benchmark as bm
from gptoss_cli.runtime import machine
from gptoss_cli.runtime.api import Engine, RequestOutput, RequestTimings
from gptoss_cli.runtime.errors import RequestError
from gptoss_cli.runtime.random_checkpoint import random_config
from gptoss_cli.runtime.roofline import decode_step_bytes

CFG_20B = random_config("20b")


class ScriptedEngine(Engine):
    """The Engine API on a fake clock: admitting requests costs `prefill_s`, a decode step the next
    value of `step_s()`. Admission waits until there is room under `max_batch`; a step either
    admits (and emits first tokens) or decodes every running request."""

    def __init__(self, config=CFG_20B, prefill_s=0.5, step_s=lambda: 0.1, max_context=4096, max_batch=None):
        super().__init__()
        self.config, self.max_context = config, max_context
        self.prefill_s, self.step_s, self.max_batch = prefill_s, step_s, max_batch
        self.clock = 1000.0
        self.waiting, self.running = [], []
        self.added, self.aborted = [], []
        self.events = {}  # request id -> event times, recorded independently of the driver

    def _admit(self, request_id, prompt, params, seed):
        out = RequestOutput(request_id, prompt, timings=RequestTimings(self.clock))
        self.waiting.append((out, params))
        self.added.append((request_id, list(prompt), params, seed))
        return out

    def has_unfinished(self):
        return bool(self.waiting or self.running)

    def abort(self, request_id):
        for queue in (self.waiting, self.running):
            for item in queue:
                if item[0].request_id == request_id:
                    queue.remove(item)
                    self.aborted.append(request_id)
                    return item[0]
        return None

    def step(self):
        room = len(self.waiting) if self.max_batch is None else self.max_batch - len(self.running)
        if self.waiting and room > 0:
            batch, self.waiting = self.waiting[:room], self.waiting[room:]
            self.running += batch
            self.clock += self.prefill_s
        else:
            batch = list(self.running)
            self.clock += self.step_s()
        return [self._emit(out, params) for out, params in batch]

    def _emit(self, out, params):
        from gptoss_cli.runtime.api import TokenEvent

        out.token_ids.append(len(out.token_ids) + 7)
        out.timings.first_token = out.timings.first_token or self.clock
        self.events.setdefault(out.request_id, []).append(self.clock)
        index = len(out.token_ids) - 1
        if len(out.token_ids) < params.max_tokens:
            return TokenEvent(out.request_id, out.token_ids[-1], index, self.clock)
        out.finish_reason, out.timings.finished = "length", self.clock
        self.running = [item for item in self.running if item[0] is not out]
        return TokenEvent(out.request_id, out.token_ids[-1], index, self.clock, "length", out)


# ---- the driver on a scripted clock -----------------------------------------------------------

def test_metrics_exact_on_scripted_clock():
    engine = ScriptedEngine()
    config = bm.BenchConfig(batch_sizes=(4,), input_len=16, output_len=5, warmup=1, repeat=2, seed=3)
    (r,) = bm.run_benchmark(engine, config, copy_bandwidth_bytes_s=1e12)
    assert (r.batch_size, r.runs, r.num_requests) == (4, 2, 8)
    assert (r.total_input_tokens, r.total_output_tokens, r.cached_prompt_tokens) == (8 * 16, 8 * 5, 0)
    approx = lambda x: pytest.approx(x, rel=1e-9)  # noqa: E731
    assert (r.ttft_s.mean, r.ttft_s.std, r.ttft_s.count) == (approx(0.5), approx(0.0), 8)
    assert (r.tpot_s.mean, r.itl_s.median, r.itl_s.count) == (approx(0.1), approx(0.1), 8 * 4)
    assert r.e2e_s.percentiles[99.0] == approx(0.9)
    assert r.decode_tok_s_per_seq.mean == approx(10.0)
    assert r.decode_tok_s.mean == approx(40.0)
    assert r.prefill_tok_s.mean == approx(4 * 16 / 0.5)
    assert r.output_throughput.mean == approx(20 / 0.9)
    assert r.total_token_throughput.mean == approx((64 + 20) / 0.9)
    assert r.request_throughput.mean == approx(4 / 0.9)
    assert r.duration_s == approx(2 * 0.9)
    # Decode steps generate tokens 1..4, attending to 16 + j positions.
    assert r.decode_step_s.mean == approx(0.1)
    assert r.decode_context == approx(16 + 2.5)
    step_bytes = decode_step_bytes(CFG_20B, 4, 18.5)["total"]
    assert r.decode_step_bytes == approx(step_bytes)
    assert r.roofline_fraction.mean == approx(step_bytes / 0.1 / 1e12)


def test_requests_seeded_fresh_and_shaped():
    engine = ScriptedEngine()
    config = bm.BenchConfig(batch_sizes=(1, 3), input_len=9, output_len=2, warmup=2, repeat=2, seed=11)
    bm.run_benchmark(engine, config)
    assert len(engine.added) == (1 + 3) * (2 + 2)
    prompts = [tuple(p) for _, p, _, _ in engine.added]
    assert all(len(p) == 9 and all(0 <= t < 199_998 for t in p) for p in prompts)
    assert len(set(p[:2] for p in prompts)) == len(prompts)  # no shared prefix for the cache to reuse
    assert all(sp.max_tokens == 2 and sp.ignore_eos for _, _, sp, _ in engine.added)
    assert len({seed for *_, seed in engine.added}) == len(engine.added)
    again = ScriptedEngine()
    bm.run_benchmark(again, config)
    assert [a[1:] for a in again.added] == [a[1:] for a in engine.added]  # same seed, same workload
    other = ScriptedEngine()
    bm.run_benchmark(other, bm.BenchConfig(batch_sizes=(1, 3), input_len=9, output_len=2, warmup=2, repeat=2, seed=12))
    assert all(a[1] != b[1] for a, b in zip(other.added, engine.added))


def test_statistics_match_numpy_on_jittered_clock():
    rng = random.Random(7)
    engine = ScriptedEngine(step_s=lambda: rng.uniform(0.01, 0.2))
    pcts = (10.0, 50.0, 90.0, 99.0, 99.9)
    config = bm.BenchConfig(batch_sizes=(3,), input_len=5, output_len=7, warmup=0, repeat=3, percentiles=pcts)
    (r,) = bm.run_benchmark(engine, config)
    assert r.roofline_fraction is None and r.achieved_bandwidth_bytes_s is not None  # no bandwidth given
    itl = np.concatenate([np.diff(times) for times in engine.events.values()])
    assert r.itl_s.count == len(itl) == 3 * 3 * 6
    assert r.itl_s.mean == pytest.approx(itl.mean())
    assert r.itl_s.std == pytest.approx(itl.std())
    for p in pcts:
        assert r.itl_s.percentiles[p] == pytest.approx(np.percentile(itl, p))
    keys = r.to_json_dict()
    assert keys["p99.9_itl_ms"] == pytest.approx(np.percentile(itl, 99.9) * 1e3)
    assert keys["p10_itl_ms"] == pytest.approx(np.percentile(itl, 10) * 1e3)


@pytest.mark.parametrize("n", [1, 2, 3, 10, 101])
def test_summarize_matches_numpy(n):
    values = np.random.default_rng(n).exponential(size=n)
    s = bm.summarize(list(values), (1, 25, 50, 99))
    assert (s.mean, s.std, s.median) == pytest.approx((values.mean(), values.std(), np.median(values)))
    assert (s.min, s.max, s.count) == (values.min(), values.max(), n)
    assert [s.percentiles[p] for p in (1.0, 25.0, 50.0, 99.0)] == pytest.approx(np.percentile(values, [1, 25, 50, 99]))
    assert bm.summarize([]) is None


def test_staggered_admission_has_no_decode_window():
    """With max_batch < B the batch never decodes as a whole: no step time, no roofline, no crash."""
    engine = ScriptedEngine(max_batch=2)
    config = bm.BenchConfig(batch_sizes=(4,), input_len=4, output_len=3, warmup=0, repeat=1)
    (r,) = bm.run_benchmark(engine, config, copy_bandwidth_bytes_s=1e12)
    assert r.roofline_fraction is None and r.decode_step_s is None
    assert r.ttft_s.max == pytest.approx(0.5 + 2 * 0.1 + 0.5)  # the second pair waits for the first
    assert r.total_output_tokens == 12
    assert r.to_json_dict()["roofline_fraction"] is None


def test_one_token_outputs():
    engine = ScriptedEngine()
    (r,) = bm.run_benchmark(engine, bm.BenchConfig(batch_sizes=(2,), input_len=3, output_len=1, warmup=0, repeat=1))
    assert r.tpot_s is None and r.itl_s is None and r.decode_tok_s_per_seq is None and r.roofline_fraction is None
    d = r.to_json_dict()
    assert d["mean_tpot_ms"] is None and d["mean_ttft_ms"] == pytest.approx(500)


def test_interrupt_aborts_outstanding_requests():
    engine = ScriptedEngine()
    calls = {"n": 0}
    real_step = engine.step

    def step():
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real_step()

    engine.step = step
    with pytest.raises(KeyboardInterrupt):
        bm.run_benchmark(engine, bm.BenchConfig(batch_sizes=(2,), input_len=3, output_len=5, warmup=0, repeat=1))
    assert sorted(engine.aborted) == sorted(rid for rid, *_ in engine.added)
    assert not engine.has_unfinished()


def test_prompt_too_long_for_context():
    engine = ScriptedEngine(max_context=100)
    with pytest.raises(RequestError, match="exceed") as info:
        bm.run_benchmark(engine, bm.BenchConfig(batch_sizes=(1,), input_len=60, output_len=41, warmup=0, repeat=1))
    assert info.value.code == "context_length_exceeded" and not engine.added


def test_prompt_set_cycles():
    engine = ScriptedEngine()
    prompt_set = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    config = bm.BenchConfig(batch_sizes=(2,), output_len=2, warmup=1, repeat=2)
    (r,) = bm.run_benchmark(engine, config, prompt_set=prompt_set)
    assert [p for _, p, _, _ in engine.added] == [prompt_set[i % 3] for i in range(6)]
    assert r.total_input_tokens == 4 + 3 + 2 + 4  # timed runs use prompts 2, 0, 1, 2 of the set


@pytest.mark.parametrize("bad", [dict(batch_sizes=()), dict(batch_sizes=(0,)), dict(input_len=0),
                                 dict(output_len=0), dict(warmup=-1), dict(repeat=0), dict(percentiles=(0,)),
                                 dict(percentiles=(101,))])
def test_config_validation(bad):
    with pytest.raises(ValueError):
        bm.BenchConfig(**bad)


# ---- prompt files, harmony stats, machine measurements ---------------------------------------

def test_read_prompt_file(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "hi"}\n\n{"messages": [{"role": "user", "content": "yo"}]}\n')
    assert bm.read_prompt_file(path) == [{"prompt": "hi"}, {"messages": [{"role": "user", "content": "yo"}]}]
    path.write_text('{"prompt": "hi"}\n{"prompt": \n')
    with pytest.raises(ValueError, match=":2: not valid JSON"):
        bm.read_prompt_file(path)
    path.write_text('{"prompt": "a"}\n{"text": "x"}\n')
    with pytest.raises(ValueError, match=":2: expected"):
        bm.read_prompt_file(path)
    path.write_text("\n")
    with pytest.raises(ValueError, match="no prompts"):
        bm.read_prompt_file(path)


@pytest.fixture(scope="module")
def tokenizer():
    from gptoss_cli.runtime.tokenizer import Tokenizer, load_o200k_base_ranks

    return Tokenizer.from_ranks(load_o200k_base_ranks())


def test_render_prompt_records(tokenizer):
    from gptoss_cli.runtime.harmony import Message, SystemConfig, render_prompt

    records = [{"prompt": "Why is the sky blue?"},
               {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]}]
    low = bm.render_prompt_records(records, tokenizer, "low")
    high = bm.render_prompt_records(records, tokenizer, "high")
    expected = render_prompt(tokenizer, [Message("user", "Why is the sky blue?")], SystemConfig(reasoning_effort="low"))
    assert low[0] == expected
    assert "Reasoning: high" in tokenizer.decode(high[1]) and "Be brief." in tokenizer.decode(high[1])
    with pytest.raises(ValueError, match="prompt 1"):
        bm.render_prompt_records([{"messages": [{"role": "robot", "content": "x"}]}], tokenizer)


def test_answer_stats(tokenizer):
    from gptoss_cli.runtime.tokenizer import CHANNEL, END, MESSAGE, RETURN, START

    thinking = tokenizer.encode("Let me think about it carefully")
    ids = [CHANNEL, *tokenizer.encode("analysis"), MESSAGE, *thinking, END,
           START, *tokenizer.encode("assistant"), CHANNEL, *tokenizer.encode("final"), MESSAGE,
           *tokenizer.encode("Blue."), RETURN]
    times = [10.0 + i for i in range(len(ids))]
    trace = bm.RequestTrace(5, 0, 9.0, times[0], times[-1], times, ids)
    reasoning, answer = bm.answer_stats(tokenizer, trace)
    assert reasoning == len(thinking) + 1  # the analysis text and its <|end|>
    first_final = ids.index(MESSAGE, ids.index(MESSAGE) + 1) + 1
    assert answer == pytest.approx(times[first_final] - 9.0)
    assert bm.answer_stats(tokenizer, bm.RequestTrace(5, 0, 9.0, 10.0, 11.0, [10.0, 11.0], thinking[:2]))[1] is None


def test_copy_bandwidth_and_memory():
    bandwidth = machine.measure_copy_bandwidth("cpu", nbytes=1 << 23, runs=3)
    assert math.isfinite(bandwidth) and 1e7 < bandwidth < 1e13
    memory, kind = machine.peak_memory()
    assert kind in ("gpu", "host") and memory > 0


def test_environment_info():
    env = machine.environment_info("random:tiny", 5, effort="low")
    for key in ("gpu", "driver", "cuda", "torch", "triton", "gptoss", "python", "model", "seed", "date"):
        assert key in env
    assert (env["model"], env["seed"], env["effort"]) == ("random:tiny", 5, "low")
    json.dumps(env)


# ---- the command, with a fake engine ----------------------------------------------------------

@pytest.fixture
def fake_model(monkeypatch):
    """Replace model loading with a ScriptedEngine; records the engine options the command chose."""
    from gptoss_cli.cli import models

    seen = {}

    def load(ui, spec, **options):
        seen.update(spec=spec, options=options)
        seen["engine"] = ScriptedEngine(max_context=options.get("max_context") or 131072)
        return models.LoadedModel(spec or "20b", seen["engine"], seen.get("tokenizer"), 0.0)

    monkeypatch.setattr(models, "load_model", load)
    monkeypatch.setattr(machine, "measure_copy_bandwidth", lambda *a, **k: 2e12)
    return seen


FAST = ["--input-len", "6", "--output-len", "3", "--warmup", "0", "--repeat", "1"]


def test_flags_reach_the_engine(fake_model, tmp_path):
    out = tmp_path / "r.json"
    result = run_cli(["bench", "-m", "random:20b", "--batch", "2,5", *FAST, "--json", str(out), "--seed", "4"])
    assert result.exit_code == 0, result.stderr
    assert fake_model["spec"] == "random:20b"
    assert fake_model["options"] == {"max_context": 9, "max_batch": 5}
    assert len(fake_model["engine"].added) == 2 + 5
    doc = json.loads(out.read_text())
    assert [r["batch_size"] for r in doc["results"]] == [2, 5]
    assert doc["env"]["seed"] == 4 and doc["env"]["model"] == "random:20b"
    assert doc["results"][1]["copy_bandwidth_bytes_s"] == 2e12
    assert doc["results"][1]["mean_ttft_ms"] == pytest.approx(500)


def test_positional_model_and_plain_table(fake_model):
    result = run_cli(["bench", "random:120b", "--batch", "3", *FAST])
    assert result.exit_code == 0, result.stderr
    assert fake_model["spec"] == "random:120b"
    lines = result.stdout.splitlines()
    assert lines[0].split()[:3] == ["batch", "in", "out"] and "% roofline" in lines[0]
    assert lines[1].split()[:3] == ["3", "6", "3"]
    assert "\x1b[" not in result.stdout and not any(c in result.stdout for c in "│┃━─")
    assert "copy bandwidth" in result.stderr


def test_json_to_stdout_and_csv(fake_model, tmp_path):
    csv_path = tmp_path / "r.csv"
    result = run_cli(["bench", "--batch", "1,2", *FAST, "--json", "-", "--csv", str(csv_path)])
    assert result.exit_code == 0, result.stderr
    doc = json.loads(result.stdout)
    assert len(doc["results"]) == 2 and "batch" in result.stderr  # the table moved to stderr
    rows = csv_path.read_text().splitlines()
    assert len(rows) == 3 and rows[0].startswith("model,gpu,batch_size,")


def test_prompts_file(fake_model, tokenizer, tmp_path):
    fake_model["tokenizer"] = tokenizer
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "one"}\n{"messages": [{"role": "user", "content": "two"}]}\n')
    out = tmp_path / "r.json"
    result = run_cli(["bench", "--batch", "2", *FAST, "--prompts", str(path), "--effort", "high", "--json", str(out)])
    assert result.exit_code == 0, result.stderr
    assert fake_model["options"]["max_context"] is None
    doc = json.loads(out.read_text())
    assert doc["env"]["workload"] == "prompts" and doc["env"]["effort"] == "high"
    assert "Reasoning: high" in tokenizer.decode(fake_model["engine"].added[0][1])
    assert doc["results"][0]["mean_reasoning_tokens"] == 0


@pytest.mark.parametrize("args,needle", [
    (["--batch", "0"], "--batch"), (["--batch", "a,b"], "--batch"), (["--batch", "1,,2"], "--batch"),
    (["--batch", "-3"], "--batch"), (["--percentiles", "0"], "--percentiles"),
    (["--percentiles", "50,x"], "--percentiles"), (["--effort", "max"], "effort"),
    (["random:tiny", "-m", "random:20b"], "two models"), (["--prompts", "/nonexistent/p.jsonl"], "--prompts"),
])
def test_bad_flags_exit_2(fake_model, args, needle):
    result = run_cli(["bench", *args])
    assert result.exit_code == 2
    assert needle in result.stderr and "Traceback" not in result.stderr
    assert "spec" not in fake_model  # nothing was loaded


def test_bad_batch_is_one_line(fake_model):
    result = run_cli(["bench", "--batch", "a,b"])
    assert result.exit_code == 2 and len(result.stderr.strip().splitlines()) == 1


def test_bad_prompt_line_names_it(fake_model, tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "ok"}\nnot json\n')
    result = run_cli(["bench", "--prompts", str(path)])
    assert result.exit_code == 2 and "p.jsonl:2" in result.stderr


def test_context_too_small_is_an_error(fake_model, monkeypatch):
    from gptoss_cli.cli import models

    monkeypatch.setattr(models, "load_model",
                        lambda ui, spec, **o: models.LoadedModel("x", ScriptedEngine(max_context=10), None, 0.0))
    result = run_cli(["bench", "--input-len", "8", "--output-len", "8", "--warmup", "0", "--repeat", "1"])
    assert result.exit_code == 1 and "context" in result.stderr


# ---- end to end on random:tiny ----------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "out.json"
    result = run_cli(["bench", "--model", "random:tiny", "--batch", "1,2", "--input-len", "8", "--output-len", "3",
                      "--repeat", "1", "--warmup", "0", "--json", str(out)])
    return result, json.loads(out.read_text()) if out.exists() else None


def test_tiny_end_to_end_table(tiny_run):
    result, _ = tiny_run
    assert result.exit_code == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 3 and [line.split()[0] for line in lines[1:]] == ["1", "2"]
    assert "\x1b[" not in result.stdout


def test_tiny_end_to_end_json(tiny_run):
    _, doc = tiny_run
    assert doc["env"]["gpu"] == "cpu" and doc["env"]["model"] == "random:tiny"
    assert len(doc["results"]) == 2
    for batch, r in zip((1, 2), doc["results"]):
        assert r["batch_size"] == batch and r["completed"] == batch
        assert r["total_output_tokens"] == 3 * batch and r["total_input_tokens"] == 8 * batch
        for key in ("mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms",
                    "p99_tpot_ms", "mean_itl_ms", "median_itl_ms", "p99_itl_ms", "output_throughput",
                    "total_token_throughput", "request_throughput", "decode_tok_s_per_seq", "prefill_tok_s",
                    "peak_memory_bytes", "copy_bandwidth_bytes_s", "roofline_fraction"):
            assert r[key] > 0, key
        assert r["p99_ttft_ms"] <= r["p99_e2el_ms"] and r["mean_ttft_ms"] <= r["mean_e2el_ms"]
        assert r["mean_tpot_ms"] * 2 == pytest.approx(r["mean_e2el_ms"] - r["mean_ttft_ms"])
        assert r["memory_kind"] == "host" and r["cached_prompt_tokens"] == 0
        assert r["decode_context"] == pytest.approx(8 + 1.5)  # tokens 1 and 2 attend to 9 and 10 positions
