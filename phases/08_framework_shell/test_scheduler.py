"""Scheduler: mixed decode + prefill steps, chunked prefill, watermark admission with preemption by
recompute, reserve admission without, one step of lookahead (a step scheduled while the previous
one is in flight), budgets, REJECTED, abort."""
import random
from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from engine.scheduling.block_manager import BlockManager
from engine.scheduling.scheduler import Scheduler, SchedulerSettings
from engine.scheduling.sequence import SamplingParams, Sequence
from engine.scheduling.sequence import SequenceStatus as S
from engine.scheduling.step import ScheduledBatch
from shell_kv_oracle import KVOracle

EOS = 0
ALLOWED_TRANSITIONS = {
    (S.WAITING, S.RUNNING_PREFILL), (S.WAITING, S.FINISHED),
    (S.WAITING, S.RUNNING_DECODE),  # a whole prompt scheduled in one step (RUNNING_PREFILL in between)
    (S.RUNNING_PREFILL, S.RUNNING_DECODE), (S.RUNNING_PREFILL, S.FINISHED), (S.RUNNING_PREFILL, S.WAITING),
    (S.RUNNING_DECODE, S.FINISHED), (S.RUNNING_DECODE, S.WAITING),
}


def blocks(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def worst_case_blocks(seq: Sequence, max_model_len: int, block_size: int) -> int:
    """KV blocks a request may need: all tokens but the last sampled one, at most max_model_len."""
    return blocks(min(seq.num_prompt_tokens + seq.sampling_params.max_tokens - 1, max_model_len), block_size)


def expected_finish(seq: Sequence, token: int, max_model_len: int) -> str | None:
    """Why ``token``, just appended, ends ``seq``, from the sequence's known tokens."""
    params = seq.sampling_params
    if (token == EOS and not params.ignore_eos) or token in params.stop_token_ids:
        return "stop"
    if len(seq.output_token_ids) == params.max_tokens or len(seq.token_ids) >= max_model_len:
        return "length"
    return None


class Freed(list):
    """An ``on_free`` callback recording the sequences whose blocks the scheduler freed;
    ``take()`` returns them and forgets them."""

    def __call__(self, seq: Sequence) -> None:
        self.append(seq)

    def take(self) -> list[Sequence]:
        taken = list(self)
        self.clear()
        return taken


def make_scheduler(num_blocks=16, block_size=4, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64,
                   admission="watermark"):
    bm = BlockManager(num_blocks, block_size)
    settings = SchedulerSettings(max_num_seqs, max_num_batched_tokens, max_model_len, admission)
    return Scheduler(settings, bm, eos_token_id=EOS, on_free=Freed()), bm


def entries(batch: ScheduledBatch) -> list[tuple[str, int, int]]:
    """(request id, start, tokens) of every entry."""
    return [(s.request_id, start, n) for s, start, n in zip(batch.seqs, batch.starts, batch.num_tokens)]


def run_to_completion(sched: Scheduler, token: int = 5, max_steps: int = 1000) -> list[list[tuple[str, int]]]:
    """Drive the scheduler synchronously, sampling ``token`` every time; returns each step's
    (request id, tokens) entries."""
    steps = []
    while sched.has_unfinished():
        assert len(steps) < max_steps, "scheduler made no progress"
        batch = sched.schedule()
        assert batch.seqs, "nothing scheduled although requests are unfinished"
        steps.append([(s.request_id, n) for s, n in zip(batch.seqs, batch.num_tokens)])
        sched.postprocess(batch, [token] * len(batch))
    return steps


requests_strategy = st.lists(
    st.fixed_dictionaries(dict(
        family=st.integers(0, 2), shared=st.integers(0, 8),
        tail=st.lists(st.integers(1, 5), min_size=1, max_size=6),
        max_tokens=st.integers(1, 12), ignore_eos=st.booleans(),
        stop_token_ids=st.lists(st.integers(1, 5), max_size=1),
        arrival=st.integers(0, 4), abort_at=st.one_of(st.none(), st.integers(0, 12)),
    )),
    min_size=2, max_size=8)


class StepChecker:
    """Checks each scheduled step against the rules, and models the device: a batch "runs" (its
    K/V is written into a ``KVOracle``) when it is read back, in schedule order, reading only
    K/V its sequences' own tokens produced; tokens it sampled that the host dropped are garbage."""

    def __init__(self, sched: Scheduler, block_size: int):
        self.sched, self.bm = sched, sched.block_manager
        self.kv = KVOracle(block_size)
        self.outputs: dict[str, list[int]] = {}
        self.chunk_start: dict[str, int] = {}  # request id -> first token of its next chunk
        self.tables: dict[str, list[int]] = {}
        self.num_partial_chunks = self.num_mixed = self.num_dropped = self.num_drains = 0

    def before(self):
        """Snapshot the scheduler before ``schedule()``."""
        sched = self.sched
        self.waiting, self.running = list(sched.waiting), list(sched.running)
        self.decoding = [s for s in self.running if s.status is S.RUNNING_DECODE]
        self.prefilling = [s for s in self.running if s.status is S.RUNNING_PREFILL]
        self.due = [s for s in self.decoding  # not ended by its pending tokens
                    if s.num_output_tokens < s.sampling_params.max_tokens and s.num_tokens < sched.max_model_len]
        self.in_flight = sched.num_in_flight

    def check(self, batch: ScheduledBatch):
        sched, bm = self.sched, self.bm
        seqs = batch.seqs
        assert len(set(map(id, seqs))) == len(seqs) and len(sched.running) <= sched.max_num_seqs
        assert batch.total_tokens <= sched.max_num_batched_tokens
        preempted = sched.preempted
        assert not preempted or (self.in_flight == 0 and sched.admission == "watermark"), \
            "preempted while a step was in flight, or under reserve admission"
        assert preempted == self.running[len(self.running) - len(preempted):][::-1], "preempt the newest first"
        # decodes first, oldest first: every decoding sequence not ended by its pending tokens
        due = [s for s in self.due if s not in preempted]
        num_decode = next((i for i, s in enumerate(seqs) if s not in due), len(seqs))
        assert seqs[:num_decode] == due[:num_decode], "decodes run first, in admission order"
        if num_decode < len(due):
            assert sched.needs_drain and self.in_flight, "a decode was left out"
            self.num_drains += 1
        # then the running prompts' next chunks, then admissions in FCFS order (preempted ones first)
        partial = [s for s in self.prefilling if s not in preempted]
        rest = seqs[num_decode:]
        assert rest[:len(partial)] == partial[:len(rest)], "unfinished prompts continue next, in order"
        admitted, queue = rest[len(partial):], preempted[::-1] + self.waiting
        assert admitted == queue[:len(admitted)] and list(sched.waiting) == queue[len(admitted):], \
            "admission takes the queue in order, preempted sequences first"
        assert not admitted or not sched.needs_drain, "admitted while a decode waits for a block"
        cap, prompt_tokens = sched.prefill_tokens_beside_decodes, sum(batch.num_tokens[num_decode:])
        left = sched.max_num_batched_tokens - batch.total_tokens  # what admission could still have taken
        if cap and (num_decode or sched.needs_drain):  # decodes run, or wait for a block
            assert prompt_tokens <= cap, "more prompt tokens beside decodes than prefill_tokens_beside_decodes"
            left = min(left, cap - prompt_tokens)
        assert left == 0 or all(batch.samples[num_decode:]), "a prompt cut short with budget left"
        for seq, start, n in zip(seqs, batch.starts, batch.num_tokens):
            rid = seq.request_id
            if seq in admitted:  # (re)admitted: hits are computed; it starts after them
                assert start == seq.num_cached_tokens and seq.status in (S.RUNNING_PREFILL, S.RUNNING_DECODE)
                assert seq is admitted[-1] or start + n == seq.num_known_tokens, "only the last admitted is cut"
                self.chunk_start[rid] = start
                self.tables[rid] = []  # a fresh table (a preempted sequence may be re-admitted at once)
            assert start == self.chunk_start[rid], "a token computed twice or skipped"
            assert n >= 1 and start + n <= seq.num_tokens
            self.chunk_start[rid] = start + n
            self.num_partial_chunks += start + n < seq.num_prompt_tokens
            old = self.tables.get(rid, [])
            assert seq.block_table[:len(old)] == old, "a running sequence lost blocks"
            assert len(seq.block_table) * bm.block_size >= start + n, "no slot for a scheduled token"
            self.tables[rid] = list(seq.block_table)
        self.num_mixed += 0 < num_decode < len(seqs)
        for seq in preempted:
            if seq.status is S.WAITING:  # (else re-admitted at once, largely from its own published blocks)
                assert seq.block_table == [] and seq.num_computed_tokens == 0
                self.tables[seq.request_id] = []
        self.check_head(left)

    def check_head(self, left: int):
        """Admission stopped for a reason: no seat, no token budget ``left`` (the step's, or the cap
        on prompt tokens beside decodes), a decode waiting for a block, or the queue's head's blocks
        do not fit: a step fills its budget, cutting a prompt where it must."""
        sched, bm = self.sched, self.bm
        if not sched.waiting or len(sched.running) >= sched.max_num_seqs or left == 0 or sched.needs_drain:
            return
        head = sched.waiting.head()
        if sched.admission == "watermark":
            fits = bm.can_allocate(head, num_reserved=sched.watermark_blocks if sched.running else 0)
        else:  # its growth beyond the prompt and every running sequence's must stay free
            def growth(seq):
                return worst_case_blocks(seq, sched.max_model_len, bm.block_size) - len(seq.block_table)
            reserved = sum(map(growth, sched.running)) + growth(head) - blocks(head.num_tokens, bm.block_size)
            fits = bm.can_allocate(head, num_reserved=reserved)
        assert not fits or bm.prefix_is_coming(head), "a waiting request that fits was not admitted"

    def run(self, batch: ScheduledBatch, token_ids: list[int]):
        """The device runs ``batch`` (read back now): check the context each entry reads, write
        what it computes; then the scheduler postprocesses it."""
        sched, bm = self.sched, self.bm
        for seq, start, n in zip(batch.seqs, batch.starts, batch.num_tokens):
            assert seq.block_table, f"{seq.request_id}: its blocks were freed while a step in flight writes them"
            if not seq.is_finished:  # a finished sequence's entry still runs: its token is dropped
                self.kv.check(seq, start)  # the computed prefix (hits, earlier chunks) holds its own K/V
            self.kv.write(seq, start, start + n)
        was_finished = {s.request_id for s in batch.seqs if s.is_finished}
        result = sched.postprocess(batch, token_ids)
        appended = []
        for seq, samples, token in zip(batch.seqs, batch.samples, token_ids):
            got = self.outputs.setdefault(seq.request_id, [])
            if seq.request_id in was_finished:
                self.num_dropped += samples
                assert seq.output_token_ids == got, "a token computed after the sequence finished reached it"
                continue
            if samples:
                got.append(token)
                appended.append(seq)
                reason = expected_finish(seq, token, sched.max_model_len)
                assert seq.finish_reason == reason and (seq in result.finished) == (reason is not None)
            assert seq.output_token_ids == got, "output tokens lost or duplicated"
        assert result.appended == appended
        in_flight = [s for b in sched.in_flight for s in b.seqs]
        held = {b for s in [*sched.running, *in_flight] for b in s.block_table}
        assert all(not s.block_table for s in sched.waiting), "a waiting sequence holds blocks"
        assert bm.num_free_blocks == bm.num_blocks - len(held), "blocks leaked or over-committed"


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(admission=st.sampled_from(["watermark", "reserve"]), overlap=st.booleans(),
       block_size=st.sampled_from([1, 2, 4]), max_model_len=st.integers(2, 24), max_num_seqs=st.integers(1, 4),
       budget_slack=st.integers(-24, 8), pool_slack=st.integers(-2, 6), requests=requests_strategy,
       seed=st.integers(0, 2**16), beside=st.sampled_from([0, 0, 1, 2, 5]))
def test_scheduler_properties(admission, overlap, block_size, max_model_len, max_num_seqs, budget_slack,
                              pool_slack, requests, seed, beside):
    """Random workloads (shared prefixes, staggered arrivals, aborts, random tokens with EOS,
    token budgets below the prompt lengths, pools too small for every request at once, a cap on
    the prompt tokens beside decodes or none) under
    both admission policies, synchronous or with one step in flight, checked step by step
    against the rules and a model of the KV cache: every token is computed exactly once, no
    token computed after a sequence finished reaches it, preempted sequences keep their output
    and come back first, no block is freed while a step in flight writes it, nothing leaks,
    every request finishes."""
    run_workload(admission, overlap, block_size, max_model_len, max_num_seqs, budget_slack, pool_slack, requests,
                 seed, beside)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(overlap=st.booleans(), block_size=st.sampled_from([1, 2]), max_model_len=st.integers(10, 24),
       max_num_seqs=st.integers(2, 4), budget_slack=st.integers(-12, 4), pool_slack=st.integers(0, 4),
       requests=st.lists(st.fixed_dictionaries(dict(
           family=st.integers(0, 2), shared=st.integers(0, 8), tail=st.lists(st.integers(1, 5), min_size=1,
                                                                              max_size=3),
           max_tokens=st.integers(4, 12), ignore_eos=st.just(True), stop_token_ids=st.just([]),
           arrival=st.integers(0, 2), abort_at=st.one_of(st.none(), st.integers(0, 30)))), min_size=3, max_size=6),
       seed=st.integers(0, 2**16), beside=st.sampled_from([0, 1, 2, 5]))
def test_preemption_properties(overlap, block_size, max_model_len, max_num_seqs, budget_slack, pool_slack, requests,
                               seed, beside):
    """The same checks under memory pressure: long-running requests over a pool about one
    request's worst case, so watermark admission preempts (and recomputes) often; with a step
    in flight a decode that finds no block waits for the engine to drain it first (the cap on
    prompt tokens beside decodes holds in that step too)."""
    sched, checker = run_workload("watermark", overlap, block_size, max_model_len, max_num_seqs, budget_slack,
                                  pool_slack, requests, seed, beside)
    event(f"preemptions: {min(sched.num_preemptions, 3)}{'+' if sched.num_preemptions >= 3 else ''}")
    event(f"drains: {checker.num_drains > 0}")


def run_workload(admission, overlap, block_size, max_model_len, max_num_seqs, budget_slack, pool_slack, requests,
                 seed, beside=0) -> tuple[Scheduler, StepChecker]:
    """Drive a Scheduler through ``requests`` (arrivals, aborts, random tokens) the way the engine
    does — with ``overlap`` the next step is scheduled before the previous is read back, and a
    ``needs_drain`` step reads it back first — checking every step."""
    rng = random.Random(seed)
    budget = max(max_num_seqs, max_model_len + budget_slack)
    num_blocks = max(1, blocks(max_model_len, block_size) + pool_slack)
    bm = BlockManager(num_blocks, block_size)
    settings = SchedulerSettings(max_num_seqs, budget, max_model_len, admission, prefill_tokens_beside_decodes=beside)
    sched = Scheduler(settings, bm, eos_token_id=EOS, on_free=Freed())
    check = StepChecker(sched, block_size)
    families = [[rng.randint(1, 5) for _ in range(8)] for _ in range(3)]
    seqs = [Sequence(families[r["family"]][:r["shared"]] + r["tail"],
                     SamplingParams(max_tokens=r["max_tokens"], ignore_eos=r["ignore_eos"],
                                    stop_token_ids=r["stop_token_ids"]), request_id=f"r{i}")
            for i, r in enumerate(requests)]
    history = {s.request_id: [s.status] for s in seqs}

    def record_transitions():
        for seq in seqs:
            if seq.status is not history[seq.request_id][-1]:
                history[seq.request_id].append(seq.status)

    def read_back(batch):
        check.run(batch, [rng.choice([EOS, 1, 2, 3, 4, 5, 6, 7, 8, 9]) for _ in batch.seqs])
        record_transitions()
        take_freed()

    def take_freed():
        freed.extend((s.request_id, s.is_finished) for s in sched.on_free.take())

    accepted, done, freed = [], [], []
    in_flight = None
    step = 0
    while step <= max(r["arrival"] for r in requests) or sched.has_unfinished() or in_flight:
        assert step < 2000, "no progress"
        for seq, r in zip(seqs, requests):
            if r["arrival"] == step:
                impossible = (seq.num_prompt_tokens > max_model_len
                              or worst_case_blocks(seq, max_model_len, block_size) > num_blocks)
                assert sched.add(seq) is not impossible
                if impossible:
                    assert seq.status is S.REJECTED and seq.reject_reason
                else:
                    accepted.append(seq)
            if r["abort_at"] == step and seq in accepted and not seq.is_finished:
                assert sched.abort(seq.request_id)
        take_freed()
        if in_flight is not None and sched.needs_drain:
            read_back(in_flight)
            in_flight = None
        check.before()
        batch = sched.schedule()
        record_transitions()
        take_freed()
        if not batch.seqs:
            assert in_flight or not sched.running, "idle although work could run"
        else:
            check.check(batch)
        previous, in_flight = in_flight, batch if batch.seqs else None
        if previous is not None:
            read_back(previous)
        if in_flight is not None and not (overlap and sched.has_unfinished()):
            read_back(in_flight)
            in_flight = None
        for seq in seqs:
            if seq.status is S.FINISHED and seq not in done:
                done.append(seq)
            if seq.is_finished and seq.num_in_flight == 0:
                assert seq.block_table == [] and seq.num_pending_tokens == 0
        step += 1
    assert sorted(s.request_id for s in done) == sorted(s.request_id for s in accepted), "lost or duplicated"
    assert bm.num_free_blocks == num_blocks and not any(bm.ref_counts)
    assert admission == "watermark" or sched.num_preemptions == 0
    finished_freed = [rid for rid, finished in freed if finished]
    assert sorted(finished_freed) == sorted(s.request_id for s in done), "a finished sequence freed twice or never"
    event(f"{admission}: {'preempted' if sched.num_preemptions else 'no preemption'}")
    event(f"chunked prefill: {check.num_partial_chunks > 0}, mixed steps: {check.num_mixed > 0}")
    event(f"lookahead tokens dropped: {check.num_dropped > 0}")
    for seq in accepted:
        path = history[seq.request_id]
        assert all(pair in ALLOWED_TRANSITIONS for pair in zip(path, path[1:])), path
        assert path[-1] is S.FINISHED and len(seq.output_token_ids) <= seq.sampling_params.max_tokens
        if seq.finish_reason == "length":
            assert len(seq.output_token_ids) == seq.sampling_params.max_tokens or len(seq.token_ids) >= max_model_len
    return sched, check


def test_status_transitions_and_finish_reasons():
    sched, bm = make_scheduler(max_model_len=8)
    eos = Sequence([1, 2], request_id="eos")
    ignore = Sequence([1, 2], SamplingParams(max_tokens=2, ignore_eos=True), request_id="ignore")
    stop_id = Sequence([1, 2], SamplingParams(stop_token_ids=[7]), request_id="stop_id")
    capped = Sequence([1, 2, 3, 4, 5, 6], SamplingParams(max_tokens=100), request_id="capped")
    seqs = [eos, ignore, stop_id, capped]
    assert all(sched.add(s) for s in seqs) and all(s.status is S.WAITING for s in seqs)
    batch = sched.schedule()
    assert batch.seqs == seqs and all(batch.samples) and all(s.status is S.RUNNING_DECODE for s in seqs)
    assert all(s.num_pending_tokens == 1 for s in seqs)
    result = sched.postprocess(batch, [3, EOS, 3, 3])
    assert result.finished == [] and result.appended == seqs and all(s.num_pending_tokens == 0 for s in seqs)
    assert result.num_new == [1, 1, 1, 1] and [out.new_token_ids for out in result.outputs] == [[3], [EOS], [3], [3]]
    batch = sched.schedule()
    assert batch.seqs == seqs and batch.is_decode
    finished = sched.postprocess(batch, [EOS, 3, 7, 3]).finished
    assert finished == [eos, ignore, stop_id, capped]
    assert [s.finish_reason for s in finished] == ["stop", "length", "stop", "length"]
    assert capped.num_tokens == 8  # stopped at max_model_len
    assert all(s.status is S.FINISHED and not s.block_table for s in seqs)
    assert not sched.has_unfinished() and len(sched.schedule()) == 0
    assert bm.num_free_blocks == bm.num_blocks and sched.on_free.take() == seqs


@pytest.mark.parametrize("admission", ["watermark", "reserve"])
def test_impossible_prompts_are_rejected_while_others_proceed(admission):
    """Longer than max_model_len, or a worst case over the whole pool: REJECTED, with the reason
    in the words Scheduler._reject_reason documents (the CLI and the server print it as it is).
    Longer than max_num_batched_tokens is no reason (chunked prefill); a pool that holds the
    worst case is enough, whatever the watermark."""
    sched, bm = make_scheduler(num_blocks=3, block_size=4, max_num_batched_tokens=4, max_model_len=14,
                               admission=admission)
    too_long = Sequence(list(range(1, 16)), request_id="too_long")           # > max_model_len
    too_big = Sequence([1] * 10, SamplingParams(max_tokens=8), request_id="too_big")  # 14 KV tokens > 3 blocks
    fine = Sequence([1] * 10, SamplingParams(max_tokens=3), request_id="fine")  # 12 KV tokens = 3 blocks
    assert not sched.add(too_long) and too_long.reject_reason == "prompt has 15 tokens, more than max_model_len (14)"
    assert not sched.add(too_big) and too_big.reject_reason == "prompt + max_tokens need 4 KV blocks, the cache has 3"
    assert all(s.status is S.REJECTED for s in (too_long, too_big))
    assert sched.add(fine)
    steps = run_to_completion(sched)
    assert steps == [[("fine", 4)], [("fine", 4)], [("fine", 2)], [("fine", 1)], [("fine", 1)]]
    assert fine.finish_reason == "length" and len(fine.output_token_ids) == 3


def test_abort_frees_blocks_wherever_the_sequence_is():
    """Waiting: freed at once. In the batch being run: finished at once, its blocks
    freed at that batch's postprocess (when their K/V exists)."""
    sched, bm = make_scheduler(num_blocks=8, block_size=2, max_num_seqs=1)
    params = SamplingParams(max_tokens=2)
    running, waiting = Sequence([1, 2, 3], params), Sequence([4, 5, 6], params)
    sched.add(running)
    sched.add(waiting)
    batch = sched.schedule()
    assert batch.seqs == [running] and bm.num_free_blocks < 8
    held = bm.num_free_blocks
    assert sched.abort(waiting.request_id) and waiting.finish_reason == "abort"
    assert sched.abort(running.request_id) and running.status is S.FINISHED
    assert bm.num_free_blocks == held and sched.on_free.take() == [waiting]  # still being computed
    assert not sched.abort(running.request_id) and not sched.abort("unknown")
    assert sched.postprocess(batch, [1]).appended == []  # aborted after schedule: no token
    assert running.output_token_ids == [] and running.block_table == [] and bm.num_free_blocks == 8
    assert sched.on_free.take() == [running] and not sched.has_unfinished()


def test_abort_in_flight_never_lets_a_prefix_hit_land_on_uncomputed_blocks():
    """A request aborted while its prefill runs keeps its blocks until the step is
    postprocessed, so a later request with the same prefix hits only computed K/V."""
    sched, bm = make_scheduler(num_blocks=16, block_size=4)
    first = Sequence(list(range(1, 9)), SamplingParams(max_tokens=4))
    sched.add(first)
    batch = sched.schedule()
    sched.abort(first.request_id)
    second = Sequence(list(range(1, 10)), SamplingParams(max_tokens=4))
    sched.add(second)
    assert len(sched.schedule()) == 0  # its prefix is being computed: it waits for it
    sched.postprocess(batch, [1])
    batch = sched.schedule()
    assert batch.seqs == [second] and second.num_cached_tokens == 8  # computed by first's finished step


def test_schedule_keeps_at_most_one_step_in_flight_and_postprocess_keeps_order():
    sched, _ = make_scheduler()
    seq = Sequence([1, 2, 3], SamplingParams(max_tokens=8))
    sched.add(seq)
    first = sched.schedule()
    second = sched.schedule()  # lookahead: the decode of the token ``first`` samples
    assert second.seqs == [seq] and second.starts == [3] and seq.num_pending_tokens == 2
    with pytest.raises(RuntimeError, match="two batches in flight"):
        sched.schedule()
    with pytest.raises(RuntimeError, match="order"):
        sched.postprocess(second, [5])
    sched.postprocess(first, [5])
    sched.postprocess(second, [6])
    assert seq.output_token_ids == [5, 6] and seq.num_pending_tokens == 0


def test_lookahead_token_of_a_finished_sequence_is_dropped():
    """A sequence that samples EOS at step N was scheduled again in step N + 1 before the host
    knew: step N + 1's token for it is dropped, and its blocks are freed only once step N + 1,
    which writes them, is postprocessed."""
    sched, bm = make_scheduler(num_blocks=8, block_size=2)
    seq = Sequence([1, 2, 3], SamplingParams(max_tokens=8))
    sched.add(seq)
    first = sched.schedule()
    second = sched.schedule()
    result = sched.postprocess(first, [EOS])
    assert result.finished == [seq] and seq.output_token_ids == [EOS] and seq.finish_reason == "stop"
    assert seq.block_table and sched.on_free.take() == [] and not sched.has_unfinished()
    result = sched.postprocess(second, [7])
    assert result.appended == [] and seq.output_token_ids == [EOS] and seq.num_pending_tokens == 0
    assert seq.block_table == [] and bm.num_free_blocks == 8 and sched.on_free.take() == [seq]


def test_a_sequence_whose_pending_tokens_end_it_is_not_scheduled_again():
    """max_tokens and max_model_len are known before the token is read back: the lookahead step
    leaves such a sequence out instead of computing a token that would be dropped."""
    sched, _ = make_scheduler(max_model_len=5)
    one = Sequence([1, 2], SamplingParams(max_tokens=1), request_id="one")
    full = Sequence([1, 2, 3, 4], SamplingParams(max_tokens=9), request_id="full")
    other = Sequence([7, 8], SamplingParams(max_tokens=9), request_id="other")
    for s in (one, full, other):
        sched.add(s)
    first = sched.schedule()
    second = sched.schedule()
    assert second.seqs == [other]
    assert [s.finish_reason for s in sched.postprocess(first, [5, 5, 5]).finished] == ["length", "length"]
    sched.postprocess(second, [5])
    assert one.output_token_ids == [5] and full.output_token_ids == [5] and other.output_token_ids == [5, 5]


def test_no_preemption_while_a_step_is_in_flight():
    """A decode that finds no free block while a step is in flight does not preempt (the
    in-flight step still writes the victim's blocks): it and the newer decodes wait, nothing is
    admitted, and ``needs_drain`` tells the engine to read the step back first; then the
    newest is preempted as usual."""
    sched, bm = make_scheduler(num_blocks=4, block_size=2, max_num_seqs=3)
    a = Sequence([1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True), request_id="a")  # 3 blocks at most
    b = Sequence([4], SamplingParams(max_tokens=4, ignore_eos=True), request_id="b")
    sched.add(a)
    sched.add(b)
    first = sched.schedule()  # a: 2 blocks, b: 1 block
    second = sched.schedule()  # a's position 3 and b's position 1 fit their blocks
    assert second.seqs == [a, b] and bm.num_free_blocks == 1
    sched.postprocess(first, [5, 5])
    third = sched.schedule()  # a takes the last block for position 4; b's position 2 finds none
    assert third.seqs == [a] and sched.needs_drain and sched.preempted == [] and b.block_table
    sched.postprocess(second, [5, 5])
    sched.postprocess(third, [5])
    fourth = sched.schedule()  # nothing in flight: b, the newest, is preempted
    assert fourth.seqs == [a] and sched.preempted == [b] and not sched.needs_drain
    assert b.status is S.WAITING and b.output_token_ids == [5, 5]


def test_failed_step_publishes_nothing_and_frees_its_batch():
    """A forward that raised: the sequences of every batch in flight finish with reason
    "error", their blocks are free, and no later request hits blocks whose K/V was never written."""
    sched, bm = make_scheduler(num_blocks=16, block_size=4)
    first = Sequence(list(range(1, 9)), SamplingParams(max_tokens=4))
    sched.add(first)
    sched.schedule()
    sched.schedule()
    assert sched.fail_in_flight() == [first]
    assert first.status is S.FINISHED and first.finish_reason == "error" and bm.num_free_blocks == 16
    assert first.num_in_flight == 0 and first.num_pending_tokens == 0 and sched.num_in_flight == 0
    second = Sequence(list(range(1, 10)), SamplingParams(max_tokens=4))
    sched.add(second)
    batch = sched.schedule()
    assert batch.seqs == [second] and second.num_cached_tokens == 0


def test_finish_ends_a_running_sequence_with_the_given_reason():
    """The engine ends a request on a matched stop string through finish(..., "stop")."""
    sched, bm = make_scheduler(num_blocks=16, block_size=4)
    seq = Sequence([1, 2, 3], SamplingParams(max_tokens=8))
    sched.add(seq)
    sched.postprocess(sched.schedule(), [5])
    assert sched.finish(seq.request_id, "stop")
    assert seq.status is S.FINISHED and seq.finish_reason == "stop" and bm.num_free_blocks == 16
    assert not sched.has_unfinished()


def test_a_waiting_request_prefills_in_the_step_where_the_running_ones_decode():
    """Mixed steps: no decode waits for a prefill; decodes come first."""
    sched, _ = make_scheduler()
    first, second = Sequence([1, 2, 3]), Sequence([4, 5])
    sched.add(first)
    sched.postprocess(sched.schedule(), [9])
    sched.add(second)
    batch = sched.schedule()
    assert entries(batch) == [(first.request_id, 3, 1), (second.request_id, 0, 2)] and batch.samples == [True, True]
    sched.postprocess(batch, [9, 9])
    assert sched.schedule().seqs == [first, second]


@pytest.mark.parametrize("admission, expected", [
    ("reserve", [[("big1", 6)], [("big2", 6), ("small", 1)]]),
    ("watermark", [[("big1", 6)], [("big2", 6)], [("small", 1)]]),  # small's block is the watermark
])
def test_fcfs_head_blocks_later_requests(admission, expected):
    """A waiting head that does not fit is not overtaken by a smaller request behind it."""
    sched, _ = make_scheduler(num_blocks=4, block_size=2, max_num_batched_tokens=8, admission=admission)
    big1 = Sequence([1] * 6, SamplingParams(max_tokens=1), request_id="big1")   # 3 blocks
    big2 = Sequence([2] * 6, SamplingParams(max_tokens=1), request_id="big2")   # 3 blocks
    small = Sequence([3], SamplingParams(max_tokens=1), request_id="small")     # 1 block: would fit
    for s in (big1, big2, small):
        sched.add(s)
    assert run_to_completion(sched) == expected


def test_tiny_pool_waits_and_never_preempts():
    """Reserve admission: the pool holds one request's worst case, so the second waits and the
    first keeps its blocks."""
    sched, bm = make_scheduler(num_blocks=3, block_size=2, max_num_seqs=2, admission="reserve")
    a = Sequence([1, 2, 3], SamplingParams(max_tokens=3), request_id="a")  # 5 KV tokens: 3 blocks
    b = Sequence([4, 5, 6], SamplingParams(max_tokens=3), request_id="b")
    sched.add(a)
    sched.add(b)
    steps = run_to_completion(sched)
    assert steps == [[("a", 3)], [("a", 1)], [("a", 1)], [("b", 3)], [("b", 1)], [("b", 1)]]
    assert len(a.output_token_ids) == len(b.output_token_ids) == 3 and bm.num_free_blocks == 3
    assert sched.num_preemptions == 0


def test_watermark_admission_preempts_the_newest_and_recomputes_it():
    """Watermark admission starts both requests (their prompts fit beside the one-block
    watermark); when the cache runs out the newest is preempted, waits at the front of the queue
    with its output, and is recomputed from prompt + output, reusing its published block."""
    sched, bm = make_scheduler(num_blocks=4, block_size=2, max_num_seqs=2)
    assert sched.watermark_blocks == 1
    a = Sequence([1, 2, 3], SamplingParams(max_tokens=4), request_id="a")  # 6 KV tokens: 3 blocks
    b = Sequence([4], SamplingParams(max_tokens=4), request_id="b")
    late = Sequence([6], SamplingParams(max_tokens=1), request_id="late")
    sched.add(a)
    sched.add(b)
    batch = sched.schedule()
    assert batch.seqs == [a, b]
    sched.postprocess(batch, [5, 5])
    batch = sched.schedule()
    assert batch.seqs == [a, b] and batch.is_decode
    sched.postprocess(batch, [5, 5])
    sched.add(late)
    batch = sched.schedule()  # a takes the last free block; b finds none
    assert batch.seqs == [a] and sched.preempted == [b] and sched.num_preemptions == 1
    assert b.status is S.WAITING and b.block_table == [] and list(sched.waiting) == [b, late]
    assert b.output_token_ids == [5, 5] and sched.on_free.take() == [b]
    sched.postprocess(batch, [5])
    batch = sched.schedule()
    assert batch.seqs == [a]  # b's 2 blocks + the watermark do not fit yet
    assert sched.postprocess(batch, [5]).finished == [a]
    batch = sched.schedule()  # the preempted one first, after its published block [4, 5]
    assert entries(batch) == [("b", 2, 1), ("late", 0, 1)] and b.num_cached_tokens == 2
    sched.postprocess(batch, [5, 5])
    assert run_to_completion(sched) == [[("b", 1)]]
    assert a.output_token_ids == [5] * 4 and b.output_token_ids == [5] * 4 and late.output_token_ids == [5]
    assert sched.num_preemptions == 1 and bm.num_free_blocks == 4


def test_chunked_prefill_covers_the_prompt_and_samples_only_at_its_end():
    """A prompt over max_num_batched_tokens runs in chunks of at most that many tokens, each
    starting where the last ended; only the last chunk samples. A prompt that arrives meanwhile
    takes what budget the first one leaves (cut too), then finishes beside the first one's decode."""
    sched, bm = make_scheduler(num_blocks=16, block_size=2, max_num_batched_tokens=4)
    long = Sequence(list(range(1, 11)), SamplingParams(max_tokens=2), request_id="long")
    sched.add(long)
    steps = []
    for step in range(4):
        batch = sched.schedule()
        steps.append(entries(batch))
        if step == 0:
            sched.add(short := Sequence([7, 8, 9], SamplingParams(max_tokens=2), request_id="short"))
        sched.postprocess(batch, [5] * len(batch))
        assert long.output_token_ids == ([5] if step == 2 else [5, 5] if step == 3 else [])
    assert steps == [[("long", 0, 4)], [("long", 4, 4)], [("long", 8, 2), ("short", 0, 2)],
                     [("long", 10, 1), ("short", 2, 1)]]
    assert short.output_token_ids == [5] and long.finish_reason == "length"


def test_a_step_of_one_token_entries_is_a_decode_step_even_where_a_chunk_samples_nothing():
    """ScheduledBatch.is_decode is the entries' shape, not their sampling: every entry computes one
    token plus its drafts. A one-token prefill chunk short of its prompt's end, beside a decode,
    makes a decode step (the runner's mixed path would find no prefill in it); a chunk of two
    tokens, or an entry of a draft's length short, does not."""
    sched, _ = make_scheduler(num_blocks=16, block_size=2, max_num_seqs=2, max_num_batched_tokens=2)
    first = Sequence([1, 2], SamplingParams(max_tokens=3), request_id="first")
    sched.add(first)
    sched.postprocess(sched.schedule(), [5])
    sched.add(Sequence([7, 8, 9], SamplingParams(max_tokens=2), request_id="later"))
    batch = sched.schedule()
    assert entries(batch) == [("first", 2, 1), ("later", 0, 1)] and batch.samples == [True, False]
    assert batch.is_decode
    seqs = batch.seqs
    assert ScheduledBatch(seqs, [2, 0], [1, 1], [True, False]).is_decode
    assert not ScheduledBatch(seqs, [2, 0], [1, 2], [True, False]).is_decode
    assert ScheduledBatch(seqs, [2, 0], [3, 1], [True, False], [[4, 4], []]).is_decode
    assert not ScheduledBatch(seqs, [2, 0], [2, 1], [True, False], [[4, 4], []]).is_decode


def test_the_scheduler_keeps_what_it_is_given_as_attributes_read_every_step():
    """The attributes later phases read and set (Scheduler's docstring): settings, watermark,
    drafter and on_free as given, eos_token_ids a frozenset, the limits plain attributes that the
    next schedule() reads (max_num_seqs = 0 holds every request back; restored, they start)."""
    bm = BlockManager(16, 4)
    settings = SchedulerSettings(4, 64, 64)
    drafter, freed = SimpleNamespace(num_speculative_tokens=2), Freed()
    assert Scheduler(settings, bm, eos_token_id=EOS, drafter=drafter).drafter is drafter  # drafts are phase 13's
    sched = Scheduler(settings, bm, eos_token_id=[EOS, 3], on_free=freed, watermark=0.25)
    assert sched.settings is settings and sched.drafter is None and sched.on_free is freed
    assert sched.watermark == 0.25 and sched.eos_token_ids == frozenset({EOS, 3})
    assert Scheduler(settings, bm, eos_token_id=None).eos_token_ids == frozenset()
    assert (sched.max_num_seqs, sched.max_num_batched_tokens, sched.max_model_len) == (4, 64, 64)
    sched.add(Sequence([1, 2], SamplingParams(max_tokens=1), request_id="held"))
    sched.max_num_seqs = 0
    assert len(sched.schedule()) == 0 and sched.has_unfinished()
    sched.max_num_seqs = 4
    assert run_to_completion(sched) == [[("held", 2)]]


def test_prompt_tokens_beside_decodes_are_capped_and_a_step_without_decodes_takes_the_budget():
    """With ``prefill_tokens_beside_decodes`` a step that decodes carries at most that many
    prompt tokens (a long prompt goes on in chunks of that size, a second prompt cut beside it),
    while a step with nothing to decode fills the whole token budget."""
    bm = BlockManager(32, 2)
    sched = Scheduler(SchedulerSettings(4, 16, 64, prefill_tokens_beside_decodes=3), bm, eos_token_id=EOS)
    first = Sequence(list(range(1, 13)), SamplingParams(max_tokens=8, ignore_eos=True), request_id="first")
    sched.add(first)
    batch = sched.schedule()
    assert entries(batch) == [("first", 0, 12)]  # nothing decodes: the whole prompt (budget 16)
    sched.postprocess(batch, [5])
    for rid, base in (("second", 20), ("third", 30)):
        sched.add(Sequence(list(range(base, base + 5)), SamplingParams(max_tokens=2, ignore_eos=True), request_id=rid))
    steps = []
    for _ in range(3):
        batch = sched.schedule()
        steps.append(entries(batch))
        sched.postprocess(batch, [5] * batch.num_logits_rows)
    assert steps == [[("first", 12, 1), ("second", 0, 3)],
                     [("first", 13, 1), ("second", 3, 2), ("third", 0, 1)],
                     [("first", 14, 1), ("second", 5, 1), ("third", 1, 3)]]
    with pytest.raises(ValueError, match=r"^prefill_tokens_beside_decodes must be >= 0 \(0: no cap\), got -1$"):
        SchedulerSettings(1, 4, 8, prefill_tokens_beside_decodes=-1)


def test_a_step_whose_decode_waits_for_a_block_caps_its_prompt_tokens_too():
    """With a step in flight, a decode that finds no free block waits (``needs_drain``) and the
    step goes on with the running prompt's chunk: that chunk is capped as if the decode ran (the
    decode waits for the step all the same)."""
    bm = BlockManager(13, 4)
    sched = Scheduler(SchedulerSettings(4, 16, 64, prefill_tokens_beside_decodes=2), bm, eos_token_id=EOS)
    sched.add(Sequence([1, 2, 3, 4], SamplingParams(max_tokens=14, ignore_eos=True), request_id="a"))
    in_flight, drained = None, []
    for step in range(14):
        if in_flight is not None and sched.needs_drain:
            sched.postprocess(in_flight, [5] * in_flight.num_logits_rows)
            in_flight = None
        batch = sched.schedule()
        if sched.needs_drain:
            drained.append(entries(batch))
        if step == 0:
            sched.add(Sequence(list(range(10, 50)), SamplingParams(max_tokens=1, ignore_eos=True), request_id="b"))
        if in_flight is not None:
            sched.postprocess(in_flight, [5] * in_flight.num_logits_rows)
        in_flight = batch if batch.seqs else None
    assert drained and all(sum(n for _, _, n in step) <= 2 for step in drained), drained


def test_abort_and_failure_mid_prefill_and_while_preempted():
    """A half-prefilled sequence aborted between steps frees its blocks, and only the blocks its
    chunks computed stay prefix-cache hits; a failed chunk finishes its sequence with "error";
    a preempted sequence waiting for recompute can be aborted like any waiting one."""
    sched, bm = make_scheduler(num_blocks=8, block_size=2, max_num_batched_tokens=4)
    half = Sequence(list(range(1, 10)), SamplingParams(max_tokens=2), request_id="half")
    sched.add(half)
    sched.postprocess(sched.schedule(), [5])
    assert half.num_computed_tokens == 4 and sched.abort("half") and bm.num_free_blocks == 8
    assert bm.cached_prefix_len(Sequence(list(range(1, 10)))) == 4  # blocks 0-1 computed; 2-3 never were
    failing = Sequence(list(range(20, 30)), SamplingParams(max_tokens=2), request_id="failing")
    sched.add(failing)
    sched.postprocess(sched.schedule(), [5])
    sched.schedule()
    assert sched.fail_in_flight() == [failing] and failing.finish_reason == "error"
    assert bm.num_free_blocks == 8 and not sched.has_unfinished()
    assert bm.cached_prefix_len(Sequence(list(range(20, 30)))) == 4  # only the first chunk's blocks
    sched, bm = make_scheduler(num_blocks=3, block_size=1, max_num_seqs=2)
    a, b = Sequence([1], SamplingParams(max_tokens=3)), Sequence([2], SamplingParams(max_tokens=3))
    sched.add(a)
    sched.add(b)
    batch = sched.schedule()
    assert batch.seqs == [a, b]
    sched.postprocess(batch, [5, 5])
    batch = sched.schedule()
    assert batch.seqs == [a] and sched.preempted == [b]
    assert sched.abort(b.request_id) and b.finish_reason == "abort" and not sched.waiting
    sched.postprocess(batch, [5])
    run_to_completion(sched)
    assert len(a.output_token_ids) == 3 and bm.num_free_blocks == 3


def test_admission_waits_for_a_prefix_another_sequence_is_computing():
    """A waiting request whose next prefix block another running sequence is computing waits a
    step and shares it, instead of computing it again (with a step in flight the blocks the
    previous step computed are not published yet when the next is scheduled)."""
    sched, _ = make_scheduler(num_blocks=16, block_size=2, max_num_batched_tokens=64)
    shared = [1, 2, 3, 4, 5, 6]
    first = Sequence(shared + [7], SamplingParams(max_tokens=4), request_id="first")
    sched.add(first)
    one = sched.schedule()
    second = Sequence(shared + [8, 9], SamplingParams(max_tokens=4), request_id="second")
    sched.add(second)
    two = sched.schedule()
    assert two.seqs == [first], "second started before the shared blocks were published"
    sched.postprocess(one, [5])
    three = sched.schedule()
    assert three.seqs == [first, second] and second.num_cached_tokens == 6


@pytest.mark.parametrize("block_size", [1, 16, 256])
def test_block_size_is_injectable(block_size):
    """The scheduler takes its block size from the BlockManager it is given."""
    bm = BlockManager(num_blocks=2, block_size=block_size)
    sched = Scheduler(SchedulerSettings(max_num_seqs=2, max_num_batched_tokens=512, max_model_len=512), bm,
                      eos_token_id=EOS)
    seq = Sequence([1] * 20, SamplingParams(max_tokens=4))  # 23 KV tokens
    assert sched.add(seq) is (blocks(23, block_size) <= 2)
    if block_size > 1:
        run_to_completion(sched)
        assert len(seq.output_token_ids) == 4


def test_decode_reserves_a_slot_for_every_running_sequence():
    sched, bm = make_scheduler(num_blocks=6, block_size=2)
    seqs = [Sequence([1, 2], SamplingParams(max_tokens=4)), Sequence([3], SamplingParams(max_tokens=4))]
    for s in seqs:
        sched.add(s)
    sched.postprocess(sched.schedule(), [5, 5])
    batch = sched.schedule()
    assert batch.is_decode
    assert all(len(s.block_table) * 2 >= start + 1 for s, start in zip(batch.seqs, batch.starts))


def test_multiple_eos_ids_and_none():
    bm = BlockManager(8, 2)
    sched = Scheduler(SchedulerSettings(2, 8, 16), bm, eos_token_id=[7, 8])
    a, b = Sequence([1], SamplingParams(max_tokens=2)), Sequence([2], SamplingParams(max_tokens=2))
    sched.add(a)
    sched.add(b)
    assert sched.postprocess(sched.schedule(), [8, 3]).finished == [a] and a.finish_reason == "stop"
    no_eos = Scheduler(SchedulerSettings(1, 8, 16), BlockManager(8, 2), eos_token_id=None)
    c = Sequence([1], SamplingParams(max_tokens=2))
    no_eos.add(c)
    steps = run_to_completion(no_eos, token=0)
    assert len(steps) == 2 and c.finish_reason == "length"


def test_bad_arguments_raise():
    """Each refusal names the value and says the rule (the engine's CLI prints these words)."""
    bm = BlockManager(8, 2)
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(2\) must be >= max_num_seqs \(4\)"):
        SchedulerSettings(max_num_seqs=4, max_num_batched_tokens=2, max_model_len=16)
    with pytest.raises(ValueError, match="max_num_seqs and max_model_len must be >= 1, got 0, 16"):
        SchedulerSettings(max_num_seqs=0, max_num_batched_tokens=2, max_model_len=16)
    with pytest.raises(ValueError, match="admission must be one of"):
        SchedulerSettings(2, 8, 16, admission="lottery")
    with pytest.raises(ValueError, match="watermark"):
        Scheduler(SchedulerSettings(2, 8, 16), bm, eos_token_id=0, watermark=1.0)
    sched = Scheduler(SchedulerSettings(2, 8, 16), bm, eos_token_id=0)
    seq = Sequence([1], request_id="x")
    sched.add(seq)
    with pytest.raises(ValueError, match="already scheduled"):
        sched.add(Sequence([2], request_id="x"))
    batch = sched.schedule()
    with pytest.raises(ValueError, match="not WAITING"):
        sched.add(seq)
    with pytest.raises(ValueError, match=r"^1 sampled rows but 0 token ids$"):
        sched.postprocess(batch, [])


def test_accepted_length_counts_the_drafts_the_sampled_tokens_confirm():
    """sampled[j] is what the target model drew after draft[:j] (one row more than the drafts):
    the drafts accepted are the longest prefix with draft[j] == sampled[j]."""
    from engine.scheduling.scheduler import accepted_length

    assert accepted_length([], [5]) == 0
    assert accepted_length([5, 6, 7], [5, 6, 7, 8]) == 3
    assert accepted_length([5, 6, 7], [5, 9, 7, 8]) == 1
    assert accepted_length([5, 6, 7], [4, 6, 7, 8]) == 0
    assert accepted_length([5, 5], [5, 5, 9]) == 2
    assert accepted_length([6, 7], [5, 6, 7]) == 0
