"""Grammar compiles in a worker process: what a spec compiles to (``compile_spec``, the same code
in the worker and in the server), and one worker process that compiles a spec on the server's
behalf and can be stopped at any moment (``CompileWorker``), which a thread's compile cannot.

A worker is a process of the ``forkserver`` start method (never ``fork``: the server runs CUDA
and threads), forked from a server that has imported xgrammar (and torch with it, 3.4 s) once: the
first worker of a process starts in ~3.4 s, every later one in ~10 ms. The server preloads only
that third-party module, never this package: the forkserver is one per process and another user of
it (the gates' runner, forking the sessions of another tree) must find no ``engine`` imported. It gets
the tokenizer's ``TokenizerInfo`` once (``serialize_json``, 0.2 MB for an 8k vocabulary), then
answers each spec sent to it with a :class:`Verdict`: the compiled grammar's size, or why
xgrammar refused the spec. It sends no grammar back: xgrammar 0.2.9 serializes a compiled
grammar with one copy of the grammar's state machine per rule (mlc-ai/xgrammar#740), so a
30-tool call schema that compiles in 0.04 s takes 2.9 s and 21 MB to serialize and 1.4 s to
read back, a 100-tool one 35 s, 233 MB and 4 GB; the server compiles the spec again itself,
once the worker has shown the compile ends in time and within the size allowed.
"""
from __future__ import annotations

import json
import multiprocessing
import os
import re
import signal
import threading
from dataclasses import dataclass

import xgrammar as xgr

from engine.scheduling.structured.spec import StructuredSpec

# xgrammar prefixes its messages with "[HH:MM:SS] /path/file.cc:LINE: "
_XGRAMMAR_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:[0-9]+: ", re.MULTILINE)
_QUOTED = re.compile(r'"([^"]{100})[^"]+"')  # a quoted piece of the input (a rule name) in a message
_MESSAGE_CHARS = 300
# xgrammar (0.2.9) lowers a JSON string with minLength / maxLength to a repetition of the first
# class, which admits raw control characters: invalid JSON (mlc-ai/xgrammar#800; fix proposed in
# #880). The second is the class its unbounded strings use, less the escapes' backslash.
_BOUNDED_STRING_CHAR, _JSON_STRING_CHAR = r'[^\"\\\r\n]', r'[^\0-\x1f\"\\]'
_CONTEXT = multiprocessing.get_context("forkserver")
START_S = 120.0  # how long a worker may take to start (the first one imports torch) before it is given up
CLOSED = "the grammar compiler is closed"


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


def compile_spec(compiler: xgr.GrammarCompiler, spec: StructuredSpec, any_whitespace: bool) -> xgr.CompiledGrammar:
    """``spec`` compiled by ``compiler`` (JSON with free whitespace only if ``any_whitespace``).
    xgrammar raises RuntimeError or ValueError for a spec it refuses."""
    if spec.kind in ("json_schema", "json_object"):
        schema = spec.value if spec.kind == "json_schema" else '{"type": "object"}'
        return compiler.compile_grammar(json_schema_grammar(schema, any_whitespace))
    if spec.kind == "regex":
        return compiler.compile_regex(spec.value)
    if spec.kind == "choice":
        return compiler.compile_grammar(choice_grammar(json.loads(spec.value)))
    if spec.kind == "tool_call":
        call = json.loads(spec.value)
        return compiler.compile_grammar(xgr.Grammar.concat(
            *(xgr.Grammar.from_ebnf(choice_grammar([text])) for text in (call["prefix"],) if text),
            json_schema_grammar(json.dumps(call["schema"]), any_whitespace),
            *(xgr.Grammar.from_ebnf(choice_grammar([text])) for text in (call["suffix"],) if text)))
    return compiler.compile_grammar(spec.value)


def shortened(message: str) -> str:
    """``message`` with each quoted piece of the input (a rule name) cut to 100 characters and the
    whole to 300: an error message never echoes a large input."""
    message = _QUOTED.sub(r'"\1..."', message)
    return message if len(message) <= _MESSAGE_CHARS else message[:_MESSAGE_CHARS - 3] + "..."


@dataclass(frozen=True)
class Verdict:
    """A worker's answer for one spec: ``grammar_bytes`` (the compiled grammar's
    ``memory_size_bytes``) when it compiled, else ``refused`` (xgrammar's reason) or ``error``
    (an unexpected failure, type and message); ``rss_bytes`` is the worker's resident memory
    once the compile is over (0 where ``/proc`` is missing)."""
    grammar_bytes: int = 0
    refused: str = ""
    error: str = ""
    rss_bytes: int = 0


class CompileWorker:
    """One worker process, driven by one thread (``probe`` one spec at a time): started by the
    first probe and again by the first one after it was stopped (killed for time, recycled for
    memory, or dead). ``close()``, from any thread, kills it for good; ``stop()``, from the
    driving thread, also waits for it to end (no zombie)."""

    def __init__(self, name: str, tokenizer_info: str, any_whitespace: bool, recycle_bytes: int):
        self.name, self.recycle_bytes = name, recycle_bytes
        self._args = (tokenizer_info, any_whitespace)
        self._lock = threading.Lock()  # the process's start against close() from another thread
        self._process: multiprocessing.Process | None = None
        self._conn = None
        self._start_rss = 0
        self._closed = False

    @property
    def pid(self) -> int | None:
        """The running process's id (None before the first probe and once stopped)."""
        process = self._process
        return process.pid if process is not None else None

    def probe(self, spec: StructuredSpec, timeout_s: float) -> Verdict | None:
        """Compile ``spec`` in the process and return its verdict, or None when the compile ran
        past ``timeout_s`` (counted from the spec's sending, not the process's start): the process
        is killed then. A process whose resident memory grew by more than ``recycle_bytes`` since
        it started is stopped after the compile, so its memory returns to the OS. A process that
        dies compiling gives the spec's refusal. Raises RuntimeError once closed."""
        conn = self._running()
        try:
            conn.send(spec)
            if not conn.poll(timeout_s):
                self.stop()
                return None
            verdict = conn.recv()
        except (EOFError, OSError):
            self.stop()
            if self._closed:
                raise RuntimeError(CLOSED) from None
            return Verdict(refused="compiling the grammar ended its worker process")
        if verdict.rss_bytes - self._start_rss > self.recycle_bytes:
            self.stop()
        return verdict

    def stop(self) -> None:
        """Kill the process (if any) and wait for it to end; the next probe starts another."""
        with self._lock:
            process, conn, self._process, self._conn = self._process, self._conn, None, None
        if process is not None:
            process.kill()
            process.join()
            conn.close()

    def close(self) -> None:
        """Kill the process and start no other (any thread; the driving thread's ``stop()`` reaps it)."""
        with self._lock:
            self._closed = True
            if self._process is not None:
                self._process.kill()

    def _running(self):
        """The connection to the running process, started (and its first message read) if needed."""
        if self._process is not None and not self._process.is_alive():
            self.stop()  # it died idle (killed from outside): reaped, and replaced below
        with self._lock:
            if self._closed:
                raise RuntimeError(CLOSED)
            if self._process is None:
                self._start()
            return self._conn

    def _start(self) -> None:
        """Start the process (the lock held) and wait for it to be ready: its resident memory then."""
        _CONTEXT.set_forkserver_preload(["xgrammar"])  # in effect only if this starts the forkserver
        conn, child = _CONTEXT.Pipe()
        process = _CONTEXT.Process(target=_serve, args=(child, *self._args), name=self.name, daemon=True)
        process.start()
        child.close()
        if not conn.poll(START_S):
            process.kill()
            process.join()
            raise RuntimeError(f"a grammar compile worker did not start within {START_S:g} s")
        self._start_rss = conn.recv()
        self._process, self._conn = process, conn


def _serve(conn, tokenizer_info: str, any_whitespace: bool) -> None:
    """The worker process: build the compiler, send its resident memory, then answer each spec
    received with its verdict, until the connection closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C stops the server, which stops its workers
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.deserialize_json(tokenizer_info), max_threads=1,
                                   cache_enabled=False)
    conn.send(_rss_bytes())
    while True:
        try:
            spec = conn.recv()
        except EOFError:
            return
        conn.send(_verdict(compiler, spec, any_whitespace))


def _verdict(compiler: xgr.GrammarCompiler, spec: StructuredSpec, any_whitespace: bool) -> Verdict:
    """Compile ``spec`` and tell how it went; the grammar is freed before the memory is read."""
    try:
        grammar_bytes = compile_spec(compiler, spec, any_whitespace).memory_size_bytes
    except (RuntimeError, ValueError) as e:  # xgrammar: the regex / EBNF / schema is refused
        return Verdict(refused=shortened(_XGRAMMAR_PREFIX.sub("", str(e)).strip()), rss_bytes=_rss_bytes())
    except Exception as e:
        return Verdict(error=shortened(f"{type(e).__name__}: {e}"), rss_bytes=_rss_bytes())
    return Verdict(grammar_bytes=grammar_bytes, rss_bytes=_rss_bytes())


def _rss_bytes() -> int:
    """This process's resident memory (Linux's ``/proc``; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0
