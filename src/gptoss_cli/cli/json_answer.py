"""`gptoss chat --json-schema FILE`: the schema file, and whether an answer satisfies it.

The schema reaches the model as a harmony response format (the developer message's `# Response
Formats`). The answer is then checked: it must parse as JSON, and, where the `jsonschema` package
is installed, validate against the schema. Without that package only the JSON syntax is checked,
and the caller says so once: a check that was not made is never reported as passed.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from .errors import UsageError


def read_schema(path: str) -> tuple[str, dict]:
    """(response format name, schema) from a JSON file; UsageError for a file that cannot be one."""
    hint = "give a JSON file holding one JSON Schema object, e.g. {\"type\": \"object\", ...}"
    try:
        schema = json.loads(Path(path).expanduser().read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UsageError(f"--json-schema {path}: no such file", hint) from None
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"--json-schema {path}: cannot read it ({e})", hint) from None
    except json.JSONDecodeError as e:
        raise UsageError(f"--json-schema {path}: not JSON (line {e.lineno}, column {e.colno}: {e.msg})", hint) from None
    if not isinstance(schema, dict):
        raise UsageError(f"--json-schema {path}: the schema must be a JSON object, not {type(schema).__name__}", hint)
    return format_name(schema, Path(path).stem), schema


def format_name(schema: dict, fallback: str) -> str:
    """The response format's name: the schema's title, else the file name, as one identifier."""
    title = schema.get("title") if isinstance(schema.get("title"), str) else fallback
    return re.sub(r"\W+", "_", title).strip("_") or "response"


def schema_checker_available() -> bool:
    try:
        import jsonschema  # noqa: F401
    except ImportError:
        return False
    return True


def answer_problem(answer: str, schema: dict) -> str | None:
    """Why `answer` does not satisfy `schema` (one line), or None. The JSON syntax is always checked,
    the schema where the jsonschema package is installed."""
    try:
        value = json.loads(answer)
    except json.JSONDecodeError as e:
        return f"the answer is not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})"
    if not schema_checker_available():
        return None
    import jsonschema

    try:
        jsonschema.validate(value, schema)
    except jsonschema.ValidationError as e:
        where = "/".join(str(p) for p in e.absolute_path) or "the top level"
        return f"the answer does not match the schema at {where}: {e.message}"
    except jsonschema.SchemaError as e:
        return f"the schema itself is invalid: {e.message}"
    return None
