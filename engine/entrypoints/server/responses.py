"""OpenAI's Responses API: ``POST /v1/responses``, stateless.

A request arrives typed (``responses_types.ResponsesRequest``) and is read as the chat request it
amounts to (``chat_body``), which takes the chat path to the engine (template, sampling, grammar,
tool-call and reasoning parsers); every error of that reading names the client's own field
(``max_output_tokens``, ``input[3].call_id``, ``text.format.schema``), never the chat field it
became. Only its shapes are its own:

- ``input``: a string (one user message) or a list of items: messages (``role`` user, assistant,
  system or developer; content a string or ``input_text`` / ``output_text`` parts),
  ``function_call`` items (the assistant's calls, joined into its turn) and
  ``function_call_output`` items (tool results). ``reasoning`` items sent back are dropped (chat
  templates drop past reasoning too). ``instructions`` is a system message before them.
- ``tools``: ``{"type": "function", "name", "description", "parameters", "strict"}``;
  ``{"type": "namespace", "name", "description", "tools": [functions]}``, each function offered
  to the model as ``<namespace>__<name>`` (Codex's flat name; the namespace's description before
  its own) and its calls answered as ``{"name", "namespace"}``, as Codex routes them (calls sent
  back with a ``namespace`` are read as the flat name); hosted tools (``web_search`` ...,
  ``responses_types.HOSTED_TOOLS``) are dropped beside function tools, and a request offering
  nothing else, or whose ``tool_choice`` forces one, is a 400;
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
  ``sequence_number``; a failure mid-stream is an ``error`` event. ``response.in_progress`` is sent
  again each time the server's keep-alive interval passes with no token (queued, or prefilling a
  long prompt): an event, not an SSE comment, since Codex's stream watchdog (300 s idle) counts
  only events.

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
from engine.entrypoints.server.openai_types import ChatRequest
from engine.entrypoints.server.output_blocks import Block, BlockStream, Grew, Opened, streamed_blocks, whole_blocks
from engine.entrypoints.server.protocol import GenerationRequest, OpenAIProtocol
from engine.entrypoints.server.request_body import APIError
from engine.entrypoints.server.request_model import PathMap, validated
from engine.entrypoints.server.responses_types import (
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionTool,
    HostedToolChoice,
    MessageItem,
    NamespaceTool,
    ResponsesRequest,
    TextPart,
)


def flat_name(namespace: str, name: str) -> str:
    """The function name a namespace's function is offered to the model under (Codex's
    ``ToolName::canonical_flat_name``)."""
    return f"{namespace.rstrip('_')}__{name.lstrip('_')}"


def namespaced(req: ResponsesRequest) -> dict[str, tuple[str, str]]:
    """The flat name of each function of the request's namespaces -> (namespace, name)."""
    return {flat_name(t.name, f.name): (t.name, f.name) for t in req.tools or [] if isinstance(t, NamespaceTool)
            for f in t.tools if isinstance(f, FunctionTool)}


def _functions(req: ResponsesRequest, paths: PathMap) -> list[dict]:
    """The chat tools of the request's functions, a namespace's under their flat names; hosted
    tools dropped beside them (an agent's whole toolbox), refused where they are all it offers
    (what it asks for, this server cannot run)."""
    functions: list[dict] = []
    hosted: list[tuple[str, str]] = []  # (path, type)

    def add(function: FunctionTool, sent: str, name: str, description: str = "") -> None:
        body = function.model_dump(exclude={"type"}, exclude_none=True) | {"name": name}
        if description.strip():
            body["description"] = f"{description}\n\n{function.description or ''}".rstrip()
        paths.add(f"tools[{len(functions)}].function", sent)
        functions.append({"type": "function", "function": body})

    for i, tool in enumerate(req.tools or []):
        if isinstance(tool, FunctionTool):
            add(tool, f"tools[{i}]", tool.name)
        elif isinstance(tool, NamespaceTool):
            for j, function in enumerate(tool.tools):
                if isinstance(function, FunctionTool):
                    add(function, f"tools[{i}].tools[{j}]", flat_name(tool.name, function.name), tool.description)
                else:
                    hosted.append((f"tools[{i}].tools[{j}]", function.type))
        else:
            hosted.append((f"tools[{i}]", tool.type))
    if hosted and not functions:
        where, kind = hosted[0]
        raise APIError(400, f"'{where}' is the hosted tool {kind!r}, which this server does not run (beside "
                            "function tools, hosted tools are dropped)", param=where)
    return functions


def chat_body(req: ResponsesRequest) -> tuple[dict, PathMap]:
    """The chat completions body a Responses request amounts to, and where each of its fields came
    from in the client's request."""
    paths = PathMap()
    chat: dict[str, Any] = {k: getattr(req, k) for k in ("model", "temperature", "top_p", "parallel_tool_calls",
                                                         "stream") if getattr(req, k) is not None}
    chat["messages"] = _messages(req, paths)
    if req.max_output_tokens is not None:
        chat["max_completion_tokens"] = req.max_output_tokens
        paths.add("max_completion_tokens", "max_output_tokens")
    functions = _functions(req, paths)
    if functions:
        chat["tools"] = functions
    if req.tool_choice is not None:
        choice = req.tool_choice
        if isinstance(choice, HostedToolChoice):
            raise APIError(400, f"'tool_choice' forces the hosted tool {choice.type!r}, which this server does "
                                "not run (hosted tools are dropped)", param="tool_choice")
        chat["tool_choice"] = choice if isinstance(choice, str) else {"type": "function",
                                                                      "function": {"name": choice.name}}
        paths.add("tool_choice.function", "tool_choice")
    fmt = req.text.format if req.text is not None else None
    if fmt is not None:
        chat["response_format"] = fmt if fmt.get("type") != "json_schema" else {
            "type": "json_schema", "json_schema": {k: v for k, v in fmt.items() if k != "type"}}
        paths.add("response_format.json_schema", "text.format")
        paths.add("response_format", "text.format")
    if req.reasoning is not None and req.reasoning.effort is not None:
        chat["reasoning_effort"] = req.reasoning.effort
        paths.add("reasoning_effort", "reasoning.effort")
    return chat, paths


def _messages(req: ResponsesRequest, paths: PathMap) -> list[dict]:
    """The chat messages of ``instructions`` and ``input``: function calls joined into the
    assistant's turn, reasoning items dropped."""
    messages: list[dict] = []

    def add(message: dict, sent: str) -> None:
        paths.add(f"messages[{len(messages)}]", sent)
        messages.append(message)

    if req.instructions:
        add({"role": "system", "content": req.instructions}, "instructions")
    if isinstance(req.input, str):
        add({"role": "user", "content": req.input}, "input")
        return messages
    paths.add("messages", "input")
    for i, item in enumerate(req.input):
        where = f"input[{i}]"
        if isinstance(item, MessageItem):
            add({"role": item.role, "content": _text(item.content)}, where)
        elif isinstance(item, FunctionCallItem):
            name = item.name if item.namespace is None else flat_name(item.namespace, item.name)
            call = {"id": item.call_id, "type": "function", "function": {"name": name, "arguments": item.arguments}}
            last = messages[-1] if messages else None
            if last is None or last["role"] != "assistant":
                add({"role": "assistant", "content": None, "tool_calls": []}, where)
                last = messages[-1]
            calls = last.setdefault("tool_calls", [])
            paths.add(f"messages[{len(messages) - 1}].tool_calls[{len(calls)}].function", where)
            paths.add(f"messages[{len(messages) - 1}].tool_calls[{len(calls)}].id", f"{where}.call_id")
            calls.append(call)
        elif isinstance(item, FunctionCallOutputItem):
            add({"role": "tool", "tool_call_id": item.call_id, "content": _text(item.output)}, where)
            paths.add(f"messages[{len(messages) - 1}].tool_call_id", f"{where}.call_id")
            paths.add(f"messages[{len(messages) - 1}].content", f"{where}.output")
    return messages


def _text(content: str | list[TextPart]) -> str:
    """A string, or text parts joined."""
    return content if isinstance(content, str) else "".join(p.text for p in content)


def parse(protocol: OpenAIProtocol, req: ResponsesRequest) -> tuple[GenerationRequest, dict, dict]:
    """(Worker thread.) The request as the engine runs it, the request fields the answer repeats
    and its namespaces' functions by flat name (``namespaced``)."""
    chat, paths = chat_body(req)
    try:
        gen = protocol.chat(validated(ChatRequest, chat, protocol.limits))
    except APIError as e:
        raise paths.error(e) from None
    echo = {"instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "metadata": req.metadata or {}, "parallel_tool_calls": req.parallel_tool_calls is not False,
            "temperature": gen.choices[0].params.temperature, "top_p": gen.choices[0].params.top_p,
            "tool_choice": "auto" if req.tool_choice is None else req.tool_choice if isinstance(req.tool_choice, str)
            else req.tool_choice.model_dump(),
            "tools": [t.model_dump(exclude_none=True) for t in req.tools or []],
            "text": {"format": (req.text.format if req.text else None) or {"type": "text"}},
            "reasoning": None if req.reasoning is None else req.reasoning.model_dump(),
            "user": req.user, "store": False, "truncation": "disabled", "previous_response_id": None}
    return gen, echo, namespaced(req)


async def create(server, request: web.Request) -> web.StreamResponse:
    """The route (``OpenAIServer.responses``)."""
    gen, echo, functions = await server.parse(request, ResponsesRequest, parse)
    generation = await server.generation(request, gen)
    answer = Answer(server.protocol.model_name, echo, functions)
    try:
        if gen.stream:
            return await _stream(request, generation, answer, server.keepalive_interval)
        out = (await generation.outputs())[0]
        blocks, finish_reason = whole_blocks(gen.parsing, out.text, out.final.finish_reason)
        return web.json_response(answer.response([answer.item(b) for b in blocks], finish_reason,
                                                 generation.usage(out.num_tokens)))
    finally:
        generation.close()


class Answer:
    """The response object of one request: its id, its items' ids as they are made, and the
    request's namespaced functions by flat name (their calls name the function and its namespace)."""

    def __init__(self, model: str, echo: dict, namespaced: dict[str, tuple[str, str]]):
        self.id, self.created_at, self.model, self.echo = "resp_" + uuid.uuid4().hex, int(time.time()), model, echo
        self.namespaced = namespaced
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

    def item_id(self, block: Block) -> str:
        """The id of ``block``'s output item, made when first asked for."""
        return self._ids.setdefault(id(block), {"reasoning": "rs_", "text": "msg_", "tool_call": "fc_"}[block.kind]
                                    + uuid.uuid4().hex)

    def item(self, block: Block, done: bool = True) -> dict:
        """The output item of ``block`` (``done``: whole, else as it opens)."""
        item_id = self.item_id(block)
        status = "completed" if done else "in_progress"
        if block.kind == "reasoning":
            return {"type": "reasoning", "id": item_id, "summary": [], "status": status,
                    "content": [{"type": "reasoning_text", "text": block.text}] if done else []}
        if block.kind == "text":
            return {"type": "message", "id": item_id, "role": "assistant", "status": status,
                    "content": [_text_part(block.text)] if done else []}
        return {"type": "function_call", "id": item_id, "call_id": block.call_id, **self.called(block),
                "arguments": block.text, "status": status}

    def called(self, block: Block) -> dict:
        """The function a tool-call block calls: ``{"name"}``, with its ``namespace`` for a namespace's."""
        if block.name not in self.namespaced:
            return {"name": block.name}
        namespace, name = self.namespaced[block.name]
        return {"name": name, "namespace": namespace}


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


async def _stream(request: web.Request, generation: Generation, answer: Answer,
                  keepalive: float) -> web.StreamResponse:
    """The answer as the Responses API's events; ``response.in_progress`` again each ``keepalive``
    seconds without a token."""
    response = await sse_response(request)
    number = iter(range(1 << 62))

    async def send(kind: str, **data) -> None:
        event = {"type": kind, "sequence_number": next(number), **data}
        await response.write(f"event: {kind}\ndata: {json.dumps(event)}\n\n".encode())

    async def send_events(events: list) -> None:
        for event in events:
            block, index = blocks.blocks[event.index], event.index
            item_id = answer.item_id(block)  # never the item: a call's arguments so far would be joined per event
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
                    await send("response.function_call_arguments.done", **where, name=answer.called(block)["name"],
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
        async for item in streamed_blocks(generation, blocks, keepalive):
            if item is None:
                await send("response.in_progress", response=answer.response([], None, None))
                continue
            events, _, finish_reason, num_tokens = item
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
