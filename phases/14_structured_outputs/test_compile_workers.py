"""The grammar compiler's worker processes (engine/scheduling/structured/compiler.py, compile_worker.py):
a compile past the time limit is stopped and its worker replaced; one client's slow schemas never
make another client's compile fail; a client's queue is bounded; the cache holds at most its bytes
and a grammar over the per-grammar cap is refused; a worker whose memory grew is replaced; close()
leaves no process behind; and the grammars compiled this way mask as xgrammar's own compile does.

Slow compiles are real ones (an enum of 100,000 strings, which takes far longer than any limit
here), stopped by a limit of 1-2 s; conditions are polled, never waited for by a sleep.
"""
from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import signal
import threading
import time

import pytest
import torch
import xgrammar as xgr

from engine.core.engine_config import DEFAULT_MODEL_DIR
from engine.core.tokenizer import load_tokenizer
from engine.scheduling.structured.compiler import GrammarBusy, MiB, _Refused
from engine.scheduling.structured.spec import StructuredOutputError, StructuredSpec
from grammar_cases import VOCAB, counted_compilers, schema_spec, slow_spec

ARITHMETIC = 'root ::= expr\nexpr ::= term (("+" | "-") term)*\nterm ::= [0-9]+ | "(" expr ")"\n'
NESTED = {"type": "object", "properties": {
    "user": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 999},
                                              "tags": {"type": "array", "items": {"enum": ["a", "b"]}}},
             "required": ["id"]},
    "active": {"type": "boolean"}, "note": {"type": "string"}}, "required": ["user", "active"]}


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(DEFAULT_MODEL_DIR)


@pytest.fixture
def make_compiler(tokenizer):
    yield from counted_compilers(tokenizer)


def enum_spec(tag: str, count: int = 3000) -> StructuredSpec:
    """An enum of ``count`` strings: 3000 make a ~0.5 MiB grammar in ~0.1 s, 10,000 a ~26 MiB one in ~1 s."""
    return schema_spec({"enum": [f"{tag}-{i}" for i in range(count)]})


def until(condition, what: str, timeout_s: float = 120.0) -> None:
    """Poll ``condition`` until it holds; fail (a hang guard, not a speed check) after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.01)


def alive(pid: int) -> bool:
    return os.path.exists(f"/proc/{pid}")


def worker_pids(compiler) -> list[int]:
    return [w.pid for w in compiler._workers if w.pid is not None]


def test_a_compile_past_the_limit_is_stopped_its_worker_replaced_and_the_spec_refused_at_once(make_compiler):
    compiler = make_compiler(workers=1, timeout_s=1.0)
    warm, slow, after = StructuredSpec("regex", "warm"), slow_spec("limit"), StructuredSpec("regex", "after")
    compiler.compile(warm)
    [first] = worker_pids(compiler)
    with pytest.raises(StructuredOutputError, match="compiling the grammar took longer than 1 s") as caught:
        compiler.compile(slow)
    assert caught.value.param == "structured_outputs.json"
    assert not alive(first) and worker_pids(compiler) == []  # killed and reaped, not left compiling
    for _ in range(3):  # refused at once: no worker compiles it again
        with pytest.raises(StructuredOutputError, match="took longer than 1 s"):
            asyncio.run(compiler.compile_async(slow, client="other"))
    assert compiler.compile(after) is not None
    assert worker_pids(compiler) not in ([], [first])  # the next compile started another worker
    assert compiler.calls == [warm, slow, after]


def test_another_clients_schema_compiles_while_one_clients_slow_schemas_hold_every_worker(make_compiler):
    """Four slow schemas of one client: two hold both workers, two queue. A small schema of another
    client is served by the first worker to free up (before the flood's queued ones) and succeeds:
    its limit counts its own compile, not the wait."""
    compiler = make_compiler(workers=2, timeout_s=2.0)
    flood, small = [slow_spec(f"flood{i}") for i in range(4)], schema_spec(NESTED)

    async def main():
        tasks = [asyncio.create_task(compiler.compile_async(spec, client="flood")) for spec in flood]
        while len(compiler.calls) < 2:  # both workers busy with the flood
            await asyncio.sleep(0.01)
        grammar = await compiler.compile_async(small, client="small")
        for task in tasks[2:]:
            task.cancel()
        return grammar, await asyncio.gather(*tasks, return_exceptions=True)
    grammar, flooded = asyncio.run(main())
    assert isinstance(grammar, xgr.CompiledGrammar)
    assert all("took longer than 2 s" in str(e) for e in flooded[:2])
    assert all(isinstance(e, asyncio.CancelledError) for e in flooded[2:])
    assert compiler.calls[:3] == [*flood[:2], small]


def test_round_robin_serves_each_client_in_turn(make_compiler):
    """Two clients with several specs queued behind one worker: the worker takes them in turns,
    each client's in the order it sent them."""
    compiler = make_compiler(workers=1)
    a, b = [enum_spec(f"a{i}", 100) for i in range(3)], [enum_spec(f"b{i}", 100) for i in range(3)]

    async def main():
        await asyncio.gather(*(compiler.compile_async(s, client="a") for s in a),
                             *(compiler.compile_async(s, client="b") for s in b))
    asyncio.run(main())
    turns = [spec in a for spec in compiler.calls]
    assert len(turns) == 6 and all(x != y for x, y in zip(turns, turns[1:]))
    assert [s for s in compiler.calls if s in a] == a and [s for s in compiler.calls if s in b] == b


def test_a_client_may_have_only_so_many_distinct_specs_pending(make_compiler):
    compiler = make_compiler(workers=1, timeout_s=1.0, max_queued_per_client=2)
    held = [slow_spec(f"held{i}") for i in range(2)]

    async def main():
        tasks = [asyncio.create_task(compiler.compile_async(spec, client="a")) for spec in held]
        deadline = time.monotonic() + 120  # a hang guard: the worker's thread may start late on a loaded host
        while not compiler.calls:  # both are pending, the first taken by the worker
            assert time.monotonic() < deadline, "the worker never took a job"
            await asyncio.sleep(0.01)
        with pytest.raises(GrammarBusy, match="2 grammars of this client are queued or compiling") as caught:
            await compiler.compile_async(schema_spec(NESTED), client="a")
        tasks.append(asyncio.create_task(compiler.compile_async(held[1], client="a")))  # the same spec: joins
        other = await compiler.compile_async(schema_spec(NESTED), client="b")  # another client is not bound
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return caught.value, other
    busy, other = asyncio.run(main())
    assert isinstance(busy, StructuredOutputError) and busy.param == "structured_outputs.json"
    assert isinstance(other, xgr.CompiledGrammar)
    assert compiler.calls[:2] == [held[0], schema_spec(NESTED)]  # b's came before a's second
    assert compiler.compile(StructuredSpec("regex", "a+"), client="a") is not None  # a waits for none now


def test_the_cache_stays_within_its_byte_bound(make_compiler):
    """A burst of distinct ~0.5 MiB grammars through a 1 MiB cache: what stays cached (the most
    recent ones) sums to at most 1 MiB, counted by each grammar's memory_size_bytes."""
    compiler = make_compiler(cache_bytes=MiB)
    specs = [enum_spec(f"burst{i}") for i in range(6)]

    async def burst():
        return await asyncio.gather(*(compiler.compile_async(s, client=str(i)) for i, s in enumerate(specs)))
    grammars = asyncio.run(burst())
    assert min(g.memory_size_bytes for g in grammars) > MiB / 4  # big enough that they cannot all stay
    cached = list(compiler._cache.entries.values())
    assert sum(g.memory_size_bytes for g in cached) == compiler._cache.bytes <= MiB
    kept = [s for s, g in zip(specs, grammars) if any(c is g for c in cached)]
    assert len(kept) == len(cached) and 1 <= len(kept) < len(specs)
    assert compiler.compile(kept[-1]) is cached[-1] and len(compiler.calls) == len(specs)  # a hit
    evicted = next(s for s in specs if s not in kept)
    compiler.compile(evicted)  # compiled again
    assert compiler.calls[-1] == evicted and sum(g.memory_size_bytes for g in compiler._cache.entries.values()) <= MiB


def test_a_grammar_over_the_per_grammar_cap_is_refused_with_its_size(make_compiler):
    compiler = make_compiler(max_grammar_bytes=MiB // 4)
    big, small = enum_spec("big"), StructuredSpec("regex", "[a-z]{3}")
    for _ in range(2):  # the second answer comes from the cache
        with pytest.raises(StructuredOutputError, match=r"the compiled grammar takes 0\.\d MiB, more than the "
                                                        r"0\.25 MiB allowed") as caught:
            compiler.compile(big)
        assert caught.value.param == "structured_outputs.json"
    assert compiler.calls == [big]
    assert isinstance(compiler._cache.entries[big.key], _Refused)  # cached as a refusal, not a grammar
    assert compiler.compile(small) is not None


def test_a_worker_whose_memory_grew_past_the_bound_is_replaced(make_compiler):
    """A compile that leaves its worker 16 MiB bigger (a 10,000-string enum's grammar is ~26 MiB)
    gets the worker replaced, so that memory returns to the OS; under a higher bound it stays."""
    for recycle_bytes, replaced in ((16 * MiB, True), (1 << 40, False)):
        compiler = make_compiler(workers=1, recycle_bytes=recycle_bytes, max_grammar_bytes=MiB)
        compiler.compile(StructuredSpec("regex", "warm"))
        [first] = worker_pids(compiler)
        with pytest.raises(StructuredOutputError, match="more than the 1 MiB allowed"):
            compiler.compile(enum_spec("grow", 10_000))
        assert alive(first) is not replaced and worker_pids(compiler) == ([] if replaced else [first])
        compiler.compile(StructuredSpec("regex", "next"))
        assert (worker_pids(compiler) != [first]) is replaced


def cpu_ticks(pid: int) -> int:
    """The CPU time (user + system, in clock ticks) process ``pid`` has used."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def test_a_worker_killed_mid_compile_refuses_that_spec_and_is_replaced(make_compiler):
    compiler = make_compiler(workers=1, timeout_s=60.0)
    compiler.compile(StructuredSpec("regex", "warm"))
    [pid] = worker_pids(compiler)
    idle, errors = cpu_ticks(pid), []

    def request():
        try:
            compiler.compile(slow_spec("killed"))
        except StructuredOutputError as e:
            errors.append(e)
    thread = threading.Thread(target=request, daemon=True)
    thread.start()
    until(lambda: cpu_ticks(pid) > idle + 20, "the worker compiles the slow schema")
    os.kill(pid, signal.SIGKILL)  # as the OOM killer would
    thread.join(120)
    assert "compiling the grammar ended its worker process" in str(errors[0])
    assert compiler.compile(StructuredSpec("regex", "after")) is not None and worker_pids(compiler) != [pid]


def test_close_leaves_no_worker_process_and_fails_what_waits(make_compiler):
    """close() while two compiles run in the workers and two are queued (one given up): the
    callers get an error, the processes are gone (reaped) and the threads ended; the compiler
    compiles no more."""
    compiler = make_compiler(workers=2, timeout_s=60.0)
    compiler.compile(StructuredSpec("regex", "warm"))  # one worker started
    errors = []

    def request(spec):
        try:
            compiler.compile(spec)
        except RuntimeError as e:
            errors.append(e)
    threads = [threading.Thread(target=request, args=(slow_spec(f"close{i}"),), daemon=True) for i in range(3)]
    for thread in threads:
        thread.start()
    until(lambda: len(compiler.calls) == 3 and len(worker_pids(compiler)) == 2, "both workers compile a slow schema")
    pids = set(worker_pids(compiler))
    assert len(pids) == 2 and pids <= {p.pid for p in multiprocessing.active_children()}

    async def given_up():  # a queued compile whose request left: dropped, its queue entry left behind
        task = asyncio.create_task(compiler.compile_async(slow_spec("gone")))
        await asyncio.sleep(0)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    asyncio.run(given_up())
    compiler.close()
    for thread in threads:
        thread.join(120)
    assert len(errors) == 3 and all("the grammar compiler is closed" in str(e) for e in errors)
    assert not any(alive(pid) for pid in pids) and worker_pids(compiler) == []
    assert not pids & {p.pid for p in multiprocessing.active_children()}
    assert not any(thread.is_alive() for thread in compiler._threads)
    with pytest.raises(RuntimeError, match="closed"):
        compiler.compile(StructuredSpec("regex", "late"))
    compiler.close()  # a second close does nothing


def test_a_refusal_never_echoes_a_large_input(make_compiler):
    compiler = make_compiler()
    name = "x" * 100_000
    with pytest.raises(StructuredOutputError, match='Rule "x{100}..." is not defined') as caught:
        compiler.compile(StructuredSpec("grammar", f"root ::= {name}"))
    assert len(str(caught.value)) < 400


def test_grammars_mask_as_xgrammars_own_compile_in_process(make_compiler):
    """Independent truth: xgrammar's GrammarCompiler in this process, on the same spec. Along
    random paths (each step a token the masks allow), the two grammars' masks are equal."""
    compiler = make_compiler()
    truth = xgr.GrammarCompiler(compiler.tokenizer_info, max_threads=1, cache_enabled=False)
    cases = [(schema_spec(NESTED), truth.compile_json_schema(json.dumps(NESTED), any_whitespace=False)),
             (StructuredSpec("regex", r"[a-z]{2,5}-\d{3}"), truth.compile_regex(r"[a-z]{2,5}-\d{3}")),
             (StructuredSpec("grammar", ARITHMETIC), truth.compile_grammar(ARITHMETIC)),
             (StructuredSpec("json_object", ""), truth.compile_json_schema('{"type": "object"}',
                                                                             any_whitespace=False))]
    for spec, expected in cases:
        compiled = compiler.compile(spec)
        for seed in range(4):
            generator = torch.Generator().manual_seed(seed)
            ours, theirs = xgr.GrammarMatcher(compiled), xgr.GrammarMatcher(expected)
            ours_mask, theirs_mask = (xgr.allocate_token_bitmask(1, VOCAB) for _ in range(2))
            for _ in range(48):
                ours.fill_next_token_bitmask(ours_mask)
                theirs.fill_next_token_bitmask(theirs_mask)
                assert torch.equal(ours_mask, theirs_mask), (spec.kind, seed)
                bits = (ours_mask[0].to(torch.int64).unsqueeze(-1) >> torch.arange(32)) & 1
                tokens = bits.reshape(-1)[:VOCAB].nonzero().flatten()
                token = int(tokens[torch.randint(len(tokens), (1,), generator=generator)])
                assert ours.accept_token(token) and theirs.accept_token(token)
                if ours.is_terminated():
                    assert theirs.is_terminated()
                    break
