"""A chat output as the blocks the Responses API (output items) and Anthropic's Messages API
(content blocks) return: reasoning, text and tool calls in the order the model wrote them.

``BlockStream`` turns the chat deltas a ``ChatStream`` makes (``{"content"}``,
``{"reasoning_content"}``, ``{"tool_calls"}``) into block events: ``Opened(index, block)`` when a
block starts (a tool call with its id and name), ``Grew(index, text)`` for each piece of its text
(a call's: argument fragments), ``Closed(index, block)`` with the whole block when the next one
starts or the output ends. One block is open at a time; a change of kind, or a new tool call,
closes it. ``whole_blocks`` reads a whole output through the same stream, so an answer and its
stream always hold the same blocks; ``streamed_blocks`` feeds it a running generation's updates.
Both are linear in the output (the parsers are; a block's text is joined once, when read).
"""
from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

from engine.core.output_processor import RequestOutput
from engine.entrypoints.server.chat_output import ChatParsing
from engine.entrypoints.server.generation import Generation

KINDS = {"reasoning_content": "reasoning", "content": "text"}


class Block:
    """``kind``: "reasoning", "text" or "tool_call"; ``text``: its text so far (a call's arguments,
    JSON text); a tool call's ``call_id`` and ``name``. The text grows as pieces, joined when it is
    read, so growing it costs only the piece."""

    def __init__(self, kind: str, text: str = "", call_id: str = "", name: str = ""):
        self.kind, self.call_id, self.name = kind, call_id, name
        self._pieces = [text] if text else []

    @property
    def text(self) -> str:
        if len(self._pieces) > 1:
            self._pieces = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    def grow(self, text: str) -> None:
        self._pieces.append(text)

    def __repr__(self) -> str:
        return f"Block({self.kind!r}, {self.text!r}, call_id={self.call_id!r}, name={self.name!r})"


@dataclass(frozen=True)
class Opened:
    index: int
    block: Block


@dataclass(frozen=True)
class Grew:
    index: int
    text: str


@dataclass(frozen=True)
class Closed:
    index: int
    block: Block


class BlockStream:
    """Chat deltas in, block events out (module docstring)."""

    def __init__(self):
        self.blocks: list[Block] = []
        self._open: Block | None = None

    def feed(self, deltas: list[dict]) -> list[Opened | Grew | Closed]:
        events: list[Opened | Grew | Closed] = []
        for delta in deltas:
            for key, kind in KINDS.items():
                if delta.get(key):
                    if self._open is None or self._open.kind != kind:
                        self._start(Block(kind), events)
                    self._grow(delta[key], events)
            for call in delta.get("tool_calls") or []:
                if "id" in call:
                    self._start(Block("tool_call", call_id=call["id"], name=call["function"]["name"]), events)
                self._grow(call["function"].get("arguments", ""), events)
        return events

    def finish(self) -> list[Opened | Grew | Closed]:
        events: list[Opened | Grew | Closed] = []
        self._close(events)
        return events

    def _start(self, block: Block, events: list) -> None:
        self._close(events)
        self._open = block
        self.blocks.append(block)
        events.append(Opened(len(self.blocks) - 1, block))

    def _grow(self, text: str, events: list) -> None:
        if text:
            self._open.grow(text)
            events.append(Grew(len(self.blocks) - 1, text))

    def _close(self, events: list) -> None:
        if self._open is not None:
            events.append(Closed(len(self.blocks) - 1, self._open))
            self._open = None


def whole_blocks(parsing: ChatParsing | None, text: str, finish_reason: str | None) -> tuple[list[Block], str | None]:
    """The blocks of a whole output (``parsing`` None: the text as one text block) and its finish
    reason as the parsers give it ("tool_calls" when calls end it)."""
    if parsing is None:
        return ([Block("text", text)] if text else []), finish_reason
    chat, blocks = parsing.stream(), BlockStream()
    blocks.feed(chat.feed(text))
    deltas, finish_reason = chat.finish(finish_reason)
    blocks.feed(deltas)
    blocks.finish()
    return blocks.blocks, finish_reason


async def streamed_blocks(generation: Generation, blocks: BlockStream, tick: float | None) -> AsyncIterator[
        tuple[list[Opened | Grew | Closed], RequestOutput, str | None, int] | None]:
    """The one choice of ``generation`` fed through ``blocks`` as it runs: per engine update, its
    block events (the last update's close the open block), the update itself, the finish reason as
    the parsers give it ("tool_calls" when calls end it; None before the end) and the output tokens
    so far; with ``tick`` (seconds), None each time that long passed without an update (the
    stream's keep-alive is due). Raises ``APIError`` as ``Generation.updates`` does."""
    parsing = generation.gen.parsing
    chat, num_tokens = (parsing.stream() if parsing else None), 0
    async for item in generation.updates(tick):
        if item is None:
            yield None
            continue
        update = item[1]
        num_tokens += len(update.token_ids)
        deltas = chat.feed(update.text) if chat else [{"content": update.text}] if update.text else []
        finish_reason = update.finish_reason
        if update.finished and chat is not None:
            more, finish_reason = chat.finish(update.finish_reason)
            deltas += more
        yield blocks.feed(deltas) + (blocks.finish() if update.finished else []), update, finish_reason, num_tokens
