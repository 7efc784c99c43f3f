"""Pieces the streaming tool-call and reasoning parsers share: a tag watch that holds back what may
still become a tag, a reader of text pieces that may push text back to be read again, and the
OpenAI stream deltas they produce.

Whitespace is the JSON set (space, tab, newline, carriage return) throughout.

Cost: everything here is linear in the text read. A run of text that cannot start a tag is passed
on as one slice, held whitespace is kept as the pieces it came in (never re-sliced or stripped),
a held start of a tag is at most the tag's length, and delta texts are gathered as pieces and
joined once, when they are taken.
"""
from __future__ import annotations

import re
from collections import deque

from engine.entrypoints.server.json_stream import WS

WS_RUN = re.compile("[ \t\n\r]+")


def skip_ws(text: str, pos: int) -> int:
    """The index of the first character at or after ``pos`` that is not whitespace (or ``len(text)``)."""
    run = WS_RUN.match(text, pos)
    return pos if run is None else run.end()


class TagWatch:
    """Scans text for ``tag`` (no whitespace in it), holding back a run of whitespace and a possible
    start of the tag after it.

    ``feed(text, pos) -> (released, end, found)`` reads ``text`` from ``pos``: ``released`` is text
    that can no longer be part of the whitespace-and-tag run (it is the caller's to emit). Reading
    stops just past the tag (``found``; ``held`` is then exactly the whitespace before the tag plus
    the tag), with ``once`` just past the first character that releases text, else at the end of
    ``text``; ``end`` is where it stopped. With ``strip_leading`` the whitespace before the first
    other character is dropped (never released). What is held is at most the whitespace run plus
    ``len(tag)`` characters; a character costs O(1), one after a held start of the tag at most
    O(``len(tag)``²).
    """

    def __init__(self, tag: str, strip_leading: bool = False):
        assert tag and not any(c in WS for c in tag), tag
        self.tag = tag
        self._strip = strip_leading
        self._space: list[str] = []  # the held whitespace, as the pieces it came in
        self._start = ""             # the held start of the tag after it (a proper prefix of the tag)
        self._stop = re.compile("[" + re.escape(WS + tag[0]) + "]")  # where a held run may begin

    @property
    def held(self) -> str:
        return "".join(self._space) + self._start

    @property
    def holds_tag_start(self) -> bool:
        """Something other than whitespace is held (a start of the tag)."""
        return bool(self._start)

    def feed(self, text: str, pos: int = 0, once: bool = False) -> tuple[str, int, bool]:
        out: list[str] = []
        if self._strip:
            pos = skip_ws(text, pos)
            if pos == len(text):
                return "", pos, False
            self._strip = False
        while pos < len(text):
            if self._start:
                pos += 1
                if self._extend(text[pos - 1], out):
                    return "".join(out), pos, True
            elif (run := WS_RUN.match(text, pos)) is not None:
                self._space.append(run.group())
                pos = run.end()
                continue
            elif text[pos] == self.tag[0]:
                self._start, pos = text[pos], pos + 1
                if self._start == self.tag:
                    return "".join(out), pos, True
                continue
            else:  # a character that neither is whitespace nor starts the tag: the run is released
                out += self._space
                self._space, end = [], pos + 1
                if not once:  # with the text up to what may begin a run again
                    stop = self._stop.search(text, end)
                    end = stop.start() if stop else len(text)
                out.append(text[pos:end])
                pos = end
            if once and out:
                break
        return "".join(out), pos, False

    def _extend(self, ch: str, out: list[str]) -> bool:
        """``ch`` after the held start of the tag; True when it completes the tag. Otherwise what can
        no longer start the tag goes to ``out``: the whitespace and the shortest prefix of the held
        start plus ``ch`` after which the rest is whitespace and a start of the tag."""
        start = self._start + ch
        if self.tag.startswith(start):
            self._start = start
            return start == self.tag
        out += self._space
        cut = 1
        while not self.tag.startswith(start[cut:].lstrip(WS)):  # at most len(tag) short strings
            cut += 1
        out.append(start[:cut])
        rest = start[cut:]
        self._start = rest.lstrip(WS)
        self._space = [rest[:len(rest) - len(self._start)]] if len(rest) > len(self._start) else []
        return False


class Reader:
    """Text read in pieces, as it streams: ``_read(text, pos)`` (a format's) reads some of ``text``
    from ``pos`` and returns where it stopped; ``_read_again(text)`` pushes text back, to be read
    before the rest. Pieces are read as (text, position) pairs, never re-sliced, so reading text
    again costs only that text."""

    def __init__(self):
        self._pending: deque[tuple[str, int]] = deque()
        self._again: list[str] = []

    def _read(self, text: str, pos: int) -> int:
        raise NotImplementedError

    def _read_again(self, text: str) -> None:
        self._again.append(text)

    def _run(self, text: str = "") -> None:
        """Read ``text`` after what is pending, until all is read."""
        self._pending.append((text, 0))
        while self._pending or self._again:
            while self._again:
                self._pending.appendleft((self._again.pop(), 0))
            text, pos = self._pending.popleft()
            while pos < len(text) and not self._again:
                pos = self._read(text, pos)
            if self._again:
                self._pending.appendleft((text, pos))


class Deltas:
    """The ``delta`` objects of OpenAI chat stream chunks, in order; adjacent text of one field, and
    adjacent argument fragments of one tool call, are merged (as the OpenAI SDK would concatenate
    them). ``take()`` returns those gathered since the last take. The texts of the last delta are
    gathered as pieces and joined once, by ``take()``."""

    def __init__(self):
        self._items: list[dict] = []
        self._last: str | int | None = None  # what the last delta may still grow by: a field, a call's index
        self._pieces: list[str] = []          # its text, not yet joined

    def text(self, field: str, text: str) -> None:
        """``field``: ``content`` or ``reasoning_content``; empty text adds nothing."""
        if not text:
            return
        if self._last != field:
            self._close()
            self._items.append({field: ""})
            self._last = field
        self._pieces.append(text)

    def tool_call(self, index: int, call_id: str, name: str) -> None:
        """A tool call's first delta: its id and name, no arguments yet."""
        self._close()
        self._items.append({"tool_calls": [{"index": index, "id": call_id, "type": "function",
                                            "function": {"name": name, "arguments": ""}}]})

    def arguments(self, index: int, fragment: str) -> None:
        """The next fragment of tool call ``index``'s arguments; an empty one adds nothing."""
        if not fragment:
            return
        if self._last != index:
            self._close()
            self._items.append({"tool_calls": [{"index": index, "function": {"arguments": ""}}]})
            self._last = index
        self._pieces.append(fragment)

    def _close(self) -> None:
        """The last delta's text joined: it grows no more."""
        if self._pieces:
            last = self._items[-1]
            if isinstance(self._last, str):
                last[self._last] = "".join(self._pieces)
            else:
                last["tool_calls"][0]["function"]["arguments"] = "".join(self._pieces)
        self._last, self._pieces = None, []

    def take(self) -> list[dict]:
        self._close()
        items, self._items = self._items, []
        return items
