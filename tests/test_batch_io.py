"""Unit tests for `gptoss run`'s input parsing, pre-pass, records, durable writer, resume and progress."""

from __future__ import annotations

import errno
import hashlib
import io
import json
import random

import pytest

from gptoss_cli.cli.batch_input import RawLine, parse_line, read_raw_lines
from gptoss_cli.cli.batch_output import RecordContext, RecordOptions, Usage, error_record, ok_record, verdict
from gptoss_cli.cli.batch_progress import BatchProgress, Counts, progress_text
from gptoss_cli.cli.batch_resume import (
    OutputBusyError,
    OutputLock,
    PriorRecords,
    RunMeta,
    check_resumable,
    read_prior_records,
    write_meta,
)
from gptoss_cli.cli.batch_result import Completion, chat_completion, text_completion
from gptoss_cli.cli.batch_scan import replay, scan_input
from gptoss_cli.cli.batch_writer import DurableFile, OutputWriteError, RecordWriter
from gptoss_cli.cli.console import make_ui
from gptoss_cli.cli.errors import UsageError
from gptoss_cli.runtime.tokenizer import CALL, CHANNEL, CONSTRAIN, END, MESSAGE, RETURN, START


def parse(obj_or_text, number: int = 1):
    data = obj_or_text if isinstance(obj_or_text, bytes) else (
        obj_or_text.encode() if isinstance(obj_or_text, str) else json.dumps(obj_or_text).encode())
    return parse_line(RawLine(number, data, len(data)))


def openai_line(custom_id="q1", **body):
    body.setdefault("messages", [{"role": "user", "content": "hi"}])
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body}


# ---- line shapes -------------------------------------------------------------------------------

def test_each_shape_is_recognised_with_its_overrides():
    line = parse(openai_line(reasoning_effort="low", max_completion_tokens=9, temperature=0.5, top_k=3, seed=4))
    assert (line.kind, line.custom_id, line.error) == ("openai", "q1", None)
    assert line.request.effort == "low"
    assert line.request.sampling == {"temperature": 0.5, "top_k": 3, "seed": 4, "max_tokens": 9}
    assert [m.role for m in line.request.messages] == ["user"]

    chat = parse({"id": 17, "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "x"}]}, 5)
    assert (chat.kind, chat.custom_id) == ("chat", "17")
    assert chat.request.developer.instructions == "be brief"  # system in messages -> developer

    prompt = parse({"prompt": "Say hi", "developer": "Be terse.", "top_p": 0.9}, 3)
    assert (prompt.kind, prompt.custom_id) == ("prompt", "line-3")
    assert prompt.request.developer.instructions == "Be terse."
    assert prompt.request.messages[-1].content == "Say hi"
    assert prompt.request.sampling == {"top_p": 0.9}

    text = parse({"text": "Once upon", "max_tokens": 2})
    assert text.kind == "text" and text.request.text == "Once upon" and text.request.sampling == {"max_tokens": 2}


def test_blank_and_comment_lines_are_skipped():
    assert parse(b"") is None
    assert parse(b"   \t") is None
    assert parse(b"// a comment") is None


@pytest.mark.parametrize("data, code, formed", [
    (b'{"prompt": "caf\xe9"}', "invalid_utf8", False),
    (b'{"prompt": "x",}', "invalid_json", False),
    (b'[1, 2]', "invalid_json", False),
    (b'{"foo": 1}', "invalid_request", True),
])
def test_unreadable_lines(data, code, formed):
    line = parse(data, 7)
    assert line.error.code == code and line.error.formed is formed
    assert line.custom_id == "line-7"


def test_invalid_json_keeps_a_plain_custom_id():
    line = parse(b'{"custom_id": "keep-me", "body": {', 2)
    assert (line.error.code, line.custom_id) == ("invalid_json", "keep-me")


def test_huge_line_is_skipped_without_being_kept():
    big = b'{"prompt": "' + b"a" * 5000 + b'"}\n'
    stream = io.BytesIO(b'{"prompt": "a"}\n' + big + b'{"prompt": "b"}')
    raws = list(read_raw_lines(stream, max_line_bytes=1000))
    assert [r.number for r in raws] == [1, 2, 3]
    assert raws[1].data is None and raws[1].size == len(big)
    line = parse_line(raws[1], 1000)
    assert line.error.code == "line_too_long" and f"{len(big):,} bytes" in line.error.message
    assert parse_line(raws[2]).request.messages[-1].content == "b"  # the next line is intact


@pytest.mark.parametrize("overrides, fragment", [
    ({"temperature": -0.5}, "temperature must be >= 0"),
    ({"top_p": 1.5}, "top_p must be in (0, 1]"),
    ({"top_p": 0}, "top_p must be in (0, 1]"),
    ({"min_p": 2}, "min_p must be in [0, 1]"),
    ({"top_k": -1}, "top_k must be >= 0"),
    ({"max_tokens": 0}, "max_tokens must be >= 1"),
    ({"seed": -3}, "seed must be in"),
    ({"temperature": "hot"}, "temperature must be a number"),
    ({"temperature": True}, "temperature must be a number"),
    ({"top_k": 2.5}, "top_k must be an integer"),
    ({"repetition_penalty": 0}, "repetition_penalty must be > 0"),
    ({"repetition_penalty": "x"}, "repetition_penalty must be a number"),
])
def test_bad_sampling_values(overrides, fragment):
    for line in (parse({"prompt": "x", **overrides}), parse(openai_line(**overrides))):
        assert line.error.code == "invalid_sampling"
        assert fragment in line.error.message


@pytest.mark.parametrize("body, fragment", [
    ({"messages": [{"role": "wizard", "content": "x"}]}, "unknown role 'wizard'"),
    ({"messages": []}, "non-empty list"),
    ({"messages": "hi"}, "non-empty list"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools[0]"),
    ({"tools": [{"type": "retrieval"}]}, "only function tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]}, "JSON schema object"),
    ({"tools": {"name": "f"}}, "must be a list"),
    ({"stream": True}, "stream must be false"),
    ({"n": 2}, "n must be 1"),
    ({"reasoning_effort": "max"}, "reasoning_effort must be low, medium or high"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
])
def test_bad_requests(body, fragment):
    line = parse(openai_line(**body))
    assert line.error is not None and line.error.formed
    assert fragment in line.error.message, line.error.message


@pytest.mark.parametrize("change, fragment", [
    ({"url": "/v1/embeddings"}, "not supported"),
    ({"method": "GET"}, "POST"),
    ({"custom_id": 5}, "custom_id must be a non-empty string"),
    ({"body": [1]}, "body must be a JSON object"),
])
def test_bad_openai_envelopes(change, fragment):
    line = parse({**openai_line(), **change})
    assert fragment in line.error.message


def test_missing_openai_keys_are_named():
    line = parse({"custom_id": "a", "body": {"messages": []}})
    assert "method, url" in line.error.message


def test_response_format_and_tools_reach_the_developer_message():
    schema = {"type": "object", "properties": {"a": {"type": "string"}}}
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    line = parse(openai_line(response_format={"type": "json_schema", "json_schema": {"name": "out", "schema": schema}},
                             tools=[tool]))
    dev = line.request.developer
    assert dev.response_formats[0].name == "out" and dev.response_formats[0].schema == schema
    assert [t.name for t in dev.tools] == ["get_weather"]
    none = parse(openai_line(tools=[tool], tool_choice="none"))
    assert none.request.developer is None


def test_unknown_fields_become_notes():
    line = parse({**openai_line(foo=1), "extra": 2})
    assert line.error is None
    assert set(line.notes) == {"unknown field body.foo (ignored)", "unknown field extra (ignored)"}
    stop = parse({"prompt": "x", "stop": ["\n"]})
    assert stop.notes == () and stop.request.stop == ("\n",)  # supported since session 20
    assert parse({"text": "x", "stop": "\n\n"}).request.stop == ("\n\n",)
    assert parse({"prompt": "x", "stop": None}).request.stop is None  # the --stop default applies


# ---- pre-pass ----------------------------------------------------------------------------------

def _jsonl(*items) -> bytes:
    return b"".join((i if isinstance(i, bytes) else json.dumps(i).encode()) + b"\n" for i in items)


def test_scan_finds_duplicates_hashes_and_collects_notes():
    data = _jsonl(openai_line("a", foo=1), b"", {"prompt": "x", "id": "a"}, b"// c", openai_line("b", foo=2),
                  b"{bad", openai_line("b"))
    scan = scan_input(io.BytesIO(data))
    assert scan.sha256 == hashlib.sha256(data).hexdigest()
    assert scan.records == 5 and scan.todo == 5 and scan.valid == 2
    assert {n: e.code for n, e in scan.errors.items()} == {3: "duplicate_custom_id", 6: "invalid_json",
                                                          7: "duplicate_custom_id"}
    assert "line 1" in scan.errors[3].message
    note = scan.notes["unknown field body.foo (ignored)"]
    assert (note.first_line, note.count) == (1, 2)
    assert scan.first_kind == "openai"
    replayed = list(replay(io.BytesIO(data), scan))
    assert [(l.number, l.error.code if l.error else None) for l in replayed] == [
        (1, None), (3, "duplicate_custom_id"), (5, None), (6, "invalid_json"), (7, "duplicate_custom_id")]


def test_scan_limit_still_hashes_everything_and_counts_skips():
    data = _jsonl(*({"prompt": str(i)} for i in range(7)))
    scan = scan_input(io.BytesIO(data), limit=4, skip=lambda number, cid, bad: number % 2 == 0)
    assert scan.sha256 == hashlib.sha256(data).hexdigest()
    assert (scan.records, scan.todo) == (4, 2)
    assert [l.number for l in replay(io.BytesIO(data), scan, limit=4)] == [1, 2, 3, 4]


# ---- completions -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tokenizer():
    from gptoss_cli.runtime.tokenizer import Tokenizer, load_o200k_base_ranks

    return Tokenizer.from_ranks(load_o200k_base_ranks())


def _msg(tok, channel, text, end, recipient=None, first=False, constrain=False):
    ids = [] if first else [START, *tok.encode("assistant")]
    ids += [CHANNEL, *tok.encode(channel)]
    if recipient:
        ids += tok.encode(f" to={recipient}")
    if constrain:
        ids += [*tok.encode(" "), CONSTRAIN, *tok.encode("json")]
    return ids + [MESSAGE, *tok.encode(text), end]


def test_chat_completion_splits_reasoning_answer_and_counts_reasoning_tokens(tokenizer):
    thinking = "The user wants the capital. It is Paris."
    ids = _msg(tokenizer, "analysis", thinking, END, first=True) + _msg(tokenizer, "final", "Paris", RETURN)
    out = chat_completion(tokenizer, ids, "stop")
    assert (out.content, out.reasoning, out.finish_reason, out.tool_calls) == ("Paris", thinking, "stop", [])
    assert out.reasoning_tokens == len(tokenizer.encode(thinking)) + 1  # its text and its <|end|>


def test_chat_completion_returns_tool_calls(tokenizer):
    ids = (_msg(tokenizer, "analysis", "need weather", END, first=True)
           + _msg(tokenizer, "commentary", '{"city":"Oslo"}', CALL, recipient="functions.get_weather", constrain=True))
    out = chat_completion(tokenizer, ids, "stop")
    assert out.finish_reason == "tool_calls" and out.content is None
    (call,) = out.tool_calls
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "get_weather", "arguments": '{"city":"Oslo"}'}


def test_chat_completion_cut_by_length_has_empty_content(tokenizer):
    ids = _msg(tokenizer, "analysis", "still thinking about it", END, first=True)[:-3]
    out = chat_completion(tokenizer, ids, "length")
    assert (out.content, out.finish_reason) == ("", "length")
    assert out.reasoning.startswith("still")


def test_text_completion_drops_only_the_stop_token(tokenizer):
    ids = tokenizer.encode(" there was a fox")
    assert text_completion(tokenizer, ids + [RETURN], "stop", (RETURN,)).content == " there was a fox"
    assert text_completion(tokenizer, ids, "length", (RETURN,)).content == " there was a fox"


# ---- records -----------------------------------------------------------------------------------

def _ctx(fmt, cid="q", line=3):
    return RecordContext(cid, line, fmt, "gpt-oss-20b", "low", 11)


def test_openai_records_match_the_batch_output_shape():
    done = Completion("Paris", "thinking", "stop", [], 5)
    rec = ok_record(_ctx("openai"), done, Usage(90, 20, 5, 64), {"ttft_ms": 1, "e2e_ms": 2}, [1, 2], RecordOptions())
    assert set(rec) == {"id", "custom_id", "response", "error"} and rec["error"] is None
    body = rec["response"]["body"]
    assert rec["response"]["status_code"] == 200 and body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "Paris", "reasoning": "thinking",
                                             "tool_calls": []}
    assert body["usage"]["total_tokens"] == 110
    assert body["usage"]["completion_tokens_details"] == {"reasoning_tokens": 5}
    assert body["usage"]["prompt_tokens_details"] == {"cached_tokens": 64}
    assert "token_ids" not in body["choices"][0]
    omitted = ok_record(_ctx("openai"), done, Usage(1, 2), None, [7, 8], RecordOptions(False, True))
    choice = omitted["response"]["body"]["choices"][0]
    assert "reasoning" not in choice["message"] and choice["token_ids"] == [7, 8]
    assert verdict(rec).ok and verdict(rec).custom_id == "q"


def test_error_records_are_visible_to_both_reader_conventions():
    from gptoss_cli.cli.batch_input import LineError

    rec = error_record(_ctx("openai"), LineError("context_length_exceeded", "prompt is 9 tokens; context is 8"))
    assert rec["response"]["status_code"] == 400
    assert rec["response"]["body"]["error"]["code"] == "context_length_exceeded"
    assert rec["error"] == {"code": "context_length_exceeded", "message": "prompt is 9 tokens; context is 8", "line": 3}
    unread = error_record(_ctx("openai"), LineError("invalid_json", "bad", formed=False))
    assert unread["response"] is None
    simple = error_record(_ctx("simple"), LineError("invalid_json", "bad", formed=False))
    assert (simple["status"], simple["output"], simple["error"]["code"]) == ("error", None, "invalid_json")
    for r in (rec, unread, simple):
        v = verdict(r)
        assert not v.ok and v.line == 3


def test_simple_record_fields():
    rec = ok_record(_ctx("simple"), Completion("hi", None, "length"), Usage(3, 4, 1, 0), {"ttft_ms": 5, "e2e_ms": 9},
                    [1], RecordOptions(token_ids=True))
    assert rec["status"] == "ok" and rec["output"] == "hi" and rec["line"] == 3 and rec["seed"] == 11
    assert rec["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "reasoning_tokens": 1, "cached_tokens": 0}
    assert rec["token_ids"] == [1] and rec["error"] is None


# ---- durable writer ----------------------------------------------------------------------------

class _MemorySink:
    def __init__(self):
        self.lines: list[dict] = []

    def write_lines(self, lines):
        self.lines += [json.loads(x) for x in lines]

    def close(self):
        pass


def test_ordered_writer_restores_input_order_and_skips_holes():
    rng = random.Random(1234)
    n = 37
    seqs = list(range(n))
    rng.shuffle(seqs)
    holes = {3, 17, 36}
    out, err = _MemorySink(), _MemorySink()
    writer = RecordWriter(out, err, ordered=True)
    max_buffered = 0
    for seq in seqs:
        writer.put(seq, None if seq in holes else {"seq": seq}, ok=seq % 5 != 0)
        max_buffered = max(max_buffered, writer.buffered)
    assert writer.buffered == 0 and writer.next_seq == n
    assert [r["seq"] for r in out.lines] == [s for s in range(n) if s not in holes and s % 5]
    assert [r["seq"] for r in err.lines] == [s for s in range(n) if s not in holes and s % 5 == 0]
    assert writer.written_ok + writer.written_failed == n - len(holes)
    with pytest.raises(ValueError):
        writer.put(0, {"seq": 0})


def test_unordered_writer_writes_at_once():
    out = _MemorySink()
    writer = RecordWriter(out, None, ordered=False)
    for seq in (2, 0, 1):
        writer.put(seq, {"seq": seq})
        assert out.lines[-1]["seq"] == seq


def test_durable_file_leaves_no_torn_line_when_the_disk_fills(tmp_path, monkeypatch):
    path = tmp_path / "out.jsonl"
    f = DurableFile(path, sync_interval=0.0)
    f.write_lines([b'{"a":1}\n', b'{"a":2}\n'])
    calls = {"n": 0}

    def short_then_full(self, fd, data):
        calls["n"] += 1
        if calls["n"] == 1:
            return __import__("os").write(fd, data[:5])  # a partial write, then ENOSPC
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(DurableFile, "_os_write", short_then_full)
    with pytest.raises(OutputWriteError, match="disk full") as info:
        f.write_lines([b'{"a":3}\n'])
    assert "--resume" in info.value.hint
    monkeypatch.undo()
    assert path.read_bytes() == b'{"a":1}\n{"a":2}\n'
    f.write_lines([b'{"a":4}\n'])
    f.close()
    assert path.read_bytes().splitlines()[-1] == b'{"a":4}'


def test_durable_file_keeps_only_synced_data_when_fsync_fails(tmp_path, monkeypatch):
    path = tmp_path / "out.jsonl"
    f = DurableFile(path, sync_interval=3600)
    f.write_lines([b'{"a":1}\n'])
    f.sync()
    f.write_lines([b'{"a":2}\n'])

    def fail(self, fd):
        raise OSError(errno.EIO, "I/O error")

    monkeypatch.setattr(DurableFile, "_os_fsync", fail)
    with pytest.raises(OutputWriteError, match="I/O error"):
        f.sync()
    assert path.read_bytes() == b'{"a":1}\n'


# ---- resume ------------------------------------------------------------------------------------

def test_prior_records_cut_a_torn_last_line(tmp_path):
    ok = ok_record(_ctx("simple", "a", 1), Completion("x", None, "stop"), Usage(1, 1), None, None, RecordOptions())
    from gptoss_cli.cli.batch_input import LineError

    bad = error_record(_ctx("openai", "b", 2), LineError("invalid_json", "x", formed=False))
    path = tmp_path / "out.jsonl"
    good = (json.dumps(ok) + "\n" + json.dumps(bad) + "\n" + "not a record\n").encode()
    path.write_bytes(good + b'{"custom_id": "c", "sta')
    prior = read_prior_records(path)
    assert prior.torn_bytes == len(b'{"custom_id": "c", "sta')
    assert path.read_bytes() == good
    assert (prior.ok_ids, prior.failed_ids, prior.failed_lines, prior.records, prior.unreadable) == (
        {"a"}, {"b"}, {2}, 2, 1)
    assert prior.should_skip(1, "a", False, retry_errors=True)
    assert prior.should_skip(5, "b", False, retry_errors=False)
    assert not prior.should_skip(5, "b", False, retry_errors=True)
    assert prior.should_skip(2, "zz", True, retry_errors=True)  # a pre-run error is not repeated
    assert not prior.should_skip(9, "new", False, retry_errors=False)


def test_lock_refuses_a_second_holder(tmp_path):
    out = tmp_path / "out.jsonl"
    with OutputLock(out):
        with pytest.raises(OutputBusyError, match="another `gptoss run` is writing out.jsonl"):
            OutputLock(out).acquire()
    with OutputLock(out):  # released and reusable
        pass
    assert not (tmp_path / "out.jsonl.lock").exists()


def test_resume_checks_the_meta_sidecar(tmp_path):
    out = tmp_path / "out.jsonl"
    meta = RunMeta("a" * 64, "random:tiny", "low", {"temperature": 1.0, "seed": None})
    write_meta(out, meta)
    some = PriorRecords(records=1)
    assert check_resumable(out, some, meta, force=False) == meta
    other = RunMeta("b" * 64, "random:tiny", "high", {"temperature": 0.5, "seed": None})
    with pytest.raises(UsageError) as info:
        check_resumable(out, some, other, force=False)
    text = str(info.value)
    assert "input changed" in text and "--effort was low, now high" in text and "temperature 1.0 → 0.5" in text
    assert check_resumable(out, some, other, force=True) == meta
    assert check_resumable(out, PriorRecords(), other, force=False) == meta  # nothing to protect yet
    (tmp_path / "out.jsonl.meta.json").unlink()
    with pytest.raises(UsageError, match="no readable"):
        check_resumable(out, some, meta, force=False)


# ---- progress ----------------------------------------------------------------------------------

def test_progress_text():
    text = progress_text(Counts(total=1000, done=412, failed=3, out_tokens=182_900), elapsed=62.0)
    assert text == "412/1000 · 41% · 6.6 req/s · 2,950 out tok/s · errors 3 · 01:02 < 01:28"
    assert progress_text(Counts(total=5), 0.0).endswith("00:00 < ?")


def test_plain_progress_logs_every_interval(capsys):
    now = [0.0]
    ui = make_ui("never")
    with BatchProgress(ui, total=4, log_interval=10.0, clock=lambda: now[0]) as progress:
        for t in (1.0, 5.0, 10.5, 12.0, 21.0, 25.0):
            now[0] = t
            progress.record(ok=t != 5.0)
            progress.tick()
    lines = capsys.readouterr().err.splitlines()
    assert lines == ["3/4 · 75% · 0.3 req/s · 0 out tok/s · errors 1 · 00:10 < 00:03",
                     "5/4 · 125% · 0.2 req/s · 0 out tok/s · errors 1 · 00:21 < 00:00"]


def test_the_example_input_is_valid():
    from pathlib import Path

    example = Path(__file__).resolve().parents[1] / "examples" / "prompts.jsonl"
    with open(example, "rb") as f:
        scan = scan_input(f)
    assert scan.records >= 5 and scan.errors == {} and scan.notes == {}
    with open(example, "rb") as f:
        kinds = {line.kind for line in replay(f, scan)}
    assert kinds == {"openai", "chat", "prompt", "text"}


def test_a_pipe_given_as_a_path_is_spooled_so_it_can_be_read_twice():
    import os

    from gptoss_cli.cli.batch_session import open_input

    r, w = os.pipe()
    os.write(w, b'{"prompt": "a"}\n{"prompt": "b"}\n')
    os.close(w)
    try:
        with open_input(f"/dev/fd/{r}") as f:
            first = scan_input(f)
            f.seek(0)
            assert [line.request.messages[-1].content for line in replay(f, first)] == ["a", "b"]
    finally:
        os.close(r)
