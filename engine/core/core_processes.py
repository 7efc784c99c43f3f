"""Engine cores in processes of their own: ``CoreProcesses`` is the ``EngineClient`` of ``serve``, so
no Python work of the front (parsing, templates, tokenising, SSE) holds the interpreter lock a step
needs, and a front that dies cannot leave a core half-served.

Each core is a spawned process (``run_core``) that builds the ``LLMEngine`` from the resolved config
and runs an ``EngineCore`` on its main thread; a reader thread there takes the front's commands off
its pipe, and grammar compiles run on an event loop thread of the core (the grammar must live where
its request runs). The front reads each core's messages on a thread of its own and posts them into
the streams. Messages are tuples of builtins and dataclasses pickled over a
``multiprocessing.Pipe``: one message per step, whatever the batch (docs/architecture.md has its
cost).

Data parallelism: ``num_cores`` > 1 runs that many cores (on CUDA core i on ``cuda:i``; on the CPU,
each its own process). A request goes to the core that last ran a prompt with the same first
blocks (``PREFIX_BLOCKS`` whole KV blocks, hashed) while that core has at most ``LOAD_SLACK`` more
streams than the least loaded one, else to the least loaded (a grammar request to the core that
compiled its grammar). Under torchrun (tensor parallel) there is one core, rank 0 of the TP
lock-step; the other ranks follow it as before (``engine.core.lockstep.mirror_rank0``).

Faults: a core that dies (its pipe ends before its exit message) fails the client: its streams end
with "error", submissions are refused and ``on_exit`` runs, so ``serve`` exits non-zero for its
supervisor. A front that dies closes the pipes: each core's reader sees the end, stops its core and
the process exits. Cores ignore SIGINT and SIGTERM (a terminal's Ctrl-C or a supervisor's signal to
the process group reaches them too): the front drains, then stops them.
"""
from __future__ import annotations

import asyncio
import atexit
import dataclasses
import gc
import hashlib
import itertools
import logging
import multiprocessing
import signal
import threading
from collections import OrderedDict
from typing import Callable

import torch

from engine.core.engine_client import EngineClient, EngineInfo, Stream
from engine.core.engine_config import EngineConfig
from engine.core.engine_core import EngineCore

log = logging.getLogger("engine.core.core_processes")

PREFIX_BLOCKS = 2  # the whole KV blocks of a prompt whose hash sends it back to the core that ran them
LOAD_SLACK = 8  # streams a prefix's core may have beyond the least loaded core's and still get it
AFFINITY_ENTRIES = 65536  # prefixes (and grammars) remembered, the least recently used out first
START_TIMEOUT_S = 900.0


class CoreProcesses(EngineClient):
    """``num_cores`` engine cores over ``config``, each in a spawned process (module docstring);
    ``setup`` (picklable) runs in each before its engine is built.
    ``start()`` returns once every core has built its engine (a core that fails to start raises a
    RuntimeError naming why); ``pids`` are the cores' process ids."""

    def __init__(self, config: EngineConfig, metrics, num_cores: int = 1, setup: Callable[[], None] | None = None):
        if num_cores < 1:
            raise ValueError(f"--data-parallel-size must be >= 1, got {num_cores}")
        super().__init__(EngineInfo.of(config), metrics, num_cores)
        self.block_size = config.cache.block_size
        context = multiprocessing.get_context("spawn")
        self._pipes, self._core_ends, self._processes = [], [], []
        for core in range(num_cores):
            front_end, core_end = context.Pipe()
            self._pipes.append(front_end)
            self._core_ends.append(core_end)  # closed here once the process has it
            # not a daemon: a core starts processes of its own (grammar compile workers); stop() ends it, and
            # the end of its pipe when this process dies
            self._processes.append(context.Process(target=run_core, args=(_config_of_core(config, core), core_end,
                                                                          core, setup), name=f"engine-core-{core}"))
        self._send_locks = [threading.Lock() for _ in range(num_cores)]
        self._listeners = [threading.Thread(target=self._listen, args=(core,), name=f"engine-core-{core}-listener",
                                            daemon=True) for core in range(num_cores)]
        self._load = [0] * num_cores
        self._turn = 0
        self._prefix_core: OrderedDict[bytes, int] = OrderedDict()
        self._grammar_core: OrderedDict[str, int] = OrderedDict()
        self._calls: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._call_ids = itertools.count()
        self._stopping = False

    @property
    def pids(self) -> list[int | None]:
        return [process.pid for process in self._processes]

    @property
    def alive(self) -> bool:
        return not any(self._exited) and all(process.is_alive() for process in self._processes)

    def start(self, timeout: float = START_TIMEOUT_S) -> None:
        if self._processes[0].pid is not None:
            return
        for process, core_end in zip(self._processes, self._core_ends):
            process.start()
            core_end.close()
        for core, pipe in enumerate(self._pipes):
            message = pipe.recv() if pipe.poll(timeout) else ("exit", "no answer", "abort", "did not start in time")
            if message[0] != "ready":
                self.stop()
                why = message[3] if message[0] == "exit" else message
                raise RuntimeError(f"engine core {core} failed to start: {why}")
        for listener in self._listeners:
            listener.start()
        log.info("engine cores started: %s", ", ".join(f"core {i} pid {pid}" for i, pid in enumerate(self.pids)))

    def stop(self, timeout: float = 30.0) -> None:
        """Stop every core still running and wait for it (``timeout`` seconds each, then it is killed)."""
        self.drain()
        self._stopping = True
        for core, process in enumerate(self._processes):
            if process.is_alive():
                try:
                    self._send(core, ("stop",))
                except OSError:
                    pass
        for core, process in enumerate(self._processes):
            if process.pid is None:
                continue
            process.join(timeout)
            if process.is_alive():
                log.error("engine core %d did not stop within %.0f s: killing it", core, timeout)
                process.kill()
                process.join(5)
        for listener in self._listeners:
            if listener.ident is not None:
                listener.join(5)

    async def compile(self, spec, client: str) -> None:
        from engine.scheduling.structured.compiler import GrammarBusy
        from engine.scheduling.structured.spec import StructuredOutputError

        core = self._grammar_core.get(spec.key)
        if core is None:
            core = self._least_loaded()
        call_id, future = next(self._call_ids), asyncio.get_running_loop().create_future()
        self._calls[call_id] = (asyncio.get_running_loop(), future)
        try:
            self._send(core, ("compile", call_id, spec, client))
            error = await future
        finally:
            self._calls.pop(call_id, None)
        if error is not None:
            kind, param, message = error
            raise (GrammarBusy if kind == "GrammarBusy" else StructuredOutputError)(param, message)
        self._remember(self._grammar_core, spec.key, core)

    # ---- placement ----------------------------------------------------------------------------

    def _least_loaded(self) -> int:
        """The core with the fewest streams; among equals, the next in turn."""
        n = len(self._load)
        self._turn = (self._turn + 1) % n
        return min(range(n), key=lambda core: (self._load[core], (core - self._turn) % n))

    def _place(self, stream: Stream) -> int:
        """(The client's lock held.) The core ``stream`` runs on (module docstring)."""
        structured = stream.params.structured
        if structured is not None and structured.key in self._grammar_core:
            core = self._grammar_core[structured.key]
        else:
            core = least = self._least_loaded()
            prefix = self._prefix_key(stream.prompt_token_ids)
            if prefix is not None:
                held = self._prefix_core.get(prefix)
                if held is not None and self._load[held] <= self._load[least] + LOAD_SLACK:
                    core = held
                self._remember(self._prefix_core, prefix, core)
        self._load[core] += 1
        return core

    def _prefix_key(self, token_ids: list[int]) -> bytes | None:
        """The hash of the prompt's first ``PREFIX_BLOCKS`` whole blocks (fewer when it has fewer;
        None: not one whole block)."""
        whole = min(len(token_ids) // self.block_size, PREFIX_BLOCKS) * self.block_size
        if not whole:
            return None
        return hashlib.blake2b(repr(token_ids[:whole]).encode(), digest_size=16).digest()

    @staticmethod
    def _remember(table: OrderedDict, key, core: int) -> None:
        table[key] = core
        table.move_to_end(key)
        if len(table) > AFFINITY_ENTRIES:
            table.popitem(last=False)

    # ---- the pipes ----------------------------------------------------------------------------

    def _send(self, core: int, command: tuple) -> None:
        with self._send_locks[core]:
            self._pipes[core].send(command)

    def _listen(self, core: int) -> None:
        """Core ``core`` 's messages into the streams until its exit message or the end of its pipe
        (the process died: the client fails)."""
        pipe = self._pipes[core]
        while True:
            try:
                message = pipe.recv()
            except (EOFError, OSError):
                process = self._processes[core]
                process.join(5)
                if not self._exited[core]:
                    why = f"engine core {core} (pid {process.pid}) died, exit code {process.exitcode}"
                    self._core_exited(core, why, "error", why)
                return
            if message[0] == "compiled":
                self._answer(*message[1:])
                continue
            if message[0] in ("outputs", "refused", "exit"):
                self._unload(core, message)
            self._receive(core, message)
            if message[0] == "exit":
                return

    def _unload(self, core: int, message: tuple) -> None:
        """Count the streams a message ends off their core's load."""
        if message[0] == "outputs":
            ended = sum(output.finished for _, output in message[1])
        elif message[0] == "refused":
            ended = message[1] in self._streams
        else:
            ended = self._load[core]
        with self._lock:
            self._load[core] -= ended

    def _answer(self, call_id: int, error: tuple | None) -> None:
        loop, future = self._calls.get(call_id, (None, None))
        if future is not None:
            loop.call_soon_threadsafe(lambda: future.done() or future.set_result(error))


def _config_of_core(config: EngineConfig, core: int) -> EngineConfig:
    """Core ``core`` 's config: on CUDA its own GPU (``cuda:core``); the CPU is shared."""
    device = config.parallel.device
    if device.type != "cuda" or core == 0:
        return config
    return dataclasses.replace(config, parallel=dataclasses.replace(config.parallel,
                                                                    device=torch.device("cuda", core)))


# ---- the core process ----------------------------------------------------------------------------

def run_core(config: EngineConfig, pipe, core: int, setup: Callable[[], None] | None = None) -> None:
    """A core process: build the engine, say ready, then run its ``EngineCore`` until a stop or the end
    of the pipe (the front gone). Sends ``("ready", pid)`` first, or ``("exit", ...)`` when the
    engine cannot be built."""
    import os

    from engine.core.llm_engine import LLMEngine

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s core {core} %(name)s: %(message)s")
    send_lock = threading.Lock()

    def send(message: tuple) -> None:
        with send_lock:
            try:
                pipe.send(message)
            except OSError:  # the front has gone; the reader stops the core
                pass

    try:
        if setup is not None:
            setup()
        engine = LLMEngine(config)
    except BaseException as e:
        send(("exit", f"the engine could not be built: {type(e).__name__}: {e}", "error",
              f"{type(e).__name__}: {e}"))
        raise
    core_loop = EngineCore(engine, send)
    compiles = asyncio.new_event_loop()
    threading.Thread(target=compiles.run_forever, name="grammar-compiles", daemon=True).start()

    async def compile_spec(call_id: int, spec, client: str) -> None:
        try:
            await engine.grammar_compiler.compile_async(spec, client=client)
            error = None
        except Exception as e:  # StructuredOutputError, GrammarBusy: the front raises them again
            error = (type(e).__name__, getattr(e, "param", None), str(e))
        send(("compiled", call_id, error))

    def read() -> None:
        while True:
            try:
                command = pipe.recv()
            except (EOFError, OSError):
                log.warning("the front has gone: stopping")
                core_loop.put(("stop",))
                return
            if command[0] == "compile":
                asyncio.run_coroutine_threadsafe(compile_spec(*command[1:]), compiles)
            else:
                core_loop.put(command)
            if command[0] == "stop":
                return

    threading.Thread(target=read, name="engine-core-reader", daemon=True).start()
    # What start-up made (torch, the model, ~400k objects) lives as long as the process: out of the collector's
    # sight, a full collection takes ~10 ms instead of holding the interpreter lock ~0.45 s mid-step
    gc.freeze()
    send(("ready", os.getpid()))
    core_loop.run()
    # the exit message is sent: run the exit handlers (the grammar compiler's workers go), then leave without
    # waiting for threads (one stuck in a collective, or a library's, must not hold the process)
    atexit._run_exitfuncs()
    logging.shutdown()
    os._exit(0 if core_loop.failure is None else 1)
