"""The shape of `gptoss run` output records: OpenAI Batch records and flat "simple" records.

`openai` records match the OpenAI / vLLM batch output, so existing readers work; a failed request
fills in both the HTTP-style `response` (status 400, error body) and the top-level `error`, so
readers of either convention see it. A line that could not be read at all has `response: null`.
`simple` records are flat and jq-friendly. Success test for both: openai
`error == null and response.status_code == 200`, simple `status == "ok"`.
"""

from __future__ import annotations

import json
import secrets
import time
from dataclasses import dataclass
from typing import Any

from .batch_input import LineError
from .batch_result import Completion

FORMATS = ("auto", "openai", "simple")


@dataclass(frozen=True)
class RecordContext:
    """What every record of one line says besides the result."""

    custom_id: str
    line: int
    fmt: str  # "openai" | "simple"
    model: str
    effort: str | None = None
    seed: int | None = None


@dataclass(frozen=True)
class RecordOptions:
    include_reasoning: bool = True
    token_ids: bool = False


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    reasoning_tokens: int = 0
    cached_tokens: int = 0


@dataclass(frozen=True)
class Verdict:
    """What resume needs to know about an existing record."""

    custom_id: str | None
    ok: bool
    line: int | None


def record_format(mode: str, kind: str | None) -> str:
    """--format auto: openai records for OpenAI-shaped lines, simple records for the short forms."""
    if mode != "auto":
        return mode
    return "openai" if kind == "openai" else "simple"


def ok_record(ctx: RecordContext, completion: Completion, usage: Usage, timing: dict[str, int] | None,
              token_ids: list[int] | None, options: RecordOptions) -> dict[str, Any]:
    if ctx.fmt == "openai":
        return _openai_ok(ctx, completion, usage, token_ids, options)
    record: dict[str, Any] = {"custom_id": ctx.custom_id, "line": ctx.line, "status": "ok", "output": completion.content}
    if options.include_reasoning:
        record["reasoning"] = completion.reasoning
    record["tool_calls"] = completion.tool_calls
    record["finish_reason"] = completion.finish_reason
    record["usage"] = {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "reasoning_tokens": usage.reasoning_tokens,
        "cached_tokens": usage.cached_tokens,
    }
    record.update(model=ctx.model, effort=ctx.effort, seed=ctx.seed, timing=timing)
    if options.token_ids:
        record["token_ids"] = token_ids
    record["error"] = None
    return record


def error_record(ctx: RecordContext, error: LineError) -> dict[str, Any]:
    if ctx.fmt == "openai":
        return _openai_error(ctx, error)
    return {
        "custom_id": ctx.custom_id, "line": ctx.line, "status": "error", "output": None, "finish_reason": None,
        "usage": None, "model": ctx.model, "effort": ctx.effort, "seed": ctx.seed, "timing": None,
        "error": {"code": error.code, "message": error.message},
    }


def _openai_ok(ctx: RecordContext, completion: Completion, usage: Usage, token_ids: list[int] | None,
               options: RecordOptions) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": completion.content}
    if options.include_reasoning:
        message["reasoning"] = completion.reasoning
    message["tool_calls"] = completion.tool_calls
    choice: dict[str, Any] = {"index": 0, "finish_reason": completion.finish_reason, "logprobs": None, "message": message}
    if options.token_ids:
        choice["token_ids"] = token_ids
    body = {
        "id": f"chatcmpl-{secrets.token_hex(12)}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": ctx.model,
        "choices": [choice],
        "usage": {
            "prompt_tokens": usage.prompt_tokens,
            "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.prompt_tokens + usage.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
            "completion_tokens_details": {"reasoning_tokens": usage.reasoning_tokens},
        },
    }
    return _openai_envelope(ctx, {"status_code": 200, "request_id": _request_id(), "body": body}, None)


def _openai_error(ctx: RecordContext, error: LineError) -> dict[str, Any]:
    response = None
    if error.formed:
        body = {"error": {"message": error.message, "type": "invalid_request_error", "param": error.param,
                          "code": error.code}}
        response = {"status_code": error.status_code, "request_id": _request_id(), "body": body}
    return _openai_envelope(ctx, response, {"code": error.code, "message": error.message, "line": ctx.line})


def _openai_envelope(ctx: RecordContext, response: dict | None, error: dict | None) -> dict[str, Any]:
    return {"id": f"batch_req_{secrets.token_hex(12)}", "custom_id": ctx.custom_id, "response": response, "error": error}


def _request_id() -> str:
    return f"req_{secrets.token_hex(12)}"


def verdict(record: Any) -> Verdict | None:
    """Read back a record of either shape; None when it is not one of ours."""
    if not isinstance(record, dict):
        return None
    custom_id = record.get("custom_id")
    custom_id = custom_id if isinstance(custom_id, str) else None
    if "status" in record:
        line = record.get("line")
        return Verdict(custom_id, record["status"] == "ok", line if isinstance(line, int) else None)
    if "response" in record or "error" in record:
        error, response = record.get("error"), record.get("response")
        ok = error is None and isinstance(response, dict) and response.get("status_code") == 200
        line = error.get("line") if isinstance(error, dict) else None
        return Verdict(custom_id, ok, line if isinstance(line, int) else None)
    return None


def encode_record(record: dict[str, Any]) -> bytes:
    """One JSONL line. Text that cannot be UTF-8 (lone surrogates from \\u escapes) is escaped instead."""
    try:
        return (json.dumps(record, ensure_ascii=False, separators=(",", ":")) + "\n").encode("utf-8")
    except UnicodeEncodeError:
        return (json.dumps(record, separators=(",", ":")) + "\n").encode("ascii")
