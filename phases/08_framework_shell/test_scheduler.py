"""Scheduler: prefill-first FCFS batching, budgets, REJECTED, abort, no preemption."""
import random

import pytest
from hypothesis import HealthCheck, given, settings
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
    (S.RUNNING_DECODE, S.FINISHED),
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


def make_scheduler(num_blocks=16, block_size=4, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64):
    bm = BlockManager(num_blocks, block_size)
    return Scheduler(bm, max_num_seqs, max_num_batched_tokens, max_model_len, eos_token_id=EOS), bm


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
        max_tokens=st.integers(1, 8), ignore_eos=st.booleans(),
        stop_token_ids=st.lists(st.integers(1, 5), max_size=1),
        arrival=st.integers(0, 4), abort_at=st.one_of(st.none(), st.integers(0, 12)),
    )),
    min_size=2, max_size=8)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(block_size=st.sampled_from([1, 2, 4]), max_model_len=st.integers(2, 24), max_num_seqs=st.integers(1, 4),
       budget_slack=st.integers(-3, 8), pool_slack=st.integers(-2, 12), requests=requests_strategy,
       seed=st.integers(0, 2**16))
def test_scheduler_properties(block_size, max_model_len, max_num_seqs, budget_slack, pool_slack, requests, seed):
    """Random workloads (shared prefixes, staggered arrivals, aborts, random tokens with EOS)
    checked step by step against the rules and a model of the KV cache."""
    rng = random.Random(seed)
    budget = max(max_num_seqs, max_model_len + budget_slack)
    num_blocks = max(1, blocks(max_model_len, block_size) + pool_slack)
    bm = BlockManager(num_blocks, block_size)
    sched = Scheduler(bm, max_num_seqs, budget, max_model_len, eos_token_id=EOS)
    kv = KVOracle(block_size)
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
    tables = {}
    accepted, done = [], []
    step = 0
    while step <= max(r["arrival"] for r in requests) or sched.has_unfinished():
        assert step < 500, "no progress"
        for seq, r in zip(seqs, requests):
            if r["arrival"] == step:
                impossible = (seq.num_prompt_tokens > max_model_len or seq.num_prompt_tokens > budget
                              or worst_case_blocks(seq, max_model_len, block_size) > num_blocks)
                assert sched.add(seq) is not impossible
                if impossible:
                    assert seq.status is S.REJECTED and seq.reject_reason
                else:
                    accepted.append(seq)
            if r["abort_at"] == step and seq in accepted and not seq.is_finished:
                assert sched.abort(seq.request_id)
                done.append(seq)
        waiting_before, running_before = list(sched.waiting), list(sched.running)
        free_before = bm.num_free_blocks
        batch, is_prefill = sched.schedule()
        record_transitions()
        if not batch:
            assert not is_prefill and not sched.has_unfinished(), "idle although work could run"
        assert len(set(map(id, batch))) == len(batch) and len(sched.running) <= max_num_seqs
        if is_prefill:
            assert batch == waiting_before[:len(batch)], "prefill must take the waiting queue in order"
            assert sum(s.num_prompt_tokens - s.num_cached_tokens for s in batch) <= budget
            for seq in batch:
                kv.write(seq, seq.num_cached_tokens, seq.num_tokens)
        elif batch:
            assert batch == running_before, "decode runs every running sequence in admission order"
            assert all(s.status is S.RUNNING_DECODE for s in batch)
            if waiting_before:  # prefill first: decode only when the queue head cannot start
                head = waiting_before[0]
                reserved = sum(worst_case_blocks(s, max_model_len, block_size) - len(tables[s.request_id])
                               for s in running_before)
                fits = (len(running_before) < max_num_seqs and head.num_prompt_tokens <= budget
                        and worst_case_blocks(head, max_model_len, block_size) + reserved <= free_before)
                assert not fits, "a waiting request that fits was not prefilled"
            for seq in batch:
                kv.write(seq, seq.num_tokens - 1, seq.num_tokens)
        for seq in batch:  # every sequence in the step reads exactly its own KV
            kv.check(seq, seq.num_tokens)
            old = tables.get(seq.request_id, [])
            assert seq.block_table[:len(old)] == old, "a running sequence lost blocks (preemption)"
            tables[seq.request_id] = list(seq.block_table)
        tokens = [rng.choice([EOS, 1, 2, 3, 4, 5]) for _ in batch]
        finished = sched.postprocess(batch, is_prefill, tokens)
        for seq, token in zip(batch, tokens):
            reason = expected_finish(seq, token, max_model_len)
            assert seq.finish_reason == reason and (seq in finished) == (reason is not None)
            assert seq.status is (S.FINISHED if reason else S.RUNNING_DECODE)
        done.extend(finished)
        record_transitions()
        for seq in seqs:
            if seq.status is S.FINISHED:
                assert seq.block_table == []
        in_use = {b for s in sched.running for b in s.block_table}
        assert bm.num_free_blocks == num_blocks - len(in_use)
        step += 1
    assert sorted(s.request_id for s in done) == sorted(s.request_id for s in accepted), "lost or duplicated"
    assert bm.num_free_blocks == num_blocks
    for seq in accepted:
        path = history[seq.request_id]
        assert all(pair in ALLOWED_TRANSITIONS for pair in zip(path, path[1:])), path
        assert path[-1] is S.FINISHED and seq.num_output_tokens <= seq.sampling_params.max_tokens


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


def test_impossible_prompts_are_rejected_while_others_proceed():
    sched, bm = make_scheduler(num_blocks=3, block_size=4, max_num_batched_tokens=12, max_model_len=14)
    too_long = Sequence(list(range(1, 16)), request_id="too_long")           # > max_model_len
    over_budget = Sequence(list(range(1, 14)), request_id="over_budget")     # > max_num_batched_tokens
    too_big = Sequence([1] * 10, SamplingParams(max_tokens=8), request_id="too_big")  # 14 KV tokens > 3 blocks
    fine = Sequence([1] * 10, SamplingParams(max_tokens=3), request_id="fine")
    assert not sched.add(too_long) and "max_model_len" in too_long.reject_reason
    assert not sched.add(over_budget) and "max_num_batched_tokens" in over_budget.reject_reason
    assert not sched.add(too_big) and "blocks" in too_big.reject_reason
    assert all(s.status is S.REJECTED for s in (too_long, over_budget, too_big))
    assert sched.add(fine)
    steps = run_to_completion(sched)
    assert all(ids == ["fine"] for ids, _ in steps) and fine.finish_reason == "length"


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


def test_fcfs_head_blocks_later_requests():
    """A waiting head that does not fit is not overtaken by a smaller request behind it."""
    sched, _ = make_scheduler(num_blocks=4, block_size=2, max_num_batched_tokens=8)
    big1 = Sequence([1] * 6, SamplingParams(max_tokens=1), request_id="big1")   # 3 blocks
    big2 = Sequence([2] * 6, SamplingParams(max_tokens=1), request_id="big2")   # 3 blocks
    small = Sequence([3], SamplingParams(max_tokens=1), request_id="small")     # 1 block: would fit
    for s in (big1, big2, small):
        sched.add(s)
    steps = run_to_completion(sched)
    assert steps == [(["big1"], True), (["big2", "small"], True)]


def test_tiny_pool_waits_and_never_preempts():
    """The pool holds one request's worst case: the second waits, the first keeps its blocks."""
    sched, bm = make_scheduler(num_blocks=3, block_size=2, max_num_seqs=2)
    a = Sequence([1, 2, 3], SamplingParams(max_tokens=3), request_id="a")  # 5 KV tokens: 3 blocks
    b = Sequence([4, 5, 6], SamplingParams(max_tokens=3), request_id="b")
    sched.add(a)
    sched.add(b)
    steps = run_to_completion(sched)
    assert steps == [(["a"], True), (["a"], False), (["a"], False), (["b"], True), (["b"], False), (["b"], False)]
    assert a.num_output_tokens == b.num_output_tokens == 3 and bm.num_free_blocks == 3


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
