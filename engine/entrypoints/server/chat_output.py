"""A chat choice's output as the OpenAI API returns it: the reasoning split off first
(``--reasoning-parser``), then the tool calls read from what is left (``--tool-call-parser``),
whole (``message``) or as the text streams (``ChatStream``).

Without either parser the output is the message's ``content`` as generated. With a reasoning
parser the message gains ``reasoning_content``; with tool calls in it, ``tool_calls`` and the
finish reason ``tool_calls`` (a choice cut by ``max_tokens`` keeps ``length``). The request's
tool fields shape what is read (``engine.entrypoints.server.tool_parsers``' module docstring has the rules):

- only calls of the request's functions are calls; a call object naming another stays content;
- ``parallel_tool_calls: false`` keeps the first call and drops the calls after it (neither calls
  nor content: vLLM's rule); the text around them is content as it would be without the option;
- a forced call (``tool_choice`` required or named) is read as the one call the grammar makes the
  model write: ``content`` is ``None`` and no content delta is streamed; an output cut off by
  ``max_tokens`` gives the call with its arguments written so far (not valid JSON) once its name
  is complete, and the finish reason ``length``.

Streamed, the deltas of a choice joined the way the OpenAI SDK joins them equal the whole message
(the one exception, a call that is not forced broken after it was announced, is
``engine.entrypoints.server.tool_parsers``'). Reading a choice, whole or streamed, costs time
linear in its text, whatever the sizes of the pieces it streams in (the parsers' contract).
"""
from __future__ import annotations

from dataclasses import dataclass

from engine.entrypoints.server.reasoning import reasoning_parser
from engine.entrypoints.server.tool_parsers import tool_parser


@dataclass(frozen=True)
class ChatParsing:
    """How one chat request's output is read: the tool-call parser's name (None: the request's
    tools are not read, e.g. ``tool_choice: "none"``) and the reasoning parser's (None: none),
    with the rendered ``prompt`` (a reasoning template may open the block in the prompt); the
    names of the request's functions (a call of no other is read: empty, none is), whether its
    tool choice forces a call (``required`` or a named function) and its ``parallel_tool_calls``."""

    tools: str | None = None
    reasoning: str | None = None
    prompt: str = ""
    tool_names: frozenset[str] = frozenset()
    forced: bool = False
    parallel_tool_calls: bool = True

    def _tool_parser(self):
        """The request's tool-call parser (``tools`` is not None)."""
        return tool_parser(self.tools, names=self.tool_names, forced=self.forced)

    def message(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """The assistant message of a whole output, and its finish reason."""
        message: dict = {"role": "assistant", "content": text}
        if self.reasoning is not None:
            message["reasoning_content"], message["content"] = reasoning_parser(self.reasoning, self.prompt).extract(
                text)
        if self.tools is not None:
            message["content"], calls = self._tool_parser().extract(message["content"] or "")
            if not self.parallel_tool_calls:
                calls = calls[:1]
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
        self._tools = None if parsing.tools is None else parsing._tool_parser().stream()
        self._calls = None if parsing.parallel_tool_calls else 1  # how many calls are sent (None: all)
        self._called = False

    def feed(self, text: str) -> list[dict]:
        if not text:
            return []
        return self._read(self._reasoning.feed(text) if self._reasoning else [{"content": text}])

    def finish(self, finish_reason: str | None) -> tuple[list[dict], str | None]:
        deltas = self._read(self._reasoning.finish()) if self._reasoning else []
        if self._tools is not None:
            deltas += self._kept(self._tools.finish())
        return deltas, _with_calls(finish_reason) if self._called else finish_reason

    def _read(self, deltas: list[dict]) -> list[dict]:
        """Reasoning deltas as they are; content deltas through the tool-call parser."""
        if self._tools is None:
            return deltas
        out = []
        for delta in deltas:
            out += self._kept(self._tools.feed(delta["content"])) if "content" in delta else [delta]
        return out

    def _kept(self, deltas: list[dict]) -> list[dict]:
        """The parser's deltas less those of the calls not sent (each call delta holds one call)."""
        if self._calls is not None:
            deltas = [d for d in deltas if "tool_calls" not in d or d["tool_calls"][0]["index"] < self._calls]
        self._called = self._called or any("tool_calls" in d for d in deltas)
        return deltas
