"""Speculative sampling is lossless without top-p: the first three tokens of a thousand seeded
requests of one prompt on the shipped demo model follow plain sampling's distributions
(``spec_sampling_check``'s docstring says how, and what the truth is)."""
from spec_sampling_check import check_first_three_tokens, load_model


def test_first_three_tokens_follow_plain_sampling():
    check_first_three_tokens(load_model(), top_p=1.0)
