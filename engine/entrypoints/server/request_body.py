"""What every route reads from a request before its API's own rules: the body as a JSON object of
bounded size, depth and valid text (``parse_json``), the caps on what a request may hold
(``RequestLimits``), the error a client's fault becomes (``APIError``: a status, a message that
never echoes a large input back, the field it names), and the signal that stops a request's
reading once its client has gone (``stop_if_client_gone``). Each API's fields are typed by its
request models (``request_model``).

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
import threading
from contextvars import ContextVar
from dataclasses import dataclass, fields
from typing import Any

MAX_JSON_DEPTH = 64  # a chat body with tool schemas nests ~20 deep; recursion in the checks starts near 1,000


class APIError(Exception):
    """A request the server answers with an error: ``status``, ``message``, the field it names
    (``param``) and a machine-readable ``code``. Each API renders it in its own error shape."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def __reduce__(self):  # whole across processes, subclasses too (engine.entrypoints.server.request_processes)
        return _rebuilt_error, (type(self), self.__dict__)

    def body(self) -> dict:
        """OpenAI's error object."""
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


def _rebuilt_error(cls: type[APIError], state: dict) -> APIError:
    error = Exception.__new__(cls)
    Exception.__init__(error, state["message"])
    error.__dict__.update(state)
    return error


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


class ClientGone(Exception):
    """The client of the request being read has gone: its work stops here."""


client_gone: ContextVar[threading.Event | None] = ContextVar("client_gone", default=None)


def stop_if_client_gone() -> None:
    """Between the costly stages of reading a request (schema checks, rendering, tokenizing):
    raise ``ClientGone`` once the request's client has gone (``client_gone``, set by the server
    around each request's reading), so no worker keeps paying for an answer nobody reads."""
    gone = client_gone.get()
    if gone is not None and gone.is_set():
        raise ClientGone()


@dataclass(frozen=True)
class RequestLimits:
    """The most items each list of a request may hold, checked where the request enters, before
    any work that grows with them, and the most sequences (prompts x n) one request may run; each
    is a ``serve`` flag (``--max-prompts`` ...). vLLM caps none of these; OpenAI caps tools at 128.
    Stop strings (16), stop token ids (64) and bad words (64) have the engine's own fixed caps
    (``engine.scheduling.sequence``), checked as early."""

    body_mib: int = 8         # MiB of a request body (a 413 past it): decoding 8 MiB of JSON holds the GIL < 1 s
    prompts: int = 256        # a /v1/completions prompt array (each prompt runs n choices)
    messages: int = 4096      # chat messages, Responses input items, Anthropic messages
    content_parts: int = 1024  # parts (text, tool results ...) of one message
    tools: int = 128          # OpenAI's own limit
    history_tool_calls: int = 4096  # assistant tool calls in a request's history, all together
    logit_bias: int = 1024    # logit_bias entries
    allowed_token_ids: int = 1 << 20
    sequences_per_request: int | None = None  # prompts x n of one request (None: 4 x the engine's max_num_seqs)

    HELP = {"body_mib": "MiB of a request body", "prompts": "prompts in one /v1/completions request",
            "messages": "messages (or input items) of a request",
            "content_parts": "content parts of one message", "tools": "tools of a request",
            "history_tool_calls": "assistant tool calls in a request's history",
            "logit_bias": "logit_bias entries of a request",
            "allowed_token_ids": "allowed_token_ids of a request",
            "sequences_per_request": "sequences (prompts x n) one request may run"}

    @classmethod
    def add_cli_args(cls, group: argparse._ArgumentGroup) -> None:
        for f in fields(cls):
            default = "4 x --max-num-seqs" if f.default is None else f.default
            group.add_argument(f"--max-{f.name.replace('_', '-')}", type=int, default=f.default, metavar="N",
                               help=f"the most {cls.HELP[f.name]} (default {default}; more is a "
                                    f"{413 if f.name == 'body_mib' else 400})")

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> RequestLimits:
        return cls(**{f.name: getattr(args, f"max_{f.name}") for f in fields(cls)})
