"""`gptoss run` input: reading JSONL lines safely and turning each one into a request or an error.

Four line shapes, detected per line: an OpenAI Batch request (`custom_id`, `method`, `url`,
`body`), `{"messages": [...]}`, `{"prompt": ..., "developer": ...}` and raw text `{"text": ...}`.
Blank lines and `//` comments are skipped. Nothing here needs the model or the tokenizer, so the
whole file can be validated before the model loads; a bad line becomes a LineError, never an
exception.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import IO, Any

from ..runtime.api import SamplingParams
from ..runtime.harmony import DeveloperConfig, Message, ResponseFormat, from_openai_messages, tool_from_openai
from ..runtime.stop_strings import check_stops
from .options import EFFORTS

MAX_LINE_BYTES = 16 * 1024 * 1024
CHAT_URL = "/v1/chat/completions"
OPENAI_KEYS = ("custom_id", "method", "url", "body")
_READ_CHUNK = 1 << 20

# Request keys, as in an OpenAI chat completions body (shorthand lines use the same names).
SAMPLING_FLOATS = ("temperature", "top_p", "min_p", "repetition_penalty")
SAMPLING_INTS = ("top_k", "seed")
MAX_TOKEN_KEYS = ("max_completion_tokens", "max_tokens")
SAMPLING_KEYS = (*SAMPLING_FLOATS, *SAMPLING_INTS, *MAX_TOKEN_KEYS, "stop", "n", "stream")
CHAT_KEYS = ("reasoning_effort", "response_format", "tools", "tool_choice", "model")
ID_KEYS = ("custom_id", "id")


@dataclass(frozen=True)
class LineError:
    """Why one line produced no completion; `formed` is False when no request could even be read."""

    code: str
    message: str
    param: str | None = None
    formed: bool = True
    status_code: int = 400


@dataclass(frozen=True)
class RequestSpec:
    """A validated request: harmony messages (chat shapes) or raw text, plus per-line overrides."""

    kind: str  # "openai" | "chat" | "prompt" | "text"
    messages: tuple[Message, ...] = ()
    developer: DeveloperConfig | None = None
    text: str | None = None
    sampling: dict[str, Any] = field(default_factory=dict)  # SamplingParams field -> value
    effort: str | None = None
    model: str | None = None
    stop: tuple[str, ...] | None = None  # the line's stop sequences; None: the command line's --stop


@dataclass(frozen=True)
class BatchLine:
    """One non-blank input line: its request, or why it has none. `notes` are once-per-key warnings."""

    number: int  # 1-based physical line number
    custom_id: str
    kind: str | None  # shape, when it could be told
    request: RequestSpec | None = None
    error: LineError | None = None
    notes: tuple[str, ...] = ()

    def with_error(self, error: LineError) -> BatchLine:
        return BatchLine(self.number, self.custom_id, self.kind, None, error, self.notes)


@dataclass(frozen=True)
class RawLine:
    number: int
    data: bytes | None  # None when the line was longer than the limit (not kept)
    size: int


class _Invalid(Exception):
    """Internal: a line failed validation (carries the LineError)."""

    def __init__(self, code: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.error = LineError(code, message, param)


# ---- reading ---------------------------------------------------------------------------------

def read_raw_lines(stream: IO[bytes], max_line_bytes: int = MAX_LINE_BYTES) -> Iterator[RawLine]:
    """Physical lines without their line ending; a line over the limit is skipped over, not kept."""
    number = 0
    while True:
        chunk = stream.readline(max_line_bytes + 1)
        if not chunk:
            return
        number += 1
        if len(chunk) > max_line_bytes and not chunk.endswith(b"\n"):
            yield RawLine(number, None, len(chunk) + _skip_rest_of_line(stream))
            continue
        data = chunk.rstrip(b"\n").rstrip(b"\r")
        if number == 1 and data.startswith(b"\xef\xbb\xbf"):
            data = data[3:]  # a UTF-8 byte order mark some editors write
        yield RawLine(number, data, len(chunk))


def _skip_rest_of_line(stream: IO[bytes]) -> int:
    skipped = 0
    while True:
        chunk = stream.readline(_READ_CHUNK)
        skipped += len(chunk)
        if not chunk or chunk.endswith(b"\n"):
            return skipped


def is_skipped(data: bytes) -> bool:
    """Blank lines and `//` comment lines produce no record."""
    stripped = data.strip()
    return not stripped or stripped.startswith(b"//")


# ---- one line --------------------------------------------------------------------------------

def parse_line(raw: RawLine, max_line_bytes: int = MAX_LINE_BYTES) -> BatchLine | None:
    """The line's request or error; None for a skipped (blank or comment) line."""
    default_id = f"line-{raw.number}"
    if raw.data is None:
        return BatchLine(raw.number, default_id, None, error=LineError(
            "line_too_long", f"line is {raw.size:,} bytes; the limit is {max_line_bytes:,}", formed=False))
    if is_skipped(raw.data):
        return None
    try:
        text = raw.data.decode("utf-8")
    except UnicodeDecodeError as e:
        return BatchLine(raw.number, default_id, None, error=LineError(
            "invalid_utf8", f"line is not valid UTF-8 (bad byte at column {e.start + 1})", formed=False))
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        return BatchLine(raw.number, _guess_id(text) or default_id, None, error=LineError(
            "invalid_json", f"invalid JSON: {e.msg} (column {e.colno})", formed=False))
    except RecursionError:
        return BatchLine(raw.number, default_id, None, error=LineError(
            "invalid_json", "invalid JSON: nested too deeply", formed=False))
    if not isinstance(obj, dict):
        return BatchLine(raw.number, default_id, None, error=LineError(
            "invalid_json", f"a line must be a JSON object, not {_json_type(obj)}", formed=False))
    return parse_object(obj, raw.number)


def parse_object(obj: dict[str, Any], number: int) -> BatchLine:
    """Classify a decoded line and validate it."""
    kind = line_kind(obj)
    custom_id = _best_id(obj, number)
    notes: list[str] = []
    if kind is None:
        return BatchLine(number, custom_id, None, error=LineError(
            "invalid_request", "a line needs `body` (OpenAI batch), `messages`, `prompt` or `text`"))
    try:
        custom_id = _custom_id(obj, kind, number)
        request = _parse_request(obj, kind, notes)
    except _Invalid as e:
        return BatchLine(number, custom_id, kind, error=e.error, notes=tuple(notes))
    return BatchLine(number, custom_id, kind, request, notes=tuple(notes))


def line_kind(obj: dict[str, Any]) -> str | None:
    if any(k in obj for k in ("body", "method", "url")):
        return "openai"
    for kind in ("messages", "prompt", "text"):
        if kind in obj:
            return "chat" if kind == "messages" else kind
    return None


def _parse_request(obj: dict[str, Any], kind: str, notes: list[str]) -> RequestSpec:
    if kind == "openai":
        body = _openai_envelope(obj, notes)
        return _chat_request(body, "openai", body.get("messages"), None, notes)
    allowed = {*ID_KEYS, *SAMPLING_KEYS, kind if kind != "chat" else "messages"}
    if kind != "text":
        allowed |= {*CHAT_KEYS, "developer", "system"}
    _note_unknown(obj, allowed, "", notes)
    if kind == "text":
        text = obj.get("text")
        if not isinstance(text, str) or not text:
            raise _Invalid("invalid_request", "`text` must be a non-empty string", "text")
        return RequestSpec("text", text=text, sampling=_sampling(obj), stop=_stop(obj))
    if kind == "prompt":
        prompt = obj.get("prompt")
        if not isinstance(prompt, str):
            raise _Invalid("invalid_request", "`prompt` must be a string", "prompt")
        # The user's "system prompt" is harmony's developer message (the system one holds effort).
        developer = obj.get("developer", obj.get("system"))
        if developer is not None and not isinstance(developer, str):
            raise _Invalid("invalid_request", "`developer` must be a string", "developer")
        messages = ([{"role": "developer", "content": developer}] if developer else []) + [{"role": "user", "content": prompt}]
        return _chat_request(obj, "prompt", messages, None, notes)
    return _chat_request(obj, "chat", obj.get("messages"), obj.get("developer", obj.get("system")), notes)


def _openai_envelope(obj: dict[str, Any], notes: list[str]) -> dict[str, Any]:
    _note_unknown(obj, set(OPENAI_KEYS), "", notes)
    missing = [k for k in OPENAI_KEYS if k not in obj]
    if missing:
        raise _Invalid("invalid_request", f"an OpenAI batch line needs {', '.join(missing)}", missing[0])
    if obj["method"] != "POST":
        raise _Invalid("invalid_request", f"method must be \"POST\", not {json.dumps(obj['method'])}", "method")
    if obj["url"] != CHAT_URL:
        raise _Invalid("unsupported_url", f"url {json.dumps(obj['url'])} is not supported; only {CHAT_URL} is", "url")
    body = obj["body"]
    if not isinstance(body, dict):
        raise _Invalid("invalid_request", f"body must be a JSON object, not {_json_type(body)}", "body")
    _note_unknown(body, {"messages", *SAMPLING_KEYS, *CHAT_KEYS}, "body.", notes)
    return body


def _chat_request(src: dict[str, Any], kind: str, messages: Any, developer: Any, notes: list[str]) -> RequestSpec:
    if not isinstance(messages, list) or not messages:
        raise _Invalid("invalid_request", "`messages` must be a non-empty list", "messages")
    if developer is not None:
        if not isinstance(developer, str):
            raise _Invalid("invalid_request", "`developer` must be a string", "developer")
        messages = [{"role": "developer", "content": developer}, *messages]
    tools = _tools(src)
    effort = src.get("reasoning_effort")
    if effort is not None and effort not in EFFORTS:
        raise _Invalid("invalid_request", f"reasoning_effort must be low, medium or high, not {json.dumps(effort)}",
                       "reasoning_effort")
    try:
        harmony_messages, dev = from_openai_messages(messages, tools)
    except (ValueError, TypeError, AttributeError, KeyError) as e:
        raise _Invalid("invalid_request", f"messages: {e}", "messages") from None
    formats = _response_formats(src.get("response_format"))
    if formats:
        dev = DeveloperConfig(dev.instructions if dev else None, dev.tools if dev else (), formats)
    model = src.get("model")
    return RequestSpec(kind, tuple(harmony_messages), dev, None, _sampling(src), effort,
                       model if isinstance(model, str) else None, _stop(src))


def _tools(src: dict[str, Any]) -> list[dict[str, Any]] | None:
    tools = src.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise _Invalid("invalid_request", "`tools` must be a list of function tools", "tools")
    for index, tool in enumerate(tools):
        try:
            tool_from_openai(tool)
        except (ValueError, TypeError, AttributeError) as e:
            raise _Invalid("invalid_request", f"tools[{index}]: {e}", "tools") from None
    choice = src.get("tool_choice")
    if choice is not None and choice not in ("auto", "none", "required") and not isinstance(choice, dict):
        raise _Invalid("invalid_request", "tool_choice must be auto, none, required or a function", "tool_choice")
    # "none" forbids calls: the model is simply not told about the tools.
    return [] if choice == "none" else tools


def _response_formats(raw: Any) -> tuple[ResponseFormat, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, dict) or raw.get("type") not in ("text", "json_schema"):
        raise _Invalid("invalid_request", "response_format must be {\"type\": \"text\"} or {\"type\": \"json_schema\", ...}",
                       "response_format")
    if raw["type"] == "text":
        return ()
    spec = raw.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
        raise _Invalid("invalid_request", "response_format.json_schema needs a `schema` object", "response_format")
    name = spec.get("name") or "response"
    description = spec.get("description")
    if not isinstance(name, str) or (description is not None and not isinstance(description, str)):
        raise _Invalid("invalid_request", "response_format.json_schema name and description must be strings",
                       "response_format")
    return (ResponseFormat(name, spec["schema"], description),)


def _sampling(src: dict[str, Any]) -> dict[str, Any]:
    """Per-line sampling overrides as SamplingParams fields; bad types and values are errors."""
    if src.get("stream") not in (None, False):
        raise _Invalid("invalid_request", "stream must be false: batch requests are not streamed", "stream")
    if src.get("n") not in (None, 1):
        raise _Invalid("invalid_request", "n must be 1: one completion per request", "n")
    out: dict[str, Any] = {}
    for key in SAMPLING_FLOATS:
        if src.get(key) is not None:
            out[key] = _number(src[key], key)
    for key in SAMPLING_INTS:
        if src.get(key) is not None:
            out[key] = _integer(src[key], key)
    limit = next((k for k in MAX_TOKEN_KEYS if src.get(k) is not None), None)
    if limit is not None:
        out["max_tokens"] = _integer(src[limit], limit)
    try:
        SamplingParams(**out)
    except ValueError as e:
        raise _Invalid("invalid_sampling", str(e), _param_named_in(str(e))) from None
    return out


def _stop(src: dict[str, Any]) -> tuple[str, ...] | None:
    """OpenAI's `stop`: a string or a list of up to 4; null (or absent) leaves the --stop default."""
    raw = src.get("stop")
    if raw is None:
        return None
    try:
        return check_stops([raw] if isinstance(raw, str) else raw if isinstance(raw, list) else [raw])
    except ValueError as e:
        raise _Invalid("invalid_request", f"stop: {e}", "stop") from None


def _number(value: Any, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _Invalid("invalid_sampling", f"{key} must be a number, not {_json_type(value)}", key)
    return float(value)


def _integer(value: Any, key: str) -> int:
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise _Invalid("invalid_sampling", f"{key} must be an integer, not {_json_type(value)}", key)
    return value


def _param_named_in(message: str) -> str | None:
    word = message.split(" ", 1)[0]
    return word if word in (*SAMPLING_FLOATS, *SAMPLING_INTS, "max_tokens") else None


def _custom_id(obj: dict[str, Any], kind: str, number: int) -> str:
    if kind == "openai":
        value = obj.get("custom_id")
        if not isinstance(value, str) or not value:
            raise _Invalid("invalid_request", "custom_id must be a non-empty string", "custom_id")
        return value
    for key in ID_KEYS:
        value = obj.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (str, int)) or value == "":
            raise _Invalid("invalid_request", f"{key} must be a non-empty string", key)
        return str(value)
    return f"line-{number}"


def _best_id(obj: dict[str, Any], number: int) -> str:
    """An id for an error record even when the id field itself is unusable."""
    for key in ID_KEYS:
        value = obj.get(key)
        if isinstance(value, (str, int)) and not isinstance(value, bool) and value != "":
            return str(value)
    return f"line-{number}"


def _guess_id(text: str) -> str | None:
    """custom_id from a line that is not valid JSON, if one is plainly there."""
    at = text.find('"custom_id"')
    if at < 0:
        return None
    rest = text[at + len('"custom_id"') :].lstrip()
    if not rest.startswith(":"):
        return None
    rest = rest[1:].lstrip()
    try:
        value, _ = json.JSONDecoder().raw_decode(rest)
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, str) and value else None


def _note_unknown(obj: dict[str, Any], allowed: set[str], prefix: str, notes: list[str]) -> None:
    notes.extend(f"unknown field {prefix}{key} (ignored)" for key in obj if key not in allowed)


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    return "a list" if isinstance(value, list) else "an object"
