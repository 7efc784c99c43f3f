"""Anthropic's Messages API: ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``, as the
anthropic SDK and Claude Code call them.

A request arrives typed (``anthropic_types.MessagesRequest``) and is read as the chat request it
amounts to (``chat_body``), which takes the chat path to the engine; every error of that reading
names the client's own field (``stop_sequences``, ``messages[2].content[1].input``,
``tools[0].input_schema``), and every answer of these routes that is an error, a 500 included,
is Anthropic's error object. Only its shapes are its own:

- ``system``: a string or text blocks; ``messages``: ``user`` / ``assistant`` turns whose content
  is a string or blocks: ``text``, ``tool_use`` (``id``, ``name``, ``input``: the assistant's
  calls), ``tool_result`` (``tool_use_id``, ``content`` a string or text blocks, ``is_error``)
  and ``thinking`` / ``redacted_thinking`` (sent back by clients; dropped, as templates drop past
  reasoning). ``cache_control`` on any block or tool is accepted and ignored (prefix caching is
  automatic). A ``system`` turn may stand anywhere in ``messages`` (a string or text blocks;
  Claude Code sends them): rendered where it stands, or, where the chat template renders no
  system turn but a first one (``renders_system_anywhere``), its text folded into the next user
  turn (else the last one before it).
- ``tools``: ``{"name", "description", "input_schema"}``; ``tool_choice`` ``auto`` / ``any`` /
  ``tool`` (``name``) / ``none``, ``any`` and ``tool`` forced through the grammar path,
  ``disable_parallel_tool_use`` as ``parallel_tool_calls: false``; ``stop_sequences``,
  ``temperature``, ``top_p``, ``top_k``, ``max_tokens`` (required); ``thinking`` ``enabled`` /
  ``disabled`` sets the template's ``enable_thinking`` where it reads it.
- The answer's ``content``: ``thinking`` (with a reasoning parser), ``text`` and ``tool_use``
  blocks in the order written (``engine.entrypoints.server.output_blocks``; a call's ``input`` is its
  arguments parsed, ``{}`` for a call cut off by max_tokens); ``stop_reason`` ``end_turn``,
  ``max_tokens``, ``stop_sequence`` (with ``stop_sequence``) or ``tool_use``; ``usage``.
- ``stream: true``: ``message_start``, ``ping``, per block ``content_block_start``,
  ``content_block_delta`` (``text_delta``, ``thinking_delta``, ``input_json_delta``),
  ``content_block_stop``; then ``message_delta`` (stop reason, output tokens) and
  ``message_stop``; a failure mid-stream is an ``error`` event. A ``ping`` also goes out each
  time the server's keep-alive interval passes with no token (queued, or prefilling a long
  prompt), so a client's stream watchdogs (Claude Code's: 180 s without a byte, 300 s without an
  event) wait.
- A prompt the context cannot hold is a 400 in Anthropic's words, which Claude Code acts on:
  "prompt is too long: N tokens > M maximum" (it compacts the conversation) and "input length
  and `max_tokens` exceed context limit: N + T > C, ..." (it lowers ``max_tokens``).

The API key may come as ``x-api-key`` (``engine.entrypoints.server.access``); ``anthropic-version`` and
``anthropic-beta`` headers are accepted.
"""
from __future__ import annotations

import functools
import json
import uuid
from typing import Any

from aiohttp import web

from engine.entrypoints.server.access import anthropic_error
from engine.entrypoints.server.anthropic_types import (
    EFFORTS,
    MessagesRequest,
    TextBlock,
    Tool,
    ToolChoice,
    ToolResultBlock,
    ToolUseBlock,
)
from engine.entrypoints.server.generation import Generation, sse_response
from engine.entrypoints.server.openai_types import ChatRequest
from engine.entrypoints.server.output_blocks import (
    Block,
    BlockStream,
    Closed,
    Grew,
    Opened,
    streamed_blocks,
    whole_blocks,
)
from engine.entrypoints.server.protocol import ContextLengthExceeded, GenerationRequest, OpenAIProtocol, usage
from engine.entrypoints.server.request_body import APIError
from engine.entrypoints.server.request_model import PathMap, validated

THINKING = {"enabled": True, "adaptive": True, "between_tools": True, "disabled": False}  # -> enable_thinking
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
PROBE_TEXT = "mid-conversation system text"
# a conversation whose second system turn shows in its rendering where a template renders one anywhere
PROBE = [{"role": "system", "content": "first system text"}, {"role": "user", "content": "a question"},
         {"role": "system", "content": PROBE_TEXT}, {"role": "user", "content": "another question"}]


@functools.lru_cache(maxsize=8)
def renders_system_anywhere(tokenizer, chat_template: str | None) -> bool:
    """Whether the chat template (``chat_template``, else ``tokenizer``'s) renders a system turn
    that is not the first where it stands: the probe conversation's second system text shows in
    its rendering. A template that raises on one (as Mistral's and Gemma's do), drops it, or
    cannot render the probe at all: False. Asked once per template."""
    try:
        text = tokenizer.apply_chat_template(PROBE, chat_template=chat_template, add_generation_prompt=True,
                                             tokenize=False)
    except Exception:  # jinja2's errors, a template's raise_exception, no template
        return False
    return isinstance(text, str) and PROBE_TEXT in text


def chat_body(req: MessagesRequest, template: Any, system_anywhere: bool) -> tuple[dict, PathMap]:
    """The chat completions body a Messages request amounts to (``template``: the chat template, to
    know whether it reads ``enable_thinking``; ``system_anywhere``: whether it renders a system
    turn that is not first, else such turns are folded into user turns), and where each of its
    fields came from in the client's request."""
    paths = PathMap()
    chat: dict[str, Any] = {k: getattr(req, k) for k in ("model", "temperature", "top_p", "top_k", "stream",
                                                         "max_tokens") if getattr(req, k) is not None}
    chat["messages"] = _messages(req, paths, system_anywhere)
    if req.stop_sequences is not None:
        chat["stop"] = req.stop_sequences
        paths.add("stop", "stop_sequences")
    if req.tools is not None:
        chat["tools"] = [_tool(t) for t in req.tools]
        for i in range(len(req.tools)):
            paths.add(f"tools[{i}].function.parameters", f"tools[{i}].input_schema")
            paths.add(f"tools[{i}].function", f"tools[{i}]")
    if req.tool_choice is not None:
        chat.update(_tool_choice(req.tool_choice))
        paths.add("tool_choice.function", "tool_choice")
        paths.add("parallel_tool_calls", "tool_choice.disable_parallel_tool_use")
    if req.thinking is not None and isinstance(template, str) and "enable_thinking" in template:
        chat["chat_template_kwargs"] = {"enable_thinking": THINKING[req.thinking.type]}
        paths.add("chat_template_kwargs", "thinking")
    config = req.output_config
    if config is not None and config.effort is not None:
        chat["reasoning_effort"] = EFFORTS[config.effort]
        paths.add("reasoning_effort", "output_config.effort")
    fmt, where = (config.format, "output_config.format") if config is not None and config.format is not None else (
        req.output_format, "output_format")
    if fmt is not None:
        chat["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt.schema_}}
        paths.add("response_format.json_schema.schema", f"{where}.schema")
        paths.add("response_format", where)
    return chat, paths


def _messages(req: MessagesRequest, paths: PathMap, system_anywhere: bool) -> list[dict]:
    """``system`` and the turns as chat messages: a turn's tool results each a tool message
    before its text, its text one message, its calls on the assistant's; a system turn where it
    stands, or (not ``system_anywhere``, and not first) its text folded into the next user turn,
    else into the last one."""
    chat: list[dict] = []
    held: list[str] = []  # system text not yet folded into a user turn

    def add(message: dict, sent: str) -> None:
        if held and message["role"] == "user":
            message = {**message, "content": "\n\n".join([*held, message["content"]])}
            held.clear()
        paths.add(f"messages[{len(chat)}]", sent)
        chat.append(message)

    if req.system:
        add({"role": "system", "content": _text(req.system)}, "system")
    paths.add("messages", "messages")
    for i, m in enumerate(req.messages):
        where = f"messages[{i}]"
        if m.role == "system":
            text = _system_text(m.content, where)
            if chat and not system_anywhere:
                held.append(text)
            else:
                add({"role": "system", "content": text}, where)
            continue
        if isinstance(m.content, str):
            add({"role": m.role, "content": m.content}, where)
            continue
        texts, calls = [], []
        for j, block in enumerate(m.content):
            at = f"{where}.content[{j}]"
            if isinstance(block, ToolUseBlock):
                if m.role != "assistant":
                    raise APIError(400, f"'{at}.type' tool_use blocks belong to assistant turns", param=f"{at}.type")
                paths.add(f"messages[{len(chat)}].tool_calls[{len(calls)}].function.arguments", f"{at}.input")
                paths.add(f"messages[{len(chat)}].tool_calls[{len(calls)}].function", at)
                paths.add(f"messages[{len(chat)}].tool_calls[{len(calls)}].id", f"{at}.id")
                calls.append({"id": block.id, "type": "function", "function": {
                    "name": block.name, "arguments": json.dumps(block.input, ensure_ascii=False)}})
            elif isinstance(block, ToolResultBlock):
                if m.role != "user":
                    raise APIError(400, f"'{at}.type' tool_result blocks belong to user turns", param=f"{at}.type")
                paths.add(f"messages[{len(chat)}].tool_call_id", f"{at}.tool_use_id")
                add({"role": "tool", "tool_call_id": block.tool_use_id, "content": _text(block.content)}, at)
            elif isinstance(block, TextBlock):
                texts.append(block.text)
        if calls or texts:
            add({"role": m.role, "content": "".join(texts) or None, "tool_calls": calls} if calls
                else {"role": m.role, "content": "".join(texts)}, where)
    if held:  # no user turn after them: the last one before takes them
        last = next((m for m in reversed(chat) if m["role"] == "user"), None)
        if last is None:
            add({"role": "system", "content": "\n\n".join(held)}, "messages")
        else:
            last["content"] = "\n\n".join([last["content"], *held])
    return chat


def _system_text(content: Any, where: str) -> str:
    """A system turn's content: a string, or text blocks joined (a 400 naming any other block)."""
    if isinstance(content, str):
        return content
    for j, block in enumerate(content):
        if not isinstance(block, TextBlock):
            raise APIError(400, f"'{where}.content[{j}].type' a system turn holds text blocks only",
                           param=f"{where}.content[{j}].type")
    return _text(content)


def _text(content: str | list[TextBlock]) -> str:
    """A string, or text blocks joined."""
    return content if isinstance(content, str) else "".join(b.text for b in content)


def _tool(tool: Tool) -> dict:
    function = {"name": tool.name, "parameters": tool.input_schema}
    if tool.description is not None:
        function["description"] = tool.description
    return {"type": "function", "function": function}


def _tool_choice(choice: ToolChoice) -> dict:
    if (choice.type == "tool") != (choice.name is not None):
        raise APIError(400, "'tool_choice.name' names the tool of {\"type\": \"tool\"} and only it",
                       param="tool_choice.name")
    chat: dict[str, Any] = {"tool_choice": {"auto": "auto", "any": "required", "none": "none"}.get(choice.type) or
                            {"type": "function", "function": {"name": choice.name}}}
    if choice.disable_parallel_tool_use:
        chat["parallel_tool_calls"] = False
    return chat


def _chat(req: MessagesRequest, protocol: OpenAIProtocol) -> GenerationRequest:
    """The request through the chat path, its errors naming the client's fields (a prompt the
    context cannot hold: in Anthropic's words, ``context_error``)."""
    anywhere = not any(m.role == "system" for m in req.messages) or renders_system_anywhere(
        protocol.tokenizer, protocol.chat_template)
    chat, paths = chat_body(req, protocol.chat_template or protocol.tokenizer.chat_template, anywhere)
    try:
        return protocol.chat(validated(ChatRequest, chat, protocol.limits))
    except ContextLengthExceeded as e:
        raise paths.error(context_error(e)) from None
    except APIError as e:
        raise paths.error(e) from None


def context_error(e: ContextLengthExceeded) -> APIError:
    """``e`` worded as Anthropic's API words it, with the numbers Claude Code reads from it: a
    prompt that alone exceeds the most it may hold (``max_model_len`` - 1: one token must be
    generated), or a prompt and ``max_tokens`` that together exceed the context."""
    if e.max_tokens is None:
        message = f"prompt is too long: {e.prompt_tokens} tokens > {e.max_model_len - 1} maximum"
    else:
        message = (f"input length and `max_tokens` exceed context limit: {e.prompt_tokens} + {e.max_tokens} > "
                   f"{e.max_model_len}, decrease input length or `max_tokens` and try again")
    return APIError(e.status, message, param=e.param, code=e.code)


def parse(protocol: OpenAIProtocol, req: MessagesRequest) -> GenerationRequest:
    """(Worker thread.) The request as the engine runs it."""
    if req.max_tokens is None:
        raise APIError(400, "'max_tokens' is required", param="max_tokens")
    return _chat(req, protocol)


def count(protocol: OpenAIProtocol, req: MessagesRequest) -> int:
    """(Worker thread.) The input tokens of a count_tokens body: its prompt as the engine would run it."""
    return _chat(req.model_copy(update={"max_tokens": 1}), protocol).num_prompt_tokens


async def create_message(server, request: web.Request) -> web.StreamResponse:
    """The route (``OpenAIServer.messages``); its errors are rendered in Anthropic's shape by the
    server's error middleware."""
    gen = await server.parse(request, MessagesRequest, parse)
    generation = await server.generation(request, gen)
    message = Message(server.protocol.model_name)
    try:
        if gen.stream:
            return await _stream(request, generation, message, server.keepalive_interval)
        out = (await generation.outputs())[0]
        blocks, finish_reason = whole_blocks(gen.parsing, out.text, out.final.finish_reason)
        usage = generation.usage(out.num_tokens)
        return web.json_response({**message.head(usage), "content": [message.block(b) for b in blocks],
                                  **message.stop(finish_reason, out.final.stop_reason)})
    finally:
        generation.close()


async def count_tokens(server, request: web.Request) -> web.Response:
    """The route (``OpenAIServer.count_tokens``)."""
    return web.json_response({"input_tokens": await server.parse(request, MessagesRequest, count)})


class Message:
    """The message object of one answer."""

    def __init__(self, model: str):
        self.id, self.model = "msg_" + uuid.uuid4().hex, model
        self._ids: dict[str, str] = {}

    def head(self, usage: dict, streaming: bool = False) -> dict:
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                **({"content": [], "stop_reason": None, "stop_sequence": None} if streaming else {}),
                "usage": {"input_tokens": usage["prompt_tokens"] - cached,  # Anthropic's count the cache apart
                          "output_tokens": usage["completion_tokens"], "cache_read_input_tokens": cached,
                          "cache_creation_input_tokens": 0}}

    @staticmethod
    def stop(finish_reason: str | None, stop_sequence: str | None) -> dict:
        reason = "stop_sequence" if finish_reason == "stop" and stop_sequence is not None else \
            STOP_REASONS.get(finish_reason, "end_turn")
        return {"stop_reason": reason, "stop_sequence": stop_sequence if reason == "stop_sequence" else None}

    def block(self, block: Block, done: bool = True) -> dict:
        """The content block of ``block`` (``done``: whole, else as it starts)."""
        if block.kind == "reasoning":
            return {"type": "thinking", "thinking": block.text if done else "", "signature": ""}
        if block.kind == "text":
            return {"type": "text", "text": block.text if done else ""}
        tool_id = self._ids.setdefault(block.call_id, "toolu_" + block.call_id.removeprefix("call_"))
        return {"type": "tool_use", "id": tool_id, "name": block.name,
                "input": _arguments(block.text) if done else {}}


def _arguments(text: str) -> dict:
    """A call's arguments as an object; ``{}`` for a call cut off before its arguments closed."""
    try:
        value = json.loads(text)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


DELTAS = {"reasoning": ("thinking_delta", "thinking"), "text": ("text_delta", "text"),
          "tool_call": ("input_json_delta", "partial_json")}


async def _stream(request: web.Request, generation: Generation, message: Message,
                  keepalive: float) -> web.StreamResponse:
    """The answer as Anthropic's events; a ``ping`` each ``keepalive`` seconds without a token."""
    response = await sse_response(request)

    async def send(kind: str, **data) -> None:
        await response.write(f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n".encode())

    blocks = BlockStream()
    try:
        await send("message_start", message=message.head(usage(generation.gen.num_prompt_tokens, 0), streaming=True))
        await send("ping")
        async for item in streamed_blocks(generation, blocks, keepalive):
            if item is None:
                await send("ping")
                continue
            events, update, finish_reason, num_tokens = item
            for event in events:
                if isinstance(event, Opened):
                    await send("content_block_start", index=event.index, content_block=message.block(event.block,
                                                                                                     done=False))
                elif isinstance(event, Grew):
                    kind, key = DELTAS[blocks.blocks[event.index].kind]
                    await send("content_block_delta", index=event.index, delta={"type": kind, key: event.text})
                elif isinstance(event, Closed):
                    await send("content_block_stop", index=event.index)
            if update.finished:
                await send("message_delta", delta=message.stop(finish_reason, update.stop_reason),
                           usage={"output_tokens": generation.usage(num_tokens)["completion_tokens"]})
        await send("message_stop")
        await response.write_eof()
    except APIError as e:  # a failure in the engine: an error event ends the stream
        try:
            await send("error", error=anthropic_error(e.status, e.message)["error"])
        except ConnectionResetError:
            pass
    except ConnectionResetError:  # the client went away
        pass
    return response
