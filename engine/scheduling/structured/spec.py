"""A request's structured-output spec, read from OpenAI's ``response_format`` or vLLM's
``structured_outputs`` field of the request body.

A spec names what the output must match (``kind``) and holds it as canonical text (``value``);
``key`` identifies it for the compile cache. Parsing checks every field where the request enters,
so a bad spec is a :class:`StructuredOutputError` naming the field (a 400), never a failure in a
step; what only the grammar compiler can judge (regex and EBNF syntax, schema features xgrammar
does not support) fails at compile time with the same error type.
"""
from __future__ import annotations

import hashlib
import json
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import jsonschema_rs

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar", "tool_call")
_SCHEMA_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
_RESPONSE_FORMAT_KEYS = {"type", "json_schema"}
_JSON_SCHEMA_KEYS = {"name", "schema", "strict", "description"}
_STRUCTURED_OUTPUT_KEYS = ("json", "regex", "choice", "grammar")


class StructuredOutputError(ValueError):
    """A structured-output spec that cannot be honoured: ``param`` names the request field
    (``response_format.json_schema.schema``), the message says why."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class StructuredSpec:
    """What the output must match. ``value`` is canonical text: for ``json_schema`` the schema as
    compact JSON with its keys in the request's order (the order of ``properties`` is the order
    the output's keys take, so it is not sorted), for ``regex`` the pattern, for ``grammar`` the
    EBNF (root rule ``root``), for ``choice`` the JSON array of the allowed strings, for
    ``json_object`` "" (any JSON object), for ``tool_call`` the compact JSON object
    ``{"prefix", "schema", "suffix"}``: the prefix text, then JSON following the schema, then the
    suffix (a call a tool parser reads; :func:`tool_call_spec`). ``param`` is the request field it
    came from (for error messages; not part of equality, hash or ``key``)."""

    kind: str
    value: str
    param: str = field(default="", compare=False)

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"StructuredSpec.kind must be one of {KINDS}, got {self.kind!r}")

    @property
    def key(self) -> str:
        """sha256 hex digest of kind and value: equal specs, equal keys, across processes."""
        return hashlib.sha256(f"{self.kind}\0{self.value}".encode()).hexdigest()


def spec_from_request(body: dict) -> StructuredSpec | None:
    """The spec asked for by a request body's ``response_format`` or ``structured_outputs``
    (at most one of them), or None when neither constrains the output (absent, null, or
    ``response_format: {"type": "text"}``). Raises :class:`StructuredOutputError` naming the
    field: a wrong type, an unknown key, a schema the meta-schema refuses (``schema_problem``), an
    empty choice."""
    response_format, structured = body.get("response_format"), body.get("structured_outputs")
    if response_format is not None and structured is not None:
        raise StructuredOutputError("structured_outputs",
                                    "give either 'response_format' or 'structured_outputs', not both")
    if response_format is not None:
        return _from_response_format(response_format)
    if structured is not None:
        return _from_structured_outputs(structured)
    return None


def tool_call_spec(prefix: str, schema: dict, suffix: str, param: str = "tool_choice") -> StructuredSpec:
    """The spec of one tool call written as ``prefix`` + JSON following ``schema`` + ``suffix``
    (the JSON schema of the call object, ``engine.entrypoints.server.tools.call_schema``)."""
    return StructuredSpec("tool_call", json.dumps({"prefix": prefix, "schema": schema, "suffix": suffix},
                                                  ensure_ascii=False, separators=(",", ":")), param)


def _from_response_format(value: Any) -> StructuredSpec | None:
    param = "response_format"
    _check_keys(_object(value, param), _RESPONSE_FORMAT_KEYS, param)
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredSpec("json_object", "", param)
    if kind != "json_schema":
        raise StructuredOutputError(f"{param}.type", "'response_format.type' must be 'text', 'json_object' or "
                                                     f"'json_schema', got {json.dumps(kind)[:50]}")
    param = f"{param}.json_schema"
    spec = _check_keys(_object(value.get("json_schema"), param), _JSON_SCHEMA_KEYS, param)
    name = spec.get("name")
    if not isinstance(name, str) or not _SCHEMA_NAME.fullmatch(name):
        raise StructuredOutputError(f"{param}.name", f"'{param}.name' must be 1 to 64 letters, digits, '_' or "
                                                     f"'-', got {json.dumps(name)[:70]}")
    if "strict" in spec and spec["strict"] is not None and not isinstance(spec["strict"], bool):
        raise StructuredOutputError(f"{param}.strict", f"'{param}.strict' must be a boolean")
    if spec.get("description") is not None and not isinstance(spec["description"], str):
        raise StructuredOutputError(f"{param}.description", f"'{param}.description' must be a string")
    return _schema_spec(spec.get("schema"), f"{param}.schema")


def _from_structured_outputs(value: Any) -> StructuredSpec:
    param = "structured_outputs"
    _check_keys(_object(value, param), set(_STRUCTURED_OUTPUT_KEYS), param)
    given = [k for k in _STRUCTURED_OUTPUT_KEYS if value.get(k) is not None]
    if len(given) != 1:
        raise StructuredOutputError(param, f"'{param}' must give exactly one of {', '.join(_STRUCTURED_OUTPUT_KEYS)}"
                                           f"; got {', '.join(given) or 'none'}")
    key = given[0]
    param, item = f"{param}.{key}", value[key]
    if key == "json":
        if isinstance(item, str):
            try:
                item = json.loads(item)
            except RecursionError:
                raise StructuredOutputError(param, f"'{param}' nests deeper than {MAX_SCHEMA_DEPTH} levels") from None
            except ValueError as e:
                raise StructuredOutputError(param, f"'{param}' is a string that is not valid JSON: {e}") from None
        return _schema_spec(item, param)
    if key == "choice":
        if not isinstance(item, list) or not item or not all(isinstance(c, str) for c in item):
            raise StructuredOutputError(param, f"'{param}' must be a non-empty array of strings")
        return StructuredSpec("choice", json.dumps(item, ensure_ascii=False, separators=(",", ":")), param)
    if not isinstance(item, str) or not item:
        raise StructuredOutputError(param, f"'{param}' must be a non-empty string")
    return StructuredSpec("regex" if key == "regex" else "grammar", item, param)


def _schema_spec(schema: Any, param: str) -> StructuredSpec:
    """A ``json_schema`` spec of ``schema``, which must be a JSON object that is a valid
    JSON Schema (draft 2020-12 meta-schema), nests at most ``MAX_SCHEMA_DEPTH`` levels (checked
    iteratively before anything recurses into it) and has no ``patternProperties``: the grammar
    can match keys to a pattern but cannot keep them unique, so an answer could repeat a key."""
    if not isinstance(schema, dict):
        raise StructuredOutputError(param, f"'{param}' must be a JSON Schema object")
    if _depth(schema) > MAX_SCHEMA_DEPTH:
        raise StructuredOutputError(param, f"'{param}' nests deeper than {MAX_SCHEMA_DEPTH} levels")
    problem = schema_problem(schema)
    if problem is not None:
        raise StructuredOutputError(param, f"'{param}' is not a valid JSON Schema: {problem}")
    if any("patternProperties" in s for s in _subschemas(schema)):
        raise StructuredOutputError(param, f"'{param}' uses patternProperties, which this server cannot honour: "
                                           "the grammar cannot keep the keys it matches unique (list the "
                                           "properties, or use additionalProperties)")
    return StructuredSpec("json_schema", json.dumps(schema, ensure_ascii=False, separators=(",", ":")), param)


MAX_SCHEMA_DEPTH = 64  # JSON levels
SCHEMA_CACHE_SIZE = 4096  # distinct schemas whose check is remembered
_DATA_KEYWORDS = {"const", "enum", "default", "examples"}  # their values are instances, not schemas
_SCHEMA_MAPS = {"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"}  # name -> schema


def schema_problem(schema: dict) -> str | None:
    """What makes ``schema`` no JSON Schema (Draft 2020-12's meta-schema, checked by jsonschema-rs),
    clipped; None when it is one. Each distinct schema (by the hash of its canonical JSON) is
    checked once while it is among the last ``SCHEMA_CACHE_SIZE``: agents send the same tools with
    every turn. Thread-safe."""
    canonical = json.dumps(schema, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    digest = hashlib.sha256(canonical.encode()).digest()
    with _checked_lock:
        if digest in _checked:
            _checked.move_to_end(digest)
            return _checked[digest]
    try:
        jsonschema_rs.meta.validate(schema)
        problem = None
    except jsonschema_rs.ValidationError as e:
        where = "/".join(map(str, e.instance_path))[:100]
        problem = (f"at {where}: " if where else "") + e.message[:200]
    with _checked_lock:
        _checked[digest] = problem
        if len(_checked) > SCHEMA_CACHE_SIZE:
            _checked.popitem(last=False)
    return problem


_checked: OrderedDict[bytes, str | None] = OrderedDict()  # schema digest -> its problem, oldest first
_checked_lock = threading.Lock()


def _depth(value: Any) -> int:
    """How deep ``value`` nests (objects and arrays), found iteratively."""
    deepest, pending = 0, [(value, 1)]
    while pending:
        item, depth = pending.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, depth)
            pending.extend((v, depth + 1) for v in (item.values() if isinstance(item, dict) else item))
    return deepest


def _subschemas(schema: dict) -> list[dict]:
    """``schema`` and every schema inside it (not the instances of const / enum / default /
    examples, not the names of a properties map)."""
    found, pending = [], [schema]
    while pending:
        item = pending.pop()
        if isinstance(item, list):
            pending.extend(item)
        elif isinstance(item, dict):
            found.append(item)
            for key, value in item.items():
                if key in _SCHEMA_MAPS and isinstance(value, dict):
                    pending.extend(value.values())
                elif key not in _DATA_KEYWORDS:
                    pending.append(value)
    return found


def _object(value: Any, param: str) -> dict:
    if not isinstance(value, dict):
        raise StructuredOutputError(param, f"'{param}' must be an object")
    return value


def _check_keys(value: dict, known: set[str], param: str) -> dict:
    """``value``, unless it sets a key outside ``known`` (null or false, the defaults of vLLM's
    other options, count as not set)."""
    unknown = sorted(k for k in set(value) - known if value[k] is not None and value[k] is not False)
    if unknown:
        raise StructuredOutputError(f"{param}.{unknown[0]}", f"'{param}.{unknown[0]}' is not supported here "
                                                              f"(known: {', '.join(sorted(known))})")
    return value
