"""A chat choice's output as the OpenAI API returns it: the reasoning split off first
(``--reasoning-parser``), then the tool calls read from what is left (``--tool-call-parser``),
whole (``message``) or as the text streams (``ChatStream``).

Without either parser the output is the message's ``content`` as generated. With a reasoning
parser the message gains ``reasoning_content``; with tool calls in it, ``tool_calls`` and the
finish reason ``tool_calls`` (a choice cut by ``max_tokens`` keeps ``length``). Streamed, the
deltas of a choice joined the way the OpenAI SDK joins them equal the whole message (the one
exception, a tool call broken after it was announced, is ``engine.server.tool_parsers``').
"""
from __future__ import annotations

from dataclasses import dataclass

from engine.server.reasoning import reasoning_parser
from engine.server.tool_parsers import tool_parser


@dataclass(frozen=True)
class ChatParsing:
    """How one chat request's output is read: the tool-call parser's name (None: the request's
    tools are not read, e.g. ``tool_choice: "none"``) and the reasoning parser's (None: none),
    with the rendered ``prompt`` (a reasoning template may open the block in the prompt)."""

    tools: str | None = None
    reasoning: str | None = None
    prompt: str = ""

    def message(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """The assistant message of a whole output, and its finish reason."""
        message: dict = {"role": "assistant", "content": text}
        if self.reasoning is not None:
            message["reasoning_content"], message["content"] = reasoning_parser(self.reasoning, self.prompt).extract(
                text)
        if self.tools is not None:
            message["content"], calls = tool_parser(self.tools).extract(message["content"] or "")
            if calls:
                message["tool_calls"] = [call.to_openai() for call in calls]
                finish_reason = _with_calls(finish_reason)
        return message, finish_reason

    def stream(self) -> ChatStream:
        return ChatStream(self)


def _with_calls(finish_reason: str | None) -> str | None:
    return "tool_calls" if finish_reason == "stop" else finish_reason


class ChatStream:
    """One choice's output as it streams: ``feed(text)`` with each new piece of text, ``finish(reason)``
    once it ends; each returns the chat ``delta`` objects to send, in order (``finish`` also the
    finish reason to send)."""

    def __init__(self, parsing: ChatParsing):
        self._reasoning = None if parsing.reasoning is None else reasoning_parser(parsing.reasoning,
                                                                                  parsing.prompt).stream()
        self._tools = None if parsing.tools is None else tool_parser(parsing.tools).stream()
        self._called = False

    def feed(self, text: str) -> list[dict]:
        if not text:
            return []
        return self._read(self._reasoning.feed(text) if self._reasoning else [{"content": text}])

    def finish(self, finish_reason: str | None) -> tuple[list[dict], str | None]:
        deltas = self._read(self._reasoning.finish()) if self._reasoning else []
        if self._tools is not None:
            deltas += self._note(self._tools.finish())
        return deltas, _with_calls(finish_reason) if self._called else finish_reason

    def _read(self, deltas: list[dict]) -> list[dict]:
        """Reasoning deltas as they are; content deltas through the tool-call parser."""
        if self._tools is None:
            return deltas
        out = []
        for delta in deltas:
            out += self._note(self._tools.feed(delta["content"])) if "content" in delta else [delta]
        return out

    def _note(self, deltas: list[dict]) -> list[dict]:
        self._called = self._called or any("tool_calls" in d for d in deltas)
        return deltas
