"""Speculative sampling is lossless with the model drafters too: the first three tokens of a
thousand seeded requests, drafted by the demo model's shipped draft model or EAGLE-3 head,
follow plain sampling's distributions (``spec_sampling_check``)."""
import pytest

from spec_sampling_check import check_first_three_tokens, load_model


@pytest.mark.parametrize("method", ["draft", "eagle3"])
def test_first_three_tokens_follow_plain_sampling_with_model_drafters(method):
    check_first_three_tokens(load_model(), top_p=1.0, speculative=dict(speculative=method, num_speculative_tokens=2))
