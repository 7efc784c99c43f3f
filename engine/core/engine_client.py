"""EngineClient: the one way a front (the HTTP server, ``generate``) reaches the engine -- whether its
core runs on a thread of this process (``InProcessClient``: tests, ``generate``, the curriculum's
phases) or in processes of its own (``engine.core.core_processes.CoreProcesses``: ``serve``, one core
per data-parallel rank). The front never steps and never holds the engine.

A front submits ``Stream`` s (one request each) and aborts them from any thread; whatever hears a core
(the in-process core's own thread, or a thread reading a core process) posts into each stream what a
step pushed for it (``RequestOutput`` deltas: new tokens, text, logprobs, the finish) and rings its
bell; a stream keeps only what its reader has not taken yet, so a slow reader costs O(its text) and
never stalls a core. ``compile`` compiles a request's grammar where its request will run, before the
submit. ``drain()`` refuses new streams, ``stop()`` ends the cores; ``health()`` says why the engine
cannot serve (draining, a core gone or silent for ``STALL_S``); ``failure`` is set when a core failed
(its streams end with "error" when a step failed, else "abort", with the reason) and ``on_exit`` is
called once the client can serve no more. ``metrics`` observes each core's ``EngineStats`` and the
streams' latencies (the server's ``ServerMetrics``).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import itertools
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable

from engine.core.engine_config import EngineConfig
from engine.core.engine_core import EngineCore, EngineStats
from engine.core.output_processor import RequestOutput
from engine.core.sampling_defaults import read_generation_config
from engine.scheduling.sequence import SamplingParams

log = logging.getLogger("engine.core.engine_client")

STALL_S = 120.0  # a core not heard from this long (it reports every step, and every 5 s idle): /health says so


@dataclasses.dataclass(frozen=True)
class EngineInfo:
    """What a front needs to know of the engine, from its resolved config alone (no engine built):
    the model's ``name`` and ``model_dir`` (its tokenizer), ``max_model_len``, ``vocab_size``,
    ``architecture``, ``generation_config`` (its sampling defaults) and ``max_num_seqs``."""
    name: str
    model_dir: Path
    max_model_len: int
    vocab_size: int
    architecture: str
    generation_config: dict
    max_num_seqs: int

    @classmethod
    def of(cls, config: EngineConfig) -> EngineInfo:
        m = config.model
        return cls(m.name, m.model_dir, config.scheduler.max_model_len, m.config.vocab_size, m.config.architecture,
                   read_generation_config(m.model_dir), config.scheduler.max_num_seqs)


class Stream:
    """One engine request of a front's request, from ``client`` (who sent it: a core admits
    waiting requests round robin over clients). Its core's listener ``post`` s its progress, a
    ``RequestOutput`` delta; the handler waits on ``bell`` (an asyncio.Event shared by the
    streams of one front request) and ``take`` s everything posted since it last took, merged into
    one delta. ``key`` (set by ``submit``) names it to its core, ``core`` is the core it runs on."""

    def __init__(self, prompt_token_ids: list[int], params: SamplingParams, index: int, bell: asyncio.Event,
                 client: str):
        self.prompt_token_ids, self.params, self.index, self.bell = prompt_token_ids, params, index, bell
        self.client = client
        self.event_loop = asyncio.get_running_loop()
        self.key: str | None = None
        self.core = 0
        self.aborted = False
        self.arrival = time.monotonic()
        self.text_length = 0     # posted so far (characters)
        self.num_tokens = 0      # output tokens posted so far
        self.last_token_at: float | None = None
        self._lock = threading.Lock()
        self._pending: RequestOutput | None = None

    def post(self, output: RequestOutput) -> None:
        """(The core's listener.) Add progress for the handler and ring its bell."""
        with self._lock:
            self._pending = output if self._pending is None else _merged(self._pending, output)
        try:
            self.event_loop.call_soon_threadsafe(self.bell.set)
        except RuntimeError:  # the event loop has closed: nobody is listening
            pass

    def end(self, finish_reason: str, error: str) -> None:
        """End the stream without its core: ``finish_reason`` because of ``error``."""
        self.post(RequestOutput(self.key or "", self.prompt_token_ids, [], "", True, finish_reason, error=error))

    def take(self) -> RequestOutput | None:
        """(Handler.) Everything posted since the last take (None: nothing)."""
        with self._lock:
            taken, self._pending = self._pending, None
        return taken


def _merged(first: RequestOutput, then: RequestOutput) -> RequestOutput:
    """Two consecutive deltas of one request as one."""
    logprobs = then.logprobs if first.logprobs is None else first.logprobs + (then.logprobs or [])
    return dataclasses.replace(then, token_ids=first.token_ids + then.token_ids, text=first.text + then.text,
                               logprobs=logprobs)


class Unobserved:
    """The metrics of a client nobody reads (``generate``)."""

    def observe(self, stats: EngineStats, core: int) -> None:
        pass

    def first_token(self, seconds: float) -> None:
        pass

    def next_tokens(self, count: int, seconds: float) -> None:
        pass

    def finished(self, reason: str, seconds: float) -> None:
        pass


class EngineClient:
    """The interface (module docstring) and what every client does alike: the streams by key,
    what a core's messages (``engine.core.engine_core``) do to them, draining and health. A
    client over ``num_cores`` cores implements ``start``, ``stop``, ``compile``, ``alive`` and
    ``_send(core, command)``; ``_place(stream)`` picks a stream's core (0 here)."""

    def __init__(self, info: EngineInfo, metrics, num_cores: int = 1):
        self.info, self.metrics = info, metrics
        self.failure: str | None = None
        self.on_exit: Callable[[], None] | None = None  # called once no core serves any more
        self._streams: dict[str, Stream] = {}  # unfinished streams by key
        self._lock = threading.Lock()
        self._closed: str | None = None  # why submissions are refused
        self._keys = itertools.count()
        self._heard = [time.monotonic()] * num_cores  # when each core was last heard from
        self._exited = [False] * num_cores

    # ---- what a front calls -------------------------------------------------------------------

    def start(self) -> None:
        raise NotImplementedError

    def stop(self, timeout: float = 30.0) -> None:
        """End the cores: unfinished streams end as "abort". Idempotent; waits ``timeout`` seconds."""
        raise NotImplementedError

    async def compile(self, spec, client: str) -> None:
        """Compile ``spec`` (a ``StructuredSpec``) where ``client`` 's next request will run, off the
        caller's event loop; raises the compiler's ``StructuredOutputError`` / ``GrammarBusy``."""
        raise NotImplementedError

    @property
    def alive(self) -> bool:
        raise NotImplementedError

    @property
    def pids(self) -> list[int | None]:
        """The process of each core (None: not started)."""
        raise NotImplementedError

    def submit(self, stream: Stream) -> None:
        """Send ``stream`` to its core; a RuntimeError naming why when the client is draining or down."""
        with self._lock:
            if self._closed is not None:
                raise RuntimeError(self._closed)
            stream.key = str(next(self._keys))
            stream.core = self._place(stream)
            self._streams[stream.key] = stream
            self._send(stream.core, ("add", stream.key, stream.prompt_token_ids, stream.params, stream.client))

    def abort(self, stream: Stream) -> None:
        """End ``stream`` 's request if it still runs (its last delta still comes, "abort")."""
        stream.aborted = True
        with self._lock:
            if stream.key in self._streams and not self._exited[stream.core]:
                self._send(stream.core, ("abort", stream.key))

    def drain(self, reason: str = "the server is shutting down") -> None:
        """Refuse new submissions with ``reason``; the streams already in go on."""
        with self._lock:
            self._closed = self._closed or reason

    @property
    def num_streams(self) -> int:
        """Streams submitted and not finished yet."""
        return len(self._streams)

    def health(self) -> str | None:
        """None when the engine serves, else why not."""
        if self._closed is not None:
            return self._closed
        if not self.alive:
            return "the engine core is not running"
        silent = [(time.monotonic() - heard, core) for core, heard in enumerate(self._heard)]
        seconds, core = max(silent)
        if seconds > STALL_S:
            return f"engine core {core} has not finished a step for {seconds:.0f} s"
        return None

    # ---- what a core's listener calls ---------------------------------------------------------

    def _place(self, stream: Stream) -> int:
        return 0

    def _send(self, core: int, command: tuple) -> None:
        raise NotImplementedError

    def _receive(self, core: int, message: tuple) -> None:
        """A message of ``core`` (``engine.core.engine_core``'s): post outputs into their streams and
        observe the latencies and stats, end a refused stream, or end what the core held."""
        now = self._heard[core] = time.monotonic()
        kind = message[0]
        if kind == "outputs":
            self.metrics.observe(message[2], core)  # first: a reader answered by this step sees its counts
            for key, output in message[1]:
                self._publish(key, output, now)
        elif kind == "refused":
            stream = self._streams.pop(message[1], None)
            if stream is not None:
                stream.end("error", message[2])
        elif kind == "exit":
            self._core_exited(core, *message[1:])

    def _publish(self, key: str, output: RequestOutput, now: float) -> None:
        stream = self._streams.get(key)
        if stream is None:
            return
        new_tokens = later_tokens = len(output.token_ids)
        if new_tokens:
            if stream.num_tokens == 0:
                self.metrics.first_token(now - stream.arrival)
                later_tokens -= 1
            if later_tokens:
                self.metrics.next_tokens(later_tokens, now - (stream.last_token_at or now))
            stream.last_token_at = now
        stream.num_tokens += new_tokens
        stream.text_length += len(output.text)
        stream.post(output)
        if output.finished:
            del self._streams[key]
            self.metrics.finished(output.finish_reason, now - stream.arrival)
            log.info("request %s: prompt %d tokens, output %d tokens, finished (%s) in %.3f s", key,
                     len(stream.prompt_token_ids), stream.num_tokens, output.finish_reason, now - stream.arrival)

    def _core_exited(self, core: int, reason: str, finish: str, failure: str | None) -> None:
        """``core`` ended (``failure``: why, None for a stop): no more submissions, its streams end
        as ``finish`` with ``reason``; a failed core fails the client (the cores left are stopped by
        whoever stops the client). ``failure`` is set first: whoever is refused after sees why."""
        if failure is not None and self.failure is None:
            self.failure = failure
            log.error("engine core %d failed (%s): stopping", core, failure)
        self.drain(reason)
        with self._lock:
            self._exited[core] = True
            ended = [key for key, stream in self._streams.items() if stream.core == core]
            streams = [self._streams.pop(key) for key in ended]
        for stream in streams:
            stream.end(finish, reason)
        if (failure is not None or all(self._exited)) and self.on_exit is not None:
            try:
                self.on_exit()
            except RuntimeError:  # the event loop has closed
                pass


class InProcessClient(EngineClient):
    """An ``EngineCore`` over ``engine`` on a thread of this process (the one thread that calls the
    engine: it is not thread-safe). ``call(fn)`` runs ``fn(engine)`` there between steps (tests
    inspect the engine so); ``engine`` and ``core`` stay reachable for them. ``metrics``: None for
    none (``Unobserved``)."""

    def __init__(self, engine, metrics=None):
        super().__init__(EngineInfo.of(engine.engine_config), metrics or Unobserved())
        self.engine = engine
        self.core = EngineCore(engine, lambda message: self._receive(0, message))
        self._thread = threading.Thread(target=self.core.run, name="engine-core", daemon=True)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def pids(self) -> list[int | None]:
        return [os.getpid()]

    def start(self) -> None:
        if self._thread.ident is None:
            self._thread.start()

    def join(self, timeout: float | None = None) -> None:
        """Wait for the core's thread to end (at most ``timeout`` seconds)."""
        self._thread.join(timeout)

    def call(self, fn: Callable[[Any], Any], timeout: float = 60.0) -> Any:
        """``fn(engine)`` run on the core's thread between steps (rank 0 only: no collectives)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self.core.put(("call", fn, future))
        return future.result(timeout)

    async def compile(self, spec, client: str) -> None:
        await self.engine.grammar_compiler.compile_async(spec, client=client)

    def stop(self, timeout: float = 30.0) -> None:
        """End the core; under TP the worker ranks get the stop, also when the core never started.
        A thread stuck in a collective with a lost peer is left behind, logged."""
        self.drain()
        if self._thread.ident is None:
            self.core.send_stop()
            return
        self.core.put(("stop",))
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.error("the engine core did not stop within %.0f s (a step or collective is stuck)", timeout)

    def _send(self, core: int, command: tuple) -> None:
        self.core.put(command)
