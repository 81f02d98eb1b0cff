"""`gptoss run` end to end: flag routing and reliability cases on a scripted engine (fast), the real
CPU engine on random:tiny, and a SIGKILL-and-resume loop on the real command in a subprocess."""

from __future__ import annotations

import errno
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from cli_helpers import run_cli
from gptoss_cli.cli import models
from gptoss_cli.cli.batch_resume import OutputLock
from gptoss_cli.cli.batch_writer import DurableFile
from gptoss_cli.runtime.api import Engine, RequestOutput, TokenEvent
from gptoss_cli.runtime.tokenizer import CALL, CHANNEL, CONSTRAIN, END, MESSAGE, N_VOCAB, RETURN, START

TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather now",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}


@pytest.fixture(scope="module")
def tokenizer():
    from gptoss_cli.runtime.tokenizer import Tokenizer, load_o200k_base_ranks

    return Tokenizer.from_ranks(load_o200k_base_ranks())


class ScriptedEngine(Engine):
    """The real Engine front end (add_request checks) over a scripted token source.

    Chat prompts get an analysis message of N tokens when the prompt says `wait N` (so earlier
    lines can finish later), then a final answer naming the prompt's length; `weather` prompts
    get a tool call; raw text prompts get ` the end`."""

    def __init__(self, tok, max_context: int = 4096, on_step=None) -> None:
        super().__init__()
        self.tok = tok
        self.config = SimpleNamespace(vocab_size=N_VOCAB)
        self.max_context = max_context
        self.on_step = on_step
        self.running: dict[str, tuple[RequestOutput, list[int], int]] = {}
        self.admitted: list[tuple[str, list[int], object, int]] = []
        self.admitted_before_first_step: int | None = None
        self.finish_order: list[str] = []
        self.aborted: list[str] = []
        self.steps = 0

    def script(self, prompt: list[int]) -> list[int]:
        tok = self.tok
        if prompt[0] != START:
            return tok.encode(" the end") + [RETURN]
        text = tok.decode(prompt)
        if "weather" in text:
            return [CHANNEL, *tok.encode("commentary to=functions.get_weather"), *tok.encode(" "), CONSTRAIN,
                    *tok.encode("json"), MESSAGE, *tok.encode('{"city":"Oslo"}'), CALL]
        wait = re.search(r"wait (\d+)", text)
        ids = []
        if wait:
            ids += [CHANNEL, *tok.encode("analysis"), MESSAGE, *([tok.encode(" x")[0]] * int(wait.group(1))), END,
                    START, *tok.encode("assistant")]
        return ids + [CHANNEL, *tok.encode("final"), MESSAGE, *tok.encode(f"answer {len(prompt)}"), RETURN]

    def _admit(self, rid, prompt, params, seed):
        out = RequestOutput(rid, prompt)
        self.running[rid] = (out, self.script(prompt), self.max_new_tokens(len(prompt), params))
        self.admitted.append((rid, prompt, params, seed))
        return out

    def has_unfinished(self) -> bool:
        return bool(self.running)

    def abort(self, rid):
        item = self.running.pop(rid, None)
        if item is None:
            return None
        self.aborted.append(rid)
        item[0].finish_reason = "abort"
        return item[0]

    def step(self):
        if self.admitted_before_first_step is None:
            self.admitted_before_first_step = len(self.admitted)
        self.steps += 1
        if self.on_step is not None:
            self.on_step(self)
        events = []
        for rid, (out, script, max_new) in list(self.running.items()):
            token, now = script[len(out.token_ids)], time.perf_counter()
            out.token_ids.append(token)
            out.timings.first_token = out.timings.first_token or now
            reason = "stop" if token in (RETURN, CALL) else "length" if len(out.token_ids) >= max_new else None
            if reason is None:
                events.append(TokenEvent(rid, token, len(out.token_ids) - 1, now))
                continue
            out.finish_reason, out.timings.finished = reason, now
            del self.running[rid]
            self.finish_order.append(rid)
            events.append(TokenEvent(rid, token, len(out.token_ids) - 1, now, reason, out))
        return events


@pytest.fixture
def fake(monkeypatch, tokenizer):
    """Patch model loading: every load builds a ScriptedEngine; `fake.engines` lists them."""
    state = SimpleNamespace(engines=[], loads=[], on_step=None)

    def load(ui, spec, **options):
        state.loads.append((spec, options))
        engine = ScriptedEngine(tokenizer, options.get("max_context") or 4096, state.on_step)
        state.engines.append(engine)
        return models.LoadedModel("fake-model", engine, tokenizer, 0.0)

    monkeypatch.setattr(models, "load_model", load)
    return state


@pytest.fixture
def no_model(monkeypatch):
    def load(ui, spec, **options):
        raise AssertionError("the model must not load")

    monkeypatch.setattr(models, "load_model", load)


def write_jsonl(path: Path, *items) -> Path:
    lines = [(i if isinstance(i, bytes) else json.dumps(i).encode()) for i in items]
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


def read_records(path: Path) -> list[dict]:
    data = path.read_bytes()
    assert not data or data.endswith(b"\n"), "torn last line"
    return [json.loads(line) for line in data.splitlines()]


def openai_line(cid, content="hi", **body):
    return {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": content}], **body}}


def is_ok(rec: dict) -> bool:
    if "status" in rec:
        return rec["status"] == "ok"
    return rec["error"] is None and rec["response"]["status_code"] == 200


def run(tmp_path, *args, input=None):
    return run_cli(["run", *[str(a) for a in args]], input=input)


# ---- batching, order, shapes -------------------------------------------------------------------

def test_every_request_is_queued_before_the_first_step_and_output_keeps_input_order(tmp_path, fake):
    src = write_jsonl(tmp_path / "in.jsonl", *[{"id": f"r{i}", "prompt": f"wait {12 - 2 * i}"} for i in range(6)])
    out = tmp_path / "out.jsonl"
    result = run(tmp_path, src, "-o", out, "--model", "random:tiny")
    assert result.exit_code == 0, result.stderr
    engine = fake.engines[0]
    assert engine.admitted_before_first_step == 6
    assert engine.finish_order == [f"line-{n}" for n in range(6, 0, -1)]  # last line finishes first
    records = read_records(out)
    assert [r["custom_id"] for r in records] == [f"r{i}" for i in range(6)]
    assert all(is_ok(r) and r["finish_reason"] == "stop" for r in records)
    assert [r["usage"]["reasoning_tokens"] for r in records] == [12 - 2 * i + 1 for i in range(6)]
    assert records[0]["output"].startswith("answer ") and records[0]["reasoning"] == " x" * 12
    assert "6 record(s) written" in result.stderr and result.stdout == ""
    meta = json.loads((tmp_path / "out.jsonl.meta.json").read_text())
    assert meta["model"] == "random:tiny" and len(meta["input_sha256"]) == 64


def test_unordered_writes_records_as_they_finish(tmp_path, fake):
    src = write_jsonl(tmp_path / "in.jsonl", *[{"id": f"r{i}", "prompt": f"wait {9 - 3 * i}"} for i in range(4)])
    result = run(tmp_path, src, "-o", tmp_path / "out.jsonl", "--unordered", "--model", "random:tiny")
    assert result.exit_code == 0
    assert [r["custom_id"] for r in read_records(tmp_path / "out.jsonl")] == ["r3", "r2", "r1", "r0"]


def test_format_auto_follows_each_line_and_can_be_forced(tmp_path, fake, tokenizer):
    src = write_jsonl(tmp_path / "in.jsonl", openai_line("q1"), {"messages": [{"role": "user", "content": "a"}]},
                      {"text": "Once upon a time"})
    result = run(tmp_path, src, "-o", tmp_path / "auto.jsonl", "--model", "random:tiny", "--token-ids")
    assert result.exit_code == 0, result.stderr
    openai, chat, text = read_records(tmp_path / "auto.jsonl")
    body = openai["response"]["body"]
    assert openai["custom_id"] == "q1" and body["model"] == "random:tiny"
    assert body["choices"][0]["message"]["content"].startswith("answer")
    assert body["choices"][0]["token_ids"][-1] == RETURN
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"]
    assert chat["status"] == "ok" and chat["custom_id"] == "line-2"
    assert text["output"] == " the end" and text["effort"] is None
    assert fake.engines[0].admitted[2][1] == tokenizer.encode("Once upon a time")  # no chat template

    forced = run(tmp_path, src, "-o", tmp_path / "simple.jsonl", "--model", "random:tiny", "--format", "simple",
                 "--reasoning", "omit")
    assert forced.exit_code == 0
    records = read_records(tmp_path / "simple.jsonl")
    assert all(r["status"] == "ok" and "reasoning" not in r and "token_ids" not in r for r in records)


def test_tool_calls_are_returned_not_run(tmp_path, fake):
    src = write_jsonl(tmp_path / "in.jsonl", openai_line("t", "weather in Oslo?", tools=[TOOL]))
    assert run(tmp_path, src, "-o", tmp_path / "out.jsonl", "--model", "random:tiny").exit_code == 0
    (rec,) = read_records(tmp_path / "out.jsonl")
    choice = rec["response"]["body"]["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert choice["message"]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city":"Oslo"}'}
    prompt = fake.engines[0].tok.decode(fake.engines[0].admitted[0][1])
    assert "type get_weather = (_: {" in prompt  # the tool was declared to the model


def test_line_settings_override_flags(tmp_path, fake, tokenizer):
    src = write_jsonl(tmp_path / "in.jsonl",
                      {"id": "a", "prompt": "x", "temperature": 0.2, "seed": 9, "top_p": 0.5, "reasoning_effort": "high",
                       "repetition_penalty": 1.5},
                      openai_line("b", max_completion_tokens=3),
                      {"id": "c", "prompt": "y"})
    args = ["--model", "random:tiny", "--temperature", "0.9", "--top-k", "3", "--min-p", "0.1", "--max-tokens", "50",
            "--effort", "low", "--repetition-penalty", "1.1"]
    assert run(tmp_path, src, "-o", tmp_path / "out.jsonl", "--seed", "5", *args).exit_code == 0
    (_, pa, a, sa), (_, pb, b, sb), (_, _, c, _) = fake.engines[0].admitted
    assert (a.temperature, a.top_p, a.top_k, a.min_p, a.seed, a.max_tokens) == (0.2, 0.5, 3, 0.1, 9, 50)
    assert (b.temperature, b.seed, b.max_tokens) == (0.9, 5, 3)
    assert (a.repetition_penalty, b.repetition_penalty, c.repetition_penalty) == (1.5, 1.1, 1.1)
    assert (sa, sb, c.seed) == (9, 5, 5)
    assert "Reasoning: high" in tokenizer.decode(pa) and "Reasoning: low" in tokenizer.decode(pb)
    records = read_records(tmp_path / "out.jsonl")
    assert (records[0]["seed"], records[0]["effort"], records[2]["effort"]) == (9, "high", "low")
    assert records[1]["response"]["body"]["choices"][0]["finish_reason"] == "length"

    # Without --seed every request still gets its own recorded seed.
    assert run(tmp_path, src, "-o", tmp_path / "out2.jsonl", *args).exit_code == 0
    seeds = [params.seed for _, _, params, _ in fake.engines[1].admitted]
    recorded = [r.get("seed") for r in read_records(tmp_path / "out2.jsonl")]
    assert seeds[0] == 9 and seeds[1] != seeds[2] and recorded[0] == 9 and recorded[2] == seeds[2]


def test_stop_sequences_cut_the_answer_and_end_the_request_early(tmp_path, fake, tokenizer):
    # The scripted answer is "answer N" after N-token " x" reasoning ("wait N"); raw text gets " the end".
    src = write_jsonl(tmp_path / "in.jsonl",
                      {"id": "flag", "prompt": "wait 3"},  # --stop " " applies
                      {"id": "line", "prompt": "y", "stop": ["wer", "zzz"]},  # its own list replaces --stop
                      {"id": "none", "prompt": "z", "stop": []},  # an empty list: no stop at all
                      {"id": "reason", "prompt": "wait 2", "stop": "x"},  # reasoning is never matched
                      {"id": "text", "text": "Once", "stop": "end"},
                      openai_line("oa", stop="swer"))
    out = tmp_path / "out.jsonl"
    result = run(tmp_path, src, "-o", out, "--model", "random:tiny", "--stop", " ", "--token-ids")
    assert result.exit_code == 0, result.stderr
    flag, line, none, reason, text, oa = read_records(out)
    assert (flag["output"], flag["finish_reason"]) == ("answer", "stop")
    assert flag["reasoning"] == " x x x"  # the analysis keeps its spaces: only the answer is cut
    assert (line["output"], line["finish_reason"]) == ("ans", "stop")
    assert none["output"].startswith("answer ") and none["finish_reason"] == "stop"
    assert reason["output"].startswith("answer ") and reason["reasoning"] == " x x"
    assert (text["output"], text["finish_reason"]) == (" the ", "stop")
    choice = oa["response"]["body"]["choices"][0]
    assert (choice["message"]["content"], choice["finish_reason"]) == ("an", "stop")
    engine = fake.engines[0]
    # Stopped requests were aborted as soon as the stop string was complete: no <|return|> came.
    assert sorted(engine.aborted) == ["line-1", "line-2", "line-5", "line-6"]
    assert all(RETURN not in r.get("token_ids", choice["token_ids"]) for r in (flag, line, text))
    assert RETURN in none["token_ids"] and RETURN in reason["token_ids"]
    assert flag["usage"]["completion_tokens"] == len(flag["token_ids"])


@pytest.mark.parametrize("stop,message", [(["a", "b", "c", "d", "e"], "at most 4"), ([""], "non-empty"),
                                          (3, "non-empty string")])
def test_bad_stop_on_a_line_is_that_lines_error(tmp_path, fake, stop, message):
    src = write_jsonl(tmp_path / "in.jsonl", {"id": "bad", "prompt": "x", "stop": stop}, {"id": "ok", "prompt": "y"})
    result = run(tmp_path, src, "-o", tmp_path / "out.jsonl", "--model", "random:tiny")
    assert result.exit_code == 3
    bad, ok = read_records(tmp_path / "out.jsonl")
    assert bad["error"]["code"] == "invalid_request" and message in bad["error"]["message"] and ok["status"] == "ok"


def test_bad_stop_flag_is_a_usage_error(tmp_path, no_model):
    src = write_jsonl(tmp_path / "in.jsonl", {"prompt": "x"})
    result = run(tmp_path, src, "-o", tmp_path / "out.jsonl", "--stop", "", "--model", "random:tiny")
    assert result.exit_code == 2 and "--stop" in result.stderr and "Traceback" not in result.stderr


def test_resume_keeps_the_stop_flag(tmp_path, fake):
    src = write_jsonl(tmp_path / "in.jsonl", {"id": "a", "prompt": "x"}, {"id": "b", "prompt": "y"})
    out = tmp_path / "out.jsonl"
    assert run(tmp_path, src, "-o", out, "--model", "random:tiny", "--limit", "1", "--stop", " ").exit_code == 0
    assert json.loads((tmp_path / "out.jsonl.meta.json").read_text())["sampling"]["stop"] == [" "]
    changed = run(tmp_path, src, "-o", out, "--model", "random:tiny", "--resume")
    assert changed.exit_code == 2 and "stop [' '] → None" in changed.stderr
    assert run(tmp_path, src, "-o", out, "--model", "random:tiny", "--resume", "--stop", " ").exit_code == 0
    assert [r["output"] for r in read_records(out)] == ["answer", "answer"]
    # Without --stop the sidecar has no stop key, as before the option existed; the same for
    # --repetition-penalty at 1.
    assert run(tmp_path, src, "-o", tmp_path / "plain.jsonl", "--model", "random:tiny").exit_code == 0
    sampling = json.loads((tmp_path / "plain.jsonl.meta.json").read_text())["sampling"]
    assert "stop" not in sampling and "repetition_penalty" not in sampling


def test_resume_keeps_the_repetition_penalty(tmp_path, fake):
    src = write_jsonl(tmp_path / "in.jsonl", {"id": "a", "prompt": "x"}, {"id": "b", "prompt": "y"})
    out = tmp_path / "out.jsonl"
    first = run(tmp_path, src, "-o", out, "--model", "random:tiny", "--limit", "1", "--repetition-penalty", "1.2")
    assert first.exit_code == 0
    assert json.loads((tmp_path / "out.jsonl.meta.json").read_text())["sampling"]["repetition_penalty"] == 1.2
    changed = run(tmp_path, src, "-o", out, "--model", "random:tiny", "--resume")
    assert changed.exit_code == 2 and "repetition_penalty 1.2 → None" in changed.stderr
    again = run(tmp_path, src, "-o", out, "--model", "random:tiny", "--resume", "--repetition-penalty", "1.2")
    assert again.exit_code == 0 and fake.engines[-1].admitted[-1][2].repetition_penalty == 1.2


def test_stdin_to_stdout(tmp_path, fake):
    data = "\n".join(json.dumps({"id": f"s{i}", "prompt": "p"}) for i in range(3)) + "\n"
    result = run(tmp_path, "-", "-o", "-", "--model", "random:tiny", input=data)
    assert result.exit_code == 0, result.stderr
    assert [json.loads(line)["custom_id"] for line in result.stdout.splitlines()] == ["s0", "s1", "s2"]
    assert "3 record(s) written" in result.stderr


def test_limit(tmp_path, fake):
    src = write_jsonl(tmp_path / "in.jsonl", *[{"prompt": str(i)} for i in range(5)])
    assert run(tmp_path, src, "-o", tmp_path / "out.jsonl", "--limit", "2", "--model", "random:tiny").exit_code == 0
    assert [r["line"] for r in read_records(tmp_path / "out.jsonl")] == [1, 2]


# ---- per-line failures -------------------------------------------------------------------------

def test_bad_lines_become_error_records_and_the_rest_runs(tmp_path, fake):
    huge = b'{"prompt": "' + b"a" * (17 * 1024 * 1024) + b'"}'
    items = [
        {"id": "ok1", "prompt": "fine", "foo": 1},                                          # 1 (unknown field)
        b"",                                                                                # 2 blank
        b'{"id": "u", "prompt": "caf\xe9"}',                                                # 3 invalid UTF-8
        b'{"id": "j", "prompt": ',                                                          # 4 invalid JSON
        {"id": "ok1", "prompt": "dup"},                                                     # 5 duplicate id
        {"id": "t", "prompt": "x", "temperature": -1},                                      # 6 negative temperature
        openai_line("p", top_p=1.5),                                                        # 7 top-p > 1
        {"id": "r", "messages": [{"role": "wizard", "content": "x"}]},                      # 8 unknown role
        openai_line("tool", tools=[{"type": "function", "function": {"parameters": {}}}]),  # 9 tool without name
        huge,                                                                               # 10 huge line
        {"id": "ok2", "prompt": "fine too", "foo": 2},                                      # 11
    ]
    src = write_jsonl(tmp_path / "in.jsonl", *items)
    out = tmp_path / "out.jsonl"
    result = run(tmp_path, src, "-o", out, "--model", "random:tiny")
    assert result.exit_code == 3
    records = read_records(out)
    lines = [r["line"] if "line" in r else r["error"]["line"] if r["error"] else None for r in records]
    assert lines == [1, 3, 4, 5, 6, 7, 8, 9, 10, 11]
    codes = [None if is_ok(r) else r["error"]["code"] for r in records]
    assert codes == [None, "invalid_utf8", "invalid_json", "duplicate_custom_id", "invalid_sampling",
                     "invalid_sampling", "invalid_request", "invalid_request", "line_too_long", None]
    assert records[1]["custom_id"] == "line-3" and records[2]["custom_id"] == "line-4"
    assert records[5]["response"]["status_code"] == 400  # openai shape for the OpenAI line
    for fragment in ("line 3: line is not valid UTF-8", "line 4: invalid JSON", "line 5: custom_id 'ok1' is already used",
                     "line 6: temperature must be >= 0", "line 7: top_p must be in (0, 1]", "line 8: messages: ",
                     "unknown role 'wizard'", "line 9: tools[0]", "line 10: line is"):
        assert fragment in result.stderr, fragment
    assert result.stderr.count("unknown field foo") == 1 and "(and 1 more line(s))" in result.stderr
    assert len(fake.engines[0].admitted) == 2


def test_prompt_longer_than_the_context_fails_alone(tmp_path, fake):
    src = write_jsonl(tmp_path / "in.jsonl", {"id": "short", "text": "hi"}, openai_line("long", "word " * 400),
                      {"id": "short2", "text": "yo"})
    out = tmp_path / "out.jsonl"
    result = run(tmp_path, src, "-o", out, "--model", "random:tiny", "--context", "128")
    assert result.exit_code == 3
    short, long, short2 = read_records(out)
    assert is_ok(short) and is_ok(short2)
    assert long["error"]["code"] == "context_length_exceeded" and "context is 128" in long["error"]["message"]
    assert long["response"]["body"]["error"]["code"] == "context_length_exceeded"
    assert fake.loads[0][1] == {"max_context": 128}
    assert run(tmp_path, src, "-o", tmp_path / "b.jsonl", "--model", "random:tiny", "--context", "128",
               "--allow-failures").exit_code == 0


def test_error_file_takes_the_failures(tmp_path, fake):
    src = write_jsonl(tmp_path / "in.jsonl", {"id": "a", "prompt": "x"}, b"{nope", {"id": "b", "prompt": "y"})
    out, err = tmp_path / "out.jsonl", tmp_path / "err.jsonl"
    assert run(tmp_path, src, "-o", out, "--error-file", err, "--model", "random:tiny").exit_code == 3
    assert [r["custom_id"] for r in read_records(out)] == ["a", "b"]
    assert [r["error"]["code"] for r in read_records(err)] == ["invalid_json"]


def test_strict_stops_before_the_model_loads(tmp_path, no_model):
    src = write_jsonl(tmp_path / "in.jsonl", {"prompt": "x"}, b"{bad")
    result = run(tmp_path, src, "-o", tmp_path / "out.jsonl", "--strict", "--model", "random:tiny")
    assert result.exit_code == 2
    assert "line 2: invalid JSON" in result.stderr and "1 of 2 input line(s) are invalid (--strict)" in result.stderr
    assert not (tmp_path / "out.jsonl").exists() or read_records(tmp_path / "out.jsonl") == []


def test_only_bad_lines_never_load_the_model(tmp_path, no_model):
    src = write_jsonl(tmp_path / "in.jsonl", b"{bad", {"prompt": 3})
    result = run(tmp_path, src, "-o", tmp_path / "out.jsonl", "--model", "random:tiny")
    assert result.exit_code == 3
    assert [r["error"]["code"] for r in read_records(tmp_path / "out.jsonl")] == ["invalid_json", "invalid_request"]


# ---- files: paths, locks, disk full, resume ---------------------------------------------------

@pytest.mark.parametrize("args, message", [
    (["-o", "{tmp}/missing/out.jsonl"], "directory {tmp}/missing does not exist"),
    (["-o", "{tmp}"], "is a directory"),
    (["-o", "-", "--resume"], "--resume needs an output file"),
    (["-o", "{tmp}/in.jsonl"], "would overwrite the input"),
    (["-o", "{tmp}/o.jsonl", "--format", "xml"], "--format must be one of"),
    (["-o", "{tmp}/o.jsonl", "--reasoning", "show"], "--reasoning must be include or omit"),
    (["-o", "{tmp}/o.jsonl", "--effort", "max"], "'max' is not one of"),
    (["-o", "{tmp}/o.jsonl", "--temperature", "-1"], "--temperature"),
    (["-o", "{tmp}/o.jsonl", "--top-p", "1.5"], "--top-p"),
    (["-o", "{tmp}/o.jsonl", "--top-p", "0"], "--top-p must be in (0, 1]"),
    (["-o", "{tmp}/o.jsonl", "--repetition-penalty", "0"], "--repetition-penalty must be > 0"),
])
def test_usage_errors_come_before_the_model(tmp_path, no_model, args, message):
    src = write_jsonl(tmp_path / "in.jsonl", {"prompt": "x"})
    result = run(tmp_path, src, *[a.format(tmp=tmp_path) for a in args], "--model", "random:tiny")
    assert result.exit_code == 2, result.stderr
    assert message.format(tmp=tmp_path) in result.stderr
    assert "Traceback" not in result.stderr


def test_missing_input_file(tmp_path, no_model):
    result = run(tmp_path, tmp_path / "nope.jsonl", "-o", tmp_path / "o.jsonl", "--model", "random:tiny")
    assert result.exit_code == 2 and "does not exist" in result.stderr


def test_existing_output_needs_resume_or_force(tmp_path, fake):
    src = write_jsonl(tmp_path / "in.jsonl", {"prompt": "x"})
    out = tmp_path / "out.jsonl"
    out.write_text('{"custom_id": "line-1", "status": "error", "line": 1}\n')
    result = run(tmp_path, src, "-o", out, "--model", "random:tiny")
    assert result.exit_code == 2 and "already exists" in result.stderr and "--resume" in result.stderr
    assert run(tmp_path, src, "-o", out, "--model", "random:tiny", "--force").exit_code == 0
    assert [is_ok(r) for r in read_records(out)] == [True]


def test_a_second_run_on_the_same_output_is_refused(tmp_path, no_model):
    src = write_jsonl(tmp_path / "in.jsonl", {"prompt": "x"})
    out = tmp_path / "out.jsonl"
    with OutputLock(out):
        result = run(tmp_path, src, "-o", out, "--model", "random:tiny")
    assert result.exit_code == 1
    assert "another `gptoss run` is writing out.jsonl" in result.stderr


def test_lock_is_held_against_another_process(tmp_path):
    out = tmp_path / "out.jsonl"
    code = ("import sys, time; from pathlib import Path; from gptoss_cli.cli.batch_resume import OutputLock;"
            "lock = OutputLock(Path(sys.argv[1])); lock.acquire(); print('held', flush=True); time.sleep(30)")
    holder = subprocess.Popen([sys.executable, "-c", code, str(out)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        from gptoss_cli.cli.batch_resume import OutputBusyError

        with pytest.raises(OutputBusyError):
            OutputLock(out).acquire()
    finally:
        holder.kill()
        holder.wait()
    with OutputLock(out):  # the kernel dropped the dead holder's lock
        pass


def test_disk_full_is_a_clear_error_and_resumable(tmp_path, fake, monkeypatch):
    src = write_jsonl(tmp_path / "in.jsonl", *[{"id": f"d{i}", "prompt": f"wait {i}"} for i in range(6)])
    out = tmp_path / "out.jsonl"
    real_write, calls = DurableFile._os_write, {"n": 0}

    def fill_up(self, fd, data):
        calls["n"] += 1
        if calls["n"] > 2:
            os.write(fd, bytes(data[: len(data) // 2]))  # half a record lands, then the disk is full
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(self, fd, data)

    monkeypatch.setattr(DurableFile, "_os_write", fill_up)
    result = run(tmp_path, src, "-o", out, "--model", "random:tiny")
    assert result.exit_code == 1
    assert f"disk full while writing {out}" in result.stderr and "--resume" in result.stderr
    assert "Traceback" not in result.stderr
    assert [r["custom_id"] for r in read_records(out)] == ["d0", "d1"]  # whole records only
    monkeypatch.setattr(DurableFile, "_os_write", real_write)
    assert run(tmp_path, src, "-o", out, "--model", "random:tiny", "--resume").exit_code == 0
    assert [r["custom_id"] for r in read_records(out)] == [f"d{i}" for i in range(6)]


def test_resume_refuses_another_input_or_config_unless_forced(tmp_path, fake):
    src = write_jsonl(tmp_path / "in.jsonl", {"id": "a", "prompt": "x"}, {"id": "b", "prompt": "y"})
    out = tmp_path / "out.jsonl"
    assert run(tmp_path, src, "-o", out, "--model", "random:tiny", "--limit", "1").exit_code == 0
    write_jsonl(src, {"id": "a", "prompt": "x"}, {"id": "b", "prompt": "CHANGED"})
    changed = run(tmp_path, src, "-o", out, "--model", "random:tiny", "--resume")
    assert changed.exit_code == 2 and "input changed" in changed.stderr and "--force" in changed.stderr
    other_model = run(tmp_path, src, "-o", out, "--model", "random:20b", "--resume", "--force")
    assert other_model.exit_code == 0
    assert [r["custom_id"] for r in read_records(out)] == ["a", "b"]
    effort = run(tmp_path, src, "-o", out, "--model", "random:20b", "--resume", "--effort", "high")
    assert effort.exit_code == 2 and "--effort was medium, now high" in effort.stderr


def test_resume_skips_done_records_and_retry_errors_redoes_failed_ones(tmp_path, fake):
    src = write_jsonl(tmp_path / "in.jsonl", {"id": "a", "text": "hi"}, openai_line("b", "long " * 200),
                      b"{bad", {"id": "c", "text": "yo"})
    out = tmp_path / "out.jsonl"
    assert run(tmp_path, src, "-o", out, "--model", "random:tiny", "--context", "64", "--limit", "3").exit_code == 3
    first = read_records(out)
    assert [is_ok(r) for r in first] == [True, False, False]
    resumed = run(tmp_path, src, "-o", out, "--model", "random:tiny", "--resume", "--context", "64")
    assert resumed.exit_code == 3  # b still failed (not retried)
    assert "3 already done" in resumed.stderr
    assert [r["custom_id"] for r in read_records(out)] == ["a", "b", "line-3", "c"]
    retried = run(tmp_path, src, "-o", out, "--model", "random:tiny", "--retry-errors")
    assert retried.exit_code == 3  # line 3 is still invalid JSON; it is not written twice
    records = read_records(out)
    assert [r["custom_id"] for r in records] == ["a", "b", "line-3", "c", "b"]
    assert is_ok(records[-1])
    assert len(fake.engines[-1].admitted) == 1
    done = run(tmp_path, src, "-o", out, "--model", "random:tiny", "--resume", "--allow-failures")
    assert done.exit_code == 0 and "nothing to do" in done.stderr


# ---- interruption ------------------------------------------------------------------------------

def _interrupt_at(step: int, times: int = 1):
    def on_step(engine):
        if engine.steps == step:
            for _ in range(times):
                os.kill(os.getpid(), signal.SIGINT)

    return on_step


def test_ctrl_c_finishes_inflight_work_then_resume_completes(tmp_path, fake):
    src = write_jsonl(tmp_path / "in.jsonl", *[{"id": f"c{i}", "prompt": f"wait {3 + i}"} for i in range(7)])
    out = tmp_path / "out.jsonl"
    fake.on_step = _interrupt_at(2)
    result = run(tmp_path, src, "-o", out, "--model", "random:tiny", "--max-concurrency", "3")
    assert result.exit_code == 130
    assert "interrupted: 4 record(s) not written" in result.stderr and "--resume" in result.stderr
    assert [r["custom_id"] for r in read_records(out)] == ["c0", "c1", "c2"]  # in flight: finished
    assert fake.engines[0].aborted == []
    fake.on_step = None
    assert run(tmp_path, src, "-o", out, "--model", "random:tiny", "--resume").exit_code == 0
    assert [r["custom_id"] for r in read_records(out)] == [f"c{i}" for i in range(7)]


def test_second_ctrl_c_aborts_what_is_left(tmp_path, fake):
    src = write_jsonl(tmp_path / "in.jsonl", *[{"id": f"c{i}", "prompt": f"wait {30 * i}"} for i in range(3)])
    out = tmp_path / "out.jsonl"
    fake.on_step = _interrupt_at(3, times=2)
    result = run(tmp_path, src, "-o", out, "--model", "random:tiny")
    assert result.exit_code == 130
    assert [r["custom_id"] for r in read_records(out)] == []  # c0 finishes at step 6, after the abort
    assert sorted(fake.engines[0].aborted) == ["line-1", "line-2", "line-3"]
    assert not fake.engines[0].has_unfinished()


def test_an_engine_failure_keeps_what_was_written(tmp_path, fake):
    src = write_jsonl(tmp_path / "in.jsonl", *[{"id": f"e{i}", "prompt": f"wait {20 * i}"} for i in range(3)])
    out = tmp_path / "out.jsonl"

    def explode(engine):
        if engine.steps == 15:  # e0 (about 12 tokens) is done, e1 and e2 are not
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

    fake.on_step = explode
    result = run(tmp_path, src, "-o", out, "--model", "random:tiny")
    assert result.exit_code == 1
    assert "the engine failed: RuntimeError: CUDA error" in result.stderr and "--resume" in result.stderr
    assert [r["custom_id"] for r in read_records(out)] == ["e0"]
    assert not fake.engines[0].has_unfinished()  # the rest were aborted, not left running


def test_progress_bar_on_a_terminal(tmp_path, fake):
    src = write_jsonl(tmp_path / "in.jsonl", *[{"prompt": f"wait {i}"} for i in range(3)])
    result = run_cli(["--color", "always", "run", str(src), "-o", str(tmp_path / "out.jsonl"),
                      "--model", "random:tiny"])
    assert result.exit_code == 0, result.stderr
    assert "3 record(s) written" in result.stderr
    assert len(read_records(tmp_path / "out.jsonl")) == 3


# ---- the real CPU engine -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_models():
    return {}


@pytest.fixture
def tiny(monkeypatch, tiny_models):
    """Real random:tiny loads, cached per engine options (the engine is idle between runs)."""
    real_load = models.load_model

    def load(ui, spec, **options):
        key = (spec, tuple(sorted(options.items())))
        if key not in tiny_models:
            tiny_models[key] = real_load(ui, spec, **options)
        assert not tiny_models[key].engine.has_unfinished()
        return tiny_models[key]

    monkeypatch.setattr(models, "load_model", load)


def test_random_tiny_end_to_end(tmp_path, tiny):
    src = write_jsonl(
        tmp_path / "in.jsonl",
        openai_line("q1", "Capital of France?", reasoning_effort="low"),
        {"id": "m", "messages": [{"role": "user", "content": "2+2?"}]},
        {"id": "p", "prompt": "Summarise harmony.", "developer": "Be terse.", "max_tokens": 2},
        {"id": "t", "text": "Once upon a time"},
        {"id": "twin", "text": "Once upon a time"},
        {"id": "long", "prompt": "word " * 300},
    )
    out = tmp_path / "out.jsonl"
    result = run(tmp_path, src, "-o", out, "--model", "random:tiny", "--max-tokens", "3", "--seed", "3",
                 "--context", "256", "--token-ids", "--temperature", "0.8")
    assert result.exit_code == 3, result.stderr
    if not torch.cuda.is_available():  # issue 8: no GPU falls back to the CPU path with a notice
        assert "no CUDA GPU found: running random:tiny on the CPU reference path" in result.stderr
    q1, m, p, t, twin, long = read_records(out)
    for rec, kind in ((q1, "openai"), (m, "simple"), (p, "simple"), (t, "simple"), (twin, "simple")):
        assert is_ok(rec), rec
        if kind == "openai":
            body = rec["response"]["body"]
            ids, usage = body["choices"][0]["token_ids"], body["usage"]
            assert body["choices"][0]["finish_reason"] in ("stop", "length", "tool_calls")
        else:
            ids, usage = rec["token_ids"], rec["usage"]
            assert rec["seed"] == 3 and rec["timing"]["e2e_ms"] >= rec["timing"]["ttft_ms"] >= 0
        assert 1 <= len(ids) == usage["completion_tokens"] <= 3 and usage["prompt_tokens"] > 0
    assert len(p["token_ids"]) <= 2  # the line's max_tokens beat --max-tokens
    assert t["token_ids"] == twin["token_ids"]  # same prompt and seed: same tokens
    assert long["error"]["code"] == "context_length_exceeded"


def _kill_loop_command(src: Path, out: Path) -> list[str]:
    return [sys.executable, "-m", "gptoss_cli", "run", str(src), "-o", str(out), "--model", "random:tiny",
            "--max-tokens", "3", "--seed", "1", "--max-concurrency", "1", "--resume"]


def _count_lines(path: Path) -> int:
    try:
        return path.read_bytes().count(b"\n")
    except FileNotFoundError:
        return 0


def _check_complete_lines(path: Path) -> None:
    """Every newline-terminated line is a valid record (a torn tail has no newline; resume cuts it)."""
    if path.exists():
        for line in path.read_bytes().split(b"\n")[:-1]:
            json.loads(line)


@pytest.mark.slow
def test_sigkill_at_random_points_then_resume(tmp_path):
    """Kill the real command with SIGKILL 10 times, alternately at a random moment of start-up and
    just after a record lands, resuming each time; then every line has exactly one ok record."""
    rng = random.Random(int.from_bytes(os.urandom(4), "little"))
    # Enough lines that work is left for every kill: a killed run may land several records first,
    # and once the file is complete a run has nothing to be killed in (10 lines ran out on a fast
    # CI machine: 9 kills in 30 runs).
    n_lines = 40
    src = write_jsonl(tmp_path / "in.jsonl", *[{"id": f"k{i}", "prompt": f"Question {i}?"} for i in range(n_lines)])
    out = tmp_path / "out.jsonl"
    env = {**os.environ, "GPTOSS_COLOR": "never", "OMP_NUM_THREADS": "1"}
    kills = attempts = 0
    while kills < 10 and attempts < 30:
        attempts += 1
        before = _count_lines(out)
        proc = subprocess.Popen(_kill_loop_command(src, out), env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        if kills % 2 == 0:
            time.sleep(rng.uniform(0.1, 2.0))  # imports, lock, pre-pass, meta, model load
        else:
            deadline = time.monotonic() + 120
            while _count_lines(out) == before and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.005)
            time.sleep(rng.uniform(0.0, 0.1))
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            kills += 1
        proc.wait()
        _check_complete_lines(out)
    final = subprocess.run(_kill_loop_command(src, out), env=env, capture_output=True, text=True, timeout=300)
    assert final.returncode == 0, final.stderr
    assert kills == 10, f"only {kills} of {attempts} runs were still running when killed"
    records = read_records(out)
    assert all(is_ok(r) for r in records)
    assert sorted(r["custom_id"] for r in records) == sorted(f"k{i}" for i in range(n_lines))
