"""The JSON object a model writes for one tool call, read whole (``parse_call``) or a character at a
time (``CallScanner``); both take exactly the same texts.

The object is ``{"name": <string>, "arguments": <object>}`` in that order, ``"parameters"``
accepted for ``"arguments"`` (Llama 3), or ``{"name": <string>}`` for a call without arguments;
any other key, another key order, or arguments that are not an object (a JSON-encoded string, for
one) is not a call, and with ``names`` given (the request's functions) neither is an object
naming another function. Whitespace may stand between tokens. A call's arguments are the model's
JSON with the whitespace between tokens removed (``compact``): ``json.loads`` of them is the parsed
object, and the model's escapes and number spellings are kept, so the stream can send them as they
come. No arguments read as ``{}``.
"""
from __future__ import annotations

import json
import re
from collections.abc import Container

from engine.entrypoints.server.json_stream import WS, JsonScanner

_W = "[ \t\n\r]*"
_HEAD = re.compile(_W + r'\{' + _W + '"name"' + _W + ":" + _W)
_ARGUMENTS = re.compile(_W + r'(?:(\})|,' + _W + '"(?:arguments|parameters)"' + _W + ":" + _W + ")")
_CLOSE = re.compile(_W + r"\}")
_TOKENS = re.compile(r'("(?:[^"\\]|\\.)*")|[ \t\n\r]+')


def _refuse(constant: str):
    raise ValueError(f"{constant} is not JSON")


# numbers stay text: their values are not needed, and huge integers would hit int()'s digit limit
_DECODER = json.JSONDecoder(parse_int=str, parse_float=str, parse_constant=_refuse)


def compact(json_text: str) -> str:
    """Valid JSON text with the whitespace between its tokens removed."""
    return _TOKENS.sub(lambda m: m.group(1) or "", json_text)


def parse_call(text: str, pos: int, names: Container[str] | None = None) -> tuple[str, str, int] | None:
    """The call object at ``text[pos:]`` (after optional whitespace) as ``(name, arguments, end)``,
    ``end`` just past its closing brace; ``None`` when there is none there (or its name is not in
    ``names``; ``None``: any name)."""
    head = _HEAD.match(text, pos)
    if head is None or not text.startswith('"', head.end()):  # the name is a string (numbers decode to str here)
        return None
    try:
        name, end = _DECODER.raw_decode(text, head.end())
        if names is not None and name not in names:
            return None
        if (sep := _ARGUMENTS.match(text, end)) is None:
            return None
        if sep.group(1):
            return name, "{}", sep.end()
        arguments, end = _DECODER.raw_decode(text, sep.end())
    except ValueError:
        return None
    close = _CLOSE.match(text, end)
    if not isinstance(arguments, dict) or close is None:
        return None
    return name, compact(text[sep.end():end]), close.end()


# the object's tokens in order: literal alternatives, or "name" / "arguments" for a JSON value
_GRAMMAR = (("{",), ('"name"',), (":",), "name", ("}", ","), ('"arguments"', '"parameters"'), (":",), "arguments",
            ("}",))
_AFTER_NAME = _GRAMMAR.index(("}", ","))


class CallScanner:
    """A call object fed a character at a time (leading whitespace allowed), its name one of
    ``names`` (``None``: any).

    ``push(ch)`` returns ``None`` when ``ch`` cannot continue a call object (the scanner is then
    spent; a name not in ``names`` breaks it with its closing quote), else the text ``ch`` adds to
    the arguments (``""`` for the object's own structure).
    ``committed`` turns true when the name is known and the text is a call whatever follows: with
    the arguments' opening brace, or with the closing brace of a call without arguments (whose
    push returns ``"{}"``). ``done`` turns true with the object's closing brace. ``name`` is set
    with the name's closing quote. Each character costs O(1) (the object's literal tokens are a
    few characters; the name is gathered as a list and joined once).
    """

    def __init__(self, names: Container[str] | None = None):
        self.name: str | None = None
        self._names = names
        self.committed = self.done = False
        self._at = 0                          # index into _GRAMMAR
        self._literal = ""                    # the current literal token's characters so far
        self._value: JsonScanner | None = None
        self._name_text: list[str] = []       # the name's JSON string, a character at a time

    def push(self, ch: str) -> str | None:
        token = _GRAMMAR[self._at]
        if isinstance(token, str):
            return self._push_value(token, ch)
        if not self._literal and ch in WS:
            return ""
        self._literal += ch
        if not any(t.startswith(self._literal) for t in token):
            return None
        if self._literal not in token:
            return ""
        closing, self._literal = self._literal == "}", ""
        self._at += 1
        if not closing:
            return ""
        self.done = self.committed = True
        return "{}" if self._at == _AFTER_NAME + 1 else ""

    def _push_value(self, token: str, ch: str) -> str | None:
        if self._value is None:
            if ch in WS:
                return ""
            self._value = JsonScanner('"' if token == "name" else "{")
        kept = self._value.push(ch)
        if kept is None:
            return None
        if token == "name":
            self._name_text.append(kept)
        else:
            self.committed = True
        if self._value.done:
            if token == "name":
                name = json.loads("".join(self._name_text))
                if self._names is not None and name not in self._names:
                    return None
                self.name = name
            self._value, self._at = None, self._at + 1
        return kept if token == "arguments" else ""
