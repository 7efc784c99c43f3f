"""The one thread that calls the engine (rank 0 of the core's TP lock-step), the error policy and draining.

HTTP handlers ``submit`` and ``abort`` streams from their own thread. Between steps the engine
thread adds and aborts what they queued, steps while there is work, and posts into each stream
what the step pushed for its request (the engine's ``RequestOutput`` deltas: new tokens, new
text, new logprobs, the finish); a stream keeps only what its reader has not taken yet, so a
slow reader costs O(its text) and never stalls the loop. A finished request is forgotten by the
engine at once.

Under torchrun rank 0 serves HTTP and leads the core's lock-step (``engine.core.lockstep``): every
iteration it sends the other ranks its adds and aborts, and every rank applies them and steps in
the same order; the other ranks only follow (``mirror_rank0``).

Error policy: in one process a step that raises fails the requests of the steps in flight (an
error answer each; the engine goes on), so a request that breaks a step harms only its batch. Steps
that fail ``MAX_FAILED_STEPS`` times in a row mean the engine itself is broken (a device error that
stays): the loop ends, every stream gets the error, ``/health`` answers 503 and ``serve`` exits
with status 1, for a supervisor to restart it, rather than staying up half-alive. Under TP it is
fatal at once: the rank that raised missed its
peers' collectives, so the loop ends without sending anything more (a stop message could meet a
peer waiting in another collective), every stream gets the error, and the process exits; the
peers' next collective fails or torchrun stops them. A failure outside a step still sends the
stop (the peers wait for the next header) and ends the streams as aborted (503). ``health()``
reports a loop that has ended, is draining, or is in a step older than ``STALL_S`` (a peer gone).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import queue
import threading
import time
from typing import Any, Callable

from engine.core.lockstep import apply_commands, run_step, send_commands
from engine.core.output_processor import RequestOutput
from engine.entrypoints.server.metrics import ServerMetrics
from engine.scheduling.sequence import SamplingParams

log = logging.getLogger("engine.entrypoints.server")

HEARTBEAT_S = 5.0  # an idle rank 0 still sends a header this often, far inside the collective timeout
STALL_S = 120.0  # an iteration with work pending taking longer than this: /health says so
MAX_FAILED_STEPS = 3  # steps failing in a row: the engine is broken, not a request


class Stream:
    """One engine request of an HTTP request, from ``client`` (who sent it: the engine admits
    waiting requests round robin over clients). The engine thread ``post``s its progress, a
    ``RequestOutput`` delta; the handler waits on ``bell`` (an asyncio.Event shared by the
    streams of one HTTP request) and ``take``s everything posted since it last took, merged into
    one delta."""

    def __init__(self, prompt_token_ids: list[int], params: SamplingParams, index: int, bell: asyncio.Event,
                 client: str):
        self.prompt_token_ids, self.params, self.index, self.bell = prompt_token_ids, params, index, bell
        self.client = client
        self.event_loop = asyncio.get_running_loop()
        self.request_id: str | None = None  # set by the engine thread
        self.aborted = False
        self.arrival = time.monotonic()
        self.text_length = 0     # engine side: text posted so far (characters)
        self.num_tokens = 0      # engine side: output tokens posted so far
        self.last_token_at: float | None = None
        self._lock = threading.Lock()
        self._pending: RequestOutput | None = None

    def post(self, output: RequestOutput) -> None:
        """(Engine thread.) Add progress for the handler and ring its bell."""
        with self._lock:
            self._pending = output if self._pending is None else _merged(self._pending, output)
        try:
            self.event_loop.call_soon_threadsafe(self.bell.set)
        except RuntimeError:  # the event loop has closed: nobody is listening
            pass

    def end(self, finish_reason: str, error: str) -> None:
        """(Engine thread.) End the stream without the engine: ``finish_reason`` because of ``error``."""
        self.post(RequestOutput(self.request_id or "", self.prompt_token_ids, [], "", True, finish_reason,
                                error=error))

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


class EngineLoop:
    """The one thread that calls the engine (it is not thread-safe). Handlers ``submit`` and
    ``abort`` streams from any thread; ``drain()`` refuses new ones; ``stop()`` ends the loop
    (and the worker ranks)."""

    def __init__(self, engine, metrics: ServerMetrics | None = None):
        self.engine = engine
        self.metrics = metrics or ServerMetrics()
        self.failure: BaseException | None = None
        self.on_exit: Callable[[], None] | None = None  # called on the engine thread as it ends
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, Stream] = {}  # unfinished requests by engine request id
        self._lock = threading.Lock()
        self._closed: str | None = None  # why submissions are refused
        self._stop_sent = False
        self._busy_since: float | None = None  # when the current step started (None: not stepping)
        self._failed_in_step = False
        self._failed_steps = 0  # steps failed in a row
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def num_streams(self) -> int:
        """Streams submitted and not finished yet (queued ones included)."""
        return len(self._streams) + self._inbox.qsize()

    def health(self) -> str | None:
        """None when healthy, else why not."""
        if self._closed is not None:
            return self._closed
        if not self.alive:
            return "the engine loop is not running"
        busy = self._busy_since
        if busy is not None and time.monotonic() - busy > STALL_S:
            return f"the engine loop has not finished a step for {time.monotonic() - busy:.0f} s"
        return None

    def start(self) -> None:
        self._thread.start()

    def join(self, timeout: float | None = None) -> None:
        """Wait for the engine thread to end (at most ``timeout`` seconds)."""
        self._thread.join(timeout)

    def submit(self, stream: Stream) -> None:
        self._put(("add", stream))

    def abort(self, stream: Stream) -> None:
        stream.aborted = True
        self._put(("abort", stream), closed_ok=True)

    def call(self, fn: Callable[[Any], Any], timeout: float = 60.0) -> Any:
        """``fn(engine)`` run on the engine thread between steps, on rank 0 only (so no collectives)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._put(("call", fn, future), closed_ok=True)
        return future.result(timeout)

    def drain(self, reason: str = "the server is shutting down") -> None:
        """Refuse new submissions with ``reason``; the streams already in go on."""
        with self._lock:
            self._closed = self._closed or reason

    def stop(self, timeout: float = 30.0) -> None:
        """End the loop: unfinished streams end as "abort"; worker ranks get the stop. Idempotent;
        also sends the stop when the loop never started. Waits ``timeout`` seconds for the thread
        (a thread stuck in a collective with a lost peer is left behind, logged)."""
        self.drain()
        if self._thread.ident is None:
            self._send_stop()
            return
        self._put(("stop",), closed_ok=True)
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.error("the engine loop did not stop within %.0f s (a step or collective is stuck)", timeout)

    def _put(self, item: tuple, closed_ok: bool = False) -> None:
        with self._lock:
            if self._closed is not None and not closed_ok:
                raise RuntimeError(self._closed)
            self._inbox.put(item)

    def _send_stop(self) -> None:
        """The stop to the other ranks, unless a step failed (a peer may wait in another collective)."""
        if not self._stop_sent and not self._failed_in_step:
            self._stop_sent = True
            send_commands([], True)

    def _run(self) -> None:
        engine = self.engine
        if engine.device.type == "cuda":
            import torch

            torch.cuda.set_device(engine.device)
        try:
            while True:
                commands, streams, stop = self.take_commands()
                self._stop_sent = stop
                send_commands(commands, stop)
                for stream, request_id in zip(streams, apply_commands(engine, commands)):
                    if request_id is None:
                        stream.end("error", "the engine refused the request")
                    else:
                        stream.request_id = request_id
                        self._streams[request_id] = stream
                if stop:
                    break
                if commands or engine.has_unfinished_requests():
                    self._busy_since = time.monotonic()
                    outputs, error = run_step(engine)
                    self._publish(outputs)
                    self._failed_steps = self._failed_steps + 1 if error else 0
                    if self._failed_steps >= MAX_FAILED_STEPS:
                        raise RuntimeError(f"{MAX_FAILED_STEPS} engine steps failed in a row, the last: {error}")
                    self._busy_since = None
                self.metrics.observe(engine)
        except BaseException as e:
            self.failure = e
            self._failed_in_step = self._busy_since is not None
            log.exception("the engine loop failed; stopping the server")
        finally:
            try:
                self._send_stop()
            except Exception:
                log.exception("could not send the stop to the other ranks")
            if self._failed_in_step:
                self._close(f"the engine failed: {type(self.failure).__name__}: {self.failure}", "error")
            else:
                self._close("the server is shutting down" if self.failure is None else "the engine loop failed")
            if self.on_exit is not None:
                try:
                    self.on_exit()
                except RuntimeError:  # the event loop has closed
                    pass

    def take_commands(self) -> tuple[list[tuple], list[Stream], bool]:
        """Drain the inbox (waiting up to HEARTBEAT_S when the engine is idle): the commands to
        send, the stream of each add, and whether to stop. Calls run here."""
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
                commands.append(("add", rest[0].prompt_token_ids, rest[0].params, rest[0].client))
                streams.append(rest[0])
            elif kind == "abort" and rest[0].request_id is not None and rest[0].request_id in self._streams:
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

    def _publish(self, outputs: list[RequestOutput]) -> None:
        """Post what a step pushed into each request's stream; forget the finished requests."""
        now = time.monotonic()
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:  # not a stream's (a request the engine holds for no one)
                continue
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
                del self._streams[output.request_id]
                self.engine.pop_request(output.request_id)
                self.metrics.finished(output.finish_reason, now - stream.arrival)
                log.info("request %s: prompt %d tokens, output %d tokens, finished (%s) in %.3f s",
                         output.request_id, len(stream.prompt_token_ids), stream.num_tokens, output.finish_reason,
                         now - stream.arrival)

    def _close(self, reason: str, finish: str = "abort") -> None:
        """No more submissions; every stream still waiting ends as ``finish`` ("abort", or "error"
        when a step failed: the engine's state is lost) with ``reason``."""
        self.drain(reason)
        if not self._failed_in_step:
            for request_id in list(self._streams):
                try:
                    self.engine.abort_request(request_id)
                    self.engine.pop_request(request_id)
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
            stream.end(finish, reason)
        self._streams.clear()
