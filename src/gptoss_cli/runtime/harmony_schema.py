"""JSON schema → the TypeScript-like type text that harmony puts in a `# Tools` section.

The output must match openai-harmony's renderer character for character (the model was trained on
it), quirks included: a nested object's description is written twice, `oneOf` variants are listed
one per line with ` | `, defaults and descriptions become `//` comments, and JSON values inside
comments are printed the way Rust's serde_json prints them (compact, shortest float form).
"""

from __future__ import annotations

import json
from decimal import Decimal
from typing import Any


def schema_to_typescript(schema: Any, indent: str = "") -> str:
    """The type text of `schema`; `indent` prefixes every line nested inside it."""
    if not isinstance(schema, dict):
        return "any"
    if isinstance(schema.get("oneOf"), list):
        return _one_of_type(schema["oneOf"], indent)
    kind = schema.get("type")
    if isinstance(kind, list):
        names = ["number" if t == "integer" else t for t in kind if isinstance(t, str)]
        return " | ".join(names) if names else "any"
    if kind == "object":
        return _object_type(schema, indent)
    if kind == "string":
        choices = [f'"{v}"' for v in _enum_values(schema) if isinstance(v, str)]
        return " | ".join(choices) if choices else "string"
    if kind in ("number", "integer"):
        return "number"
    if kind == "boolean":
        return "boolean"
    if kind == "array":
        return f"{schema_to_typescript(schema['items'], indent)}[]" if "items" in schema else "Array<any>"
    return "any"


def _one_of_type(variants: list, indent: str) -> str:
    out = ""
    for variant in variants:
        out += f"\n{indent} | " + _variant_type(variant, indent)
        comments = []
        if isinstance(_get(variant, "description"), str):
            comments.append(variant["description"])
        if "default" in _as_dict(variant):
            default = variant["default"]
            if isinstance(default, str) and not _is_enum(variant):
                comments.append(f'default: "{default}"')
            else:
                comments.append(f"default: {to_serde_json(default)}")
        if comments:
            out += " // " + " ".join(comments)
    return out


def _variant_type(variant: Any, indent: str) -> str:
    text = schema_to_typescript(variant, indent + "   ")
    if _get(variant, "nullable") is True and "null" not in text:
        text += " | null"
    return text


def _object_type(schema: dict, indent: str) -> str:
    out = f"{indent}// {schema['description']}\n" if isinstance(schema.get("description"), str) else ""
    out += "{\n"
    props = schema.get("properties")
    if isinstance(props, dict):
        listed = schema.get("required")
        required = {r for r in listed if isinstance(r, str)} if isinstance(listed, list) else set()
        for key, prop in props.items():
            out += _property(key, prop, key in required, indent)
    return out + f"{indent}}}"


def _property(key: str, prop: Any, required: bool, indent: str) -> str:
    spec = _as_dict(prop)
    mark = "" if required else "?"
    out = ""
    if isinstance(spec.get("title"), str):
        out += f"{indent}// {spec['title']}\n{indent}//\n"
    if "oneOf" not in spec and isinstance(spec.get("description"), str):
        out += f"{indent}// {spec['description']}\n"
    if isinstance(spec.get("examples"), list) and spec["examples"]:
        out += f"{indent}// Examples:\n"
        out += "".join(f'{indent}// - "{ex}"\n' for ex in spec["examples"] if isinstance(ex, str))
    if isinstance(spec.get("oneOf"), list):
        return out + _one_of_property(key, spec, mark, indent)
    text = schema_to_typescript(prop, indent + "    ")
    if spec.get("nullable") is True and "null" not in text:
        text += " | null"
    out += f"{indent}{key}{mark}: {text},"
    if "oneOf" not in spec and "default" in spec:
        out += f" // default: {_default_text(spec)}"
    return out + "\n"


def _one_of_property(key: str, spec: dict, mark: str, indent: str) -> str:
    variants = spec["oneOf"]
    desc = spec.get("description") if isinstance(spec.get("description"), str) else None
    # A description repeated by the first variant is written once, after that variant.
    desc_above = desc is not None and not (variants and _get(variants[0], "description") == desc)
    out = f"{indent}// {desc}\n" if desc_above else ""
    if "default" in spec:
        out += f"{indent}// default: {_default_text(spec)}\n"
    out += f"{indent}{key}{mark}:\n"
    for i, variant in enumerate(variants):
        out += f"{indent} | " + _variant_type(variant, indent)
        comments = []
        vdesc = _get(variant, "description")
        if not (i == 0 and desc_above) and isinstance(vdesc, str) and vdesc != desc:
            comments.append(vdesc)
        if "default" in _as_dict(variant):
            comments.append(f"default: {_default_text(variant)}")
        if comments:
            out += " // " + " ".join(comments)
        out += "\n"
    return out + f"{indent},\n"


def _default_text(spec: dict) -> str:
    """A property's default: strings quoted unless the property is an enum, other values as JSON."""
    default = spec["default"]
    if isinstance(default, str):
        return default if _is_enum(spec) else f'"{default}"'
    return to_serde_json(default)


def _is_enum(spec: Any) -> bool:
    return bool(_enum_values(spec))


def _enum_values(spec: Any) -> list:
    values = _get(spec, "enum")
    return values if isinstance(values, list) else []


def _get(value: Any, key: str) -> Any:
    return value.get(key) if isinstance(value, dict) else None


def _as_dict(value: Any) -> dict:
    return value if isinstance(value, dict) else {}


def to_serde_json(value: Any) -> str:
    """Compact JSON as Rust's serde_json writes it (floats in ryu's shortest form: 1e-7, 1e16, 0.5)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        # serde_json holds integers as i64/u64; anything wider is read as a float.
        return str(value) if -(2**63) <= value < 2**64 else _ryu_float(float(value))
    if isinstance(value, float):
        return _ryu_float(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(to_serde_json(v) for v in value) + "]"
    if isinstance(value, dict):
        items = (f"{json.dumps(str(k), ensure_ascii=False)}:{to_serde_json(v)}" for k, v in value.items())
        return "{" + ",".join(items) + "}"
    raise TypeError(f"cannot write {type(value).__name__} as JSON")


def _ryu_float(x: float) -> str:
    if x != x or x in (float("inf"), float("-inf")):
        return "null"  # serde_json writes non-finite floats as null
    sign = "-" if str(x).startswith("-") else ""
    if x == 0:
        return sign + "0.0"
    # repr gives the shortest round-trip digits, the same digits ryu picks; only the layout differs.
    _, digit_tuple, exp = Decimal(repr(abs(x))).normalize().as_tuple()
    digits = "".join(map(str, digit_tuple))
    point = len(digits) + exp  # position of the decimal point relative to the first digit
    if 0 <= exp and point <= 16:
        body = digits + "0" * exp + ".0"
    elif 0 < point <= 16:
        body = digits[:point] + "." + digits[point:]
    elif -5 < point <= 0:
        body = "0." + "0" * -point + digits
    else:
        mantissa = digits if len(digits) == 1 else digits[0] + "." + digits[1:]
        body = f"{mantissa}e{point - 1}"
    return sign + body
