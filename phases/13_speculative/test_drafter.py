"""The n-gram (prompt lookup) drafter against a brute-force reading of its rule
(``spec_cases.reference_draft``): the longest suffix (prompt_lookup_max down to
prompt_lookup_min tokens) that occurred earlier, its most recent earlier occurrence, and the
tokens that followed it, copied on into the suffix and the proposal itself."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.scheduling.sequence import SamplingParams, Sequence
from engine.scheduling.speculative import NgramDrafter
from spec_cases import reference_draft


@settings(max_examples=400, deadline=None)
@given(tokens=st.lists(st.integers(0, 5), min_size=1, max_size=40), num=st.integers(0, 6),
       n_min=st.integers(1, 3), extra=st.integers(0, 3))
def test_lookup_follows_the_longest_suffix_seen_before(tokens, num, n_min, extra):
    """Token ids 0..5 make repeats common; ids with bytes that match inside a neighbour's bytes
    (``test_misaligned_byte_matches_are_skipped``) are covered separately."""
    drafter = NgramDrafter(num_speculative_tokens=6, prompt_lookup_min=n_min, prompt_lookup_max=n_min + extra)
    assert drafter.lookup(tokens, num) == reference_draft(tokens, num, n_min, n_min + extra)


def test_misaligned_byte_matches_are_skipped():
    """The search runs on int32 bytes: a byte pattern found across two tokens is no match."""
    drafter = NgramDrafter(4, prompt_lookup_min=1, prompt_lookup_max=1)
    tokens = [0x0100, 0x0200, 7, 0x01]  # 0x01 occurs in the bytes of 0x0100, misaligned
    assert drafter.lookup(tokens, 4) == []
    assert drafter.lookup([5, 6, 0x0100, 0x0600, 5], 3) == reference_draft([5, 6, 0x0100, 0x0600, 5], 3, 1, 1)


def test_propose_reads_the_sequence_and_respects_both_limits():
    drafter = NgramDrafter(3, prompt_lookup_min=2, prompt_lookup_max=3)
    seq = Sequence([1, 2, 3, 4, 5, 1, 2], SamplingParams(max_tokens=8))
    seq.output_token_ids = [3]
    assert drafter.propose([seq], [8]) == [[4, 5, 1]]  # [1, 2, 3] occurred at 0; three tokens at most
    assert drafter.propose([seq], [2]) == [[4, 5]]
    assert drafter.propose([seq], [0]) == [[]]
    assert drafter.lookup([1, 2, 3, 9], 3) == []  # no suffix of two tokens occurred before


@pytest.mark.parametrize("kwargs, field", [
    (dict(num_speculative_tokens=0), "num_speculative_tokens"),
    (dict(num_speculative_tokens=17), "num_speculative_tokens"),
    (dict(num_speculative_tokens=2.0), "num_speculative_tokens"),
    (dict(prompt_lookup_min=0), "prompt_lookup_min"),
    (dict(prompt_lookup_min=3, prompt_lookup_max=2), "prompt_lookup_max"),
    (dict(prompt_lookup_max=True), "prompt_lookup_max"),
])
def test_bad_options_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        NgramDrafter(**kwargs)
