"""Large requests read in worker processes of their own, so their parsing never holds the front's
interpreter lock.

A request thread that parses megabytes of JSON, renders a template over a hundred tool schemas and
tokenizes the result takes the interpreter lock from the event loop at every turn: each socket read
and write of the event loop gives the lock up and waits for it again (measured on 2 cores: a witness
stream's chunks waited up to 0.6 s beside six clients sending 2.6 MiB requests back to back, the
event loop lagging 200-320 ms). ``RequestProcesses`` runs such requests (``read_large``: inflate,
decode, type and read one body) in ``workers`` spawned processes, each holding its own
``OpenAIProtocol`` built from the same arguments (tokenizer, chat template, parsers, limits); what a
read returns (a ``GenerationRequest``, token ids, a count) and the ``APIError`` it raises come back
pickled, a few KiB; a read is a module's function or a ``ProtocolMethod``. The workers run at a
lower scheduling priority (``NICENESS``): where cores are few, the engine cores' steps and the event
loop come first. The pool starts with the first large request; a worker that died (the OOM killer)
fails its request with a 500 and the next request gets a new pool.

A worker dies with the thread that started it (Linux's parent-death signal): a pool the server could
not shut down (the server killed, a test session ended with ``os._exit``) leaves no process behind, and
none holding the server's output open. A read that has started in a process runs to its end even when
its client has gone (a thread's
read stops at its next stage): a large request costs at most one read of ``--max-body-mib``.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import multiprocessing
import os
import signal
import sys
import threading
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Any, Callable

from engine.core.tokenizer import load_tokenizer
from engine.entrypoints.server.body import RawBody, inflate
from engine.entrypoints.server.protocol import OpenAIProtocol
from engine.entrypoints.server.request_body import APIError, parse_json
from engine.entrypoints.server.request_model import Model, validated

NICENESS = 5  # the workers' scheduling priority below the front's and the engine cores'
_PR_SET_PDEATHSIG = 1  # prctl(2)
_protocol: OpenAIProtocol | None = None  # a worker process's own


def _start(parent: int, model_dir, protocol_options: dict) -> None:
    global _protocol
    if sys.platform == "linux":  # killed when the thread that started it ends (the server's event loop)
        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:  # it ended before the line above
            os._exit(0)
    os.nice(NICENESS)
    _protocol = OpenAIProtocol(load_tokenizer(model_dir), **protocol_options)


def read_large(body: RawBody, max_bytes: int, model: type[Model], read: Callable[[OpenAIProtocol, Model], Any]) -> Any:
    """(A worker process.) ``body`` inflated, decoded, typed as ``model`` and given to ``read``
    with this process's protocol."""
    return read(_protocol, validated(model, parse_json(inflate(body, max_bytes)), _protocol.limits))


@dataclass(frozen=True)
class ProtocolMethod:
    """The read ``protocol.<name>(request)`` as a value that pickles by name, so a request worker
    process runs it with its own protocol (and a thread with the server's, as it stands)."""
    name: str

    def __call__(self, protocol: OpenAIProtocol, request: Model) -> Any:
        return getattr(protocol, self.name)(request)


class RequestProcesses:
    """At most ``workers`` processes reading large requests with a protocol of
    ``OpenAIProtocol(load_tokenizer(model_dir), **protocol_options)``."""

    def __init__(self, workers: int, model_dir, protocol_options: dict):
        self.workers, self.model_dir, self.protocol_options = workers, model_dir, protocol_options
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None
        self._lock = threading.Lock()

    async def read(self, body: RawBody, max_bytes: int, model: type[Model],
                   read: Callable[[OpenAIProtocol, Model], Any]) -> Any:
        """``read_large`` in a worker process (``read`` must pickle: a module's function or a
        protocol method); a worker that died is a 500 and a new pool for the next request."""
        pool = self._current()
        try:
            return await asyncio.wrap_future(pool.submit(read_large, body, max_bytes, model, read))
        except BrokenProcessPool:
            with self._lock:
                if self._pool is pool:
                    self._pool = None
            pool.shutdown(wait=False, cancel_futures=True)
            raise APIError(500, "the process reading this request died (out of memory?)") from None

    def _current(self) -> concurrent.futures.ProcessPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = concurrent.futures.ProcessPoolExecutor(
                    self.workers, mp_context=multiprocessing.get_context("spawn"), initializer=_start,
                    initargs=(os.getpid(), self.model_dir, self.protocol_options))
            return self._pool

    def pids(self) -> list[int]:
        """The worker processes running now (none before the first large request)."""
        with self._lock:
            return [] if self._pool is None else list(self._pool._processes or {})

    def shutdown(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
