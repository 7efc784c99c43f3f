"""The Triton backend's one-launch split-K merge (the last split to arrive merges; its arrival
counters reset for the next launch) against float64 attention, on GQA and on MLA's latent head.
A file apart from test_paged_decode_split_k.py so that xdist runs the two 40-split cases side by
side."""
from __future__ import annotations

import pytest

from test_attention import run_decode
from test_paged_decode_split_k import check_split_count


@pytest.mark.parametrize("num_splits", [3, 40])
def test_paged_decode_fused_merge_split_count_does_not_change_the_result(target, num_splits):
    """The split-K merge by the last split to arrive: any split count gives the float64 answer,
    and a second call gives it again (the counters are back at zero; see ``check_split_count``)."""
    check_split_count(target, num_splits, fused_merge=True)


def test_paged_decode_mla_fused_merge(target):
    """The one-launch merge on MLA's shapes: one latent KV head, 16 query heads in one head block,
    V = the first 512 of 576 channels."""
    if "triton" not in target.module:
        pytest.skip("fused_merge is a Triton-backend knob")
    run_decode(target, 1, 16, 576, 512, True, 16, [1, 40], seed=7, num_splits=3, fused_merge=True)
