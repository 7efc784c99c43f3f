"""Drafts in the scheduler (speculative decoding's verify entries; phase 13 brings the n-gram drafter,
here a drafter written for the tests stands in for it): decodes carry drafted tokens from the budget and blocks left,
the longest draft prefix equal to the sampled tokens is accepted plus the token sampled after it,
runs are cut where a token ends the sequence, only accepted positions count as computed and are
published, blocks holding only rejected drafts are freed, and drafts never pass the room
max_tokens and max_model_len leave. Checked against a model of the device (a deterministic
"target model" over token prefixes, with noise for rejections) and of the KV cache (each slot
records the token prefix its K/V was computed from)."""
import random

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from engine.scheduling.block_manager import BlockManager
from engine.scheduling.scheduler import Scheduler, SchedulerSettings
from engine.scheduling.sequence import SamplingParams, Sequence
from engine.scheduling.sequence import SequenceStatus as S
from engine.scheduling.step import ScheduledBatch

EOS = 0


class LookupDrafter:
    """A drafter as the Scheduler takes one (``num_speculative_tokens``, ``propose(seqs, rooms)``):
    per sequence up to ``k`` tokens (and its room) that followed the latest earlier occurrence of
    the sequence's last 3, else 2, else 1 tokens."""

    def __init__(self, k: int):
        self.num_speculative_tokens = k

    def propose(self, seqs: list[Sequence], rooms: list[int]) -> list[list[int]]:
        return [self.lookup(seq.token_ids, min(self.num_speculative_tokens, room)) for seq, room in zip(seqs, rooms)]

    @staticmethod
    def lookup(tokens: list[int], num: int) -> list[int]:
        for n in (3, 2, 1):
            tail = tokens[-n:]
            for start in range(len(tokens) - n - 1, -1, -1):
                if len(tokens) > n and tokens[start:start + n] == tail:
                    return tokens[start + n:start + n + num]
        return []


def blocks(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class KVModel:
    """Slot -> the token prefix its K/V was computed from."""

    def __init__(self, block_size: int):
        self.block_size, self.slots = block_size, {}

    def slot(self, seq: Sequence, pos: int) -> int:
        assert pos // self.block_size < len(seq.block_table), f"{seq.request_id}: no block for position {pos}"
        return seq.block_table[pos // self.block_size] * self.block_size + pos % self.block_size

    def write(self, seq: Sequence, start: int, tokens: list[int]) -> None:
        """Positions ``start ..`` computed from ``tokens`` (the known ones, then any drafts)."""
        for pos in range(start, len(tokens)):
            self.slots[self.slot(seq, pos)] = tuple(tokens[:pos + 1])

    def check(self, seq: Sequence, end: int) -> None:
        tokens = seq.token_ids
        for pos in range(end):
            got = self.slots.get(self.slot(seq, pos))
            assert got == tuple(tokens[:pos + 1]), f"{seq.request_id} position {pos} reads K/V of {got}"


def target(prefix: list[int], noise: random.Random, noisy: float) -> int:
    """The model of the target model: an order-2 Markov chain over tokens 0..5 (so n-gram drafts
    come true once a pattern repeats), replaced by a random token with probability ``noisy``."""
    if noise.random() < noisy:
        return noise.randint(0, 5)
    a, b = (prefix[-2:] if len(prefix) > 1 else [0, prefix[-1]])
    return (3 * a + b * b + 1) % 6


def run_verify_step(sched: Scheduler, kv: KVModel, batch: ScheduledBatch, noise: random.Random, noisy: float,
                    budget: int, max_model_len: int):
    """Check the drafts of ``batch``, run it on the device model, postprocess it and check what the
    scheduler made of each entry against the acceptance rule written here."""
    assert batch.total_tokens <= budget
    before = {s.request_id: (list(s.output_token_ids), s.num_tokens) for s in batch.seqs}
    rows, expected = [], {}
    for i, (seq, start, num, draft) in enumerate(zip(batch.seqs, batch.starts, batch.num_tokens, batch.drafts)):
        kv.check(seq, start)  # what the entry attends to: its own prefix, never a rejected draft
        known = seq.token_ids
        if draft:
            assert start == len(known) - 1 and num == 1 + len(draft), "a draft follows a decode's last token"
            params = seq.sampling_params
            output, tokens = before[seq.request_id]
            assert not params.penalized and params.logprobs is None
            assert len(output) + 1 + len(draft) <= params.max_tokens, "drafts past max_tokens"
            assert tokens + len(draft) <= max_model_len, "drafts past max_model_len"
            assert len(draft) <= sched.drafter.num_speculative_tokens
        kv.write(seq, start, known[:start + num] if not draft else known + draft)
        sampled = [target(known[:start + 1] + draft[:j], noise, noisy) for j in range(len(draft) + 1)]
        rows.append(sampled)
        accepted = 0
        while accepted < len(draft) and draft[accepted] == sampled[accepted]:
            accepted += 1
        run = []
        for token in sampled[:accepted + 1]:
            run.append(token)
            params = seq.sampling_params
            if ((token == EOS and not params.ignore_eos) or token in params.stop_token_ids
                    or len(before[seq.request_id][0]) + len(run) >= params.max_tokens
                    or len(known) + len(run) >= max_model_len):
                break
        expected[seq.request_id] = (run if batch.samples[i] else [], accepted)
    token_ids = [r[0] for r in rows] + [t for r in rows for t in r[1:]]
    drafted = sched.num_draft_tokens
    result = sched.postprocess(batch, token_ids)
    assert sched.num_draft_tokens - drafted == sum(map(len, batch.drafts))
    for seq, n in zip(result.appended, result.num_new):
        run, accepted = expected[seq.request_id]
        assert seq.output_token_ids == before[seq.request_id][0] + run and n == len(run)
    for seq in batch.seqs:
        if seq.status is S.RUNNING_DECODE:
            run, accepted = expected[seq.request_id]
            assert seq.num_computed_tokens == seq.num_tokens - 1, "computed tokens do not follow the accepted ones"
            kv.check(seq, seq.num_computed_tokens)
            assert len(seq.block_table) == blocks(seq.num_tokens - 1, kv.block_size), \
                "a block holding only rejected drafts is still held"
    return sum(len(r) - 1 for r in rows), sum(accepted for _, accepted in expected.values())


requests_strategy = st.lists(st.fixed_dictionaries(dict(
    family=st.integers(0, 1), shared=st.integers(0, 6), tail=st.lists(st.integers(0, 5), min_size=1, max_size=5),
    max_tokens=st.integers(1, 16), ignore_eos=st.booleans(), stop_token_ids=st.lists(st.integers(1, 5), max_size=1),
    logprobs=st.sampled_from([None, None, None, 0]), arrival=st.integers(0, 6),
    continue_from=st.one_of(st.none(), st.integers(0, 7)), abort_at=st.one_of(st.none(), st.integers(0, 20)))),
    min_size=2, max_size=8)


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(admission=st.sampled_from(["watermark", "reserve"]), block_size=st.sampled_from([1, 2, 4]),
       max_model_len=st.integers(4, 32), max_num_seqs=st.integers(1, 4), budget_slack=st.integers(-24, 8),
       pool_slack=st.integers(0, 8), k=st.integers(1, 5), noisy=st.sampled_from([0.0, 0.2, 0.6]),
       requests=requests_strategy, seed=st.integers(0, 2**16))
def test_verify_entries_follow_the_acceptance_rule_and_keep_the_cache_right(
        admission, block_size, max_model_len, max_num_seqs, budget_slack, pool_slack, k, noisy, requests, seed):
    """Random workloads (shared prefixes, prompts continuing an earlier request's output so they
    hit its published blocks, aborts, requests asking logprobs, small budgets and pools that
    preempt) with a lookup drafter, synchronous steps: every step's drafts stay within their
    room, every entry's tokens follow the acceptance rule, every context reads its own K/V, no
    block leaks, every request finishes."""
    rng, noise = random.Random(seed), random.Random(seed + 1)
    budget = max(max_num_seqs, max_model_len + budget_slack)
    num_blocks = max(1, blocks(max_model_len, block_size) + pool_slack)
    bm = BlockManager(num_blocks, block_size)
    sched = Scheduler(SchedulerSettings(max_num_seqs, budget, max_model_len, admission), bm, eos_token_id=EOS,
                      drafter=LookupDrafter(k))
    kv = KVModel(block_size)
    families = [[rng.randint(0, 5) for _ in range(6)] for _ in range(2)]
    seqs: dict[int, Sequence] = {}
    drafted = accepted = 0
    for step in range(400):
        for i, r in enumerate(requests):
            if i not in seqs and step >= r["arrival"]:
                follows = r["continue_from"] if r["continue_from"] is not None and r["continue_from"] < i else None
                base = seqs.get(follows)
                if follows is None or (base is not None and base.is_finished):  # else wait for it to finish
                    prompt = (base.token_ids if base is not None else families[r["family"]][:r["shared"]]) + r["tail"]
                    seqs[i] = Sequence(prompt[:max_model_len], SamplingParams(
                        max_tokens=r["max_tokens"], ignore_eos=r["ignore_eos"], stop_token_ids=r["stop_token_ids"],
                        logprobs=r["logprobs"]), request_id=f"r{i}")
                    sched.add(seqs[i])
            if r["abort_at"] == step and i in seqs:
                sched.abort(seqs[i].request_id)
        batch = sched.schedule()
        if batch.seqs:
            d, a = run_verify_step(sched, kv, batch, noise, noisy, budget, max_model_len)
            drafted, accepted = drafted + d, accepted + a
        held = {b for s in sched.running for b in s.block_table}
        assert bm.num_free_blocks == num_blocks - len(held), "blocks leaked or over-committed"
        if len(seqs) == len(requests) and not sched.has_unfinished():
            break
    assert len(seqs) == len(requests) and not sched.has_unfinished(), "a request never finished"
    assert bm.num_free_blocks == num_blocks and not any(bm.ref_counts)
    assert drafted == sched.num_draft_tokens and accepted == sched.num_accepted_tokens
    assert sum(s.num_accepted_tokens for s in seqs.values()) == accepted
    event(f"drafted: {drafted > 0}, accepted: {accepted > 0}, rejected: {accepted < drafted}")
    event(f"preempted: {sched.num_preemptions > 0}")
    event(f"prefix hits: {bm.num_prefix_hits > 0}")


def make(num_blocks=32, block_size=4, budget=64, max_model_len=64, k=4):
    bm = BlockManager(num_blocks, block_size)
    return Scheduler(SchedulerSettings(1, budget, max_model_len), bm, eos_token_id=EOS,
                     drafter=LookupDrafter(k)), bm


def prefill(sched: Scheduler, seq: Sequence, first: int) -> None:
    """Prefill ``seq`` (in chunks when the budget is small); its first output token is ``first``."""
    sched.add(seq)
    while not seq.output_token_ids:
        batch = sched.schedule()
        assert batch.seqs == [seq] and batch.drafts == [[]], "a prefill drafts nothing"
        sched.postprocess(batch, [first])


def test_a_draft_is_cut_to_the_room_max_model_len_max_tokens_budget_and_blocks_leave():
    """A repeating prompt drafts k = 4 tokens; fewer when max_model_len, max_tokens, the token
    budget or the free blocks leave less room; requests with logprobs draft nothing."""
    pattern = [1, 2, 3, 4] * 3
    cases = [  # (scheduler settings, max_tokens, expected draft length)
        (dict(), 16, 4),
        (dict(max_model_len=16), 16, 16 - 13 - 1),  # 13 tokens after the first: 3 more fit, drafts + 1
        (dict(), 3, 3 - 1 - 1),                       # one output token so far; the step samples 1 + drafts
        (dict(budget=3), 16, 2),                      # one token for the decode, two for drafts
        (dict(num_blocks=8), 16, 3),                  # the last free block holds positions 12..15
    ]
    for settings_, max_tokens, expected in cases:
        sched, bm = make(**settings_)
        seq = Sequence(pattern, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        prefill(sched, seq, first=1)
        if "num_blocks" in settings_:
            bm.allocate(Sequence(list(range(16))))  # another holder takes four of the five free blocks
        batch = sched.schedule()
        assert batch.drafts == [[2, 3, 4, 1][:expected]], settings_
        assert batch.num_tokens == [1 + expected] and batch.starts == [12]
        assert len(seq.block_table) * bm.block_size >= 13 + expected
    sched, _ = make()
    asks = Sequence(pattern, SamplingParams(max_tokens=16, logprobs=2))
    prefill(sched, asks, first=1)
    assert sched.schedule().drafts == [[]]


def test_acceptance_appends_the_accepted_drafts_and_the_next_token():
    """Drafts [2, 3, 4, 1] against sampled rows: all accepted (k + 1 tokens), none (the first row's
    token), two (then the third row's token); rejected positions are not computed and their
    blocks are freed; hashes cover accepted positions only."""
    for sampled, run in (([2, 3, 4, 1, 2], [2, 3, 4, 1, 2]), ([5, 3, 4, 1, 2], [5]), ([2, 3, 5, 1, 2], [2, 3, 5])):
        sched, bm = make(block_size=2)
        seq = Sequence([1, 2, 3, 4] * 3, SamplingParams(max_tokens=16, ignore_eos=True))
        prefill(sched, seq, first=1)
        batch = sched.schedule()
        assert batch.drafts == [[2, 3, 4, 1]] and len(seq.block_table) == 9  # positions 0..16
        result = sched.postprocess(batch, sampled)
        assert seq.output_token_ids == [1] + run and result.num_new == [len(run)]
        assert seq.num_computed_tokens == 12 + len(run) and len(seq.block_table) == blocks(12 + len(run), 2)
        assert (seq.num_draft_tokens, seq.num_accepted_tokens) == (4, len(run) - 1)
        assert bm.num_published(seq) == (12 + len(run)) // 2


def test_a_token_that_ends_the_sequence_cuts_the_accepted_run():
    """EOS or a stop token id inside an accepted run ends the output there (the run's later
    tokens are dropped); max_tokens ends it where the drafts' room ran out."""
    cases = [  # prompt, params, the drafts, the sampled rows, the output after the step, finish reason
        ([1, 2, EOS, 4] * 3, SamplingParams(max_tokens=16), [2, EOS, 4, 1], [2, EOS, 4, 1, 2], [1, 2, EOS], "stop"),
        ([1, 2, 3, 4] * 3, SamplingParams(max_tokens=16, stop_token_ids=[3]), [2, 3, 4, 1], [2, 3, 4, 1, 2],
         [1, 2, 3], "stop"),
        ([1, 2, 3, 4] * 3, SamplingParams(max_tokens=4, ignore_eos=True), [2, 3], [2, 3, 4], [1, 2, 3, 4], "length"),
    ]
    for prompt, params, draft, sampled, output, reason in cases:
        sched, bm = make()
        seq = Sequence(prompt, params)
        prefill(sched, seq, first=1)
        batch = sched.schedule()
        assert batch.drafts == [draft]
        result = sched.postprocess(batch, sampled)
        assert seq.output_token_ids == output and result.num_new == [len(output) - 1]
        assert result.finished == [seq] and seq.finish_reason == reason
        assert bm.num_free_blocks == bm.num_blocks


@pytest.mark.parametrize("num_rows", [4, 6])
def test_postprocess_wants_one_id_per_sampled_row(num_rows):
    sched, _ = make()
    seq = Sequence([1, 2, 3, 4] * 3, SamplingParams(max_tokens=16, ignore_eos=True))
    prefill(sched, seq, first=1)
    batch = sched.schedule()
    assert batch.num_logits_rows == 5 and batch.logits_row_seqs == [seq] * 5
    with pytest.raises(ValueError, match="5 sampled rows"):
        sched.postprocess(batch, [1] * num_rows)
