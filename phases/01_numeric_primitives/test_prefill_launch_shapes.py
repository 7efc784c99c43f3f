"""The Triton prefill kernel at each launch shape it may take, against float64 attention
(``run_varlen`` of test_attention.py). A file of its own: under the Triton interpreter these
cases are most of the phase's time, and the gate runs a phase's files side by side."""
from __future__ import annotations

import dataclasses

import pytest

from test_attention import run_varlen


@pytest.mark.parametrize("shape", [(16, 16), (32, 16), (16, 32), (128, 64), (128, 128)])
def test_varlen_kernel_launch_shapes(target, shape):
    """The Triton prefill kernel at each launch shape it may take: key tiles wholly visible to a query
    block skip the mask, the diagonal ones keep it, query blocks run from the last (the interpreter
    takes the small tiles on longer sequences than its usual draw, so every block kind is met; with
    at most 2 x 2 heads there, as the tiles, not the heads, are what this test varies)."""
    if target.module != "engine.model.kernels.triton":
        pytest.skip("the Triton kernel's own launch shapes")
    from engine.model.kernels.triton.prefill_attention import PrefillLaunch, flash_varlen_attention

    block_m, block_n = shape
    if target.device == "cpu" and block_m > 32:
        pytest.skip("large tiles run on the GPU (the interpreter is one program at a time)")
    def attention(q, *args):
        # three stages of 128 x 128 tiles fit shared memory only for heads up to 128 wide
        stages = 3 if q.shape[2] <= 128 or block_m * block_n < 128 * 128 else 2
        launch = PrefillLaunch(block_m, block_n, num_warps=8 if block_m == 128 else 4, num_stages=stages)
        return flash_varlen_attention(q, *args, launch=launch)

    if target.device == "cpu":  # the interpreter's time grows with heads x tiles
        run_varlen(dataclasses.replace(target, max_tokens=max(target.max_tokens, 80)), attention,
                   kv_heads=(1, 2), ratios=(1, 2))
    else:
        run_varlen(target, attention)
