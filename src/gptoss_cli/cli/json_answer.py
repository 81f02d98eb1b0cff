"""`gptoss chat --json-schema FILE`: the schema file, and whether an answer satisfies it.

The schema reaches the model as a harmony response format (the developer message's `# Response
Formats`). The answer is then checked: it must parse as JSON, and, where the `jsonschema` package
is installed, validate against the schema. Without that package only the JSON syntax is checked,
and the caller says so once: a check that was not made is never reported as passed.
"""

from __future__ import annotations

import json
import re
from .errors import UsageError
from .text_files import TextFileError, read_text_file


def read_schema(path: str) -> dict:
    """The schema in a JSON file; UsageError for a file that cannot be one."""
    hint = "give a JSON file holding one JSON Schema object, e.g. {\"type\": \"object\", ...}"
    try:
        schema = json.loads(read_text_file(path))
    except TextFileError as e:
        raise UsageError(f"--json-schema {path}: {e}", hint) from None
    except json.JSONDecodeError as e:
        raise UsageError(f"--json-schema {path}: not JSON (line {e.lineno}, column {e.colno}: {e.msg})", hint) from None
    if not isinstance(schema, dict):
        raise UsageError(f"--json-schema {path}: the schema must be a JSON object, not {type(schema).__name__}", hint)
    return schema


def format_name(schema: dict) -> str:
    """The response format's name in the prompt: the schema's title as one identifier, else "response"."""
    title = schema.get("title") if isinstance(schema.get("title"), str) else ""
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
