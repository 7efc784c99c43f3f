"""OpenAI's Responses API: ``POST /v1/responses``, stateless.

A request is read as the chat request it amounts to (``chat_body``) and takes the chat path to the
engine (template, sampling, grammar, tool-call and reasoning parsers); only its shapes are its own:

- ``input``: a string (one user message) or a list of items: messages (``role`` user, assistant,
  system or developer; content a string or ``input_text`` / ``output_text`` parts),
  ``function_call`` items (the assistant's calls, joined into its turn) and
  ``function_call_output`` items (tool results). ``reasoning`` items sent back are dropped (chat
  templates drop past reasoning too). ``instructions`` is a system message before them.
- ``tools``: ``{"type": "function", "name", "description", "parameters", "strict"}``;
  ``tool_choice`` ``auto`` / ``required`` / ``none`` / ``{"type": "function", "name"}``;
  ``text.format`` ``text`` / ``json_object`` / ``json_schema`` (through the grammar path, as chat's
  ``response_format``); ``reasoning.effort`` as chat's ``reasoning_effort``; ``max_output_tokens``.
- The answer's ``output`` holds a ``reasoning`` item (with a reasoning parser), a ``message`` with
  one ``output_text`` part, and ``function_call`` items, in the order the model wrote them
  (``engine.entrypoints.server.output_blocks``); ``status`` is ``completed``, or ``incomplete`` with
  ``incomplete_details.reason: "max_output_tokens"`` at the token limit; ``usage`` counts input
  (cached included), output and total tokens.
- ``stream: true``: ``response.created``, ``response.in_progress``, per item
  ``response.output_item.added``, its content events (``response.content_part.added``,
  ``response.output_text.delta`` ... ``.done``; ``response.reasoning_text.delta`` / ``.done``;
  ``response.function_call_arguments.delta`` / ``.done``), ``response.output_item.done``; then
  ``response.completed`` (or ``response.incomplete``). Each event names its ``type`` and a
  ``sequence_number``; a failure mid-stream is an ``error`` event.

Nothing is stored: ``store`` is accepted and ignored (the answer says ``"store": false``);
``previous_response_id``, ``conversation``, ``prompt`` and ``background: true`` need stored state
and are refused. Errors are OpenAI error objects.
"""
from __future__ import annotations

import json
import time
import uuid
from typing import Any

from aiohttp import web

from engine.entrypoints.server.generation import Generation, sse_response
from engine.entrypoints.server.output_blocks import Block, BlockStream, Grew, Opened, streamed_blocks, whole_blocks
from engine.entrypoints.server.protocol import GenerationRequest, OpenAIProtocol
from engine.entrypoints.server.request_body import APIError, check_fields, field, shown

HONOURED = {"model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "tools", "tool_choice",
            "parallel_tool_calls", "text", "reasoning", "stream"}
IGNORED = {"store", "metadata", "user", "safety_identifier", "prompt_cache_key", "prompt_cache_retention",
           "service_tier", "include", "truncation", "stream_options", "max_tool_calls"}
REFUSED = {"previous_response_id": (None,), "conversation": (None,), "prompt": (None,), "background": (None, False),
           "top_logprobs": (None, 0)}
ROLES = {"user", "assistant", "system", "developer"}
TEXT_PARTS = {"input_text", "output_text", "text"}


def chat_body(body: dict, protocol: OpenAIProtocol) -> dict:
    """The chat completions body a Responses request amounts to (a 400 naming the field that
    cannot be read)."""
    check_fields(body, HONOURED | IGNORED, REFUSED, ": this server stores no responses")
    chat: dict[str, Any] = {k: body[k] for k in ("model", "temperature", "top_p", "parallel_tool_calls", "stream")
                            if body.get(k) is not None}
    chat["messages"] = _messages(body, protocol)
    if body.get("max_output_tokens") is not None:
        chat["max_completion_tokens"] = body["max_output_tokens"]
    if body.get("tools") is not None:
        chat["tools"] = [_tool(t, i) for i, t in enumerate(protocol.limits.check(field(body, "tools", list), "tools",
                                                                                 "tools"))]
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    text = field(body, "text", dict, {})
    if text.get("format") is not None:
        chat["response_format"] = _response_format(text["format"])
    effort = field(body, "reasoning", dict, {}).get("effort")
    if effort is not None:
        chat["reasoning_effort"] = effort
    return chat


def _messages(body: dict, protocol: OpenAIProtocol) -> list[dict]:
    messages = []
    instructions = field(body, "instructions", str)
    if instructions:
        messages.append({"role": "system", "content": instructions})
    items = body.get("input")
    if isinstance(items, str):
        return messages + [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise APIError(400, "'input' must be a string or a non-empty array of items", param="input")
    for i, item in enumerate(protocol.limits.check(items, "messages", "input")):
        where = f"input[{i}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message":
            if item.get("role") not in ROLES:
                raise APIError(400, f"'{where}.role' must be one of {', '.join(sorted(ROLES))}", param=f"{where}.role")
            messages.append({"role": item["role"], "content": _text(item.get("content"), f"{where}.content",
                                                                    protocol)})
        elif kind == "function_call":
            call = {"id": field(item, "call_id", str, param=f"{where}.call_id"), "type": "function",
                    "function": {"name": field(item, "name", str, param=f"{where}.name"),
                                 "arguments": field(item, "arguments", str, param=f"{where}.arguments")}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": field(item, "call_id", str, param=f"{where}.call_id"),
                             "content": _text(item.get("output"), f"{where}.output", protocol)})
        elif kind != "reasoning":
            raise APIError(400, f"'{where}.type' must be message, function_call, function_call_output or "
                                f"reasoning, got {shown(kind)}", param=f"{where}.type")
    return messages


def _text(content: Any, where: str, protocol: OpenAIProtocol) -> str:
    """A string, or text parts joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        protocol.limits.check(content, "content_parts", where)
        if all(isinstance(p, dict) and p.get("type") in TEXT_PARTS and isinstance(p.get("text"), str)
               for p in content):
            return "".join(p["text"] for p in content)
    raise APIError(400, f"'{where}' must be a string or an array of text parts (input_text, output_text): this "
                        "server reads text only", param=where)


def _tool(tool: Any, i: int) -> dict:
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise APIError(400, f"'tools[{i}]' must be a function tool ({{\"type\": \"function\", \"name\", ...}}): this "
                            "server runs no built-in tools", param=f"tools[{i}]")
    unknown = sorted(set(tool) - {"type", "name", "description", "parameters", "strict"})
    if unknown:
        raise APIError(400, f"'tools[{i}].{shown(unknown[0], 40)}' is not a field of a function tool",
                       param=f"tools[{i}]")
    return {"type": "function", "function": {k: tool[k] for k in ("name", "description", "parameters", "strict")
                                             if tool.get(k) is not None}}


def _tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function" and set(choice) <= {"type", "name"}:
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice  # strings, and what chat's check refuses naming tool_choice


def _response_format(fmt: Any) -> dict:
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
        return fmt
    return {"type": "json_schema", "json_schema": {k: v for k, v in fmt.items() if k != "type"}}


def parse(body: dict, protocol: OpenAIProtocol) -> tuple[GenerationRequest, dict]:
    """(Worker thread.) The request as the engine runs it, and the request fields the answer repeats."""
    gen = protocol.chat(chat_body(body, protocol))
    echo = {"instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
            "metadata": body.get("metadata") or {}, "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "temperature": gen.choices[0].params.temperature, "top_p": gen.choices[0].params.top_p,
            "tool_choice": body.get("tool_choice", "auto"), "tools": body.get("tools") or [],
            "text": {"format": field(body, "text", dict, {}).get("format") or {"type": "text"}},
            "reasoning": body.get("reasoning"), "user": body.get("user"), "store": False,
            "truncation": "disabled", "previous_response_id": None}
    return gen, echo


async def create(server, request: web.Request) -> web.StreamResponse:
    """The route (``OpenAIServer.responses``)."""
    gen, echo = await server.parse(request, lambda body: parse(body, server.protocol))
    generation = await server.generation(request, gen)
    answer = Answer(server.protocol.model_name, echo)
    try:
        if gen.stream:
            return await _stream(request, generation, answer)
        out = (await generation.outputs())[0]
        blocks, finish_reason = whole_blocks(gen.parsing, out.text, out.final.finish_reason)
        return web.json_response(answer.response([answer.item(b) for b in blocks], finish_reason,
                                                 generation.usage(out.num_tokens)))
    finally:
        generation.close()


class Answer:
    """The response object of one request: its id, and its items' ids as they are made."""

    def __init__(self, model: str, echo: dict):
        self.id, self.created_at, self.model, self.echo = "resp_" + uuid.uuid4().hex, int(time.time()), model, echo
        self._ids: dict[int, str] = {}  # id() of a block -> its item id

    def response(self, output: list[dict], finish_reason: str | None, usage: dict | None) -> dict:
        """The response object; ``finish_reason`` None: still in progress."""
        status = "in_progress" if finish_reason is None else "incomplete" if finish_reason == "length" else "completed"
        return {"id": self.id, "object": "response", "created_at": self.created_at, "model": self.model,
                "status": status, "error": None,
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "output": output, **self.echo, "usage": None if usage is None else {
                    "input_tokens": usage["prompt_tokens"],
                    "input_tokens_details": {"cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]},
                    "output_tokens": usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
                    "total_tokens": usage["total_tokens"]}}

    def item(self, block: Block, done: bool = True) -> dict:
        """The output item of ``block`` (``done``: whole, else as it opens)."""
        item_id = self._ids.setdefault(id(block), {"reasoning": "rs_", "text": "msg_", "tool_call": "fc_"}[block.kind]
                                       + uuid.uuid4().hex)
        status = "completed" if done else "in_progress"
        if block.kind == "reasoning":
            return {"type": "reasoning", "id": item_id, "summary": [], "status": status,
                    "content": [{"type": "reasoning_text", "text": block.text}] if done else []}
        if block.kind == "text":
            return {"type": "message", "id": item_id, "role": "assistant", "status": status,
                    "content": [_text_part(block.text)] if done else []}
        return {"type": "function_call", "id": item_id, "call_id": block.call_id, "name": block.name,
                "arguments": block.text, "status": status}


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


async def _stream(request: web.Request, generation: Generation, answer: Answer) -> web.StreamResponse:
    response = await sse_response(request)
    number = iter(range(1 << 62))

    async def send(kind: str, **data) -> None:
        event = {"type": kind, "sequence_number": next(number), **data}
        await response.write(f"event: {kind}\ndata: {json.dumps(event)}\n\n".encode())

    async def send_events(events: list) -> None:
        for event in events:
            block, index = blocks.blocks[event.index], event.index
            item_id = answer.item(block, done=False)["id"]
            where = {"item_id": item_id, "output_index": index}
            if isinstance(event, Opened):
                await send("response.output_item.added", output_index=index, item=answer.item(block, done=False))
                if block.kind != "tool_call":
                    part = _text_part("") if block.kind == "text" else {"type": "reasoning_text", "text": ""}
                    await send("response.content_part.added", **where, content_index=0, part=part)
            elif isinstance(event, Grew):
                if block.kind == "tool_call":
                    await send("response.function_call_arguments.delta", **where, delta=event.text)
                elif block.kind == "text":
                    await send("response.output_text.delta", **where, content_index=0, delta=event.text, logprobs=[])
                else:
                    await send("response.reasoning_text.delta", **where, content_index=0, delta=event.text)
            else:
                if block.kind == "tool_call":
                    await send("response.function_call_arguments.done", **where, name=block.name,
                               arguments=block.text)
                else:
                    part = _text_part(block.text) if block.kind == "text" else {"type": "reasoning_text",
                                                                                "text": block.text}
                    done = "response.output_text.done" if block.kind == "text" else "response.reasoning_text.done"
                    await send(done, **where, content_index=0, text=block.text,
                               **({"logprobs": []} if block.kind == "text" else {}))
                    await send("response.content_part.done", **where, content_index=0, part=part)
                await send("response.output_item.done", output_index=index, item=answer.item(block))

    blocks = BlockStream()
    try:
        await send("response.created", response=answer.response([], None, None))
        await send("response.in_progress", response=answer.response([], None, None))
        async for events, _, finish_reason, num_tokens in streamed_blocks(generation, blocks):
            await send_events(events)
        final = answer.response([answer.item(b) for b in blocks.blocks], finish_reason, generation.usage(num_tokens))
        await send("response.incomplete" if final["status"] == "incomplete" else "response.completed", response=final)
        await response.write_eof()
    except APIError as e:  # a failure in the engine: an error event ends the stream
        try:
            await send("error", code=e.code, message=e.message, param=e.param)
        except ConnectionResetError:
            pass
    except ConnectionResetError:  # the client went away
        pass
    return response
