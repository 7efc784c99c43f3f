"""EngineCore: the step loop over one ``LLMEngine`` -- commands in, each step's outputs out. It is the
part of serving that owns the scheduler and the runner: ``serve`` runs it in a process of its own
(``engine.core.core_processes``), tests, ``generate`` and the phases on a thread of theirs
(``engine.core.engine_client.InProcessClient``); the front that talks to it never steps.

Commands (``put``, from any thread; a front's key names each request, the engine's own ids stay inside):
``("add", key, prompt_token_ids, params, client)``, ``("abort", key)``, ``("call", fn, future)`` (in
one process only: ``fn(engine)`` between steps, its result into the ``concurrent.futures.Future``) and
``("stop",)``. Messages out (``send``, on the loop's thread, in order):

- ``("outputs", [(key, RequestOutput), ...], EngineStats)`` after every iteration with work (the
  step's deltas, a finished request's last one included: the core forgets it then) and, while idle,
  every ``HEARTBEAT_S`` without outputs (a front tells a stalled core from an idle one by them);
- ``("refused", key, message)``: the engine refused an add (it never ran);
- last, ``("exit", reason, finish, failure)``: the loop has ended; every request still held ends as
  ``finish`` ("abort" on a stop, "error" when a step failed and the state is lost) because of
  ``reason``; ``failure`` is what ended it ("RuntimeError: ..."), None for a stop.

Under torchrun the core is rank 0 of the TP lock-step (``engine.core.lockstep``): every iteration it
sends the other ranks its adds and aborts, and every rank applies them and steps in the same order.

Error policy: in one process a step that raises fails the requests of the steps in flight (an error
output each; the core goes on), so a request that breaks a step harms only its batch. Steps failing
``MAX_FAILED_STEPS`` times in a row mean the engine itself is broken (a device error that stays): the
loop ends with that error. Under TP it is fatal at once: the rank that raised missed its peers'
collectives, so the loop ends without sending the other ranks anything more (a stop message could meet
a peer waiting in another collective); their next collective fails or torchrun stops them. A failure
outside a step still sends them the stop.
"""
from __future__ import annotations

import logging
import queue
import time
from dataclasses import dataclass
from typing import Callable

from engine.core.lockstep import apply_commands, run_step, send_commands

log = logging.getLogger("engine.core.engine_core")

HEARTBEAT_S = 5.0  # an idle core still sends its stats (and rank 0 a lock-step header) this often
MAX_FAILED_STEPS = 3  # steps failing in a row: the engine is broken, not a request


@dataclass(frozen=True)
class EngineStats:
    """What a core reports after each iteration: requests ``running`` and ``waiting``, the fraction
    of KV blocks in use, and running totals (prefix-cache lookups and hits in tokens, prompt tokens
    admitted, tokens generated; speculative decoding's drafted tokens verified and accepted, the
    verify entries that drafted, and per draft position the drafts accepted there), and the
    speculative ``spec_decode_method`` ("" when off)."""
    running: int
    waiting: int
    kv_usage: float
    prefix_queries: int
    prefix_hits: int
    prompt_tokens: int
    generation_tokens: int
    spec_decode_num_draft_tokens: int
    spec_decode_num_accepted_tokens: int
    spec_decode_num_drafts: int = 0
    spec_decode_num_accepted_per_position: tuple[int, ...] = ()
    spec_decode_method: str = ""

    @classmethod
    def of(cls, engine) -> EngineStats:
        scheduler, bm = engine.scheduler, engine.block_manager
        return cls(len(scheduler.running), len(scheduler.waiting), 1 - bm.num_free_blocks / bm.num_blocks,
                   bm.num_prefix_queries, bm.num_prefix_hits, engine.num_prompt_tokens,
                   engine.num_generation_tokens, scheduler.num_draft_tokens, scheduler.num_accepted_tokens,
                   scheduler.num_drafts, tuple(scheduler.num_accepted_per_position),
                   engine.engine_config.speculative.method or "")


class EngineCore:
    """Runs ``engine`` (an ``LLMEngine``, rank 0 under TP) until a stop: ``put`` commands from any
    thread, ``run()`` on the one thread that may call the engine; ``send`` gets the messages out
    (module docstring). ``busy_since`` is when the step in progress started (None: not stepping)."""

    def __init__(self, engine, send: Callable[[tuple], None]):
        self.engine, self.send = engine, send
        self.busy_since: float | None = None
        self.failure: BaseException | None = None
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._keys: dict[str, str] = {}  # engine request id -> the front's key, of unfinished requests
        self._request_ids: dict[str, str] = {}  # the front's key -> engine request id
        self._stop_sent = False
        self._failed_in_step = False
        self._failed_steps = 0  # steps failed in a row

    def put(self, command: tuple) -> None:
        self._inbox.put(command)

    def send_stop(self) -> None:
        """The stop to the other TP ranks, once, unless a step failed (a peer may wait in another
        collective); also for a core whose loop never ran."""
        if not self._stop_sent and not self._failed_in_step:
            self._stop_sent = True
            send_commands([], True)

    def run(self) -> None:
        """The loop: take commands, step while there is work, send what each step pushed; ends on
        a stop or a fatal failure with the ``exit`` message, also when the failure is re-raised."""
        engine, failure = self.engine, None
        if engine.device.type == "cuda":
            import torch

            torch.cuda.set_device(engine.device)
        quiet_since = time.monotonic()
        try:
            while True:
                commands, keys, stop = self.take_commands()
                self._stop_sent = stop
                send_commands(commands, stop)
                for key, request_id in zip(keys, apply_commands(engine, commands)):
                    if request_id is None:
                        self.send(("refused", key, "the engine refused the request"))
                    else:
                        self._keys[request_id], self._request_ids[key] = key, request_id
                if stop:
                    break
                if commands or engine.has_unfinished_requests():
                    self.busy_since = time.monotonic()
                    outputs, error = run_step(engine)
                    self._failed_steps = self._failed_steps + 1 if error else 0
                    self.send(("outputs", self._keyed(outputs), EngineStats.of(engine)))
                    if self._failed_steps >= MAX_FAILED_STEPS:
                        raise RuntimeError(f"{MAX_FAILED_STEPS} engine steps failed in a row, the last: {error}")
                    self.busy_since, quiet_since = None, time.monotonic()
                elif time.monotonic() - quiet_since >= HEARTBEAT_S:
                    self.send(("outputs", [], EngineStats.of(engine)))
                    quiet_since = time.monotonic()
        except BaseException as e:
            failure = e
            self._failed_in_step = self.busy_since is not None
            log.exception("the engine loop failed")
        finally:
            self._end(failure)

    def _keyed(self, outputs: list) -> list[tuple[str, object]]:
        """A step's outputs by the front's keys; finished requests are forgotten (popped) here."""
        keyed = []
        for output in outputs:
            key = self._keys.get(output.request_id)
            if key is None:  # a request held for no one
                continue
            keyed.append((key, output))
            if output.finished:
                del self._keys[output.request_id], self._request_ids[key]
                self.engine.pop_request(output.request_id)
        return keyed

    def take_commands(self) -> tuple[list[tuple], list[str], bool]:
        """Drain the inbox (waiting up to HEARTBEAT_S when the engine is idle): the lock-step
        commands, each add's key, and whether to stop. Calls run here."""
        items = []
        if not self.engine.has_unfinished_requests():
            try:
                items.append(self._inbox.get(timeout=HEARTBEAT_S))
            except queue.Empty:
                pass
        while not self._inbox.empty():
            items.append(self._inbox.get())
        commands, keys, stop, aborted = [], [], False, set()
        for kind, *rest in items:
            if kind == "abort":
                aborted.add(rest[0])
        for kind, *rest in items:
            if kind == "add" and rest[0] not in aborted:  # added and aborted in one go: never runs
                key, token_ids, params, client = rest
                commands.append(("add", token_ids, params, client))
                keys.append(key)
            elif kind == "abort" and rest[0] in self._request_ids:
                commands.append(("abort", self._request_ids[rest[0]]))
            elif kind == "call":
                fn, future = rest
                try:
                    future.set_result(fn(self.engine))
                except Exception as e:
                    future.set_exception(e)
            elif kind == "stop":
                stop = True
        return commands, keys, stop

    def _end(self, failure: BaseException | None) -> None:
        """Send the other ranks the stop (unless a step failed: a peer may wait in another
        collective), end what is held and send the ``exit`` message."""
        try:
            self.send_stop()
        except Exception:
            log.exception("could not send the stop to the other ranks")
        if self._failed_in_step:
            reason, finish = f"the engine failed: {type(failure).__name__}: {failure}", "error"
        else:
            reason, finish = "the server is shutting down" if failure is None else "the engine loop failed", "abort"
            for request_id in list(self._keys):
                try:
                    self.engine.abort_request(request_id)
                    self.engine.pop_request(request_id)
                except Exception:
                    log.exception("could not abort request %s", request_id)
        while not self._inbox.empty():
            kind, *rest = self._inbox.get()
            if kind == "call":
                rest[1].set_exception(RuntimeError(reason))
        self._keys.clear()
        self._request_ids.clear()
        self.failure = failure
        self.send(("exit", reason, finish, None if failure is None else f"{type(failure).__name__}: {failure}"))
