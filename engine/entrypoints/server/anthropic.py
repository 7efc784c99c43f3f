"""Anthropic's Messages API: ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``, as the
anthropic SDK and Claude Code call them.

A request is read as the chat request it amounts to (``chat_body``) and takes the chat path to the
engine; only its shapes are its own:

- ``system``: a string or text blocks; ``messages``: ``user`` / ``assistant`` turns whose content
  is a string or blocks: ``text``, ``tool_use`` (``id``, ``name``, ``input``: the assistant's
  calls), ``tool_result`` (``tool_use_id``, ``content`` a string or text blocks, ``is_error``)
  and ``thinking`` / ``redacted_thinking`` (sent back by clients; dropped, as templates drop past
  reasoning). ``cache_control`` on any block or tool is accepted and ignored (prefix caching is
  automatic).
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
  ``message_stop``; a failure mid-stream is an ``error`` event.

The API key may come as ``x-api-key`` (``engine.entrypoints.server.access``); ``anthropic-version`` and
``anthropic-beta`` headers are accepted. Errors on these routes are Anthropic's error objects.
"""
from __future__ import annotations

import json
import uuid
from typing import Any

from aiohttp import web

from engine.entrypoints.server.access import anthropic_error
from engine.entrypoints.server.generation import Generation, sse_response
from engine.entrypoints.server.output_blocks import (
    Block,
    BlockStream,
    Closed,
    Grew,
    Opened,
    streamed_blocks,
    whole_blocks,
)
from engine.entrypoints.server.protocol import GenerationRequest, OpenAIProtocol, usage
from engine.entrypoints.server.request_body import APIError, check_fields, field, shown

HONOURED = {"model", "messages", "max_tokens", "system", "stop_sequences", "stream", "temperature", "top_p", "top_k",
            "tools", "tool_choice", "thinking", "output_config", "output_format"}
IGNORED = {"metadata", "service_tier", "context_management", "cache_control", "diagnostics", "inference_geo", "speed",
           "user_profile_id", "workspace_id"}
REFUSED = {"mcp_servers": (None, []), "container": (None,)}
TOOL_FIELDS = {"name", "description", "input_schema", "type", "strict", "cache_control", "defer_loading",
               "eager_input_streaming", "input_examples", "allowed_callers"}  # the first four are read
THINKING = {"enabled": True, "adaptive": True, "between_tools": True, "disabled": False}
EFFORTS = {"low": "low", "medium": "medium", "high": "high", "xhigh": "xhigh", "max": "xhigh"}  # -> reasoning_effort
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


def chat_body(body: dict, protocol: OpenAIProtocol, counting: bool = False) -> dict:
    """The chat completions body a Messages request amounts to (``counting``: a count_tokens body,
    which has no max_tokens); a 400 naming the field that cannot be read."""
    check_fields(body, HONOURED | IGNORED, REFUSED)
    chat: dict[str, Any] = {k: body[k] for k in ("model", "temperature", "top_p", "top_k", "stream")
                            if body.get(k) is not None}
    if not counting:
        if body.get("max_tokens") is None:
            raise APIError(400, "'max_tokens' is required", param="max_tokens")
        chat["max_tokens"] = body["max_tokens"]
    chat["messages"] = _system(body.get("system")) + _messages(body.get("messages"), protocol)
    if body.get("stop_sequences") is not None:
        chat["stop"] = body["stop_sequences"]
    tools = body.get("tools")
    if tools is not None:
        chat["tools"] = [_tool(t, i) for i, t in enumerate(protocol.limits.check(field(body, "tools", list), "tools",
                                                                                 "tools"))]
    if body.get("tool_choice") is not None:
        chat.update(_tool_choice(field(body, "tool_choice", dict)))
    thinking = field(body, "thinking", dict)
    if thinking is not None:
        if thinking.get("type") not in THINKING:
            raise APIError(400, f"'thinking.type' must be one of {', '.join(THINKING)}", param="thinking.type")
        template = protocol.chat_template or protocol.tokenizer.chat_template
        if isinstance(template, str) and "enable_thinking" in template:
            chat["chat_template_kwargs"] = {"enable_thinking": THINKING[thinking["type"]]}
    chat.update(_output(field(body, "output_config", dict, {}), body.get("output_format")))
    return chat


def _output(config: dict, output_format: Any) -> dict:
    """``output_config`` (``effort``, ``format``) and the older ``output_format`` as chat fields."""
    chat: dict[str, Any] = {}
    effort = config.get("effort")
    if effort is not None:
        if effort not in EFFORTS:
            raise APIError(400, f"'output_config.effort' must be one of {', '.join(EFFORTS)}",
                           param="output_config.effort")
        chat["reasoning_effort"] = EFFORTS[effort]
    fmt = config.get("format") if config.get("format") is not None else output_format
    if fmt is not None:
        if not (isinstance(fmt, dict) and fmt.get("type") == "json_schema" and set(fmt) <= {"type", "schema"}):
            raise APIError(400, "'output_config.format' must be {\"type\": \"json_schema\", \"schema\": {...}}",
                           param="output_config.format")
        chat["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": "output", "schema": fmt.get("schema")}}
    return chat


def _system(system: Any) -> list[dict]:
    if system is None or system == "":
        return []
    return [{"role": "system", "content": _text(system, "system")}]


def _text(content: Any, where: str) -> str:
    """A string, or text blocks joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(b, dict) and b.get("type") == "text" and
                                         isinstance(b.get("text"), str) for b in content):
        return "".join(b["text"] for b in content)
    raise APIError(400, f"'{where}' must be a string or an array of text blocks", param=where)


def _messages(messages: Any, protocol: OpenAIProtocol) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "'messages' must be a non-empty array", param="messages")
    chat: list[dict] = []
    for i, m in enumerate(protocol.limits.check(messages, "messages", "messages")):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise APIError(400, f"'{where}.role' must be 'user' or 'assistant'", param=f"{where}.role")
        content = m.get("content")
        if isinstance(content, str):
            chat.append({"role": m["role"], "content": content})
            continue
        if not isinstance(content, list):
            raise APIError(400, f"'{where}.content' must be a string or an array of blocks", param=f"{where}.content")
        protocol.limits.check(content, "content_parts", f"{where}.content")
        chat += _blocks(m["role"], content, f"{where}.content")
    return chat


def _blocks(role: str, blocks: list, where: str) -> list[dict]:
    """One turn's blocks as chat messages: tool results each a tool message, the text one message,
    the calls on the assistant's."""
    results, texts, calls = [], [], []
    for j, block in enumerate(blocks):
        at = f"{where}[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            texts.append(field(block, "text", str, "", param=f"{at}.text"))
        elif kind == "tool_use" and role == "assistant":
            arguments = block.get("input", {})
            if not isinstance(arguments, dict):
                raise APIError(400, f"'{at}.input' must be an object", param=f"{at}.input")
            calls.append({"id": field(block, "id", str, param=f"{at}.id"), "type": "function",
                          "function": {"name": field(block, "name", str, param=f"{at}.name"),
                                       "arguments": json.dumps(arguments, ensure_ascii=False)}})
        elif kind == "tool_result" and role == "user":
            content = block.get("content", "")
            results.append({"role": "tool", "tool_call_id": field(block, "tool_use_id", str, param=f"{at}.tool_use_id"),
                            "content": _text(content, f"{at}.content")})
        elif kind not in ("thinking", "redacted_thinking"):
            raise APIError(400, f"'{at}.type' {shown(kind)} is not a block this server reads in a {role} turn "
                                "(text, tool_use, tool_result, thinking)", param=f"{at}.type")
    turn = ([{"role": role, "content": "".join(texts) or None, "tool_calls": calls}] if calls
            else [{"role": role, "content": "".join(texts)}] if texts else [])
    return results + turn


def _tool(tool: Any, i: int) -> dict:
    if not isinstance(tool, dict) or tool.get("type", "custom") != "custom":
        raise APIError(400, f"'tools[{i}]' must be a client tool ({{\"name\", \"input_schema\", ...}}): this server "
                            "runs no server tools", param=f"tools[{i}]")
    unknown = sorted(set(tool) - TOOL_FIELDS)
    if unknown:
        raise APIError(400, f"'tools[{i}].{shown(unknown[0], 40)}' is not a field of a tool", param=f"tools[{i}]")
    function = {"name": tool.get("name"), "parameters": tool.get("input_schema", {"type": "object"})}
    if tool.get("description") is not None:
        function["description"] = tool["description"]
    return {"type": "function", "function": function}


def _tool_choice(choice: dict) -> dict:
    kind = choice.get("type")
    unknown = sorted(set(choice) - {"type", "name", "disable_parallel_tool_use"})
    if kind not in ("auto", "any", "tool", "none") or unknown or (kind == "tool") != ("name" in choice):
        raise APIError(400, "'tool_choice' must be {\"type\": \"auto\" | \"any\" | \"none\"} or {\"type\": \"tool\", "
                            "\"name\": ...}", param="tool_choice")
    chat: dict[str, Any] = {"tool_choice": {"auto": "auto", "any": "required", "none": "none"}.get(kind) or
                            {"type": "function", "function": {"name": choice["name"]}}}
    if choice.get("disable_parallel_tool_use"):
        chat["parallel_tool_calls"] = False
    return chat


def parse(body: dict, protocol: OpenAIProtocol) -> GenerationRequest:
    """(Worker thread.) The request as the engine runs it."""
    return protocol.chat(chat_body(body, protocol))


def count(body: dict, protocol: OpenAIProtocol) -> int:
    """(Worker thread.) The input tokens of a count_tokens body: its prompt as the engine would run it."""
    chat = chat_body(body, protocol, counting=True)
    return protocol.chat({**chat, "max_tokens": 1}).num_prompt_tokens


async def _answering(request: web.Request, answer) -> web.StreamResponse:
    """``await answer()``, with an ``APIError`` (or an HTTP error: a body over the limit) in
    Anthropic's error shape."""
    try:
        return await answer()
    except APIError as e:
        return web.json_response(anthropic_error(e.status, e.message), status=e.status)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        return web.json_response(anthropic_error(e.status, e.reason), status=e.status)


async def create_message(server, request: web.Request) -> web.StreamResponse:
    """The route (``OpenAIServer.messages``)."""
    async def answer() -> web.StreamResponse:
        gen = await server.parse(request, lambda body: parse(body, server.protocol))
        generation = await server.generation(request, gen)
        message = Message(server.protocol.model_name)
        try:
            if gen.stream:
                return await _stream(request, generation, message)
            out = (await generation.outputs())[0]
            blocks, finish_reason = whole_blocks(gen.parsing, out.text, out.final.finish_reason)
            usage = generation.usage(out.num_tokens)
            return web.json_response({**message.head(usage), "content": [message.block(b) for b in blocks],
                                      **message.stop(finish_reason, out.final.stop_reason)})
        finally:
            generation.close()

    return await _answering(request, answer)


async def count_tokens(server, request: web.Request) -> web.Response:
    """The route (``OpenAIServer.count_tokens``)."""
    async def answer() -> web.Response:
        return web.json_response({"input_tokens": await server.parse(request, lambda body: count(body,
                                                                                              server.protocol))})

    return await _answering(request, answer)


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


async def _stream(request: web.Request, generation: Generation, message: Message) -> web.StreamResponse:
    response = await sse_response(request)

    async def send(kind: str, **data) -> None:
        await response.write(f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n".encode())

    blocks = BlockStream()
    try:
        await send("message_start", message=message.head(usage(generation.gen.num_prompt_tokens, 0), streaming=True))
        await send("ping")
        async for events, update, finish_reason, num_tokens in streamed_blocks(generation, blocks):
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
