"""A reasoning model's output split into ``reasoning_content`` and ``content`` (``--reasoning-parser``):
``qwen3`` and ``deepseek_r1``, read whole (``extract``) or as it streams (``stream()``).

The reasoning is the text of a ``<think>`` ... ``</think>`` block at the start of the output;
the content is what follows ``</think>``. Whether the output starts inside the block is the one
difference between the two:

- ``qwen3``: only when the rendered prompt ends with ``<think>`` (Qwen3 thinking templates that
  open the block for the model, e.g. Qwen3-2507-Thinking); otherwise there is reasoning only if
  the output itself starts with ``<think>`` (after whitespace), and an output that does not is
  all content, ``</think>`` or not.
- ``deepseek_r1``: always (its template opens the block): everything before ``</think>`` is
  reasoning, with or without an opening tag.

A leading ``<think>`` (after whitespace) is dropped in both. Whitespace next to the tags, and at
the start of the reasoning, is dropped (as Qwen3's template strips it when it renders the turn
back). An output that ends inside the block (no ``</think>``: cut off by ``max_tokens``) is all
reasoning, content ``None``: the stream has sent it as reasoning by then and cannot take it back,
and the whole parse says the same. Tags after the block are content. Empty parts are ``None``.

The stream holds back whitespace and a possible start of the next tag and sends
``{"reasoning_content": ...}`` / ``{"content": ...}`` deltas; for any split of the output into
deltas, the joined deltas of each field equal ``extract``'s parts. Both are linear in the output:
the stream holds back at most a whitespace run plus ``len("</think>")`` characters, kept as pieces
(``engine.entrypoints.server.stream_text``), whatever the deltas' sizes.
"""
from __future__ import annotations

from engine.entrypoints.server.json_stream import WS
from engine.entrypoints.server.stream_text import Deltas, Reader, TagWatch, skip_ws

OPEN, CLOSE = "<think>", "</think>"


class ReasoningParser:
    """``starts_inside``: the output starts inside the reasoning block (see the module docstring)."""

    def __init__(self, starts_inside: bool):
        self.starts_inside = starts_inside

    def extract(self, text: str) -> tuple[str | None, str | None]:
        """``(reasoning, content)`` of a whole output."""
        body = text.lstrip(WS)
        if body.startswith(OPEN):
            body = body[len(OPEN):]
        elif not self.starts_inside:
            return None, text or None
        reasoning, closed, content = body.partition(CLOSE)
        if not closed:
            return reasoning.lstrip(WS) or None, None
        return reasoning.strip(WS) or None, content.lstrip(WS) or None

    def stream(self) -> ReasoningStream:
        return ReasoningStream(self.starts_inside)


class ReasoningStream(Reader):
    """One output read as it streams: ``feed(delta)`` and ``finish()`` return deltas. Modes:
    start (before the first other character: is there an opening tag?), reasoning, content.
    Linear in the output: content goes out a piece at a time, reasoning through a ``TagWatch``,
    and the start (whitespace and at most ``<think>``) is read again once when it is no tag."""

    def __init__(self, starts_inside: bool):
        super().__init__()
        self._starts_inside = starts_inside
        self._deltas = Deltas()
        self._mode, self._watch = "start", TagWatch(OPEN)
        self._strip = False  # content: drop whitespace until its first other character

    def feed(self, delta: str) -> list[dict]:
        self._run(delta)
        return self._deltas.take()

    def finish(self) -> list[dict]:
        if self._mode == "start":
            self._no_opening_tag(self._watch.held)
            self._run()
        if self._mode == "reasoning":
            self._deltas.text("reasoning_content", self._watch.held)
        return self._deltas.take()

    def _read(self, text: str, pos: int) -> int:
        if self._mode == "content":
            if self._strip:
                pos = skip_ws(text, pos)
                self._strip = pos == len(text)
            self._deltas.text("content", text[pos:])
            return len(text)
        released, end, found = self._watch.feed(text, pos, once=self._mode == "start")
        if self._mode == "start":
            if found:
                self._mode, self._watch = "reasoning", TagWatch(CLOSE, strip_leading=True)
            elif released:
                self._no_opening_tag(released + self._watch.held)
        else:
            self._deltas.text("reasoning_content", released)
            if found:
                self._mode, self._strip = "content", True
        return end

    def _no_opening_tag(self, start: str) -> None:
        """The output does not start with <think>: its ``start`` is read again as reasoning or content."""
        self._read_again(start)
        if self._starts_inside:
            self._mode, self._watch = "reasoning", TagWatch(CLOSE, strip_leading=True)
        else:
            self._mode, self._strip = "content", False


REASONING_PARSERS = ("qwen3", "deepseek_r1")


def reasoning_parser(name: str, prompt: str = "") -> ReasoningParser:
    """The parser ``--reasoning-parser name`` selects for one request whose rendered prompt is ``prompt``."""
    if name not in REASONING_PARSERS:
        raise ValueError(f"--reasoning-parser: unknown parser {name!r}; choose one of {', '.join(REASONING_PARSERS)}")
    return ReasoningParser(starts_inside=name == "deepseek_r1" or prompt.rstrip(WS).endswith(OPEN))
