"""Scheduler: prefill-first FCFS batching, chunked prefill, watermark admission with preemption by
recompute, reserve admission without, budgets, REJECTED, abort."""
import random

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from engine.block_manager import BlockManager
from engine.scheduler import Scheduler
from engine.sequence import SamplingParams, Sequence
from engine.sequence import SequenceStatus as S
from shell_kv_oracle import KVOracle

EOS = 0
ALLOWED_TRANSITIONS = {
    (S.WAITING, S.RUNNING_PREFILL), (S.WAITING, S.FINISHED),
    (S.RUNNING_PREFILL, S.RUNNING_DECODE), (S.RUNNING_PREFILL, S.FINISHED),
    (S.RUNNING_DECODE, S.FINISHED), (S.RUNNING_DECODE, S.WAITING),
}


def blocks(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def worst_case_blocks(seq: Sequence, max_model_len: int, block_size: int) -> int:
    """KV blocks a request may need: all tokens but the last sampled one, at most max_model_len."""
    return blocks(min(seq.num_prompt_tokens + seq.sampling_params.max_tokens - 1, max_model_len), block_size)


def expected_finish(seq: Sequence, token: int, max_model_len: int) -> str | None:
    params = seq.sampling_params
    if (token == EOS and not params.ignore_eos) or token in params.stop_token_ids:
        return "stop"
    if seq.num_output_tokens == params.max_tokens or seq.num_tokens >= max_model_len:
        return "length"
    return None


def make_scheduler(num_blocks=16, block_size=4, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64,
                   admission="watermark"):
    bm = BlockManager(num_blocks, block_size)
    return Scheduler(bm, max_num_seqs, max_num_batched_tokens, max_model_len, eos_token_id=EOS,
                     admission=admission), bm


def run_to_completion(sched: Scheduler, token: int = 5, max_steps: int = 1000) -> list[tuple[list[str], bool]]:
    """Drive the scheduler like the engine, sampling ``token`` every time; returns the steps."""
    steps = []
    while sched.has_unfinished():
        assert len(steps) < max_steps, "scheduler made no progress"
        batch, is_prefill = sched.schedule()
        assert batch, "nothing scheduled although requests are unfinished"
        steps.append(([s.request_id for s in batch], is_prefill))
        sched.postprocess(batch, is_prefill, [token] * len(batch))
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
    """Checks one scheduled step against the rules; owns the KV model and what each
    sequence has been given so far (its outputs, where its next prefill chunk starts)."""

    def __init__(self, sched: Scheduler, block_size: int):
        self.sched, self.bm = sched, sched.block_manager
        self.kv = KVOracle(block_size)
        self.outputs: dict[str, list[int]] = {}
        self.chunk_start: dict[str, int] = {}  # request id -> first token of its next prefill chunk
        self.tables: dict[str, list[int]] = {}
        self.num_partial_chunks = 0

    def before(self):
        """Snapshot the scheduler before ``schedule()``."""
        sched, bm = self.sched, self.bm
        self.waiting, self.running = list(sched.waiting), list(sched.running)
        head = self.waiting[0] if self.waiting else None
        if head is None or len(self.running) >= sched.max_num_seqs:
            self.head_fits = False
        elif sched.admission == "watermark":
            self.head_fits = bm.can_allocate(head, num_reserved=sched.watermark_blocks if self.running else 0)
        else:  # its growth beyond the prompt and every running sequence's must stay free
            def growth(seq):
                return worst_case_blocks(seq, sched.max_model_len, bm.block_size) - len(seq.block_table)
            reserved = sum(map(growth, self.running)) + growth(head) - blocks(head.num_tokens, bm.block_size)
            self.head_fits = bm.can_allocate(head, num_reserved=reserved)

    def check_prefill(self, batch: list[Sequence]):
        sched = self.sched
        partial = [s for s in self.running if s.status is S.RUNNING_PREFILL]
        assert batch[:len(partial)] == partial[:len(batch)], "unfinished prompts must continue first, in order"
        admitted = batch[len(partial):]
        assert admitted == self.waiting[:len(admitted)], "prefill must take the waiting queue in order"
        for seq in batch[1:]:
            assert seq in partial or seq.num_scheduled_tokens == seq.num_tokens - seq.num_cached_tokens, \
                "only a batch's first sequence may start a prompt in chunks"
        assert sched.preempted == [] and all(s.status is S.RUNNING_PREFILL for s in batch)
        assert sum(s.num_scheduled_tokens for s in batch) <= sched.max_num_batched_tokens
        for seq in batch:
            rid = seq.request_id
            if seq in admitted:  # (re)admitted: hits are computed; it starts after them
                assert seq.num_computed_tokens == seq.num_cached_tokens
                self.chunk_start[rid] = seq.num_cached_tokens
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + seq.num_scheduled_tokens
            assert start == self.chunk_start[rid] and start < end <= seq.num_tokens, "a token computed twice or skipped"
            self.chunk_start[rid] = end
            self.num_partial_chunks += end < seq.num_tokens
            self.kv.check(seq, start)  # the computed prefix (hits, earlier chunks) holds its own K/V
            self.kv.write(seq, start, end)
            self.kv.check(seq, end)

    def check_decode(self, batch: list[Sequence]):
        sched = self.sched
        assert not self.head_fits, "a waiting request that fits was not prefilled"
        kept, preempted = self.running[:len(batch)], self.running[len(batch):]
        assert batch == kept, "decode runs the running sequences in admission order, preempting the newest"
        assert sched.preempted == preempted[::-1] and list(sched.waiting) == preempted + self.waiting
        assert not preempted or sched.admission == "watermark", "reserve admission never preempts"
        assert all(s.status is S.RUNNING_DECODE for s in batch), "decode while a prompt is half prefilled"
        for seq in preempted:
            assert seq.status is S.WAITING and seq.block_table == [] and seq.num_computed_tokens == 0
            del self.tables[seq.request_id]
        for seq in batch:
            assert seq.num_scheduled_tokens == 1 and seq.num_computed_tokens == seq.num_tokens - 1
            self.kv.write(seq, seq.num_tokens - 1, seq.num_tokens)
            self.kv.check(seq, seq.num_tokens)

    def check_tables(self, batch: list[Sequence]):
        """A sequence keeps its blocks from admission until it finishes or is preempted."""
        for seq in batch:
            old = self.tables.get(seq.request_id, [])
            assert seq.block_table[:len(old)] == old, "a running sequence lost blocks"
            self.tables[seq.request_id] = list(seq.block_table)

    def after(self, batch: list[Sequence], token_ids: list[int], finished: list[Sequence]):
        sched, bm = self.sched, self.bm
        for seq, token in zip(batch, token_ids):
            got = self.outputs.setdefault(seq.request_id, [])
            if seq.status is S.RUNNING_PREFILL:  # a chunk short of the end samples nothing
                assert seq.num_computed_tokens < seq.num_tokens and seq not in finished
            else:
                got.append(token)
                reason = expected_finish(seq, token, sched.max_model_len)
                assert seq.finish_reason == reason and (seq in finished) == (reason is not None)
                assert seq.status is (S.FINISHED if reason else S.RUNNING_DECODE)
            assert seq.output_token_ids == got, "output tokens lost or duplicated"
        in_use = {b for s in sched.running for b in s.block_table}
        assert all(not s.block_table for s in sched.waiting), "a waiting sequence holds blocks"
        assert bm.num_free_blocks == bm.num_blocks - len(in_use), "blocks leaked or over-committed"


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(admission=st.sampled_from(["watermark", "reserve"]), block_size=st.sampled_from([1, 2, 4]),
       max_model_len=st.integers(2, 24), max_num_seqs=st.integers(1, 4), budget_slack=st.integers(-24, 8),
       pool_slack=st.integers(-2, 6), requests=requests_strategy, seed=st.integers(0, 2**16))
def test_scheduler_properties(admission, block_size, max_model_len, max_num_seqs, budget_slack, pool_slack,
                              requests, seed):
    """Random workloads (shared prefixes, staggered arrivals, aborts, random tokens with EOS,
    token budgets below the prompt lengths, pools too small for every request at once) under
    both admission policies, checked step by step against the rules and a model of the KV
    cache: prefill chunks cover every prompt token exactly once, preempted sequences keep their
    output and come back first, nothing leaks, every request finishes."""
    run_workload(admission, block_size, max_model_len, max_num_seqs, budget_slack, pool_slack, requests, seed)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(block_size=st.sampled_from([1, 2]), max_model_len=st.integers(10, 24), max_num_seqs=st.integers(2, 4),
       budget_slack=st.integers(-12, 4), pool_slack=st.integers(0, 4),
       requests=st.lists(st.fixed_dictionaries(dict(
           family=st.integers(0, 2), shared=st.integers(0, 8), tail=st.lists(st.integers(1, 5), min_size=1,
                                                                              max_size=3),
           max_tokens=st.integers(4, 12), ignore_eos=st.just(True), stop_token_ids=st.just([]),
           arrival=st.integers(0, 2), abort_at=st.one_of(st.none(), st.integers(0, 30)))), min_size=3, max_size=6),
       seed=st.integers(0, 2**16))
def test_preemption_properties(block_size, max_model_len, max_num_seqs, budget_slack, pool_slack, requests, seed):
    """The same checks under memory pressure: long-running requests over a pool about one
    request's worst case, so watermark admission preempts (and recomputes) often."""
    sched = run_workload("watermark", block_size, max_model_len, max_num_seqs, budget_slack, pool_slack, requests,
                         seed)
    event(f"preemptions: {min(sched.num_preemptions, 3)}{'+' if sched.num_preemptions >= 3 else ''}")


def run_workload(admission, block_size, max_model_len, max_num_seqs, budget_slack, pool_slack, requests,
                 seed) -> Scheduler:
    """Drive a Scheduler through ``requests`` (arrivals, aborts, random tokens), checking every step."""
    rng = random.Random(seed)
    budget = max(max_num_seqs, max_model_len + budget_slack)
    num_blocks = max(1, blocks(max_model_len, block_size) + pool_slack)
    bm = BlockManager(num_blocks, block_size)
    sched = Scheduler(bm, max_num_seqs, budget, max_model_len, eos_token_id=EOS, admission=admission)
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
    accepted, done = [], []
    step = 0
    while step <= max(r["arrival"] for r in requests) or sched.has_unfinished():
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
                done.append(seq)
        check.before()
        batch, is_prefill = sched.schedule()
        record_transitions()
        if not batch:
            assert not is_prefill and not sched.has_unfinished(), "idle although work could run"
        assert len(set(map(id, batch))) == len(batch) and len(sched.running) <= max_num_seqs
        if is_prefill:
            check.check_prefill(batch)
        elif batch:
            check.check_decode(batch)
        check.check_tables(batch)
        tokens = [rng.choice([EOS, 1, 2, 3, 4, 5, 6, 7, 8, 9]) for _ in batch]
        finished = sched.postprocess(batch, is_prefill, tokens)
        check.after(batch, tokens, finished)
        done.extend(finished)
        record_transitions()
        for seq in seqs:
            if seq.status is S.FINISHED:
                assert seq.block_table == []
        step += 1
    assert sorted(s.request_id for s in done) == sorted(s.request_id for s in accepted), "lost or duplicated"
    assert bm.num_free_blocks == num_blocks and not any(bm.ref_counts)
    assert admission == "watermark" or sched.num_preemptions == 0
    event(f"{admission}: {'preempted' if sched.num_preemptions else 'no preemption'}")
    event(f"chunked prefill: {check.num_partial_chunks > 0}")
    for seq in accepted:
        path = history[seq.request_id]
        assert all(pair in ALLOWED_TRANSITIONS for pair in zip(path, path[1:])), path
        assert path[-1] is S.FINISHED and seq.num_output_tokens <= seq.sampling_params.max_tokens
        if seq.finish_reason == "length":
            assert seq.num_output_tokens == seq.sampling_params.max_tokens or seq.num_tokens >= max_model_len
    return sched


def test_status_transitions_and_finish_reasons():
    sched, bm = make_scheduler(max_model_len=8)
    eos = Sequence([1, 2], request_id="eos")
    ignore = Sequence([1, 2], SamplingParams(max_tokens=2, ignore_eos=True), request_id="ignore")
    stop_id = Sequence([1, 2], SamplingParams(stop_token_ids=[7]), request_id="stop_id")
    capped = Sequence([1, 2, 3, 4, 5, 6], SamplingParams(max_tokens=100), request_id="capped")
    seqs = [eos, ignore, stop_id, capped]
    assert all(sched.add(s) for s in seqs) and all(s.status is S.WAITING for s in seqs)
    batch, is_prefill = sched.schedule()
    assert is_prefill and batch == seqs and all(s.status is S.RUNNING_PREFILL for s in seqs)
    assert sched.postprocess(batch, True, [3, EOS, 3, 3]) == []
    assert all(s.status is S.RUNNING_DECODE for s in seqs)
    batch, is_prefill = sched.schedule()
    assert not is_prefill and batch == seqs
    finished = sched.postprocess(batch, False, [EOS, 3, 7, 3])
    assert finished == [eos, ignore, stop_id, capped]
    assert [s.finish_reason for s in finished] == ["stop", "length", "stop", "length"]
    assert capped.num_tokens == 8  # stopped at max_model_len
    assert all(s.status is S.FINISHED and not s.block_table for s in seqs)
    assert not sched.has_unfinished() and sched.schedule() == ([], False)
    assert bm.num_free_blocks == bm.num_blocks


@pytest.mark.parametrize("admission", ["watermark", "reserve"])
def test_impossible_prompts_are_rejected_while_others_proceed(admission):
    """Longer than max_model_len, or a worst case over the whole pool: REJECTED. Longer than
    max_num_batched_tokens is no reason (chunked prefill); a pool that holds the worst case is
    enough, whatever the watermark."""
    sched, bm = make_scheduler(num_blocks=3, block_size=4, max_num_batched_tokens=4, max_model_len=14,
                               admission=admission)
    too_long = Sequence(list(range(1, 16)), request_id="too_long")           # > max_model_len
    too_big = Sequence([1] * 10, SamplingParams(max_tokens=8), request_id="too_big")  # 14 KV tokens > 3 blocks
    fine = Sequence([1] * 10, SamplingParams(max_tokens=3), request_id="fine")  # 12 KV tokens = 3 blocks
    assert not sched.add(too_long) and "max_model_len" in too_long.reject_reason
    assert not sched.add(too_big) and "blocks" in too_big.reject_reason
    assert all(s.status is S.REJECTED for s in (too_long, too_big))
    assert sched.add(fine)
    steps = run_to_completion(sched)
    assert all(ids == ["fine"] for ids, _ in steps) and fine.finish_reason == "length"
    assert [p for _, p in steps] == [True, True, True, False, False] and fine.num_output_tokens == 3


def test_abort_frees_blocks_wherever_the_sequence_is():
    """Waiting: freed at once. In the batch being run: finished at once, its blocks
    freed at that batch's postprocess (when their K/V exists)."""
    sched, bm = make_scheduler(num_blocks=8, block_size=2, max_num_seqs=1)
    params = SamplingParams(max_tokens=2)
    running, waiting = Sequence([1, 2, 3], params), Sequence([4, 5, 6], params)
    sched.add(running)
    sched.add(waiting)
    batch, _ = sched.schedule()
    assert batch == [running] and bm.num_free_blocks < 8
    held = bm.num_free_blocks
    assert sched.abort(waiting.request_id) and waiting.finish_reason == "abort"
    assert sched.abort(running.request_id) and running.status is S.FINISHED
    assert bm.num_free_blocks == held  # still being computed
    assert not sched.abort(running.request_id) and not sched.abort("unknown")
    assert sched.postprocess(batch, True, [1]) == []  # aborted after schedule: no token
    assert running.output_token_ids == [] and running.block_table == [] and bm.num_free_blocks == 8
    assert not sched.has_unfinished()


def test_abort_in_flight_never_lets_a_prefix_hit_land_on_uncomputed_blocks():
    """A request aborted while its prefill runs keeps its blocks until the step is
    postprocessed, so a later request with the same prefix hits only computed K/V."""
    sched, bm = make_scheduler(num_blocks=16, block_size=4)
    first = Sequence(list(range(1, 9)), SamplingParams(max_tokens=4))
    sched.add(first)
    batch, _ = sched.schedule()
    sched.abort(first.request_id)
    with pytest.raises(RuntimeError, match="postprocess"):
        sched.schedule()  # the engine must finish the step before scheduling the next
    sched.postprocess(batch, True, [1])
    second = Sequence(list(range(1, 10)), SamplingParams(max_tokens=4))
    sched.add(second)
    batch, _ = sched.schedule()
    assert batch == [second] and second.num_cached_tokens == 8  # computed by first's finished step


def test_failed_step_publishes_nothing_and_frees_its_batch():
    """A forward that raised: its sequences finish with reason "error", their blocks are
    free, and no later request hits blocks whose K/V was never written."""
    sched, bm = make_scheduler(num_blocks=16, block_size=4)
    first = Sequence(list(range(1, 9)), SamplingParams(max_tokens=4))
    sched.add(first)
    sched.schedule()
    assert sched.fail_in_flight() == [first]
    assert first.status is S.FINISHED and first.finish_reason == "error" and bm.num_free_blocks == 16
    second = Sequence(list(range(1, 10)), SamplingParams(max_tokens=4))
    sched.add(second)
    batch, _ = sched.schedule()
    assert batch == [second] and second.num_cached_tokens == 0


def test_finish_ends_a_running_sequence_with_the_given_reason():
    """The engine ends a request on a matched stop string through finish(..., "stop")."""
    sched, bm = make_scheduler(num_blocks=16, block_size=4)
    seq = Sequence([1, 2, 3], SamplingParams(max_tokens=8))
    sched.add(seq)
    batch, is_prefill = sched.schedule()
    sched.postprocess(batch, is_prefill, [5])
    assert sched.finish(seq.request_id, "stop")
    assert seq.status is S.FINISHED and seq.finish_reason == "stop" and bm.num_free_blocks == 16
    assert not sched.has_unfinished()


def test_waiting_request_is_prefilled_before_running_ones_decode():
    sched, _ = make_scheduler()
    first, second = Sequence([1, 2, 3]), Sequence([4, 5])
    sched.add(first)
    batch, is_prefill = sched.schedule()
    sched.postprocess(batch, is_prefill, [9])
    sched.add(second)
    assert sched.schedule() == ([second], True)
    sched.postprocess([second], True, [9])
    assert sched.schedule() == ([first, second], False)


@pytest.mark.parametrize("admission, expected", [
    ("reserve", [(["big1"], True), (["big2", "small"], True)]),
    ("watermark", [(["big1"], True), (["big2"], True), (["small"], True)]),  # small's block is the watermark
])
def test_fcfs_head_blocks_later_requests(admission, expected):
    """A waiting head that does not fit is not overtaken by a smaller request behind it."""
    sched, _ = make_scheduler(num_blocks=4, block_size=2, max_num_batched_tokens=8, admission=admission)
    big1 = Sequence([1] * 6, SamplingParams(max_tokens=1), request_id="big1")   # 3 blocks
    big2 = Sequence([2] * 6, SamplingParams(max_tokens=1), request_id="big2")   # 3 blocks
    small = Sequence([3], SamplingParams(max_tokens=1), request_id="small")     # 1 block: would fit
    for s in (big1, big2, small):
        sched.add(s)
    steps = run_to_completion(sched)
    assert steps == expected


def test_tiny_pool_waits_and_never_preempts():
    """Reserve admission: the pool holds one request's worst case, so the second waits and the
    first keeps its blocks."""
    sched, bm = make_scheduler(num_blocks=3, block_size=2, max_num_seqs=2, admission="reserve")
    a = Sequence([1, 2, 3], SamplingParams(max_tokens=3), request_id="a")  # 5 KV tokens: 3 blocks
    b = Sequence([4, 5, 6], SamplingParams(max_tokens=3), request_id="b")
    sched.add(a)
    sched.add(b)
    steps = run_to_completion(sched)
    assert steps == [(["a"], True), (["a"], False), (["a"], False), (["b"], True), (["b"], False), (["b"], False)]
    assert a.num_output_tokens == b.num_output_tokens == 3 and bm.num_free_blocks == 3
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
    assert sched.schedule() == ([a, b], True)
    sched.postprocess([a, b], True, [5, 5])
    assert sched.schedule() == ([a, b], False)
    sched.postprocess([a, b], False, [5, 5])
    sched.add(late)
    batch, is_prefill = sched.schedule()  # a takes the last free block; b finds none
    assert (batch, is_prefill) == ([a], False) and sched.preempted == [b] and sched.num_preemptions == 1
    assert b.status is S.WAITING and b.block_table == [] and list(sched.waiting) == [b, late]
    assert b.output_token_ids == [5, 5]
    sched.postprocess(batch, is_prefill, [5])
    assert sched.schedule() == ([a], False)  # b's 2 blocks + the watermark do not fit yet
    assert sched.postprocess([a], False, [5]) == [a]
    assert sched.schedule() == ([b, late], True)  # the preempted one first
    assert (b.num_cached_tokens, b.num_scheduled_tokens) == (2, 1)  # block [4, 5] was published before
    sched.postprocess([b, late], True, [5, 5])
    assert run_to_completion(sched) == [(["b"], False)]
    assert a.output_token_ids == [5] * 4 and b.output_token_ids == [5] * 4 and late.num_output_tokens == 1
    assert sched.num_preemptions == 1 and bm.num_free_blocks == 4


def test_chunked_prefill_covers_the_prompt_and_samples_only_at_its_end():
    """A prompt over max_num_batched_tokens runs in chunks of at most that many tokens, each
    starting where the last ended; the tokens sampled by chunks short of the end are dropped.
    A prompt that arrives meanwhile waits for a step with room for it whole."""
    sched, bm = make_scheduler(num_blocks=16, block_size=2, max_num_batched_tokens=4)
    long = Sequence(list(range(1, 11)), SamplingParams(max_tokens=2), request_id="long")
    sched.add(long)
    chunks = []
    for step in range(3):
        batch, is_prefill = sched.schedule()
        assert batch[0] is long and is_prefill and long.status is S.RUNNING_PREFILL
        chunks.append((long.num_computed_tokens, long.num_scheduled_tokens))
        if step == 0:
            sched.add(short := Sequence([7, 8, 9], SamplingParams(max_tokens=2), request_id="short"))
        else:
            assert batch == [long, short][:len(batch)]
        sched.postprocess(batch, is_prefill, [5] * len(batch))
        assert long.output_token_ids == ([5] if step == 2 else [])
    assert chunks == [(0, 4), (4, 4), (8, 2)] and long.status is S.RUNNING_DECODE
    assert short.status is S.WAITING  # step 2 left 2 tokens of budget, short has 3
    assert sched.schedule() == ([short], True) and short.num_scheduled_tokens == 3
    sched.postprocess([short], True, [5])
    assert short.output_token_ids == [5] and sched.schedule() == ([long, short], False)


def test_abort_and_failure_mid_prefill_and_while_preempted():
    """A half-prefilled sequence aborted between steps frees its blocks, and only the blocks its
    chunks computed stay prefix-cache hits; a failed chunk finishes its sequence with "error";
    a preempted sequence waiting for recompute can be aborted like any waiting one."""
    sched, bm = make_scheduler(num_blocks=8, block_size=2, max_num_batched_tokens=4)
    half = Sequence(list(range(1, 10)), SamplingParams(max_tokens=2), request_id="half")
    sched.add(half)
    batch, is_prefill = sched.schedule()
    sched.postprocess(batch, is_prefill, [5])
    assert half.num_computed_tokens == 4 and sched.abort("half") and bm.num_free_blocks == 8
    assert bm.cached_prefix_len(Sequence(list(range(1, 10)))) == 4  # blocks 0-1 computed; 2-3 never were
    failing = Sequence(list(range(20, 30)), SamplingParams(max_tokens=2), request_id="failing")
    sched.add(failing)
    batch, is_prefill = sched.schedule()
    sched.postprocess(batch, is_prefill, [5])
    sched.schedule()
    assert sched.fail_in_flight() == [failing] and failing.finish_reason == "error"
    assert bm.num_free_blocks == 8 and not sched.has_unfinished()
    assert bm.cached_prefix_len(Sequence(list(range(20, 30)))) == 4  # only the first chunk's blocks
    sched, bm = make_scheduler(num_blocks=3, block_size=1, max_num_seqs=2)
    a, b = Sequence([1], SamplingParams(max_tokens=3)), Sequence([2], SamplingParams(max_tokens=3))
    sched.add(a)
    sched.add(b)
    assert sched.schedule() == ([a, b], True)
    sched.postprocess([a, b], True, [5, 5])
    assert sched.schedule()[0] == [a] and sched.preempted == [b]
    assert sched.abort(b.request_id) and b.finish_reason == "abort" and not sched.waiting
    sched.postprocess([a], False, [5])
    run_to_completion(sched)
    assert a.num_output_tokens == 3 and bm.num_free_blocks == 3


@pytest.mark.parametrize("block_size", [1, 16, 256])
def test_block_size_is_injectable(block_size):
    """The scheduler takes its block size from the BlockManager it is given."""
    bm = BlockManager(num_blocks=2, block_size=block_size)
    sched = Scheduler(bm, max_num_seqs=2, max_num_batched_tokens=512, max_model_len=512, eos_token_id=EOS)
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
    batch, is_prefill = sched.schedule()
    sched.postprocess(batch, is_prefill, [5, 5])
    batch, is_prefill = sched.schedule()
    assert not is_prefill
    assert all(len(s.block_table) * 2 >= s.num_tokens for s in batch)  # slot for position num_tokens - 1


def test_multiple_eos_ids_and_none():
    bm = BlockManager(8, 2)
    sched = Scheduler(bm, 2, 8, 16, eos_token_id=[7, 8])
    a, b = Sequence([1], SamplingParams(max_tokens=2)), Sequence([2], SamplingParams(max_tokens=2))
    sched.add(a)
    sched.add(b)
    batch, _ = sched.schedule()
    assert sched.postprocess(batch, True, [8, 3]) == [a] and a.finish_reason == "stop"
    no_eos = Scheduler(BlockManager(8, 2), 1, 8, 16, eos_token_id=None)
    c = Sequence([1], SamplingParams(max_tokens=2))
    no_eos.add(c)
    steps = run_to_completion(no_eos, token=0)
    assert len(steps) == 2 and c.finish_reason == "length"


def test_bad_arguments_raise():
    bm = BlockManager(8, 2)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=2, max_model_len=16, eos_token_id=0)
    with pytest.raises(ValueError, match="max_num_seqs"):
        Scheduler(bm, max_num_seqs=0, max_num_batched_tokens=2, max_model_len=16, eos_token_id=0)
    sched = Scheduler(bm, 2, 8, 16, eos_token_id=0)
    seq = Sequence([1], request_id="x")
    sched.add(seq)
    with pytest.raises(ValueError, match="already scheduled"):
        sched.add(Sequence([2], request_id="x"))
    batch, is_prefill = sched.schedule()
    with pytest.raises(ValueError, match="not WAITING"):
        sched.add(seq)
    with pytest.raises(ValueError, match="token ids"):
        sched.postprocess(batch, is_prefill, [])
