"""Grammar compilation with xgrammar, off the engine loop: a bounded pool of worker threads, one
compile per spec however many requests ask for it at once, an LRU cache of the results, and a
time limit.

The time limit (``timeout_s``) bounds how long a request waits for its grammar, queueing
included: past it the request gets ``StructuredOutputError("compiling the grammar took longer
than N s")`` (a 400). An xgrammar compile cannot be cancelled, so a compile that has started runs
to its end on its worker; then, if the compile itself ran longer than ``timeout_s``, its grammar
is dropped and the spec is cached as refused (later requests for it get the same error at once
and take no worker), else the grammar is cached (it was late only because it queued). A queued
compile that every request waiting for it has given up on is cancelled before it starts. At most
``workers`` compiles run at once, each on one thread (xgrammar's own parallelism is off), so
however many pathological schemas arrive they take at most ``workers`` cores from the engine
loop and each distinct one runs once; requests queued behind them wait, up to their limit. A
process exiting waits for the compiles running then (as for any ``ThreadPoolExecutor``): a
worker cut off inside xgrammar at exit would abort the process.

xgrammar releases the GIL while it compiles, so the engine loop runs meanwhile.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import json
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

import xgrammar as xgr

from engine.structured.spec import StructuredOutputError, StructuredSpec

# xgrammar prefixes its messages with "[HH:MM:SS] /path/file.cc:LINE: "
_XGRAMMAR_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:[0-9]+: ", re.MULTILINE)
# xgrammar (0.2.9) lowers a JSON string with minLength / maxLength to a repetition of the first
# class, which admits raw control characters: invalid JSON (mlc-ai/xgrammar#800; fix proposed in
# #880). The second is the class its unbounded strings use, less the escapes' backslash.
_BOUNDED_STRING_CHAR, _JSON_STRING_CHAR = r'[^\"\\\r\n]', r'[^\0-\x1f\"\\]'


@dataclass(frozen=True)
class _Refused:
    """A spec's compile outcome when it has no grammar: why (cached like a grammar)."""
    message: str


@dataclass
class _Job:
    """One compile of ``spec``, shared by the ``waiters`` requests waiting for it; ``future``
    (the pool's) resolves to a ``CompiledGrammar`` or a ``_Refused``."""
    spec: StructuredSpec
    future: concurrent.futures.Future
    waiters: int = 0


def json_schema_grammar(schema: str, any_whitespace: bool) -> xgr.Grammar:
    """xgrammar's grammar of ``schema`` (JSON text), with length-bounded strings kept to JSON's
    characters (no raw control characters; as in xgrammar, no escapes in them either)."""
    grammar = xgr.Grammar.from_json_schema(schema, any_whitespace=any_whitespace)
    ebnf = str(grammar)
    if _BOUNDED_STRING_CHAR not in ebnf:
        return grammar
    return xgr.Grammar.from_ebnf(ebnf.replace(_BOUNDED_STRING_CHAR, _JSON_STRING_CHAR))


def choice_grammar(choices: list[str]) -> str:
    """EBNF whose root matches exactly one of ``choices``: each a string literal escaped as JSON
    escapes it (quotes, backslashes and control characters; other characters verbatim), which
    xgrammar's EBNF reads back to the same string."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class GrammarCompiler:
    """Compiles :class:`StructuredSpec` s into ``xgrammar.CompiledGrammar`` s for one tokenizer.

    ``vocab_size`` is the model's (the logits' width; it may exceed the tokenizer's, ids past
    the tokenizer's are never allowed). ``stop_token_ids`` are the engine's EOS ids: a completed
    grammar allows exactly them. JSON is generated without free whitespace unless
    ``any_whitespace`` (xgrammar's default separators ", " and ": " on one line): with free
    whitespace a model can loop on whitespace tokens. ``json_object`` is the schema
    ``{"type": "object"}``: any object, as OpenAI's JSON mode and vLLM have it.

    ``compile`` (blocking) and ``compile_async`` (asyncio) are safe from any thread or event
    loop; see the module docstring for the pool, the cache and the time limit. ``close()`` cancels
    the queued compiles.
    """

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: Iterable[int], *, workers: int = 2,
                 cache_size: int = 128, timeout_s: float = 10.0, any_whitespace: bool = False):
        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                                 stop_token_ids=sorted(stop_token_ids))
        self._xgrammar = xgr.GrammarCompiler(self.tokenizer_info, max_threads=1, cache_enabled=False)
        self.timeout_s, self.cache_size, self.any_whitespace = timeout_s, cache_size, any_whitespace
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, xgr.CompiledGrammar | _Refused] = OrderedDict()
        self._jobs: dict[str, _Job] = {}
        self._pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="grammar-compiler")

    def compile(self, spec: StructuredSpec) -> xgr.CompiledGrammar:
        """The compiled grammar of ``spec``, waiting at most ``timeout_s`` (blocks the calling
        thread). Raises :class:`StructuredOutputError` (param ``spec.param``) when xgrammar
        refuses the spec or the wait runs past the limit. A cached spec returns the same object."""
        found = self._claim(spec)
        if not isinstance(found, _Job):
            return self._grammar(spec, found)
        try:
            outcome = found.future.result(timeout=self.timeout_s)
        except concurrent.futures.TimeoutError:
            outcome = self._too_slow()
        finally:
            self._release(found)
        return self._grammar(spec, outcome)

    async def compile_async(self, spec: StructuredSpec) -> xgr.CompiledGrammar:
        """``compile`` for an asyncio caller: the event loop runs while the compile does. A
        cancelled caller (a client gone) stops waiting; the compile goes on for other waiters."""
        found = self._claim(spec)
        if not isinstance(found, _Job):
            return self._grammar(spec, found)
        try:
            done, _ = await asyncio.wait([asyncio.wrap_future(found.future)], timeout=self.timeout_s)
        finally:
            self._release(found)
        return self._grammar(spec, done.pop().result() if done else self._too_slow())

    def close(self) -> None:
        """Cancel the queued compiles; the workers stop once the running ones end."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _claim(self, spec: StructuredSpec) -> xgr.CompiledGrammar | _Refused | _Job:
        """The cached outcome of ``spec``, else the job compiling it (joined, or queued now)."""
        with self._lock:
            outcome = self._cache.get(spec.key)
            if outcome is not None:
                self._cache.move_to_end(spec.key)
                return outcome
            job = self._jobs.get(spec.key)
            if job is None:  # the worker's _run takes the lock: it sees the job registered
                job = self._jobs[spec.key] = _Job(spec, self._pool.submit(self._run, spec))
            job.waiters += 1
            return job

    def _release(self, job: _Job) -> None:
        """A waiter is done with ``job``; the last one cancels it if it has not started."""
        with self._lock:
            job.waiters -= 1
            if job.waiters == 0 and job.future.cancel() and self._jobs.get(job.spec.key) is job:
                del self._jobs[job.spec.key]

    def _run(self, spec: StructuredSpec) -> xgr.CompiledGrammar | _Refused:
        """On a worker: compile ``spec`` and cache the outcome (before the job's future resolves
        to it). An error that is not xgrammar refusing the spec reaches the waiters, uncached."""
        start = time.monotonic()
        try:
            outcome = self._compile_now(spec)
        except (RuntimeError, ValueError) as e:  # xgrammar: the regex / EBNF / schema is refused
            outcome = _Refused(_XGRAMMAR_PREFIX.sub("", str(e)).strip())
        except Exception:
            with self._lock:
                del self._jobs[spec.key]
            raise
        if time.monotonic() - start > self.timeout_s:
            outcome = self._too_slow()
        with self._lock:
            del self._jobs[spec.key]
            self._cache[spec.key] = outcome
            if len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return outcome

    def _compile_now(self, spec: StructuredSpec) -> xgr.CompiledGrammar:
        if spec.kind in ("json_schema", "json_object"):
            schema = spec.value if spec.kind == "json_schema" else '{"type": "object"}'
            return self._xgrammar.compile_grammar(json_schema_grammar(schema, self.any_whitespace))
        if spec.kind == "regex":
            return self._xgrammar.compile_regex(spec.value)
        if spec.kind == "choice":
            return self._xgrammar.compile_grammar(choice_grammar(json.loads(spec.value)))
        if spec.kind == "tool_call":
            call = json.loads(spec.value)
            return self._xgrammar.compile_grammar(xgr.Grammar.concat(
                *(xgr.Grammar.from_ebnf(choice_grammar([text])) for text in (call["prefix"],) if text),
                json_schema_grammar(json.dumps(call["schema"]), self.any_whitespace),
                *(xgr.Grammar.from_ebnf(choice_grammar([text])) for text in (call["suffix"],) if text)))
        return self._xgrammar.compile_grammar(spec.value)

    def _too_slow(self) -> _Refused:
        return _Refused(f"compiling the grammar took longer than {self.timeout_s:g} s")

    @staticmethod
    def _grammar(spec: StructuredSpec, outcome: xgr.CompiledGrammar | _Refused) -> xgr.CompiledGrammar:
        if isinstance(outcome, _Refused):
            raise StructuredOutputError(spec.param, f"'{spec.param}' cannot be compiled: {outcome.message}")
        return outcome
