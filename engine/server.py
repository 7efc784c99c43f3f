"""OpenAI-compatible HTTP server: ``python -m engine serve``.

Routes: ``GET /health``, ``GET /v1/models``, ``POST /v1/completions`` and
``POST /v1/chat/completions`` (JSON, or Server-Sent Events with ``stream``).
Errors are OpenAI error objects: 400 for a malformed or invalid request, 404 for
an unknown route or model, 500 when the engine failed on the request, 503 while
shutting down. Limits: ``n`` = 1 only, no logprobs; prompt + max_tokens must fit
max_model_len, else 400 (without max_tokens a completion gets 16 tokens and a chat
completion the whole room left, each capped by that room).

One engine thread (``EngineLoop``) makes every engine call: between steps it adds
the requests and aborts the HTTP handlers queued, steps while there is work, and
hands each request's new output to its handler after every step. A handler whose
client goes away aborts its request. Under torchrun rank 0 serves HTTP and
broadcasts each iteration's commands before running them, so every rank adds,
aborts and steps the same requests in the same order (request ids are counters,
identical on every rank); the other ranks only mirror (``mirror_rank0``). Rank 0
ends them with a stop command, sent from a ``finally`` block also when it fails.
"""
from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import copy
import dataclasses
import json
import logging
import os
import queue
import re
import signal
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from aiohttp import web

from engine.sequence import SamplingParams

log = logging.getLogger(__name__)

HEARTBEAT_S = 5.0  # an idle rank 0 still broadcasts this often, far inside the collective timeout
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


# ---- the engine thread ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Update:
    """A request's output so far, as its handler sees it; ``message`` explains an "error" or "abort"."""

    text: str
    num_tokens: int
    finish_reason: str | None = None
    message: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class Stream:
    """One engine request of an HTTP request: the prompt and parameters it asks for, and the
    asyncio queue its handler reads ``(index, Update)`` pairs from."""

    def __init__(self, prompt_token_ids: list[int], params: SamplingParams, index: int, updates: asyncio.Queue):
        self.prompt_token_ids, self.params, self.index, self.updates = prompt_token_ids, params, index, updates
        self.event_loop = asyncio.get_running_loop()
        self.request_id: str | None = None  # set by the engine thread
        self.aborted = False
        self.last = Update("", 0)  # the engine thread's last delivered update

    def deliver(self, update: Update) -> None:
        """Hand ``update`` to the handler (from the engine thread)."""
        self.last = update
        try:
            self.event_loop.call_soon_threadsafe(self.updates.put_nowait, (self.index, update))
        except RuntimeError:  # the event loop has closed: nobody is listening
            pass


def _apply(engine, commands: list[tuple]) -> list[str | None]:
    """Run broadcast commands, ``("add", token_ids, params)`` or ``("abort", request_id)``, on
    this rank's engine; returns each add's request id (None when the engine refused it)."""
    request_ids = []
    for command in commands:
        if command[0] == "add":
            try:
                request_ids.append(engine.add_request(command[1], command[2]))
            except Exception:
                log.exception("the engine refused a request")
                request_ids.append(None)
        else:
            engine.abort_request(command[1])
    return request_ids


def _step(engine) -> tuple[list, str | None]:
    """One ``engine.step()``: the requests it reports finished, and an error message when it
    raised (the engine has then finished the failed batch with "error"). Under TP a failed
    step is fatal (re-raised): the rank that raised could not have joined its peers'
    collectives, so the ranks' states have parted and only a stop of every rank is safe."""
    try:
        return engine.step(), None
    except Exception as e:
        log.exception("engine step failed")
        if engine.tp.size > 1:
            raise
        return [], f"the engine failed on this request: {type(e).__name__}: {e}"


def mirror_rank0(engine) -> None:
    """A worker rank's loop: run rank 0's broadcast commands and steps until its stop command.
    Any thread may run it: it makes the engine's device current first."""
    from engine.distributed import broadcast_object

    if engine.device.type == "cuda":
        import torch

        torch.cuda.set_device(engine.device)  # a new thread starts on cuda:0, whatever its rank's GPU

    while True:
        commands, stop = broadcast_object(None)
        _apply(engine, commands)
        if stop:
            return
        if commands or engine.has_unfinished_requests():
            for output in _step(engine)[0]:
                engine.pop_request(output.request_id)


class EngineLoop:
    """The one thread that calls the engine (it is not thread-safe). Handlers ``submit`` and
    ``abort`` streams from any thread; ``stop`` ends the loop (and the worker ranks)."""

    def __init__(self, engine):
        self.engine = engine
        self.failure: BaseException | None = None
        self.on_exit: Callable[[], None] | None = None  # called on the engine thread as it ends
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, Stream] = {}  # unfinished requests by engine request id
        self._lock = threading.Lock()
        self._closed = False
        self._stop_sent = False
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def start(self) -> None:
        self._thread.start()

    def submit(self, stream: Stream) -> None:
        self._put(("add", stream))

    def abort(self, stream: Stream) -> None:
        stream.aborted = True
        self._put(("abort", stream))

    def call(self, fn: Callable[[Any], Any], timeout: float = 60.0) -> Any:
        """``fn(engine)`` run on the engine thread between steps, on rank 0 only (so no collectives)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._put(("call", fn, future))
        return future.result(timeout)

    def stop(self) -> None:
        """End the loop: unfinished requests end as "abort"; worker ranks get the stop command.
        Idempotent; also sends the stop when the loop never started."""
        if self._thread.ident is None:
            self._closed = True
            self._send_stop()
            return
        self._put(("stop",), closed_ok=True)
        self._thread.join()

    def _put(self, item: tuple, closed_ok: bool = False) -> None:
        with self._lock:
            if self._closed and not closed_ok:
                raise RuntimeError("the engine loop has stopped")
            self._inbox.put(item)

    def _send_stop(self) -> None:
        from engine.distributed import broadcast_object

        if not self._stop_sent:
            self._stop_sent = True
            broadcast_object(([], True))

    def _run(self) -> None:
        from engine.distributed import broadcast_object

        if self.engine.device.type == "cuda":
            import torch

            torch.cuda.set_device(self.engine.device)
        stop = False
        try:
            while not stop:
                commands, streams, stop = self._take_commands()
                self._stop_sent = stop
                broadcast_object((commands, stop))
                for stream, request_id in zip(streams, _apply(self.engine, commands)):
                    if request_id is None:
                        stream.deliver(Update("", 0, "error", "the engine refused the request"))
                    else:
                        stream.request_id = request_id
                        self._streams[request_id] = stream
                if stop:
                    break
                finished, error = [], None
                if commands or self.engine.has_unfinished_requests():
                    finished, error = _step(self.engine)
                self._publish(error)
                for output in finished:
                    self.engine.pop_request(output.request_id)
        except BaseException as e:
            self.failure = e
            log.exception("the engine loop failed; stopping the server")
        finally:
            try:
                self._send_stop()
            except Exception:
                log.exception("could not send the stop command to the worker ranks")
            self._close("the server is shutting down" if self.failure is None else "the engine loop failed")
            if self.on_exit is not None:
                try:
                    self.on_exit()
                except RuntimeError:  # the event loop has closed
                    pass

    def _take_commands(self) -> tuple[list[tuple], list[Stream], bool]:
        """Drain the inbox (waiting up to HEARTBEAT_S when the engine is idle): the commands to
        broadcast, the stream of each add, and whether to stop. Calls run here."""
        items = []
        if not self.engine.has_unfinished_requests():
            try:
                items.append(self._inbox.get(timeout=HEARTBEAT_S))
            except queue.Empty:
                pass
        while not self._inbox.empty():
            items.append(self._inbox.get())
        commands, streams, stop = [], [], False
        for kind, *rest in items:
            if kind == "add" and not rest[0].aborted:
                commands.append(("add", rest[0].prompt_token_ids, rest[0].params))
                streams.append(rest[0])
            elif kind == "abort" and rest[0].request_id is not None:
                commands.append(("abort", rest[0].request_id))
            elif kind == "call":
                fn, future = rest
                try:
                    future.set_result(fn(self.engine))
                except Exception as e:
                    future.set_exception(e)
            elif kind == "stop":
                stop = True
        return commands, streams, stop

    def _publish(self, error: str | None) -> None:
        """Deliver every request's changed output; forget the finished ones."""
        for request_id, stream in list(self._streams.items()):
            text, num_tokens, finished = self.engine.request_progress(request_id)
            if finished:
                out = self.engine.request_output(request_id)
                del self._streams[request_id]
                message = error if out.finish_reason == "error" else out.reject_reason
                stream.deliver(Update(out.text, len(out.token_ids), out.finish_reason, message))
            elif len(text) != len(stream.last.text) or num_tokens != stream.last.num_tokens:
                stream.deliver(Update(text, num_tokens))

    def _close(self, reason: str) -> None:
        """No more submissions; every stream still waiting ends as "abort" with ``reason``."""
        with self._lock:
            self._closed = True
        for request_id in self._streams:
            try:
                self.engine.abort_request(request_id)
            except Exception:
                log.exception("could not abort request %s", request_id)
        pending = list(self._streams.values())
        while not self._inbox.empty():
            kind, *rest = self._inbox.get()
            if kind == "add":
                pending.append(rest[0])
            elif kind == "call":
                rest[1].set_exception(RuntimeError(reason))
        for stream in pending:
            stream.deliver(dataclasses.replace(stream.last, finish_reason="abort", message=reason))
        self._streams.clear()


# ---- HTTP ----------------------------------------------------------------------------------------

class APIError(Exception):
    """An error answered as an OpenAI error object."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}

    def response(self) -> web.Response:
        return web.json_response(self.body(), status=self.status)


@web.middleware
async def _error_objects(request: web.Request, handler):
    """Every failure becomes an OpenAI error object; the server keeps serving."""
    try:
        return await handler(request)
    except APIError as e:
        return e.response()
    except web.HTTPException as e:  # the router's 404 (unknown route) and 405 (wrong method)
        if e.status < 400:
            raise
        return APIError(e.status, f"{e.reason}: {request.method} {request.path}",
                        code=e.reason.lower().replace(" ", "_")).response()
    except Exception as e:
        log.exception("request %s %s failed", request.method, request.path)
        return APIError(500, f"internal error: {type(e).__name__}: {e}").response()


_TYPE_NAMES = {int: "an integer", float: "a number", bool: "a boolean", str: "a string", list: "an array",
               dict: "an object"}


def _field(body: dict, name: str, kind: type, default: Any = None) -> Any:
    """``body[name]`` checked to be a ``kind`` (a float may be given as an int; a bool is never a
    number); ``default`` when absent or null; else a 400 naming the field."""
    value = body.get(name)
    if value is None:
        return default
    types = (int, float) if kind is float else kind
    if not isinstance(value, types) or (kind is not bool and isinstance(value, bool)):
        raise APIError(400, f"'{name}' must be {_TYPE_NAMES[kind]}, got {json.dumps(value)[:50]}", param=name)
    return value


async def _json_object(request: web.Request) -> dict:
    try:
        body = await request.json()
    except ValueError as e:
        raise APIError(400, f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    return body


def _sampling_params(body: dict, max_tokens: int | None) -> SamplingParams:
    """The request's sampling fields as SamplingParams (max_tokens 1 when not given: it is set per
    prompt later); a 400 naming the field for a wrong type or value."""
    if _field(body, "n", int, 1) != 1:
        raise APIError(400, "only n=1 is supported", param="n")
    stop = () if body.get("stop") is None else body["stop"]
    if not (isinstance(stop, str) or isinstance(stop, (list, tuple)) and all(isinstance(s, str) for s in stop)):
        raise APIError(400, "'stop' must be a string or an array of strings", param="stop")
    try:
        return SamplingParams(temperature=_field(body, "temperature", float, 1.0),
                              top_p=_field(body, "top_p", float, 1.0), top_k=_field(body, "top_k", int, 0),
                              max_tokens=1 if max_tokens is None else max_tokens, stop=stop,
                              ignore_eos=_field(body, "ignore_eos", bool, False), seed=_field(body, "seed", int))
    except ValueError as e:  # "SamplingParams.<field> must be ..."
        field = re.match(r"SamplingParams\.(\w+)", str(e))
        raise APIError(400, str(e).removeprefix("SamplingParams."), param=field and field[1]) from None


class _Completion:
    """Response shapes of /v1/completions."""

    object, chunk_object, id_prefix = "text_completion", "text_completion", "cmpl-"

    @staticmethod
    def choice(index: int, text: str, finish_reason: str | None) -> dict:
        return {"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}

    delta = choice
    opening = None


class _Chat:
    """Response shapes of /v1/chat/completions."""

    object, chunk_object, id_prefix = "chat.completion", "chat.completion.chunk", "chatcmpl-"

    @staticmethod
    def choice(index: int, text: str, finish_reason: str | None) -> dict:
        return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": None,
                "finish_reason": finish_reason}

    @staticmethod
    def delta(index: int, text: str, finish_reason: str | None) -> dict:
        return {"index": index, "delta": {"content": text} if text else {}, "logprobs": None,
                "finish_reason": finish_reason}

    @staticmethod
    def opening(index: int) -> dict:
        return {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                "finish_reason": None}


class OpenAIServer:
    """The HTTP front of an EngineLoop. ``await start(host, port)`` returns the bound port (0 picks
    a free one); ``await stop()`` shuts HTTP and the engine loop down; ``done`` is set once the
    engine loop has ended."""

    def __init__(self, engine_loop: EngineLoop, model_name: str):
        engine = engine_loop.engine
        self.engine_loop, self.model_name = engine_loop, model_name
        self.tokenizer = copy.deepcopy(engine.tokenizer)  # the engine thread decodes with the original
        self.max_model_len, self.vocab_size = engine.max_model_len, engine.config.vocab_size
        self.created = int(time.time())
        self.done = asyncio.Event()
        self.app = web.Application(middlewares=[_error_objects])
        self.app.add_routes([web.get("/health", self.health), web.get("/v1/models", self.models),
                             web.post("/v1/completions", self.completions),
                             web.post("/v1/chat/completions", self.chat_completions)])
        self.app.on_shutdown.append(self._stop_engine_loop)
        self._runner: web.AppRunner | None = None

    async def start(self, host: str = "127.0.0.1", port: int = 8000) -> int:
        event_loop = asyncio.get_running_loop()
        self.engine_loop.on_exit = lambda: event_loop.call_soon_threadsafe(self.done.set)
        self._runner = web.AppRunner(self.app, handler_cancellation=True, shutdown_timeout=10, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, host, port).start()
        self.engine_loop.start()
        return self._runner.addresses[0][1]

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _stop_engine_loop(self, app: web.Application) -> None:
        await asyncio.to_thread(self.engine_loop.stop)

    # ---- routes -------------------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        if not self.engine_loop.alive:
            raise APIError(503, "the engine loop is not running")
        return web.json_response({"status": "ok"})

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "agent-infer",
             "max_model_len": self.max_model_len}]})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await _json_object(request)
        self._check_model(body)
        if body.get("logprobs") is not None:
            raise APIError(400, "logprobs are not supported", param="logprobs")
        max_tokens = _field(body, "max_tokens", int)
        params = _sampling_params(body, max_tokens)
        prompts = [self._fit(p, params, max_tokens, COMPLETION_DEFAULT_MAX_TOKENS, "prompt")
                   for p in self._completion_prompts(body.get("prompt"))]
        return await self._generate(request, body, prompts, _Completion)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        body = await _json_object(request)
        self._check_model(body)
        if body.get("logprobs") or body.get("top_logprobs") is not None:
            raise APIError(400, "logprobs are not supported", param="logprobs")
        max_tokens = _field(body, "max_completion_tokens", int, _field(body, "max_tokens", int))
        params = _sampling_params(body, max_tokens)
        prompt = self._encode(self._render_chat(body.get("messages")), "messages")
        return await self._generate(request, body, [self._fit(prompt, params, max_tokens, None, "messages")], _Chat)

    # ---- request checks -----------------------------------------------------------------------

    def _check_model(self, body: dict) -> None:
        model = _field(body, "model", str)
        if model is not None and model != self.model_name:
            raise APIError(404, f"the model {model!r} does not exist; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")

    def _completion_prompts(self, prompt: Any) -> list[list[int]]:
        """A string, an array of strings, token ids or an array of token-id arrays -> token-id prompts."""
        def is_ids(p):
            return isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p)

        if isinstance(prompt, str) or is_ids(prompt):
            prompt = [prompt]
        elif not (isinstance(prompt, list) and prompt and all(isinstance(p, str) or is_ids(p) for p in prompt)):
            raise APIError(400, "'prompt' must be a string, an array of strings, an array of token ids or an "
                                "array of token-id arrays", param="prompt")
        for p in prompt:
            if not isinstance(p, str) and not all(0 <= t < self.vocab_size for t in p):
                raise APIError(400, f"prompt token ids must be in [0, {self.vocab_size})", param="prompt")
        return [self._encode(p, "prompt") if isinstance(p, str) else p for p in prompt]

    def _render_chat(self, messages: Any) -> str:
        """``messages`` through the tokenizer's chat template, with the assistant turn opened."""
        if not isinstance(messages, list) or not messages:
            raise APIError(400, "'messages' must be a non-empty array", param="messages")
        rendered = []
        for m in messages:
            content = m.get("content") if isinstance(m, dict) else None
            if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                                 and isinstance(p.get("text"), str) for p in content):
                content = "".join(p["text"] for p in content)
            if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(content, str)):
                raise APIError(400, "each message must be an object with a string 'role' and a 'content' string "
                                    "(or an array of text parts)", param="messages")
            rendered.append({"role": m["role"], "content": content})
        if not self.tokenizer.chat_template:
            raise APIError(400, "this model's tokenizer has no chat template; use /v1/completions",
                           param="messages", code="no_chat_template")
        try:
            return self.tokenizer.apply_chat_template(rendered, add_generation_prompt=True, tokenize=False)
        except Exception as e:  # jinja2 errors, e.g. a template's raise_exception for a role order
            raise APIError(400, f"the chat template failed: {e}", param="messages") from None

    def _encode(self, text: str, param: str) -> list[int]:
        token_ids = self.tokenizer.encode(text, add_special_tokens=False)  # as LLMEngine.add_request(str)
        if not token_ids:
            raise APIError(400, "the prompt encodes to no tokens", param=param)
        return token_ids

    def _fit(self, prompt: list[int], params: SamplingParams, max_tokens: int | None, default: int | None,
             param: str) -> tuple[list[int], SamplingParams]:
        """``prompt`` with ``params`` whose max_tokens fits max_model_len: the requested one if it
        fits (else a 400), or ``default`` (None: all the room) capped by the room left."""
        n, limit = len(prompt), self.max_model_len
        room = limit - n
        if room < 1:
            raise APIError(400, f"the prompt has {n} tokens; this model's maximum context length is {limit} "
                                f"tokens (max_model_len) for prompt and completion together",
                           param=param, code="context_length_exceeded")
        if max_tokens is not None and max_tokens > room:
            raise APIError(400, f"max_tokens={max_tokens} with a prompt of {n} tokens exceeds this model's maximum "
                                f"context length of {limit} tokens (max_model_len); at most {room} new tokens fit",
                           param="max_tokens", code="context_length_exceeded")
        return prompt, dataclasses.replace(params, max_tokens=max_tokens or min(default or room, room))

    # ---- generation ---------------------------------------------------------------------------

    async def _generate(self, request: web.Request, body: dict, prompts: list[tuple[list[int], SamplingParams]],
                        shape) -> web.StreamResponse:
        stream = _field(body, "stream", bool, False)
        include_usage = _field(_field(body, "stream_options", dict, {}), "include_usage", bool, False)
        updates: asyncio.Queue = asyncio.Queue()
        streams = [Stream(ids, params, i, updates) for i, (ids, params) in enumerate(prompts)]
        finals: dict[int, Update] = {}
        try:
            for s in streams:
                self.engine_loop.submit(s)
        except RuntimeError as e:
            raise APIError(503, str(e)) from None
        try:
            if stream:
                return await self._stream(request, streams, updates, finals, shape, include_usage)
            while len(finals) < len(streams):
                index, update = await updates.get()
                if update.finished:
                    finals[index] = update
                    _raise_if_failed(update)
            return web.json_response({"id": shape.id_prefix + uuid.uuid4().hex, "object": shape.object,
                                      "created": int(time.time()), "model": self.model_name,
                                      "choices": [shape.choice(i, finals[i].text, finals[i].finish_reason)
                                                  for i in range(len(streams))],
                                      "usage": _usage(streams, finals)})
        finally:
            for s in streams:
                if s.index not in finals:
                    self.engine_loop.abort(s)

    async def _stream(self, request: web.Request, streams: list[Stream], updates: asyncio.Queue,
                      finals: dict[int, Update], shape, include_usage: bool) -> web.StreamResponse:
        """Server-Sent Events: each step's new text per choice, the finish reasons, a usage chunk
        if asked, then ``data: [DONE]``. Text that could still become a stop string is held back
        until it cannot, so the streamed text always equals the non-streaming text."""
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        head = {"id": shape.id_prefix + uuid.uuid4().hex, "object": shape.chunk_object, "created": int(time.time()),
                "model": self.model_name}

        async def send(data: dict | str) -> None:
            await response.write(f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n".encode())

        sent = [0] * len(streams)
        tokens_sent = [0] * len(streams)
        try:
            if shape.opening is not None:
                for s in streams:
                    await send({**head, "choices": [shape.opening(s.index)]})
            while len(finals) < len(streams):
                index, update = await updates.get()
                holdback = 0 if update.finished else max(map(len, streams[index].params.stop), default=1) - 1
                visible = update.text[:max(0, len(update.text) - holdback)]
                if update.finished:
                    finals[index] = update
                    try:
                        _raise_if_failed(update)
                    except APIError as e:
                        await send(e.body())
                        break
                # a chunk per step that produced tokens, even when they add no visible text yet (a token
                # inside a multi-byte character or a possible stop string): clients see the time of every
                # token, as TTFT / ITL measure it
                if len(visible) > sent[index] or update.num_tokens > tokens_sent[index] or update.finished:
                    await send({**head, "choices": [shape.delta(index, visible[sent[index]:], update.finish_reason)]})
                    sent[index], tokens_sent[index] = max(sent[index], len(visible)), update.num_tokens
            if include_usage:
                await send({**head, "choices": [], "usage": _usage(streams, finals)})
            await send("[DONE]")
            await response.write_eof()
        except ConnectionResetError:  # the client went away; the caller aborts what is unfinished
            pass
        return response


def _raise_if_failed(update: Update) -> None:
    if update.finish_reason == "rejected":
        raise APIError(400, f"the engine rejected the request: {update.message}", code="rejected")
    if update.finish_reason == "error":
        raise APIError(500, update.message or "the engine failed on this request")
    if update.finish_reason == "abort":
        raise APIError(503, update.message or "the request was aborted")


def _usage(streams: list[Stream], finals: dict[int, Update]) -> dict:
    prompt = sum(len(s.prompt_token_ids) for s in streams)
    completion = sum(u.num_tokens for u in finals.values())
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


# ---- command line --------------------------------------------------------------------------------

def add_serve_command(commands) -> None:
    """Add ``serve`` to the ``python -m engine`` subcommands."""
    from engine.__main__ import add_engine_arguments

    parser = commands.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API",
                                 description="Serve /v1/completions, /v1/chat/completions, /v1/models and "
                                             "/health. Under torchrun rank 0 serves; SIGINT/SIGTERM stop every rank.")
    add_engine_arguments(parser)
    http = parser.add_argument_group("server")
    http.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    http.add_argument("--port", type=int, default=8000, help="port to bind, 0 for any free one (default 8000)")
    http.add_argument("--served-model-name", default=None,
                      help="the model name requests give (default: the model directory's name)")
    parser.set_defaults(run=serve)


def serve(args: argparse.Namespace) -> int:
    from engine.__main__ import build_engine

    engine = build_engine(args)
    if engine.tp.rank != 0:
        for sig in (signal.SIGINT, signal.SIGTERM):  # rank 0 gets them too and sends the stop command
            signal.signal(sig, lambda *_: log.warning("rank %d: waiting for rank 0's stop", engine.tp.rank))
        mirror_rank0(engine)
        return 0
    engine_loop = EngineLoop(engine)
    try:
        asyncio.run(_serve(OpenAIServer(engine_loop, args.served_model_name or Path(engine.model_dir).name),
                           args.host, args.port))
    finally:
        engine_loop.stop()
    return 1 if engine_loop.failure is not None else 0


async def _serve(server: OpenAIServer, host: str, port: int) -> None:
    """Serve until SIGINT or SIGTERM, or until the engine loop ends."""
    event_loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        event_loop.add_signal_handler(sig, server.done.set)
    try:
        port = await server.start(host, port)
        print(f"agent-infer: serving {server.model_name!r} on http://{host}:{port} (pid {os.getpid()})",
              file=sys.stderr, flush=True)
        await server.done.wait()
    finally:
        await server.stop()
