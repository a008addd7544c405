"""Whether structured outputs are what their schema asks for: json.loads, then the schema.

The schema is checked with the `jsonschema` package when it is installed (the full standard); without it, with a
minimal check of the keywords the built-in json set uses (type, properties, required, additionalProperties, items,
minItems, maxItems, enum, minimum, maximum, pattern), said so in the report.
"""

from __future__ import annotations

import importlib.util
import json
import re

TYPES = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None)}


def validator_name() -> str:
    return "jsonschema" if importlib.util.find_spec("jsonschema") is not None else "minimal"


def schema_error(value, schema: dict, validator: str | None = None) -> str | None:
    """Why value does not follow schema, or None when it does."""
    if (validator or validator_name()) == "jsonschema":
        import jsonschema

        error = jsonschema.exceptions.best_match(jsonschema.validators.validator_for(schema)(schema).iter_errors(value))
        return None if error is None else f"{error.json_path}: {error.message}"
    return minimal_error(value, schema)


def minimal_error(value, schema: dict, path: str = "$") -> str | None:
    """The first violation of the common keywords, walking objects and arrays; None when there is none."""
    types = schema.get("type")
    if types is not None:
        allowed = [types] if isinstance(types, str) else list(types)
        if not any(_is_type(value, t) for t in allowed):
            return f"{path}: expected {' or '.join(allowed)}, got {type(value).__name__}"
    if "enum" in schema and value not in schema["enum"]:
        return f"{path}: {value!r} is not one of {schema['enum']}"
    if isinstance(value, str) and "pattern" in schema and not re.search(schema["pattern"], value):
        return f"{path}: {value!r} does not match {schema['pattern']}"
    if _is_number(value):
        if "minimum" in schema and value < schema["minimum"]:
            return f"{path}: {value} < minimum {schema['minimum']}"
        if "maximum" in schema and value > schema["maximum"]:
            return f"{path}: {value} > maximum {schema['maximum']}"
    if isinstance(value, dict):
        return _object_error(value, schema, path)
    if isinstance(value, list):
        return _array_error(value, schema, path)
    return None


def _object_error(value: dict, schema: dict, path: str) -> str | None:
    properties = schema.get("properties", {})
    missing = [k for k in schema.get("required", []) if k not in value]
    if missing:
        return f"{path}: missing {', '.join(missing)}"
    if schema.get("additionalProperties") is False:
        extra = [k for k in value if k not in properties]
        if extra:
            return f"{path}: unexpected {', '.join(extra)}"
    for key, sub in properties.items():
        if key in value and (error := minimal_error(value[key], sub, f"{path}.{key}")):
            return error
    return None


def _array_error(value: list, schema: dict, path: str) -> str | None:
    if len(value) < schema.get("minItems", 0):
        return f"{path}: {len(value)} items < minItems {schema['minItems']}"
    if "maxItems" in schema and len(value) > schema["maxItems"]:
        return f"{path}: {len(value)} items > maxItems {schema['maxItems']}"
    items = schema.get("items")
    if isinstance(items, dict):
        for i, item in enumerate(value):
            if error := minimal_error(item, items, f"{path}[{i}]"):
                return error
    return None


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_type(value, name: str) -> bool:
    if name == "integer":
        return _is_number(value) and float(value).is_integer()
    if name == "number":
        return _is_number(value)
    return isinstance(value, TYPES.get(name, object))


def output_error(text: str, schema: dict, validator: str | None = None) -> str | None:
    """Why an output is not a JSON value that follows schema (not JSON, or the schema's first violation)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        return f"not JSON: {e.msg} at character {e.pos}"
    return schema_error(value, schema, validator)


def validity(texts: list[str], schemas: list[dict], validator: str | None = None) -> dict:
    """How many outputs parse as JSON and follow their schema; the first few failures, for a look."""
    validator = validator or validator_name()
    errors = [output_error(t, s, validator) for t, s in zip(texts, schemas)]
    parsed = sum(e is None or not e.startswith("not JSON") for e in errors)
    valid = sum(e is None for e in errors)
    return {"outputs": len(errors), "parsed": parsed, "valid": valid,
            "validity_rate": valid / len(errors) if errors else None, "validator": validator,
            "failures": [{"row": i, "error": e} for i, e in enumerate(errors) if e is not None][:5]}
