"""Fair admission: waiting sequences are admitted preempted first, then round robin over clients
(``Sequence.client``), first come, first served within one client; one client is plain FCFS. A
head whose blocks do not fit stops admission (nobody passes it, so it is never starved); a head
waiting for a prefix another sequence is computing passes its client's turn for the step.

The truth is written by hand for small cases, and for random ones is ``ReferenceQueue``: the rule
stated as simply as possible (a list of clients in turn order, each turn taking the client's
oldest arrival), independent of ``WaitingQueue``'s ring of per-client queues."""
from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from engine.scheduling.block_manager import BlockManager
from engine.scheduling.scheduler import Scheduler, SchedulerSettings
from engine.scheduling.sequence import SamplingParams, Sequence
from engine.scheduling.sequence import SequenceStatus as S
from engine.scheduling.waiting import WaitingQueue

EOS = 0
CLIENTS = ["", "a", "b", "c"]


class ReferenceQueue:
    """The admission order by its definition: ``preempted`` (the next first), then turns:
    ``turns`` lists the clients with a sequence waiting, the next turn first; a turn takes the
    client's oldest arrival and sends the client to the end of ``turns`` if it has more."""

    def __init__(self) -> None:
        self.preempted: list[Sequence] = []
        self.arrived: list[Sequence] = []  # in arrival order
        self.turns: list[str] = []

    def append(self, seq: Sequence) -> None:
        self.arrived.append(seq)
        if seq.client not in self.turns:
            self.turns.append(seq.client)

    def appendleft(self, seq: Sequence) -> None:
        self.preempted.insert(0, seq)

    def remove(self, seq: Sequence) -> None:
        if seq in self.preempted:
            self.preempted.remove(seq)
            return
        self.arrived.remove(seq)
        if not any(s.client == seq.client for s in self.arrived):
            self.turns.remove(seq.client)

    def head(self, passed=()) -> Sequence | None:
        if self.preempted:
            return self.preempted[0]
        client = next((c for c in self.turns if c not in passed), None)
        return None if client is None else next(s for s in self.arrived if s.client == client)

    def take(self, seq: Sequence) -> None:
        assert seq is self.head({c for c in self.turns if c != seq.client}), "taken out of turn"
        if self.preempted:
            self.preempted.pop(0)
            return
        self.arrived.remove(seq)
        self.turns.remove(seq.client)
        if any(s.client == seq.client for s in self.arrived):
            self.turns.append(seq.client)

    def order(self) -> list[Sequence]:
        """Every waiting sequence in the order turns would take them, nothing passed."""
        copy = ReferenceQueue()
        copy.preempted, copy.arrived, copy.turns = list(self.preempted), list(self.arrived), list(self.turns)
        order = []
        while (seq := copy.head()) is not None:
            copy.take(seq)
            order.append(seq)
        return order


def seq(name: str, client: str = "", prompt: list[int] | None = None, max_tokens: int = 1) -> Sequence:
    return Sequence(prompt or [1], SamplingParams(max_tokens=max_tokens, ignore_eos=True), request_id=name,
                    client=client)


def make_scheduler(num_blocks=64, block_size=2, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64,
                   admission="watermark") -> Scheduler:
    settings = SchedulerSettings(max_num_seqs, max_num_batched_tokens, max_model_len, admission)
    return Scheduler(settings, BlockManager(num_blocks, block_size), eos_token_id=EOS)


def step(sched: Scheduler, token: int = 5) -> list[str]:
    """One synchronous step: the request ids it scheduled, in batch order."""
    batch = sched.schedule()
    if batch.seqs:
        sched.postprocess(batch, [token] * batch.num_logits_rows)
    return [s.request_id for s in batch.seqs]


def admitted(sched: Scheduler) -> list[str]:
    """One synchronous step: the request ids it admitted (waiting before it), in admission order."""
    waiting = {s.request_id for s in sched.waiting}
    return [rid for rid in step(sched) if rid in waiting]


def admissions(sched: Scheduler, max_steps: int = 200) -> list[list[str]]:
    """Run to the end synchronously: each step's admitted request ids, in admission order."""
    steps = []
    while sched.has_unfinished():
        assert len(steps) < max_steps, "no progress"
        steps.append(admitted(sched))
    return steps


def worst_case_blocks(seq: Sequence, sched: Scheduler) -> int:
    """KV blocks ``seq`` may ever hold: every token but the last sampled one, within max_model_len."""
    max_kv = min(seq.num_prompt_tokens + seq.sampling_params.max_tokens - 1, sched.max_model_len)
    return -(-max_kv // sched.block_manager.block_size)


def fits(sched: Scheduler, head: Sequence) -> bool:
    """``head``'s blocks fit now by the admission policy's rule (the scheduler's state after a step)."""
    bm = sched.block_manager
    if sched.admission == "watermark":
        return bm.can_allocate(head, num_reserved=sched.watermark_blocks if sched.running else 0)
    growth = worst_case_blocks(head, sched) - bm.blocks_for(head.num_tokens)
    reserved = sum(worst_case_blocks(s, sched) - len(s.block_table) for s in sched.running)
    return bm.can_allocate(head, num_reserved=reserved + growth)


# ---- the queue alone ---------------------------------------------------------------------------


def test_turns_go_round_robin_over_clients_and_fifo_within_one():
    queue = WaitingQueue()
    for name in ["a1", "a2", "a3", "b1", "c1", "b2"]:
        queue.append(seq(name, client=name[0]))
    order = [s.request_id for s in queue]
    assert order == ["a1", "b1", "c1", "a2", "b2", "a3"] and len(queue) == 6
    taken = []
    while queue:
        head = queue.head()
        queue.take(head)
        taken.append(head.request_id)
    assert taken == order and len(queue) == 0 and queue.head() is None


def test_a_client_that_starts_waiting_takes_its_turn_after_those_already_waiting():
    queue = WaitingQueue()
    for name in ["a1", "a2", "a3"]:
        queue.append(seq(name, client="a"))
    queue.take(queue.head())  # a1: a's turn ends
    queue.append(seq("b1", client="b"))
    assert [s.request_id for s in queue] == ["a2", "b1", "a3"]
    queue.append(seq("c1", client="c"))
    assert [s.request_id for s in queue] == ["a2", "b1", "c1", "a3"]


def test_preempted_sequences_come_before_every_client_and_take_no_turn():
    queue = WaitingQueue()
    for name in ["a1", "b1", "a2"]:
        queue.append(seq(name, client=name[0]))
    queue.appendleft(old := seq("old", client="b"))
    queue.appendleft(older := seq("older", client="a"))  # preempted after "old": recomputed first
    assert [s.request_id for s in queue] == ["older", "old", "a1", "b1", "a2"] and queue.has_preempted
    queue.take(older)
    queue.take(old)
    assert not queue.has_preempted and queue.head().request_id == "a1"  # a's turn is still first


def test_a_passed_client_keeps_its_turn_and_removal_keeps_the_order():
    queue = WaitingQueue()
    for name in ["a1", "a2", "b1", "b2", "c1"]:
        queue.append(seq(name, client=name[0]))
    b1 = queue.head(passed={"a"})
    assert b1.request_id == "b1" and queue.head(passed={"a", "b", "c"}) is None
    queue.take(b1)
    assert [s.request_id for s in queue] == ["a1", "c1", "b2", "a2"]
    with pytest.raises(ValueError, match="not a head"):
        queue.take(next(s for s in queue if s.request_id == "a2"))  # a1 comes first
    queue.remove(next(s for s in queue if s.request_id == "c1"))  # c's only one: c leaves the turns
    queue.remove(next(s for s in queue if s.request_id == "a2"))
    assert [s.request_id for s in queue] == ["a1", "b2"]
    with pytest.raises(ValueError, match="not waiting"):
        queue.remove(seq("stranger", client="z"))


@settings(max_examples=300, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["append", "append", "preempt", "remove", "take"]),
                              st.sampled_from(CLIENTS), st.sets(st.sampled_from(CLIENTS)), st.integers(0, 99)),
                    max_size=60))
def test_the_queue_matches_the_reference_order(ops):
    """Random appends, preemptions, removals and admissions (with random clients passed): the
    same heads, the same iteration order and length as ``ReferenceQueue``."""
    queue, reference = WaitingQueue(), ReferenceQueue()
    for i, (op, client, passed, pick) in enumerate(ops):
        if op in ("append", "preempt"):
            new = seq(f"r{i}", client=client)
            (queue.append if op == "append" else queue.appendleft)(new)
            (reference.append if op == "append" else reference.appendleft)(new)
        elif op == "remove" and len(queue):
            victim = list(queue)[pick % len(queue)]
            queue.remove(victim)
            reference.remove(victim)
        elif op == "take":
            head = queue.head(passed)
            assert head is reference.head(passed)
            if head is not None:
                queue.take(head)
                reference.take(head)
        assert list(queue) == reference.order() and len(queue) == len(reference.order())
        assert bool(queue) == bool(reference.order()) and queue.has_preempted == bool(reference.preempted)


# ---- the scheduler's admission -------------------------------------------------------------------


def test_admission_takes_turns_over_clients():
    """One seat per step: a client's five sequences take turns with the others' (FCFS would run
    all of a's first)."""
    sched = make_scheduler(max_num_seqs=1)
    for name in ["a1", "a2", "a3", "a4", "a5", "b1", "c1", "c2"]:
        sched.add(seq(name, client=name[0]))
    assert admissions(sched) == [["a1"], ["b1"], ["c1"], ["a2"], ["c2"], ["a3"], ["a4"], ["a5"]]
    sched = make_scheduler(max_num_seqs=4)  # several seats: the turns fill them in order
    for name in ["a1", "a2", "a3", "a4", "a5", "b1", "c1", "c2"]:
        sched.add(seq(name, client=name[0]))
    assert admissions(sched) == [["a1", "b1", "c1", "a2"], ["c2", "a3", "a4", "a5"]]


@pytest.mark.parametrize("client", ["", "solo"])
def test_one_client_is_first_come_first_served(client):
    """With one client (whichever key) admission is FCFS, the head blocking those behind it, as
    before clients existed: the same steps as the hand-written FCFS schedule."""
    sched = make_scheduler(num_blocks=4, block_size=2, max_num_seqs=4, max_num_batched_tokens=8)
    for name, prompt in [("big1", [1] * 6), ("big2", [2] * 6), ("small", [3])]:
        sched.add(seq(name, client=client, prompt=prompt))
    assert admissions(sched) == [["big1"], ["big2"], ["small"]]  # small's block is the watermark beside big2


def test_preempted_sequences_are_recomputed_before_any_client_turn():
    """b (client B) is preempted; c of client C, whose turn is next, still waits for b's recompute."""
    sched, b = preempted_b()
    assert [s.request_id for s in sched.waiting] == ["b", "c"]
    assert admissions(sched) == [[], ["b", "c"], []]  # a finishes; then b (recomputed) before c


def preempted_b() -> tuple[Scheduler, Sequence]:
    """a (client A) and b (client B) run until the pool is out and b, the newest, is preempted;
    c (client C) arrived meanwhile."""
    sched = make_scheduler(num_blocks=4, block_size=2, max_num_seqs=2)
    a = seq("a", "A", [1, 2, 3], max_tokens=4)  # 6 KV tokens: 3 blocks
    b = seq("b", "B", [4], max_tokens=4)
    sched.add(a)
    sched.add(b)
    assert step(sched) == ["a", "b"] and step(sched) == ["a", "b"]
    sched.add(seq("c", "C", [6]))
    assert step(sched) == ["a"] and sched.preempted == [b]
    return sched, b


def test_a_head_waiting_for_its_prefix_passes_its_turn_and_keeps_its_place():
    """n choices of one prompt share its prefill: the second choice waits for the first's prefix
    blocks (a step in flight computes them), and meanwhile another client's head goes; once the
    blocks are published the waiting choice is admitted before that client's next one."""
    sched = make_scheduler(num_blocks=32, block_size=2, max_num_seqs=2)
    shared = [1, 2, 3, 4, 5, 6]
    sched.add(seq("first", "A", shared + [7], max_tokens=4))
    one = sched.schedule()
    sched.add(second := seq("second", "A", shared + [8], max_tokens=4))
    sched.add(seq("b1", "B", [9]))
    sched.add(seq("b2", "B", [10]))
    two = sched.schedule()  # first's blocks are in flight: second waits, b1 takes the seat
    assert [s.request_id for s in two.seqs] == ["first", "b1"]
    assert [s.request_id for s in sched.waiting] == ["second", "b2"]
    sched.postprocess(one, [5])
    sched.postprocess(two, [5, 5])  # b1 ends: one seat
    three = sched.schedule()  # A's turn, kept while it passed: second, sharing first's blocks
    assert [s.request_id for s in three.seqs] == ["first", "second"] and second.num_cached_tokens == 6
    assert [s.request_id for s in sched.waiting] == ["b2"]


def test_a_preempted_head_waiting_for_its_prefix_stops_admission():
    """A preempted sequence is recomputed before anything new, also while it waits for a prefix:
    no client passes it, though both fit."""
    sched, b = preempted_b()
    assert admitted(sched) == []  # a's last token (b does not fit yet); a ends
    sched.block_manager.prefix_is_coming = lambda s: s is b  # as if another sequence computed b's prefix
    assert admitted(sched) == [] and [s.request_id for s in sched.waiting] == ["b", "c"]
    del sched.block_manager.prefix_is_coming
    assert admitted(sched) == ["b", "c"]


@pytest.mark.parametrize("admission, expected", [
    ("watermark", [["b0"], [], ["big", "b1"], ["b2", "b3", "b4"], ["b5"]]),  # beside big, one block is the watermark
    ("reserve", [["b0"], [], ["big", "b1", "b2"], ["b3", "b4"], ["b5"]]),
])
def test_a_head_whose_blocks_do_not_fit_is_not_passed_by_other_clients(admission, expected):
    """A's big sequence does not fit beside the running x; B's small ones would (one block each),
    and B sends one every step, yet after B's own turn (b0) none passes A's head: big starts once
    x ends, then B's go."""
    sched = make_scheduler(num_blocks=5, block_size=2, max_num_seqs=4, admission=admission)
    sched.add(seq("x", "X", [1, 2, 3, 4], max_tokens=3))  # 3 blocks at most
    assert step(sched) == ["x"]
    sched.add(seq("b0", "B", [7]))
    sched.add(seq("big", "A", [2] * 5))  # 3 blocks: fits only once x has ended
    started = []
    for i in range(1, 6):
        sched.add(seq(f"b{i}", "B", [7 + i]))
        started.append(admitted(sched))
    assert started == expected


# ---- random workloads --------------------------------------------------------------------------


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(admission=st.sampled_from(["watermark", "reserve"]), overlap=st.booleans(),
       block_size=st.sampled_from([1, 2, 4]), max_num_seqs=st.integers(1, 4), pool_slack=st.integers(-3, 3),
       budget=st.integers(4, 24),
       requests=st.lists(st.fixed_dictionaries(dict(
           client=st.sampled_from(CLIENTS), length=st.integers(1, 8), max_tokens=st.integers(1, 12),
           arrival=st.integers(0, 3), abort_at=st.one_of(st.none(), st.integers(0, 20)))), min_size=1, max_size=12),
       seed=st.integers(0, 2**16))
def test_scheduler_admits_in_the_reference_order(admission, overlap, block_size, max_num_seqs, pool_slack, budget,
                                                 requests, seed):
    """Random clients, arrivals, aborts, preemptions (small pools), both admission policies,
    synchronous or with a step in flight: every step admits the first sequences of the reference
    order (preempted ones first), the waiting queue iterates in that order, and admission stops
    only at a head that cannot start (no seat, no token budget, a decode waiting for a block, or
    blocks that do not fit), never passing it. Prompts share no block, so no head waits for a prefix."""
    rng = random.Random(seed)
    max_model_len = 20
    num_blocks = max(1, -(-max_model_len // block_size) + pool_slack)  # about one request's worst case
    sched = make_scheduler(num_blocks, block_size, max_num_seqs, max(budget, max_num_seqs), max_model_len, admission)
    seqs = [seq(f"r{i}", r["client"], [100 + i] + [1] * (r["length"] - 1), r["max_tokens"])
            for i, r in enumerate(requests)]
    reference, in_flight = ReferenceQueue(), None
    for t in range(500):
        if t > max(r["arrival"] for r in requests) and not sched.has_unfinished() and in_flight is None:
            break
        for s, r in zip(seqs, requests):
            if r["arrival"] == t:
                assert sched.add(s) is (worst_case_blocks(s, sched) <= num_blocks)
                if not s.is_finished:
                    reference.append(s)
            if r["abort_at"] == t and r["arrival"] <= t and not s.is_finished:
                if s.status is S.WAITING:
                    reference.remove(s)
                sched.abort(s.request_id)
        if in_flight is not None and sched.needs_drain:
            sched.postprocess(in_flight, [rng.randint(1, 9) for _ in range(in_flight.num_logits_rows)])
            in_flight = None
        assert list(sched.waiting) == reference.order()
        waiting = set(map(id, sched.waiting))
        batch = sched.schedule()
        for victim in sched.preempted:
            reference.appendleft(victim)
        started = [s for s in batch.seqs if id(s) in waiting or s in sched.preempted]
        expected = reference.order()
        assert started == expected[:len(started)], "admitted out of the reference order"
        for s in started:
            reference.take(s)
        assert list(sched.waiting) == reference.order()
        head = reference.head()
        if head is not None and len(sched.running) < max_num_seqs and not sched.needs_drain and \
                batch.total_tokens < sched.max_num_batched_tokens:
            assert not fits(sched, head), "admission stopped before a head that fits"
        previous, in_flight = in_flight, batch if batch.seqs else None
        if previous is not None:
            sched.postprocess(previous, [rng.randint(1, 9) for _ in range(previous.num_logits_rows)])
        if in_flight is not None and not (overlap and sched.has_unfinished()):
            sched.postprocess(in_flight, [rng.randint(1, 9) for _ in range(in_flight.num_logits_rows)])
            in_flight = None
    else:
        raise AssertionError("no progress")
    assert all(s.is_finished for s in seqs) and not sched.waiting
    event(f"clients: {len({r['client'] for r in requests})}, preempted: {sched.num_preemptions > 0}")
