"""Tool calls read out of a model's text (``--tool-call-parser``): ``hermes``, ``llama3_json``, ``none``.

A parser reads one request's output whole (``extract(text) -> (content, tool_calls)``) or as it
streams (``stream()``: an object whose ``feed(delta)`` and ``finish()`` return OpenAI chat stream
``delta`` objects). Model output never raises: what is not a well-formed call stays in the content.
A call's ``arguments`` are its JSON object as the model wrote it, less the whitespace between
tokens (``engine.entrypoints.server.call_object``). ``content`` is ``None`` when there is no content text.
A parser made for a request knows the names of its functions (``names``; ``None``: any name, for
text read outside a request): a call object naming another function is no call and stays content,
like a malformed block (vLLM's rule), whole and streamed; the stream knows the name before it
commits to a call, so it never announces one.

- ``hermes`` (Qwen2.5, Qwen3): ``<tool_call>`` + call object + ``</tool_call>`` blocks, anywhere
  in the text, the last one's closing tag optional at the end of the output. Whitespace right
  before and after a block is dropped; a block that is not a call leaves its ``<tool_call>`` tag
  in the content and the text after the tag is read on (it may hold a block).
- ``llama3_json`` (Llama 3.1 / 3.2 JSON tool calling): the whole output is calls: optional
  whitespace and ``<|python_tag|>``, then call objects separated by ``;``. What does not fit is
  content from where it stops fitting: the whole output when the first object is no call, else
  the text after the last call (its whitespace dropped), separator included.
- ``none``: everything is content.

Stream and whole parse agree, for any split of the text into deltas: the content deltas joined
are ``content`` (empty: ``None``), and per call, in index order, the first delta carries ``id``,
``type`` and ``name`` (``arguments: ""``), the next ones argument fragments whose concatenation is
``arguments``. The stream holds back what may still turn out to be part of a call (a possible
start of ``<tool_call>``, whitespace before it, a call object until its name is known and its
arguments have opened) and releases it as content when it cannot. The one exception: a call
object that breaks after it was announced (invalid JSON inside the arguments, the output cut
off inside them, text other than ``</tool_call>`` after a hermes block) cannot be taken back;
the stream ends that call there and reads on as text, while the whole parse leaves the block in
the content. A forced call (below) rules that out.

Cost: whole and streamed, linear in the text, however it is split into deltas. The stream holds
back at most a whitespace run plus the longest tag's length, or a call object until it commits
(``engine.entrypoints.server.stream_text``: held text as pieces, never re-sliced or re-stripped);
what it held is read again when it turns out to be no call (a character a bounded number of
times: a block's text can hold another block's tag only inside its name); a call object's
characters cost O(1) each (``CallScanner``).

Forced (``tool_parser(..., forced=True)``, ``ForcedCallParser``): with ``tool_choice`` required or
named the grammar has the model write exactly ``call_prefix`` + one call object + ``call_suffix``,
so the output is that call and never content (``content`` is always ``None``, and no content
delta is streamed). The call comes with its arguments as written so far once its name is complete,
also when ``max_tokens`` cut the output off inside it (its ``arguments`` are then not valid JSON;
the finish reason, ``length``, says so); an output cut before the name is complete has no call.
Stream and whole parse agree without exception (the stream announces the call with its name).

ids come from the parser's ``new_id`` (default ``random_call_id``), one per call in order, so a
stream and a whole parse given the same id source give the same ids.
"""
from __future__ import annotations

import secrets
import string
from collections.abc import Container
from dataclasses import dataclass
from typing import Callable

from engine.entrypoints.server.call_object import CallScanner, parse_call
from engine.entrypoints.server.json_stream import WS
from engine.entrypoints.server.stream_text import Deltas, Reader, TagWatch, skip_ws

_ALPHABET = string.ascii_letters + string.digits


def random_call_id() -> str:
    """``call_`` and 24 random letters and digits."""
    return "call_" + "".join(secrets.choice(_ALPHABET) for _ in range(24))


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object, compact

    def to_openai(self) -> dict:
        """The call as an item of an OpenAI message's ``tool_calls``."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


class _Stream(Reader):
    """What the format streams share: the text still to read (``Reader``), the deltas, and the
    call being read, announced once committed. A format defines ``_read(text, pos)`` (read some of
    ``text`` from ``pos``, return where it stopped) and ``finish()`` (the deltas for what it held
    back at the end of the output). A call object names one of ``names`` (``None``: any)."""

    def __init__(self, new_id: Callable[[], str], names: Container[str] | None):
        super().__init__()
        self._new_id, self._names = new_id, names
        self._deltas = Deltas()
        self._calls = 0                      # calls announced so far
        self._call: CallScanner | None = None

    def feed(self, delta: str) -> list[dict]:
        """The deltas that the next text of the output makes certain."""
        self._run(delta)
        return self._deltas.take()

    def _read_call(self, text: str, pos: int) -> tuple[int, bool]:
        """``text`` from ``pos`` into the current call until it is done, breaks or the text ends:
        where it stopped, and whether it broke (on ``text[end]``, which is not read)."""
        for end in range(pos, len(text)):
            if not self._push_call(text[end]):
                return end, True
            if self._call.done:
                return end + 1, False
        return len(text), False

    def _push_call(self, ch: str) -> bool:
        """``ch`` into the current call; announces it when it commits, emits its argument text.
        False when ``ch`` breaks it."""
        was_committed = self._call.committed
        fragment = self._call.push(ch)
        if fragment is None:
            return False
        if self._call.committed and not was_committed:
            self._deltas.tool_call(self._calls, self._new_id(), self._call.name)
            self._calls += 1
        self._deltas.arguments(self._calls - 1, fragment)
        return True


class HermesToolParser:
    """Qwen's ``<tool_call>`` blocks (module docstring)."""
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    # what tool_choice required / named has the model write: prefix + call object + suffix
    call_prefix, call_suffix, arguments_key = "<tool_call>\n", "\n</tool_call>", "arguments"

    def __init__(self, new_id: Callable[[], str] = random_call_id, names: Container[str] | None = None):
        self.new_id, self.names = new_id, names

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        content, calls, pos = [], [], 0
        while (start := text.find(self.OPEN, pos)) != -1:
            after_tag = start + len(self.OPEN)
            call = parse_call(text, after_tag, self.names)
            end = call and self._block_end(text, call[2])
            if end is None:  # no call: the tag is text
                content.append(text[pos:after_tag])
                pos = after_tag
                continue
            content.append(text[pos:start].rstrip(WS))
            calls.append(ToolCall(self.new_id(), call[0], call[1]))
            pos = skip_ws(text, end)
        content.append(text[pos:])
        return "".join(content) or None, calls

    def _block_end(self, text: str, pos: int) -> int | None:
        """Past the closing tag after the call object ending at ``pos`` (or the end of the text
        when only whitespace follows); ``None`` when something else follows."""
        after = skip_ws(text, pos)
        if text.startswith(self.CLOSE, after):
            return after + len(self.CLOSE)
        return len(text) if after == len(text) else None

    def stream(self) -> HermesStream:
        return HermesStream(self.new_id, self.names)


class HermesStream(_Stream):
    """The hermes format read as it streams. Modes: text (watching for ``<tool_call>``), call
    (inside the object), end (after it, watching for ``</tool_call>``)."""

    def __init__(self, new_id: Callable[[], str], names: Container[str] | None):
        super().__init__(new_id, names)
        self._to_text(strip=False)
        self._opening = ""            # the held whitespace and <tool_call> tag of the block being read
        self._raw: list[str] = []     # the block's text after its tag, until the call commits

    def _to_text(self, strip: bool) -> None:
        self._mode, self._watch = "text", TagWatch(HermesToolParser.OPEN, strip_leading=strip)

    def _read(self, text: str, pos: int) -> int:
        if self._mode == "text":
            released, end, found = self._watch.feed(text, pos)
            self._deltas.text("content", released)
            if found:
                self._mode, self._opening, self._raw = "call", self._watch.held, []
                self._call = CallScanner(self._names)
        elif self._mode == "call":
            end, broke = self._read_call(text, pos)
            if not self._call.committed:
                self._raw.append(text[pos:end])
            if broke:
                self._break()
            elif self._call.done:
                self._mode, self._watch = "end", TagWatch(HermesToolParser.CLOSE)
        else:
            released, end, found = self._watch.feed(text, pos, once=True)
            if found:
                self._to_text(strip=True)
            elif released:  # not the closing tag: the block is broken after its call was announced
                self._read_again(released + self._watch.held)
                self._to_text(strip=True)
        return end

    def _break(self) -> None:
        """The call object broke (on the next character to read, or at the end of the output): before
        it committed, its tag is content and the text after the tag is read again; after, the text
        reads on from that character."""
        if not self._call.committed:
            self._deltas.text("content", self._opening)
            self._read_again("".join(self._raw))
        self._to_text(strip=False)

    def finish(self) -> list[dict]:
        while (self._mode == "call" and not self._call.committed) or \
                (self._mode == "end" and self._watch.holds_tag_start):
            if self._mode == "call":
                self._break()
            else:  # a partial closing tag at the end
                self._read_again(self._watch.held)
                self._to_text(strip=True)
            self._run()
        if self._mode == "text":
            self._deltas.text("content", self._watch.held)
        return self._deltas.take()


class Llama3JsonToolParser:
    """Llama 3's JSON tool calls (module docstring)."""
    PYTHON_TAG = "<|python_tag|>"
    call_prefix, call_suffix, arguments_key = "", "", "parameters"

    def __init__(self, new_id: Callable[[], str] = random_call_id, names: Container[str] | None = None):
        self.new_id, self.names = new_id, names

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        calls, rest = [], 0  # rest: where the content starts
        pos = skip_ws(text, 0)
        if text.startswith(self.PYTHON_TAG, pos):
            pos = skip_ws(text, pos + len(self.PYTHON_TAG))
        while text.startswith("{", pos) and (call := parse_call(text, pos, self.names)) is not None:
            calls.append(ToolCall(self.new_id(), call[0], call[1]))
            rest = pos = skip_ws(text, call[2])
            if not text.startswith(";", pos):
                break
            pos = skip_ws(text, pos + 1)
        return text[rest:] or None, calls

    def stream(self) -> Llama3JsonStream:
        return Llama3JsonStream(self.new_id, self.names)


class Llama3JsonStream(_Stream):
    """The llama3_json format read as it streams. Modes: start (whitespace and the python tag),
    call, after (a call ended), separator (after ``;``), text (the rest is content). ``_held`` is
    the text since the last call (or the start) while it may still lead to a call, as pieces;
    ``_tag`` counts the python tag's characters read in the start mode."""

    def __init__(self, new_id: Callable[[], str], names: Container[str] | None):
        super().__init__(new_id, names)
        self._mode, self._held, self._tag = "start", [], 0

    def _read(self, text: str, pos: int) -> int:
        tag = Llama3JsonToolParser.PYTHON_TAG
        if self._mode == "text":
            self._deltas.text("content", text[pos:])
            return len(text)
        if self._mode == "call":
            end, broke = self._read_call(text, pos)
            if not self._call.committed:
                self._held.append(text[pos:end])
            if broke:  # the breaking character is content, and before the call committed what it held
                self._to_text("" if self._call.committed else "".join(self._held))
            elif self._call.done:
                self._mode, self._call, self._held = "after", None, []
            return end
        if self._mode == "after":
            end = skip_ws(text, pos)
            if end < len(text):
                if text[end] != ";":
                    self._to_text("")
                    return end
                self._mode, self._held, end = "separator", [";"], end + 1
            return end
        # start or separator: whitespace (in the start, around the python tag), then "{" opens a call
        between_tokens = self._mode == "separator" or self._tag in (0, len(tag))
        end = skip_ws(text, pos) if between_tokens else pos
        self._held.append(text[pos:end])
        if end == len(text):
            return end
        ch = text[end]
        if ch == "{" and between_tokens:
            self._mode, self._call = "call", CallScanner(self._names)
        elif self._mode == "start" and self._tag < len(tag) and ch == tag[self._tag]:
            self._tag += 1
            self._held.append(ch)
            end += 1
        else:  # no call: what was held and the rest are content
            self._to_text("".join(self._held))
        return end

    def _to_text(self, released: str) -> None:
        self._deltas.text("content", released)
        self._mode, self._held = "text", []

    def finish(self) -> list[dict]:
        if self._mode in ("start", "separator") or self._mode == "call" and not self._call.committed:
            self._to_text("".join(self._held))
        return self._deltas.take()


class NoToolParser:
    """``none``: the output is content."""
    call_prefix = call_suffix = arguments_key = None

    def __init__(self, new_id: Callable[[], str] = random_call_id, names: Container[str] | None = None):
        self.new_id, self.names = new_id, names

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        return text or None, []

    def stream(self) -> ContentStream:
        return ContentStream()


class ContentStream:
    """Every delta is content."""

    def __init__(self):
        self._deltas = Deltas()

    def feed(self, delta: str) -> list[dict]:
        self._deltas.text("content", delta)
        return self._deltas.take()

    def finish(self) -> list[dict]:
        return []


class ForcedCallParser:
    """The one call a forced tool choice has the model write, after ``prefix`` (the format's
    ``call_prefix``); never content (module docstring)."""

    def __init__(self, prefix: str, new_id: Callable[[], str] = random_call_id,
                 names: Container[str] | None = None):
        self.prefix, self.new_id, self.names = prefix, new_id, names

    def extract(self, text: str) -> tuple[None, list[ToolCall]]:
        stream = self.stream()
        stream.feed(text)
        return None, [] if stream.call is None else [stream.call]

    def stream(self) -> ForcedCallStream:
        return ForcedCallStream(self.prefix, self.new_id, self.names)


class ForcedCallStream:
    """The forced call read as it streams: the prefix's characters passed over, then the call
    object until it ends or breaks; the rest (the suffix) is not read. The call is announced when
    its name is complete; ``call`` is the call read so far (``None`` before its name)."""

    def __init__(self, prefix: str, new_id: Callable[[], str], names: Container[str] | None):
        self._prefix, self._new_id = prefix, new_id  # _prefix: what of it is still to come
        self._scanner, self._reading = CallScanner(names), True
        self._id: str | None = None
        self._name: str | None = None
        self._arguments: list[str] = []
        self._deltas = Deltas()

    @property
    def call(self) -> ToolCall | None:
        return None if self._id is None else ToolCall(self._id, self._name, "".join(self._arguments))

    def feed(self, delta: str) -> list[dict]:
        for ch in delta:
            if not self._reading:  # the rest (the suffix) is not read
                break
            self._step(ch)
        return self._deltas.take()

    def _step(self, ch: str) -> None:
        if self._prefix:
            if ch == self._prefix[0]:
                self._prefix = self._prefix[1:]
                return
            self._prefix = ""  # not what the grammar writes: read on as the call object
        if not self._reading:
            return
        fragment = self._scanner.push(ch)
        self._reading = fragment is not None and not self._scanner.done
        if fragment is None:
            return
        if self._id is None and self._scanner.name is not None:
            self._id, self._name = self._new_id(), self._scanner.name
            self._deltas.tool_call(0, self._id, self._name)
        self._arguments.append(fragment)
        self._deltas.arguments(0, fragment)

    def finish(self) -> list[dict]:
        return self._deltas.take()


TOOL_PARSERS = {"hermes": HermesToolParser, "llama3_json": Llama3JsonToolParser, "none": NoToolParser}


def tool_parser(name: str, new_id: Callable[[], str] = random_call_id, names: Container[str] | None = None,
                forced: bool = False):
    """The parser ``--tool-call-parser name`` selects, for one request: its ids from ``new_id``, its
    calls to the functions ``names`` (``None``: any name); ``forced``: the request's tool choice
    forces one call (``ForcedCallParser`` with the format's prefix)."""
    if name not in TOOL_PARSERS:
        raise ValueError(f"--tool-call-parser: unknown parser {name!r}; choose one of {', '.join(TOOL_PARSERS)}")
    parser = TOOL_PARSERS[name](new_id, names)
    if not forced:
        return parser
    if parser.call_prefix is None:
        raise ValueError(f"--tool-call-parser {name} reads no calls, so it cannot read a forced one")
    return ForcedCallParser(parser.call_prefix, new_id, names)


def default_tool_parser(architecture: str) -> str:
    """The parser for a checkpoint's ``architectures[0]``: Qwen families write hermes blocks, Llama
    writes JSON calls; others (Mistral's [TOOL_CALLS], DeepSeek's ``<｜tool▁calls▁begin｜>``
    format: not implemented) get ``none``."""
    if architecture.startswith("Qwen"):
        return "hermes"
    return "llama3_json" if architecture.startswith("Llama") else "none"
