"""The HTTP server and the ``serve`` command: ``python -m engine serve``.

Routes: ``GET /health``, ``GET /metrics`` (Prometheus text), ``GET /version``, ``GET /v1/models``,
``POST /v1/completions`` and ``POST /v1/chat/completions`` (JSON, or Server-Sent Events with
``stream``), the Responses API's ``POST /v1/responses`` (``engine.entrypoints.server.responses``), Anthropic's
``POST /v1/messages`` and ``POST /v1/messages/count_tokens`` (``engine.entrypoints.server.anthropic``),
``POST /tokenize`` (``{"prompt"}`` or ``{"messages"}`` -> ``{"tokens", "count", "max_model_len"}``)
and ``POST /detokenize`` (``{"tokens"}`` -> ``{"prompt"}``). With an API key every route but
``/health``, ``/metrics`` and ``/version`` needs it. Every API takes the one path to the engine
(``engine.entrypoints.server.generation``); chat outputs are read by the tool-call and reasoning parsers
(``engine.entrypoints.server.chat_output``); a constrained request's grammar is compiled off the event loop
before it reaches the engine.

The event loop only reads bodies (at most ``--max-body-mib``) and moves bytes: inflating, parsing
and typing a body, validating it, rendering the chat template and tokenizing run on a pool of
request worker threads (``--request-workers``, default from the cores; bodies of ``LARGE_BODY_BYTES`` or
more, or compressed, in half as many worker processes, so a small request never queues behind a flood
of big ones and their parsing never holds this process's interpreter lock), each check linear in the
request's size and every list capped where it enters (``RequestLimits``); a request's work stops
when its client goes, and the engine admits waiting sequences round robin over clients, so no
request can stall the others.

Errors are error objects in each API's shape: 400 for a malformed or invalid request (one log line,
no traceback; every API's body is typed by its models, so a field of the wrong type is a 400 naming
the client's own field path), 401 without the API key, 404 for an unknown route or model, 408 when a
body has not arrived within ``--body-timeout``, 413 for a body over ``--max-body-mib`` (8; inflated
bodies too), 415 for a body that is not JSON or a ``Content-Encoding`` other than gzip, deflate or
identity, 429 when a client has too many grammars compiling, 500 when the engine failed on the
request (logged with its traceback), 503 while shutting down. Connections have deadlines and caps
(``engine.entrypoints.server.connections``). Without max_tokens a completion gets 16 tokens and a
chat completion the whole room left, each capped by max_model_len. SIGTERM (or SIGINT) drains: new
requests get 503, ``/health`` 503, in-flight ones finish for up to ``--shutdown-timeout`` seconds,
then the rest end with an error. A second signal stops at once. An engine that keeps failing its
steps, or an engine core that dies, ends the server (exit code 1, for a supervisor to restart it).

``serve`` runs the engine in processes of its own (``engine.core.core_processes``: one engine core,
or ``--data-parallel-size`` of them), so this process only speaks HTTP and its Python work never
delays a step; the server reaches them through an ``EngineClient`` (tests and the phases pass an
in-process one). Under torchrun rank 0 serves and its engine core leads the TP lock-step; every rank
steps.
"""
from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextvars
import dataclasses
import gc
import importlib.metadata
import json
import logging
import os
import signal
import ssl
import sys
import threading
import time
import tomllib
from pathlib import Path
from typing import Any, Callable

from aiohttp import web

from engine.core.core_processes import CoreProcesses
from engine.core.engine_args import EngineArgs
from engine.core.engine_client import EngineClient
from engine.core.lockstep import mirror_rank0
from engine.core.output_processor import RequestOutput
from engine.core.tokenizer import load_tokenizer
from engine.entrypoints.server import anthropic, reasoning, responses
from engine.entrypoints.server.access import (
    anthropic_error,
    api_key_middleware,
    cors_middleware,
    ssl_context,
)
from engine.entrypoints.server.body import inflate, read_body
from engine.entrypoints.server.chat_output import ChatParsing, ChatStream
from engine.entrypoints.server.connections import ConnectionLimits, Connections
from engine.entrypoints.server.generation import Generation, client_of, sse_response
from engine.entrypoints.server.metrics import ServerMetrics
from engine.entrypoints.server.openai_types import ChatRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from engine.entrypoints.server.protocol import GenerationRequest, OpenAIProtocol
from engine.entrypoints.server.request_body import (
    APIError,
    RequestLimits,
    check_content_type,
    client_gone,
    parse_json,
    stop_if_client_gone,
)
from engine.entrypoints.server.request_model import Model, validated
from engine.entrypoints.server.request_processes import ProtocolMethod, RequestProcesses
from engine.entrypoints.server.tool_parsers import tool_parser
from engine.scheduling.structured.spec import StructuredOutputError, StructuredSpec

log = logging.getLogger("engine.entrypoints.server")


LARGE_BODY_BYTES = 64 << 10  # a body this big (or compressed) is read in a request worker process


def default_request_workers() -> int:
    """Request worker threads: one per core, 2 to 8 (tokenizing releases the GIL and takes a core;
    the engine thread needs one too)."""
    return max(2, min(8, os.cpu_count() or 1))


class OpenAIServer:
    """The HTTP front of an EngineClient. ``await start(host, port)`` returns the bound port (0 picks
    a free one); ``await shutdown(timeout)`` drains; ``await stop()`` shuts HTTP and the engine
    loop down; ``done`` is set once the engine loop has ended.

    Agents' options: ``tool_call_parser`` (a name of ``engine.entrypoints.server.tool_parsers``; None: the
    architecture's default, read when a request first uses tools; "none": tools are refused),
    ``reasoning_parser`` (None: off), ``chat_template`` (replaces the tokenizer's), ``api_key``
    (None: open), ``allowed_origins`` (CORS; None: none) and ``ssl_files`` ((certfile, keyfile):
    HTTPS). Parser names given are checked here; the agent path runs only for what uses it.
    ``limits`` caps the lists a request may hold; ``request_workers`` threads parse requests (and half
    as many processes the large ones);
    ``connection_limits`` are the connections' deadlines and caps (``connections``);
    ``keepalive_interval``: the seconds after which a silent Messages or Responses stream (queued,
    or prefilling a long prompt) gets a keep-alive event, so agents' stream watchdogs wait."""

    def __init__(self, engine_client: EngineClient, model_name: str, *, tool_call_parser: str | None = None,
                 reasoning_parser: str | None = None, chat_template: str | None = None, api_key: str | None = None,
                 allowed_origins: list[str] | None = None, ssl_files: tuple[str, str] | None = None,
                 limits: RequestLimits = RequestLimits(), request_workers: int | None = None,
                 connection_limits: ConnectionLimits = ConnectionLimits(), keepalive_interval: float = 10.0):
        info = engine_client.info
        self.engine_client, self.model_name = engine_client, model_name
        self.tokenizer = load_tokenizer(info.model_dir)  # the front's own: the core decodes with its own
        if tool_call_parser is not None or reasoning_parser is not None:
            self._check_parser_names(tool_call_parser, reasoning_parser)
        protocol_options = dict(model_name=model_name, max_model_len=info.max_model_len, vocab_size=info.vocab_size,
                                tool_call_parser=tool_call_parser, reasoning_parser=reasoning_parser,
                                chat_template=chat_template, generation_config=info.generation_config,
                                architecture=info.architecture,
                                limits=dataclasses.replace(limits, sequences_per_request=(
                                    limits.sequences_per_request or 4 * info.max_num_seqs)))
        self.protocol = OpenAIProtocol(self.tokenizer, **protocol_options)
        self.max_model_len = info.max_model_len
        if not keepalive_interval > 0:
            raise ValueError(f"keepalive_interval must be > 0 seconds, got {keepalive_interval}")
        self.keepalive_interval = keepalive_interval
        self.created = int(time.time())
        self.done = asyncio.Event()
        workers = request_workers or default_request_workers()
        self.workers = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="request-worker")
        self.large_requests = RequestProcesses(max(1, workers // 2), info.model_dir, protocol_options)
        middlewares = self._access(api_key, allowed_origins or []) if api_key or allowed_origins else []
        self.ssl_context = self._tls(*ssl_files) if ssl_files else None
        self.max_body_bytes, self.connection_limits = limits.body_mib << 20, connection_limits
        self.connections = Connections(connection_limits)
        self.app = web.Application(middlewares=[self.connections.middleware, self._error_objects, *middlewares],
                                   client_max_size=self.max_body_bytes)
        self.app.add_routes([web.get("/health", self.health), web.get("/metrics", self.metrics),
                             web.get("/version", self.version), web.get("/v1/models", self.models),
                             web.post("/v1/completions", self.completions),
                             web.post("/v1/chat/completions", self.chat_completions),
                             web.post("/v1/responses", self.responses),
                             web.post("/v1/messages", self.messages),
                             web.post("/v1/messages/count_tokens", self.count_tokens),
                             web.post("/tokenize", self.tokenize), web.post("/detokenize", self.detokenize)])
        self.app.on_shutdown.append(self._stop_engine_client)
        self._runner: web.AppRunner | None = None

    async def start(self, host: str = "127.0.0.1", port: int = 8000) -> int:
        event_loop = asyncio.get_running_loop()
        self.engine_client.on_exit = lambda: event_loop.call_soon_threadsafe(self.done.set)
        if self.engine_client.failure is not None:  # a core failed before anyone listened
            self.done.set()
        # auto_decompress off: body.read_body reads a compressed body as sent, inflate inflates it under the cap
        self._runner = web.AppRunner(self.app, handler_cancellation=True, shutdown_timeout=10, access_log=None,
                                     auto_decompress=False, **self.connections.handler_options())
        await self._runner.setup()
        port = await self.connections.listen(self._runner.server, host, port, self.ssl_context)
        # What start-up made (torch, transformers, the model, ~400k objects) lives as long as the process: out of
        # the collector's sight, a full collection takes ~10 ms instead of holding the interpreter lock ~0.45 s,
        # which stalled every stream each time requests' garbage set one off (vLLM's engine core does the same).
        gc.freeze()
        self.engine_client.start()
        return port

    async def shutdown(self, timeout: float) -> None:
        """Graceful drain: refuse new requests, let those in flight finish for up to ``timeout``
        seconds, then end the rest (an error answer each) and stop."""
        self.engine_client.drain()
        log.info("draining: %d requests in flight, up to %.0f s", self.engine_client.num_streams, timeout)
        deadline = asyncio.get_running_loop().time() + timeout
        client = self.engine_client
        while client.num_streams and client.alive and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        if self.engine_client.num_streams:
            log.warning("aborting %d requests still in flight after %.0f s", self.engine_client.num_streams, timeout)
        await asyncio.to_thread(self.engine_client.stop)
        await asyncio.sleep(0.2)  # handlers write the error of what was aborted

    async def stop(self) -> None:
        self.connections.close()
        if self._runner is not None:
            await self._runner.cleanup()
        self.workers.shutdown(wait=False, cancel_futures=True)
        self.large_requests.shutdown()

    async def _stop_engine_client(self, app: web.Application) -> None:
        await asyncio.to_thread(self.engine_client.stop)

    @web.middleware
    async def _error_objects(self, request: web.Request, handler):
        """Every failure becomes an error object in the shape of the route's API (Anthropic's on
        ``/v1/messages`` and its ``count_tokens``, OpenAI's elsewhere); the server keeps serving. A
        client's fault is one log line; a failure of the server's own is logged with its traceback."""
        try:
            return await handler(request)
        except APIError as e:
            log.log(logging.ERROR if e.status >= 500 else logging.INFO, "%s %s: %d %s", request.method, request.path,
                    e.status, e.message[:200])
            return self._error_response(request, e)
        except web.HTTPException as e:  # the router's 404 / 405, an over-large body's 413
            if e.status < 400:
                raise
            where = f"{request.method} {request.path[:200]}"
            return self._error_response(request, APIError(e.status, f"{e.reason}: {where}",
                                                          code=e.reason.lower().replace(" ", "_")))
        except Exception as e:
            log.exception("request %s %s failed", request.method, request.path[:200])
            return self._error_response(request, APIError(500, f"internal error: {type(e).__name__}: {e}"))

    def _error_response(self, request: web.Request, error: APIError) -> web.Response:
        messages_api = request.match_info.route.handler in (self.messages, self.count_tokens)
        return web.json_response(self._anthropic_error(error) if messages_api else error.body(), status=error.status)

    # ---- agents (phase 14) --------------------------------------------------------------------

    @staticmethod
    def _anthropic_error(error: APIError) -> dict:
        """Anthropic's error object of ``error`` (the Messages API's routes)."""
        return anthropic_error(error.status, error.message)

    @staticmethod
    def _check_parser_names(tool_call: str | None, reasoning_name: str | None) -> None:
        """The parser names given (None: not given) name parsers: else a ValueError listing the choices."""
        if tool_call is not None:
            tool_parser(tool_call)
        if reasoning_name is not None:
            reasoning.reasoning_parser(reasoning_name)

    @staticmethod
    def _access(api_key: str | None, allowed_origins: list[str]) -> list:
        """The middlewares of CORS (for ``allowed_origins``) and the API key, outermost first: a
        browser's preflight is answered before the key is asked for."""
        return ([cors_middleware(allowed_origins)] if allowed_origins else []) + (
            [api_key_middleware(api_key)] if api_key else [])

    @staticmethod
    def _tls(certfile: str, keyfile: str) -> ssl.SSLContext:
        return ssl_context(certfile, keyfile)

    async def _compile(self, spec: StructuredSpec, client: str) -> None:
        """Compile ``spec`` off the event loop (the engine's own compile is then a cache hit), in
        ``client``'s turn; a spec the compiler refuses is a 400 naming its field, a client with too
        many compiles queued a 429."""
        from engine.scheduling.structured.compiler import GrammarBusy

        try:
            await self.engine_client.compile(spec, client)
        except GrammarBusy as e:
            raise APIError(429, str(e), param=e.param, code="too_many_grammars") from None
        except StructuredOutputError as e:
            raise APIError(400, str(e), param=e.param) from None

    @staticmethod
    def _parsed_message(parsing: ChatParsing, choice: dict) -> dict:
        """A whole chat choice with its message read by the parsers (tool calls, reasoning)."""
        message, finish_reason = parsing.message(choice["message"]["content"], choice["finish_reason"])
        return {**choice, "message": message, "finish_reason": finish_reason}

    @staticmethod
    def _chat_stream(parsing: ChatParsing) -> ChatStream:
        return parsing.stream()

    @staticmethod
    def _parsed_deltas(stream: ChatStream, update: RequestOutput) -> tuple[list[dict], str | None]:
        """The chat deltas of one update of a parsed choice, and its finish reason once it ends."""
        deltas = stream.feed(update.text)
        if not update.finished:
            return deltas, None
        more, finish_reason = stream.finish(update.finish_reason)
        return deltas + more, finish_reason

    async def responses(self, request: web.Request) -> web.StreamResponse:
        """``POST /v1/responses``: ``engine.entrypoints.server.responses``."""
        return await responses.create(self, request)

    async def messages(self, request: web.Request) -> web.StreamResponse:
        """``POST /v1/messages``: ``engine.entrypoints.server.anthropic``."""
        return await anthropic.create_message(self, request)

    async def count_tokens(self, request: web.Request) -> web.Response:
        """``POST /v1/messages/count_tokens``: ``engine.entrypoints.server.anthropic``."""
        return await anthropic.count_tokens(self, request)

    # ---- routes -------------------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        problem = self.engine_client.health()
        if problem is not None:
            raise APIError(503, problem)
        return web.json_response({"status": "ok", "engine_core_pids": self.engine_client.pids})

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self.engine_client.metrics.render(),
                            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "agent-infer",
             "max_model_len": self.max_model_len}]})

    async def version(self, request: web.Request) -> web.Response:
        """agent-infer's version: the installed package's, else (a checkout run without installing
        it, ``PYTHONPATH=.``) the one ``pyproject.toml`` declares."""
        try:
            version = importlib.metadata.version("agent-infer")
        except importlib.metadata.PackageNotFoundError:
            version = tomllib.loads((Path(__file__).parents[3] / "pyproject.toml").read_text())["project"]["version"]
        return web.json_response({"version": version})

    async def tokenize(self, request: web.Request) -> web.Response:
        tokens = await self.parse(request, TokenizeRequest, ProtocolMethod("tokenize"))
        return web.json_response({"tokens": tokens, "count": len(tokens), "max_model_len": self.max_model_len})

    async def detokenize(self, request: web.Request) -> web.Response:
        return web.json_response({"prompt": await self.parse(request, DetokenizeRequest, ProtocolMethod("detokenize"))})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, await self.parse(request, CompletionRequest, ProtocolMethod("completion")))

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, await self.parse(request, ChatRequest, ProtocolMethod("chat")))

    # ---- the path to the engine ---------------------------------------------------------------

    async def parse(self, request: web.Request, model: type[Model],
                    read: Callable[[OpenAIProtocol, Model], Any]) -> Any:
        """The request's body read on the event loop (bytes only, at most ``--max-body-mib``), then
        decoded, typed as the API's request ``model`` (every field's type checked before any logic)
        and given to ``read`` (protocol, typed request -> what it asks; a module's function or a
        protocol method) on a request worker thread, or in a request worker process when the body
        is ``LARGE_BODY_BYTES`` or more, or compressed (``request_processes``): whatever grows with
        the request runs off the event loop, and the large ones off its interpreter lock. A client
        that goes while a thread reads its request stops that work at the next stage
        (``stop_if_client_gone``); one that went before a worker took it costs nothing."""
        check_content_type(request.headers.get("Content-Type"))
        body = await read_body(request, self.max_body_bytes, self.connection_limits.body_timeout)
        if len(body.data) >= LARGE_BODY_BYTES or body.coding is not None:
            return await self.large_requests.read(body, self.max_body_bytes, model, read)
        gone = threading.Event()

        def work() -> Any:
            client_gone.set(gone)
            stop_if_client_gone()  # gone while the request waited for a worker
            decoded = parse_json(inflate(body, self.max_body_bytes))
            stop_if_client_gone()
            return read(self.protocol, validated(model, decoded, self.protocol.limits))

        try:
            return await asyncio.get_running_loop().run_in_executor(self.workers, contextvars.copy_context().run, work)
        except asyncio.CancelledError:
            gone.set()
            raise

    async def generation(self, request: web.Request, gen: GenerationRequest) -> Generation:
        """``gen`` on the engine, its grammar compiled first: both in the turn of the client who
        sent it (``client_of``: the compile queue's and the engine's admission round robin)."""
        client = client_of(request)
        if gen.structured is not None:
            await self._compile(gen.structured, client)
        return Generation(self.engine_client, gen, client)

    async def _generate(self, request: web.Request, gen: GenerationRequest) -> web.StreamResponse:
        generation = await self.generation(request, gen)
        try:
            if gen.stream:
                return await self._stream(request, generation)
            return await self._answer(generation)
        finally:  # a client gone (the handler cancelled) or an error: end what is still running
            generation.close()

    async def _answer(self, generation: Generation) -> web.Response:
        gen, choices, outputs = generation.gen, [], await generation.outputs()
        for s, out in zip(generation.streams, outputs):
            text, lp = out.text, self.protocol.logprobs_object(gen.chat, out.logprobs) if gen.logprobs else None
            if gen.echo:
                text, lp = self._echoed(gen, s.prompt_token_ids, out.final, text, out.logprobs)
            choice = self.protocol.choice(gen.chat, s.index, text, out.final.finish_reason, lp)
            if gen.prompt_logprobs is not None:
                choice["prompt_logprobs"] = self.protocol.prompt_logprobs_object(out.final.prompt_logprobs,
                                                                                 gen.prompt_logprobs)
            choices.append(choice if gen.parsing is None else self._parsed_message(gen.parsing, choice))
        num_tokens = 0 if gen.drop_output else sum(out.num_tokens for out in outputs)
        return web.json_response({**self.protocol.head(gen.chat, stream=False), "choices": choices,
                                  "usage": generation.usage(num_tokens)})

    def _echoed(self, gen: GenerationRequest, prompt_token_ids: list[int], update: RequestOutput, text: str,
                items: list) -> tuple[str, dict | None]:
        """An echoed completion choice's first (or whole) text and its logprobs object (None: not
        asked): the prompt's text and logprobs, then the output's (none when it is dropped, max_tokens
        0), whose text offsets count from the prompt text's end."""
        if gen.drop_output:
            text, items = "", []
        prompt_text, lp = self.protocol.tokenizer.decode(prompt_token_ids), None
        if gen.logprobs:
            echoed = self.protocol.echoed_logprobs(prompt_token_ids, update.prompt_logprobs, gen.num_logprobs)
            lp = self.protocol.logprobs_object(False, items, len(prompt_text))
            lp = {k: v + lp[k] for k, v in self.protocol.logprobs_object(False, echoed).items()}
        return prompt_text + text, lp

    async def _stream(self, request: web.Request, generation: Generation) -> web.StreamResponse:
        """Server-Sent Events: a chunk per step that produced tokens for a choice (clients see the
        time of every token, as TTFT / ITL measure it), the finish reasons, a usage chunk if
        asked, then ``data: [DONE]``. The engine holds back text that could still become a stop
        string (``OutputProcessor``), so the streamed text equals the non-streaming text."""
        gen, streams = generation.gen, generation.streams
        response = await sse_response(request)
        head = self.protocol.head(gen.chat, stream=True)

        async def send(data: dict | str) -> None:
            await response.write(f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n".encode())

        sent = [0] * len(streams)         # characters sent
        tokens = [0] * len(streams)
        parsers = None if gen.parsing is None else [self._chat_stream(gen.parsing) for _ in streams]
        try:
            if gen.chat:
                for s in streams:
                    await send({**head, "choices": [self.protocol.delta(True, s.index, "", None, None, opening=True)]})
            async for i, update in generation.updates():
                s = streams[i]
                lp = (self.protocol.logprobs_object(gen.chat, update.logprobs, sent[i])
                      if gen.logprobs and update.logprobs else None)
                if gen.echo:
                    text, lp = (self._echoed(gen, s.prompt_token_ids, update, update.text, update.logprobs or [])
                                if tokens[i] == 0 else ("", None) if gen.drop_output else (update.text, lp))
                    update = dataclasses.replace(update, text=text)
                if parsers is None:
                    delta = self.protocol.delta(gen.chat, s.index, update.text, update.finish_reason, lp)
                    if gen.prompt_logprobs is not None and tokens[i] == 0:
                        delta["prompt_logprobs"] = self.protocol.prompt_logprobs_object(update.prompt_logprobs,
                                                                                        gen.prompt_logprobs)
                    await send({**head, "choices": [delta]})
                else:  # one chunk per delta the parsers make; the logprobs ride on the first
                    deltas, finish_reason = self._parsed_deltas(parsers[i], update)
                    if deltas or lp is not None or update.finished:
                        deltas = deltas or [{}]
                        for k, delta in enumerate(deltas):
                            await send({**head, "choices": [{
                                "index": s.index, "delta": delta, "logprobs": lp if k == 0 else None,
                                "finish_reason": finish_reason if k == len(deltas) - 1 else None}]})
                sent[i] += len(update.text)
                tokens[i] += len(update.token_ids)
            if gen.include_usage:
                await send({**head, "choices": [], "usage": generation.usage(0 if gen.drop_output else sum(tokens))})
            await send("[DONE]")
            await response.write_eof()
        except APIError as e:  # a choice failed: an error chunk ends the stream, without [DONE]
            await _quietly(send(e.body()))
        except ConnectionResetError:  # the client went away
            pass
        return response


async def _quietly(write) -> None:
    """``await write``, unless the client has gone."""
    try:
        await write
    except ConnectionResetError:
        pass


# ---- command line --------------------------------------------------------------------------------

def add_serve_command(commands) -> None:
    """Add ``serve`` to the ``python -m engine`` subcommands."""
    parser = commands.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API",
                                 description="Serve /v1/completions, /v1/chat/completions, /v1/responses, "
                                             "/v1/messages (Anthropic), /v1/messages/count_tokens, /v1/models, "
                                             "/tokenize, /detokenize, /version, /health and /metrics. Under torchrun "
                                             "rank 0 serves; SIGTERM or SIGINT drains (a second one stops at once) "
                                             "and stops every rank.")
    EngineArgs.add_cli_args(parser)
    http = parser.add_argument_group("server")
    http.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    http.add_argument("--port", type=int, default=8000, help="port to bind, 0 for any free one (default 8000)")
    http.add_argument("--served-model-name", default=None,
                      help="the model name requests give (default: the --model Hub id as given, else the model "
                           "directory's name)")
    http.add_argument("--shutdown-timeout", type=float, default=30.0,
                      help="on SIGTERM, seconds the requests in flight may take to finish (default 30)")
    http.add_argument("--stats-interval", type=float, default=10.0,
                      help="seconds between the stats lines logged while busy (default 10)")
    http.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                      help="log level (default info: a line per finished request and the stats lines)")
    http.add_argument("--keepalive-interval", type=float, default=10.0, metavar="SECONDS",
                      help="a /v1/messages or /v1/responses stream silent this long (queued, or prefilling a long "
                           "prompt) gets a keep-alive event, so agents' stream watchdogs wait (default 10)")
    http.add_argument("--data-parallel-size", type=int, default=1, metavar="N",
                      help="engine cores, each a whole replica in its own process (on CUDA one GPU each: cuda:0 .. "
                           "N-1), behind this one server; requests go to the least loaded core, or back to the core "
                           "that ran the same prompt start (default 1)")
    http.add_argument("--request-workers", type=int, default=None, metavar="N",
                      help="threads that parse, validate and tokenize requests off the event loop "
                           f"(default: one per core, 2 to 8; {default_request_workers()} here)")
    RequestLimits.add_cli_args(parser.add_argument_group("request limits (each checked before any work that grows "
                                                         "with it)"))
    ConnectionLimits.add_cli_args(parser.add_argument_group("connections (deadlines and caps: no client holds "
                                                            "connections open for free)"))
    agents = parser.add_argument_group("agents and access")
    agents.add_argument("--tool-call-parser", default=None,
                        help="how tool calls are read from the output: hermes (Qwen's <tool_call> blocks), "
                             "llama3_json, or none (tools refused); default: the architecture's")
    agents.add_argument("--reasoning-parser", default=None,
                        help="split the reasoning off the output into reasoning_content: qwen3 or deepseek_r1 "
                             "(default: off)")
    agents.add_argument("--chat-template", default=None, metavar="FILE",
                        help="a Jinja chat template file replacing the tokenizer's")
    agents.add_argument("--api-key", default=os.environ.get("AGENT_INFER_API_KEY"),
                        help="every route but /health, /metrics and /version needs 'Authorization: Bearer KEY' "
                             "(default: $AGENT_INFER_API_KEY; unset: open)")
    agents.add_argument("--allowed-origins", nargs="+", default=None, metavar="ORIGIN",
                        help="origins browsers may call from (CORS; '*' for any; default: none)")
    agents.add_argument("--ssl-certfile", default=None, help="serve HTTPS with this PEM certificate chain")
    agents.add_argument("--ssl-keyfile", default=None, help="the private key of --ssl-certfile")
    parser.set_defaults(run=serve)


def serve(args: argparse.Namespace, core_setup: Callable[[], None] | None = None) -> int:
    """``python -m engine serve``; ``core_setup`` (picklable) runs in each engine core process before
    its engine is built (a preset's random weights)."""
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = dataclasses.replace(EngineArgs.from_cli_args(args), serving=True).create_engine_config()
    rank, world_size = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    if world_size > 1 and args.data_parallel_size > 1:
        raise SystemExit("serve: --data-parallel-size > 1 runs whole replicas; under torchrun (tensor parallel) "
                         "there is one engine core")
    if rank != 0:  # a TP worker: follows the lock-step of rank 0's engine core
        from engine.core.llm_engine import LLMEngine

        engine = LLMEngine(config)
        for sig in (signal.SIGINT, signal.SIGTERM):  # rank 0 gets them too and sends the stop
            signal.signal(sig, lambda *_: log.warning("rank %d: waiting for rank 0's stop", rank))
        mirror_rank0(engine)
        return 0
    if (args.ssl_certfile is None) != (args.ssl_keyfile is None):
        raise SystemExit("serve: --ssl-certfile and --ssl-keyfile go together")
    chat_template = Path(args.chat_template).read_text() if args.chat_template else None
    engine_client = CoreProcesses(config, ServerMetrics(args.stats_interval), args.data_parallel_size, core_setup)
    try:
        engine_client.start()
        server = OpenAIServer(engine_client, args.served_model_name or config.model.name,
                              tool_call_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser,
                              chat_template=chat_template, api_key=args.api_key,
                              allowed_origins=args.allowed_origins,
                              ssl_files=(args.ssl_certfile, args.ssl_keyfile) if args.ssl_certfile else None,
                              limits=RequestLimits.from_cli_args(args), request_workers=args.request_workers,
                              connection_limits=ConnectionLimits.from_cli_args(args),
                              keepalive_interval=args.keepalive_interval)
        asyncio.run(_serve(server, args.host, args.port, args.shutdown_timeout))
    finally:
        engine_client.stop()
    return 1 if engine_client.failure is not None else 0


async def _serve(server: OpenAIServer, host: str, port: int, shutdown_timeout: float) -> None:
    """Serve until the engine loop ends or a signal's drain completes; a second signal stops at once."""
    event_loop = asyncio.get_running_loop()
    draining: list[asyncio.Task] = []

    def on_signal():
        if draining:
            server.done.set()
            return
        draining.append(event_loop.create_task(server.shutdown(shutdown_timeout)))
        draining[0].add_done_callback(lambda _: server.done.set())

    for sig in (signal.SIGINT, signal.SIGTERM):
        event_loop.add_signal_handler(sig, on_signal)
    try:
        port = await server.start(host, port)
        scheme = "https" if server.ssl_context else "http"
        print(f"agent-infer: serving {server.model_name!r} on {scheme}://{host}:{port} (pid {os.getpid()})",
              file=sys.stderr, flush=True)
        await server.done.wait()
    finally:
        await server.stop()
