"""Pieces the streaming tool-call and reasoning parsers share: a tag watch that holds back what may
still become a tag, and the OpenAI stream deltas they produce.

Whitespace is the JSON set (space, tab, newline, carriage return) throughout.
"""
from __future__ import annotations

from engine.entrypoints.server.json_stream import WS


class TagWatch:
    """Scans text a character at a time for ``tag``, holding back a run of whitespace and a possible
    start of the tag after it.

    ``push(ch) -> (released, found)``: ``released`` is text that can no longer be part of the
    whitespace-and-tag run (it is the caller's to emit); ``found`` is true with the character that
    completes the tag, and ``held`` is then exactly the whitespace before the tag plus the tag. With
    ``strip_leading`` the whitespace before the first other character is dropped (never released).
    """

    def __init__(self, tag: str, strip_leading: bool = False):
        self.tag, self.held = tag, ""
        self._strip = strip_leading

    def push(self, ch: str) -> tuple[str, bool]:
        if self._strip:
            if ch in WS:
                return "", False
            self._strip = False
        held = self.held + ch
        cut = 0
        while not self.tag.startswith(held[cut:].lstrip(WS)):
            cut += 1
        self.held = held[cut:]
        return held[:cut], self.held.lstrip(WS) == self.tag


class Deltas:
    """The ``delta`` objects of OpenAI chat stream chunks, in order; adjacent text of one field, and
    adjacent argument fragments of one tool call, are merged (as the OpenAI SDK would concatenate
    them). ``take()`` returns those gathered since the last take."""

    def __init__(self):
        self._items: list[dict] = []

    def text(self, field: str, text: str) -> None:
        """``field``: ``content`` or ``reasoning_content``; empty text adds nothing."""
        if not text:
            return
        if self._items and set(self._items[-1]) == {field}:
            self._items[-1][field] += text
        else:
            self._items.append({field: text})

    def tool_call(self, index: int, call_id: str, name: str) -> None:
        """A tool call's first delta: its id and name, no arguments yet."""
        self._items.append({"tool_calls": [{"index": index, "id": call_id, "type": "function",
                                            "function": {"name": name, "arguments": ""}}]})

    def arguments(self, index: int, fragment: str) -> None:
        """The next fragment of tool call ``index``'s arguments; an empty one adds nothing."""
        if not fragment:
            return
        last = self._items[-1]["tool_calls"][0] if self._items and "tool_calls" in self._items[-1] else None
        if last is not None and last["index"] == index and "id" not in last:
            last["function"]["arguments"] += fragment
        else:
            self._items.append({"tool_calls": [{"index": index, "function": {"arguments": fragment}}]})

    def take(self) -> list[dict]:
        items, self._items = self._items, []
        return items
