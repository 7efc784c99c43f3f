"""The Triton backend's split-K paged decode against float64 attention (``run_decode`` of
test_attention.py): the split count does not change the result, the splits merged by a second
launch. The one-launch merge is test_paged_decode_fused_merge.py's. Files of their own: under the
Triton interpreter the 40-split cases are most of the phase's time, and xdist spreads a phase by
file."""
from __future__ import annotations

import pytest

from test_attention import run_decode


def check_split_count(target, num_splits: int, fused_merge: bool) -> None:
    """Any number of splits (empty ones included) gives the float64 answer, called twice (with
    ``fused_merge`` its arrival counters must be back at zero for the second call). Each split
    takes whole 64-token tiles of its own context: at 40 splits the 2200-token context fills 35
    (more than one 32-split merge step), 150 tokens fill 3 and 1 token fills 1, the rest stay
    empty; at 3 splits a 330-token context fills all three (2, 2 and 2 tiles, the last one
    partial); with one split the split kernel writes the output itself. A context of 0 stays a
    zero row on every path. (The 2200-token context runs only where more than 32 splits need it,
    with one KV head of 4 queries: under the Triton interpreter it is most of this file's time.)"""
    if "triton" not in target.module:
        pytest.skip("num_splits is a Triton-backend knob")
    longest, kv_heads = (2200, 1) if num_splits > 32 else (330, 2)
    for seed in (num_splits, num_splits + 1):
        run_decode(target, kv_heads, 4, 128, 128, False, 16, [1, 150, 0, longest], seed=seed, num_splits=num_splits,
                   fused_merge=fused_merge)


@pytest.mark.parametrize("num_splits", [1, 3, 40])
def test_paged_decode_split_count_does_not_change_the_result(target, num_splits):
    """The Triton split-K merge by a second launch: any split count gives the float64 answer
    (see ``check_split_count``)."""
    check_split_count(target, num_splits, fused_merge=False)
