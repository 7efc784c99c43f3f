"""What every route reads from a request before its API's own rules: the body as a JSON object of
bounded size, depth and valid text (``parse_json``), its fields by type (``field``,
``bounded_int``), the caps on the lists a request may hold (``RequestLimits``), and the error a
client's fault becomes (``APIError``: a status, a message that never echoes a large input back,
the field it names).

A body is refused with a 400 naming the cause when it is not JSON (NaN and Infinity included), not
an object, nests deeper than ``MAX_JSON_DEPTH`` levels, or holds a string with a lone surrogate
(``"\\ud800"``: not text, no tokenizer can encode it); with a 415 when its ``Content-Type`` is set
and is not JSON (``curl -d`` without ``-H`` sends ``application/x-www-form-urlencoded``). A body
over ``RequestLimits.body_mib`` is a 413 before it is read (aiohttp's ``client_max_size``): Python
decodes JSON holding the interpreter lock (about 80 ms per MB of dense JSON, 2.5 s for 30 MB of
tools), which no thread can hide from the others, so the body's size is what bounds that pause.
The checks are linear in the body's size and run where the rest of the request's checks run:
off the event loop (``OpenAIServer.parse``).
"""
from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, fields
from typing import Any

MAX_JSON_DEPTH = 64  # a chat body with tool schemas nests ~20 deep; recursion in the checks starts near 1,000


class APIError(Exception):
    """A request the server answers with an error: ``status``, ``message``, the field it names
    (``param``) and a machine-readable ``code``. Each API renders it in its own error shape."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        """OpenAI's error object."""
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


def clipped(text: str, limit: int = 100) -> str:
    """``text`` cut to ``limit`` characters: an error never echoes a large input back."""
    return text if len(text) <= limit else text[:limit - 3] + "..."


def shown(value: Any, limit: int = 60) -> str:
    """``value`` as JSON for an error message, ``clipped`` to ``limit`` characters."""
    try:
        text = json.dumps(value, ensure_ascii=True)
    except (TypeError, ValueError):
        text = repr(value)
    return clipped(text, limit)


def unknown_field(name: str) -> APIError:
    """The 400 of a field no API served here has (its name cut to 64 characters)."""
    name = clipped(name, 64)
    return APIError(400, f"unknown field '{name}'", param=name)


def check_fields(body: dict, known: set[str], refused: dict[str, tuple], why: str = "") -> None:
    """The field policy of an API: every field of ``body`` is ``known`` (honoured or ignored), or
    one of ``refused`` asking for nothing (one of the values it lists), else a 400 naming it:
    "not supported" (and ``why``) for a refused one, "unknown field" for any other."""
    for name, value in body.items():
        if name in known:
            continue
        if name not in refused:
            raise unknown_field(name)
        if not any(value == v and type(value) is type(v) for v in refused[name]):
            raise APIError(400, f"'{name}' is not supported by this server{why}", param=name)


def check_content_type(content_type: str | None) -> None:
    """A body's ``Content-Type`` (None or "": not given, read as JSON) is JSON (``application/json``,
    ``application/*+json``); else a 415."""
    media = (content_type or "").split(";", 1)[0].strip().lower()
    if media and media != "application/json" and not (media.startswith("application/") and media.endswith("+json")):
        raise APIError(415, f"the request body must be JSON (Content-Type: application/json), got "
                            f"{shown(media, 80)}", code="unsupported_media_type")


def parse_json(raw: bytes) -> dict:
    """The request body as a JSON object; NaN and Infinity (not JSON), nesting past
    ``MAX_JSON_DEPTH`` and lone surrogates are refused (400)."""
    def refuse(constant: str):
        raise ValueError(f"{constant} is not a JSON number")

    try:
        body = json.loads(raw, parse_constant=refuse)
    except RecursionError:
        raise APIError(400, f"the request body nests deeper than {MAX_JSON_DEPTH} levels") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON: {shown(str(e), 200)}") from None
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    _check_values(body)
    return body


def _check_values(body: dict) -> None:
    """Depth and text of every value, iteratively (a deep body must not recurse here either)."""
    pending: list[tuple[Any, int]] = [(body, 1)]
    while pending:
        value, depth = pending.pop()
        if isinstance(value, str):
            _check_text(value)
            continue
        if not isinstance(value, (dict, list)):
            continue
        if depth > MAX_JSON_DEPTH:
            raise APIError(400, f"the request body nests deeper than {MAX_JSON_DEPTH} levels")
        if isinstance(value, dict):
            for key, item in value.items():
                _check_text(key)
                pending.append((item, depth + 1))
        else:
            pending.extend((item, depth + 1) for item in value)


def _check_text(text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise APIError(400, f"the request body holds a lone surrogate ({shown(e.object[e.start:e.end])}), "
                            "which is not text: send the character it is half of") from None


_TYPE_NAMES = {int: "an integer", float: "a number", bool: "a boolean", str: "a string", list: "an array",
               dict: "an object"}


def field(body: dict, name: str, kind: type, default: Any = None, param: str | None = None) -> Any:
    """``body[name]`` checked to be a ``kind`` (a float may be given as an int; a bool is never a
    number); ``default`` when absent or null; else a 400 naming the field (``param``, default ``name``)."""
    value = body.get(name)
    if value is None:
        return default
    types = (int, float) if kind is float else kind
    if not isinstance(value, types) or (kind is not bool and isinstance(value, bool)):
        param = param or name
        raise APIError(400, f"'{param}' must be {_TYPE_NAMES[kind]}, got {shown(value)}", param=param)
    return value


def bounded_int(body: dict, name: str, low: int, high: int, default: int | None,
                param: str | None = None) -> int | None:
    """``field(body, name, int)`` in ``[low, high]``, else a 400 naming the field."""
    value = field(body, name, int, default, param)
    if value is not None and not low <= value <= high:
        param = param or name
        raise APIError(400, f"'{param}' must be an integer in [{low}, {high}], got {value}", param=param)
    return value


@dataclass(frozen=True)
class RequestLimits:
    """The most items each list of a request may hold, checked where the request enters, before
    any work that grows with them; each is a ``serve`` flag (``--max-prompts`` ...). vLLM caps
    none of these; OpenAI caps tools at 128. Stop strings (16), stop token ids (64) and bad words
    (64) have the engine's own fixed caps (``engine.scheduling.sequence``), checked as early."""

    body_mib: int = 8         # MiB of a request body (a 413 past it): decoding 8 MiB of JSON holds the GIL < 1 s
    prompts: int = 256        # a /v1/completions prompt array (each prompt runs n choices)
    messages: int = 4096      # chat messages, Responses input items, Anthropic messages
    content_parts: int = 1024  # parts (text, tool results ...) of one message
    tools: int = 128          # OpenAI's own limit
    history_tool_calls: int = 4096  # assistant tool calls in a request's history, all together
    logit_bias: int = 1024    # logit_bias entries
    allowed_token_ids: int = 1 << 20

    HELP = {"body_mib": "MiB of a request body", "prompts": "prompts in one /v1/completions request",
            "messages": "messages (or input items) of a request",
            "content_parts": "content parts of one message", "tools": "tools of a request",
            "history_tool_calls": "assistant tool calls in a request's history",
            "logit_bias": "logit_bias entries of a request",
            "allowed_token_ids": "allowed_token_ids of a request"}

    def check(self, items: list, name: str, param: str) -> list:
        """``items`` (the request's field ``param``) unless it holds more than the cap ``name``: a
        400 naming the field and the cap."""
        cap = getattr(self, name)
        if len(items) > cap:
            raise APIError(400, f"'{param}' holds {len(items)} items; this server takes at most {cap} "
                                f"(serve --max-{name.replace('_', '-')})", param=param, code="too_many_items")
        return items

    @classmethod
    def add_cli_args(cls, group: argparse._ArgumentGroup) -> None:
        for f in fields(cls):
            group.add_argument(f"--max-{f.name.replace('_', '-')}", type=int, default=f.default, metavar="N",
                               help=f"the most {cls.HELP[f.name]} (default {f.default}; more is a "
                                    f"{413 if f.name == 'body_mib' else 400})")

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> RequestLimits:
        return cls(**{f.name: getattr(args, f"max_{f.name}") for f in fields(cls)})
