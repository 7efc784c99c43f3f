"""Grammar compilation with xgrammar, out of the engine loop's way: worker processes that try each
spec first, a queue in front of them fair across clients, one compile per spec however many
requests ask for it, and an LRU cache bounded in bytes.

Pool. At most ``workers`` worker processes (``compile_worker.CompileWorker``, forkserver-started
by the first compile that misses the cache), each driven by a thread of this process. A spec is
compiled in a worker first; only a spec the worker compiled in time and within the size allowed
is compiled again here, on that thread (xgrammar releases the GIL, so the engine loop runs; the
compile is deterministic, so it ends in about the worker's time), and its grammar cached. No
grammar comes back from a worker: why is in ``compile_worker``.

Time limit. A compile that runs in its worker past ``timeout_s`` is stopped: the process is
killed (the worker's next compile starts another, in ~10 ms) and the spec is cached as refused
("compiling the grammar took longer than N s"), so asking again is answered at once. The limit
counts the spec's own compile, never the time it queued.

Fairness. Queued specs are served in turns across clients (``client``: whoever the caller says
sent the request, e.g. its address): a free worker takes the oldest spec of the client with the
fewest compiles running, among equals the one served longest ago. So one client's flood of slow
specs delays another client's compile by at most about one ``timeout_s`` (its share of the
workers' time), and never makes it fail. A client
has at most ``max_queued_per_client`` distinct specs queued or compiling; past that its request
gets :class:`GrammarBusy`. An identical spec compiles once: its request joins the job queued or
running for it. A request that stops waiting (a cancelled asyncio task: the client left) leaves
the job; a queued job that nobody waits for any more is dropped before it starts.

Memory. The cache holds at most ``cache_bytes`` (a grammar counts its ``memory_size_bytes``, a
refusal 1 KiB), the least recently used out first. A grammar bigger than ``max_grammar_bytes``
is refused ("the compiled grammar takes N MiB, more than the M MiB allowed") and never compiled
here. What a compile allocates in a worker returns to the OS with the process: a killed worker
goes, and one whose resident memory grew by more than ``recycle_bytes`` is replaced after its
compile. Here, a compile of a grammar of 1 MiB or more, or one that evicted others, is followed
by glibc's ``malloc_trim``, which gives the heap's free pages back (else they stay with the
process).

``close()`` (run at interpreter exit too) fails the queued compiles, kills the workers (their
compiles fail) and returns once the processes and their threads have ended (a compile running
here, on a thread, ends first).
"""
from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import ctypes
import threading
from collections import Counter, OrderedDict, deque
from collections.abc import Iterable
from dataclasses import dataclass, field

import xgrammar as xgr

from engine.scheduling.structured.compile_worker import CLOSED, CompileWorker, compile_spec
from engine.scheduling.structured.spec import StructuredOutputError, StructuredSpec

MiB = 1 << 20
_REFUSED_BYTES = 1024  # what a cached refusal counts (its key and message) against cache_bytes
_TRIM_BYTES = MiB  # a grammar this big or bigger is followed by malloc_trim
_MALLOC_TRIM = getattr(ctypes.CDLL(None), "malloc_trim", None)  # glibc's; None elsewhere


class GrammarBusy(StructuredOutputError):
    """The client has ``max_queued_per_client`` distinct specs queued or compiling already: retry
    once they are done (a 429, not a 400: the spec may be fine)."""


@dataclass(frozen=True)
class _Refused:
    """A spec's compile outcome when it has no grammar: why (cached like a grammar)."""
    message: str


@dataclass(eq=False)
class _Job:
    """One compile of ``spec``; ``future`` resolves to a ``CompiledGrammar`` or a ``_Refused``.
    ``waiters`` counts the requests waiting for it, by client; ``client`` is the one whose turn
    started it (None while queued)."""
    spec: StructuredSpec
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    waiters: Counter = field(default_factory=Counter)
    client: str | None = None


class _FairQueue:
    """Queued jobs by client. The next job is the oldest of the client with the fewest jobs
    compiling and, among equals, served longest ago (a client served goes behind the others, one
    with nothing queued comes in ahead of them): while one client's jobs hold every worker,
    another's is the next to start. A job is in the queue of each client that asked for it before
    it started; started once, its other entries are skipped, as are those of a job nobody waits
    for any more (dropped)."""

    def __init__(self):
        self._queues: OrderedDict[str, deque[_Job]] = OrderedDict()
        self._compiling: Counter[str] = Counter()

    def put(self, client: str, job: _Job) -> None:
        if client not in self._queues:
            self._queues[client] = deque()
            self._queues.move_to_end(client, last=False)
        self._queues[client].append(job)

    def take(self) -> _Job | None:
        """The next job to start (now counted as its client's), or None when none waits."""
        while self._queues:
            client = min(self._queues, key=self._compiling.__getitem__)  # the first of the least busy
            jobs = self._queues.pop(client)
            job = jobs.popleft()
            if jobs:
                self._queues[client] = jobs  # behind the other clients now
            if job.client is None and job.waiters:
                job.client = client
                self._compiling[client] += 1
                return job
        return None

    def done(self, job: _Job) -> None:
        """``job`` (taken) no longer compiles."""
        self._compiling[job.client] -= 1
        if not self._compiling[job.client]:
            del self._compiling[job.client]

    def clear(self) -> list[_Job]:
        """Empty the queue; returns the jobs it held that had not started and were waited for, once each."""
        jobs = {id(job): job for queue in self._queues.values() for job in queue if job.client is None and job.waiters}
        self._queues.clear()
        return list(jobs.values())


class _Cache:
    """Compile outcomes by spec key, least recently used first, ``max_bytes`` in all at most (a
    grammar counts its ``memory_size_bytes``, a refusal 1 KiB; one bigger than the whole is not kept)."""

    def __init__(self, max_bytes: int):
        self.max_bytes, self.bytes = max_bytes, 0
        self.entries: OrderedDict[str, xgr.CompiledGrammar | _Refused] = OrderedDict()

    def get(self, key: str) -> xgr.CompiledGrammar | _Refused | None:
        outcome = self.entries.get(key)
        if outcome is not None:
            self.entries.move_to_end(key)
        return outcome

    def put(self, key: str, outcome: xgr.CompiledGrammar | _Refused) -> int:
        """Keep ``outcome`` under ``key`` (not there yet), evicting the least recently used
        first; returns the bytes evicted."""
        size, evicted = _size(outcome), 0
        if size > self.max_bytes:
            return 0
        while self.bytes + size > self.max_bytes:
            freed = _size(self.entries.popitem(last=False)[1])
            self.bytes -= freed
            evicted += freed
        self.entries[key] = outcome
        self.bytes += size
        return evicted


def _size(outcome: xgr.CompiledGrammar | _Refused) -> int:
    return _REFUSED_BYTES if isinstance(outcome, _Refused) else outcome.memory_size_bytes


def _trim() -> None:
    """Give the heap's free pages back to the OS (glibc's ``malloc_trim``; nothing elsewhere)."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


class GrammarCompiler:
    """Compiles :class:`StructuredSpec` s into ``xgrammar.CompiledGrammar`` s for one tokenizer.

    ``vocab_size`` is the model's (the logits' width; it may exceed the tokenizer's, ids past
    the tokenizer's are never allowed). ``stop_token_ids`` are the engine's EOS ids: a completed
    grammar allows exactly them. JSON is generated without free whitespace unless
    ``any_whitespace`` (xgrammar's default separators ", " and ": " on one line): with free
    whitespace a model can loop on whitespace tokens. ``json_object`` is the schema
    ``{"type": "object"}``: any object, as OpenAI's JSON mode and vLLM have it.

    ``compile`` (blocking) and ``compile_async`` (asyncio) are safe from any thread or event
    loop; the module docstring tells the pool, the time limit, the fairness across ``client`` s
    and the memory bounds (``cache_bytes``, ``max_grammar_bytes``, ``recycle_bytes``).
    """

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: Iterable[int], *, workers: int = 2,
                 timeout_s: float = 10.0, any_whitespace: bool = False, cache_bytes: int = 256 * MiB,
                 max_grammar_bytes: int = 64 * MiB, max_queued_per_client: int = 8, recycle_bytes: int = 64 * MiB):
        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                                 stop_token_ids=sorted(stop_token_ids))
        self._xgrammar = xgr.GrammarCompiler(self.tokenizer_info, max_threads=1, cache_enabled=False)
        self.timeout_s, self.any_whitespace = timeout_s, any_whitespace
        self.max_grammar_bytes, self.max_queued_per_client = max_grammar_bytes, max_queued_per_client
        info = self.tokenizer_info.serialize_json()
        self._workers = [CompileWorker(f"grammar-compile-worker-{i}", info, any_whitespace, recycle_bytes)
                         for i in range(workers)]
        self._lock = threading.Lock()
        self._queued = threading.Condition(self._lock)
        self._cache = _Cache(cache_bytes)
        self._jobs: dict[str, _Job] = {}
        self._queue = _FairQueue()
        self._pending: Counter[str] = Counter()  # by client: the distinct jobs it waits for
        self._threads: list[threading.Thread] = []
        self._closed = False

    def compile(self, spec: StructuredSpec, client: str = "") -> xgr.CompiledGrammar:
        """The compiled grammar of ``spec``, blocking the calling thread while it queues and
        compiles. Raises :class:`StructuredOutputError` (param ``spec.param``) when xgrammar
        refuses the spec, its compile runs past the limit or its grammar is too big, and
        :class:`GrammarBusy` when ``client`` has too many specs pending. A cached spec returns
        the same object."""
        found = self._claim(spec, client)
        if not isinstance(found, _Job):
            return self._grammar(spec, found)
        try:
            outcome = found.future.result()
        finally:
            self._release(found, client)
        return self._grammar(spec, outcome)

    async def compile_async(self, spec: StructuredSpec, client: str = "") -> xgr.CompiledGrammar:
        """``compile`` for an asyncio caller: the event loop runs while the spec queues and
        compiles. A cancelled caller (a client gone) stops waiting; the compile goes on for the
        others waiting, and a queued one nobody waits for any more is dropped."""
        found = self._claim(spec, client)
        if not isinstance(found, _Job):
            return self._grammar(spec, found)
        try:
            await asyncio.wait([asyncio.wrap_future(found.future)])
        finally:
            self._release(found, client)
        return self._grammar(spec, found.future.result())

    def close(self) -> None:
        """Fail the queued compiles, kill the workers and wait for them and their threads to end."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            dropped = self._queue.clear()
            for job in dropped:
                del self._jobs[job.spec.key]
            self._queued.notify_all()
        for job in dropped:
            job.future.set_exception(RuntimeError(CLOSED))
        for worker in self._workers:
            worker.close()
        for thread in self._threads:
            thread.join()
        atexit.unregister(self.close)

    def _claim(self, spec: StructuredSpec, client: str) -> xgr.CompiledGrammar | _Refused | _Job:
        """The cached outcome of ``spec``, else the job compiling it (joined, or queued now) with
        one more waiter from ``client``."""
        with self._lock:
            if self._closed:
                raise RuntimeError(CLOSED)
            outcome = self._cache.get(spec.key)
            if outcome is not None:
                return outcome
            job = self._jobs.get(spec.key)
            joined = job is not None and job.waiters[client] > 0
            if not joined and self._pending[client] >= self.max_queued_per_client:
                raise GrammarBusy(spec.param, f"'{spec.param}' cannot be compiled now: {self._pending[client]} "
                                              "grammars of this client are queued or compiling; retry once they end")
            if job is None:
                job = self._jobs[spec.key] = _Job(spec)
                self._start_thread()
            if not joined:
                self._pending[client] += 1
                if job.client is None:
                    self._queue.put(client, job)
                    self._queued.notify()
            job.waiters[client] += 1
            return job

    def _release(self, job: _Job, client: str) -> None:
        """A waiter from ``client`` is done with ``job``; a job left without waiters before it
        started is dropped."""
        with self._lock:
            job.waiters[client] -= 1
            if job.waiters[client] == 0:
                del job.waiters[client]
                self._pending[client] -= 1
                if self._pending[client] == 0:
                    del self._pending[client]
            if not job.waiters and job.client is None and self._jobs.get(job.spec.key) is job:
                del self._jobs[job.spec.key]

    def _start_thread(self) -> None:
        """Start the next worker's thread, while some worker has none (the lock held)."""
        if len(self._threads) == len(self._workers):
            return
        if not self._threads:
            atexit.register(self.close)
        worker = self._workers[len(self._threads)]
        thread = threading.Thread(target=self._drive, args=(worker,), name=worker.name, daemon=True)
        self._threads.append(thread)
        thread.start()

    def _drive(self, worker: CompileWorker) -> None:
        """A worker's thread: compile the jobs it takes until the compiler closes, then reap the worker."""
        try:
            while (job := self._next_job()) is not None:
                try:
                    outcome = self._outcome(worker, job.spec)
                except Exception as e:  # closed, or an unexpected failure: for the waiters, not cached
                    self._fail(job, e)
                else:
                    self._finish(job, outcome)
        finally:
            worker.stop()

    def _next_job(self) -> _Job | None:
        """The next queued job (round-robin across clients), waiting for one; None once closed."""
        with self._lock:
            while not self._closed:
                job = self._queue.take()
                if job is not None:
                    return job
                self._queued.wait()
            return None

    def _outcome(self, worker: CompileWorker, spec: StructuredSpec) -> xgr.CompiledGrammar | _Refused:
        """Compile ``spec`` in ``worker``, then here if the worker's verdict allows it."""
        verdict = worker.probe(spec, self.timeout_s)
        if verdict is None:
            return _Refused(f"compiling the grammar took longer than {self.timeout_s:g} s")
        if verdict.error:
            raise RuntimeError(f"compiling the grammar failed: {verdict.error}")
        if verdict.refused:
            return _Refused(verdict.refused)
        if verdict.grammar_bytes > self.max_grammar_bytes:
            return _Refused(f"the compiled grammar takes {verdict.grammar_bytes / MiB:.1f} MiB, more than the "
                            f"{self.max_grammar_bytes / MiB:g} MiB allowed")
        return compile_spec(self._xgrammar, spec, self.any_whitespace)

    def _finish(self, job: _Job, outcome: xgr.CompiledGrammar | _Refused) -> None:
        """Cache ``job``'s outcome, then hand it to its waiters; trim the heap after a big grammar."""
        with self._lock:
            del self._jobs[job.spec.key]
            self._queue.done(job)
            evicted = self._cache.put(job.spec.key, outcome)
        job.future.set_result(outcome)
        if evicted or _size(outcome) >= _TRIM_BYTES:
            _trim()

    def _fail(self, job: _Job, error: Exception) -> None:
        with self._lock:
            del self._jobs[job.spec.key]
            self._queue.done(job)
        job.future.set_exception(error)

    @staticmethod
    def _grammar(spec: StructuredSpec, outcome: xgr.CompiledGrammar | _Refused) -> xgr.CompiledGrammar:
        if isinstance(outcome, _Refused):
            raise StructuredOutputError(spec.param, f"'{spec.param}' cannot be compiled: {outcome.message}")
        return outcome
