"""BlockManager: paged allocation, reference counts, chain-hashed prefix caching."""
from collections import Counter

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from engine.scheduling.block_manager import BlockManager, chain_hash
from engine.scheduling.sequence import SamplingParams, Sequence
from shell_kv_oracle import KVOracle

TOKENS = st.integers(0, 3)  # a tiny vocabulary makes equal blocks (and prefix hits) common


def common_prefix_len(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


class BlockManagerMachine(RuleBasedStateMachine):
    """Random allocate / prefill-chunk / decode-append / free over shared prefixes, checked
    against a KV model and reference counts recomputed from the live block tables. A prompt's
    K/V is computed in random chunks (chunked prefill), each published as it is written, so a
    later prompt may only hit blocks whose K/V exists."""

    @initialize(num_blocks=st.integers(1, 20), block_size=st.sampled_from([1, 2, 4]))
    def setup(self, num_blocks, block_size):
        self.bm = BlockManager(num_blocks, block_size)
        self.kv = KVOracle(block_size)
        self.live: list[Sequence] = []
        self.history: list[list[int]] = []  # token ids of every sequence ever allocated

    @rule(data=st.data(), extra=st.lists(TOKENS, min_size=1, max_size=9))
    def allocate(self, data, extra):
        prompt = list(extra)
        if self.history and data.draw(st.booleans(), label="share a prefix"):
            donor = data.draw(st.sampled_from(self.history), label="donor")
            prompt = donor[:data.draw(st.integers(0, len(donor)), label="prefix")] + prompt
        seq = Sequence(prompt)
        size = self.bm.block_size
        if not self.bm.can_allocate(seq):
            assert self.bm.blocks_for(len(prompt)) > self.bm.num_free_blocks  # hits only ever help
            with pytest.raises(ValueError):
                self.bm.allocate(seq)
            assert seq.block_table == []
            return
        self.bm.allocate(seq)
        assert len(seq.block_table) == self.bm.blocks_for(len(prompt))
        assert seq.num_cached_tokens % size == 0 and seq.num_cached_tokens < len(prompt)
        for other in self.live:  # a live sequence's computed full blocks must be hit
            computed = other.token_ids[:other.num_computed_tokens]
            shared_blocks = min(common_prefix_len(computed, prompt), len(prompt) - 1) // size
            assert seq.num_cached_tokens >= shared_blocks * size
        seq.num_computed_tokens = seq.num_cached_tokens
        self.live.append(seq)
        self.history.append(list(prompt))
        self.prefill_chunk(data, seq)

    @precondition(lambda self: any(s.num_computed_tokens < s.num_tokens for s in self.live))
    @rule(data=st.data())
    def prefill_chunk(self, data, seq=None):
        """Compute the next chunk of a prompt and publish what is computed (the step ends)."""
        if seq is None:
            seq = data.draw(st.sampled_from([s for s in self.live if s.num_computed_tokens < s.num_tokens]),
                            label="prefilling seq")
        end = data.draw(st.integers(seq.num_computed_tokens + 1, seq.num_tokens), label="chunk end")
        self.kv.write(seq, seq.num_computed_tokens, end)
        seq.num_computed_tokens = end
        self.bm.publish(seq, end)

    @precondition(lambda self: any(s.num_computed_tokens == s.num_tokens for s in self.live))
    @rule(data=st.data(), token=TOKENS)
    def decode_append(self, data, token):
        seq = data.draw(st.sampled_from([s for s in self.live if s.num_computed_tokens == s.num_tokens]),
                        label="seq")
        seq.output_token_ids.append(token)
        if not self.bm.can_append(seq):
            assert self.bm.num_free_blocks == 0
            assert len(seq.block_table) * self.bm.block_size < seq.num_tokens
            seq.output_token_ids.pop()
            return
        self.bm.append_slot(seq)
        self.kv.write(seq, seq.num_tokens - 1, seq.num_tokens)
        seq.num_computed_tokens = seq.num_tokens
        self.bm.publish(seq, seq.num_tokens)
        self.history.append(seq.token_ids)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data):
        seq = data.draw(st.sampled_from(self.live), label="seq")
        self.bm.free(seq)
        self.live.remove(seq)
        assert seq.block_table == [] and seq.num_cached_tokens == 0

    @invariant()
    def accounting(self):
        if not hasattr(self, "bm"):
            return
        held = Counter(b for seq in self.live for b in seq.block_table)
        assert all(r >= 0 for r in self.bm.ref_counts)
        assert self.bm.ref_counts == [held[b] for b in range(self.bm.num_blocks)]
        assert self.bm.num_free_blocks + len(held) == self.bm.num_blocks

    @invariant()
    def tables_and_kv(self):
        if not hasattr(self, "bm"):
            return
        size = self.bm.block_size
        holders: dict[int, list[tuple[Sequence, int]]] = {}
        for seq in self.live:
            assert len(set(seq.block_table)) == len(seq.block_table)
            assert len(seq.block_table) == self.bm.blocks_for(seq.num_tokens)
            self.kv.check(seq, seq.num_computed_tokens)
            for i, b in enumerate(seq.block_table):
                holders.setdefault(b, []).append((seq, i))
        for b, sharers in holders.items():
            if len(sharers) < 2:
                continue
            first, index = sharers[0]
            end = (index + 1) * size  # a shared block is full and has the same prefix everywhere
            for seq, i in sharers:
                assert i == index and seq.num_tokens >= end
                assert seq.token_ids[:end] == first.token_ids[:end]

    def teardown(self):
        if not hasattr(self, "bm"):
            return
        for seq in self.live:
            self.bm.free(seq)
        assert self.bm.num_free_blocks == self.bm.num_blocks
        assert not any(self.bm.ref_counts)


BlockManagerMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=30, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
test_block_manager_state_machine = BlockManagerMachine.TestCase


def test_prefix_hit_after_free_reuses_the_same_blocks():
    """A freed sequence's published blocks are the next one's prefix hit; num_prefix_queries /
    num_prefix_hits (the server's prefix-cache metrics) count the prompt tokens looked up and
    found, from 0."""
    bm = BlockManager(num_blocks=8, block_size=4)
    assert (bm.num_prefix_queries, bm.num_prefix_hits) == (0, 0)
    first = Sequence(list(range(10)))
    bm.allocate(first)
    bm.publish(first, first.num_tokens)
    first_table = list(first.block_table)
    bm.free(first)
    second = Sequence(list(range(8)) + [42, 43, 44])
    assert bm.cached_prefix_len(second) == 8
    bm.allocate(second)
    assert second.block_table[:2] == first_table[:2]
    assert second.num_cached_tokens == 8
    assert bm.num_free_blocks == 5
    assert (bm.num_prefix_queries, bm.num_prefix_hits) == (10 + 11, 8)


def test_live_prefix_is_shared_by_reference():
    bm = BlockManager(num_blocks=8, block_size=4)
    a, b = Sequence(list(range(9))), Sequence(list(range(8)) + [7])
    bm.allocate(a)
    bm.publish(a, a.num_tokens)
    free_before = bm.num_free_blocks
    bm.allocate(b)
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] != a.block_table[2]
    assert bm.num_free_blocks == free_before - 1
    assert [bm.ref_counts[i] for i in a.block_table] == [2, 2, 1]


def test_a_prefix_computed_twice_stays_cached_while_either_copy_lives():
    """Two sequences admitted before either published compute the same prefix block each. When
    the copy published last is freed and its block taken for other tokens, the other copy (still
    in use) must still be found: a later prompt with that prefix hits it (found by the state
    machine above: the hash pointed at one block only and was dropped with it)."""
    bm = BlockManager(num_blocks=4, block_size=1)
    a, b = Sequence([5, 6]), Sequence([5, 7])
    bm.allocate(a)
    bm.allocate(b)   # a not yet published: no hit, b computes its own copy of [5]
    assert b.num_cached_tokens == 0 and a.block_table[0] != b.block_table[0]
    bm.publish(a, 2)
    bm.publish(b, 2)
    bm.free(b)
    c = Sequence([8, 9])
    bm.allocate(c)   # takes both of b's blocks, its copy of [5] included
    assert sorted(c.block_table) == sorted(set(range(4)) - set(a.block_table))
    bm.free(c)
    d = Sequence([5, 1])
    bm.allocate(d)
    assert d.num_cached_tokens == 1 and d.block_table[0] == a.block_table[0]
    assert bm.ref_counts[a.block_table[0]] == 2


def test_fully_cached_prompt_recomputes_its_last_block():
    """Rule: the block holding the last prompt token is never a hit, so the model
    always has at least one token to compute."""
    bm = BlockManager(num_blocks=8, block_size=4)
    a, b = Sequence(list(range(8))), Sequence(list(range(8)))
    bm.allocate(a)
    bm.publish(a, a.num_tokens)
    bm.allocate(b)
    assert b.num_cached_tokens == 4
    assert b.block_table[0] == a.block_table[0] and b.block_table[1] != a.block_table[1]


def test_a_sequence_asking_for_prompt_logprobs_takes_no_cached_block():
    """Prompt logprobs need every prompt position's logits, so a sequence that asks for them
    computes its whole prompt: no prefix hit, its own blocks (it still publishes them); the same
    prompt without them hits."""
    bm = BlockManager(num_blocks=8, block_size=4)
    a = Sequence(list(range(9)))
    bm.allocate(a)
    bm.publish(a, a.num_tokens)
    wants = Sequence(list(range(9)), SamplingParams(prompt_logprobs=1))
    bm.allocate(wants)
    assert wants.num_cached_tokens == 0 and not set(a.block_table) & set(wants.block_table)
    plain = Sequence(list(range(9)))
    bm.allocate(plain)
    assert plain.num_cached_tokens == 8 and plain.block_table[:2] == a.block_table[:2]


def test_partial_last_block_is_never_shared():
    bm = BlockManager(num_blocks=8, block_size=4)
    a, b = Sequence([1, 2, 3, 4, 5, 6]), Sequence([1, 2, 3, 4, 5, 6, 7])
    bm.allocate(a)
    bm.publish(a, a.num_tokens)
    bm.allocate(b)
    assert b.num_cached_tokens == 4
    assert b.block_table[1] != a.block_table[1]


def test_hash_covers_the_whole_prefix():
    """Equal blocks after different prefixes are different cache entries."""
    bm = BlockManager(num_blocks=8, block_size=2)
    a, b = Sequence([1, 2, 5, 6, 0]), Sequence([3, 4, 5, 6, 0])
    bm.allocate(a)
    bm.publish(a, a.num_tokens)
    bm.allocate(b)
    assert b.num_cached_tokens == 0 and not set(a.block_table) & set(b.block_table)
    assert chain_hash(b"", [1, 2]) != chain_hash(b"", [3, 4])
    assert chain_hash(chain_hash(b"", [1, 2]), [5, 6]) != chain_hash(chain_hash(b"", [3, 4]), [5, 6])


def test_blocks_filled_during_decode_are_cached():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = Sequence([1, 2, 3])
    bm.allocate(a)
    bm.publish(a, a.num_tokens)
    for token in [4, 5, 6, 7]:  # positions 3..6: block 0 fills at position 3
        a.output_token_ids.append(token)
        bm.append_slot(a)
        bm.publish(a, a.num_tokens)
    b = Sequence([1, 2, 3, 4, 5, 6, 7, 8])
    assert bm.cached_prefix_len(b) == 4  # block 1 holds positions 4..6 only: not full, not cached
    bm.allocate(b)
    assert b.block_table[0] == a.block_table[0]


def test_sampled_token_without_kv_is_never_cached():
    """The last sampled token has no KV yet; freeing must not publish its block."""
    bm = BlockManager(num_blocks=4, block_size=4)
    a = Sequence([1, 2, 3])
    bm.allocate(a)
    bm.publish(a, a.num_tokens)
    a.output_token_ids.append(4)  # sampled, finished before a decode step computed it
    bm.free(a)
    assert bm.cached_prefix_len(Sequence([1, 2, 3, 4, 9])) == 0


def test_prefix_caching_can_be_turned_off():
    bm = BlockManager(num_blocks=8, block_size=2, enable_prefix_caching=False)
    a, b = Sequence([1, 2, 3, 4, 5]), Sequence([1, 2, 3, 4, 5])
    bm.allocate(a)
    bm.publish(a, a.num_tokens)
    bm.allocate(b)
    assert b.num_cached_tokens == 0 and not set(a.block_table) & set(b.block_table)


def test_publish_covers_only_the_computed_tokens():
    """A prompt prefilled in chunks publishes block by block: a block becomes a hit only once
    the chunk that completes its K/V has been published."""
    bm = BlockManager(num_blocks=8, block_size=4)
    a = Sequence(list(range(13)))
    bm.allocate(a)
    bm.publish(a, 7)  # first chunk: positions 0..6, block 0 complete
    assert bm.cached_prefix_len(Sequence(list(range(13)))) == 4
    bm.publish(a, 12)  # second chunk: positions 7..11, block 2 complete
    assert bm.cached_prefix_len(Sequence(list(range(13)))) == 12
    bm.free(a)
    assert bm.cached_prefix_len(Sequence(list(range(13)))) == 12  # published blocks stay hits once free
    b = Sequence(list(range(20, 33)))
    bm.allocate(b)
    bm.publish(b, 5)
    bm.free(b)  # freed before its second chunk ran: only block 0 was ever published
    assert bm.cached_prefix_len(Sequence(list(range(20, 33)))) == 4


def test_hashes_are_findable_only_once_published():
    """A block's K/V exists only after the step that computes it: until ``publish`` no
    other sequence may hit it, and a sequence freed unpublished (failed step) leaves no hash."""
    bm = BlockManager(num_blocks=8, block_size=4)
    a = Sequence(list(range(9)))
    bm.allocate(a)
    assert bm.cached_prefix_len(Sequence(list(range(9)))) == 0
    a.output_token_ids += [9, 10, 11]
    bm.append_slot(a)  # position 11 completes block 2, still unpublished
    bm.free(a)
    assert bm.cached_prefix_len(Sequence(list(range(13)))) == 0
    c = Sequence(list(range(9)))
    bm.allocate(c)
    bm.publish(c, c.num_tokens)
    assert bm.cached_prefix_len(Sequence(list(range(9)))) == 8


def test_append_slot_takes_a_block_only_when_the_last_is_full():
    bm = BlockManager(num_blocks=3, block_size=2)
    a = Sequence([1, 2])
    bm.allocate(a)
    a.output_token_ids.append(3)  # position 2 needs a second block
    assert bm.can_append(a)
    bm.append_slot(a)
    assert len(a.block_table) == 2 and bm.num_free_blocks == 1
    a.output_token_ids.append(4)  # position 3 fits the second block
    bm.append_slot(a)
    assert len(a.block_table) == 2 and bm.num_free_blocks == 1


def test_exhausted_pool_refuses_without_side_effects():
    bm = BlockManager(num_blocks=2, block_size=2)
    a = Sequence([1, 2, 3, 4])
    bm.allocate(a)
    b = Sequence([5, 6])
    assert not bm.can_allocate(b)
    with pytest.raises(ValueError, match="can_allocate"):
        bm.allocate(b)
    a.output_token_ids.append(9)
    assert not bm.can_append(a)
    with pytest.raises(ValueError, match="can_append"):
        bm.append_slot(a)
    assert len(a.block_table) == 2 and bm.num_free_blocks == 0


def test_can_allocate_honours_a_reservation():
    bm = BlockManager(num_blocks=4, block_size=2)
    seq = Sequence([1, 2, 3])  # two blocks
    assert bm.can_allocate(seq, num_reserved=2)
    assert not bm.can_allocate(seq, num_reserved=3)


@pytest.mark.parametrize("num_blocks, block_size", [(0, 4), (4, 0)])
def test_bad_sizes_raise(num_blocks, block_size):
    with pytest.raises(ValueError, match="num_blocks and block_size"):
        BlockManager(num_blocks, block_size)


def test_allocating_a_sequence_that_holds_blocks_raises():
    """A second allocate of a sequence (its table still held) is a ValueError naming it, and takes
    no block."""
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = Sequence(list(range(6)), request_id="twice")
    bm.allocate(seq)
    free = bm.num_free_blocks
    with pytest.raises(ValueError, match="^twice already holds blocks$"):
        bm.allocate(seq)
    assert bm.num_free_blocks == free and len(seq.block_table) == 2
