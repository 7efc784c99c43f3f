"""The FP8 decode launches of ``engine.model.kernels.triton.fp8`` (up to 16 rows: the GEMM's split-K
shapes, forced one at a time) against float64 on the dequantized values, and the host work of
every decode launch (the GEMV's too): Triton under its interpreter on CPU, the real kernels under
``cuda``. The GEMV's cases are in ``test_fp8_gemv.py``: interpreter cases spread over files run
side by side."""
from __future__ import annotations

import pytest
import torch

from engine.model.kernels.triton import fp8 as triton_fp8
from engine.model.kernels.triton.fp8 import GemmConfig
from engine.model.kernels.triton.fp8_gemv import Fp8GemvConfig
from fp8_launch_check import check_decode_launch
from fp8_truth import TRITON_TARGETS, random_fp8_weight
from phases.harness import HostOpRecorder, count_step


@pytest.mark.parametrize("device", TRITON_TARGETS)
@pytest.mark.parametrize("m, n, k, block_rows, bias", [(1, 200, 300, 128, True), (3, 96, 256, 1, False),
                                                       (16, 130, 384, 128, False), (1, 64, 1, 128, True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("config", [GemmConfig(16, 64, 1, 4, 4), GemmConfig(16, 32, 2, 4, 3),
                                    GemmConfig(16, 16, 4, 4, 3), GemmConfig(16, 32, 8, 4, 3)], ids=str)
def test_fp8_decode_split_k_matches_float64(device, m, n, k, block_rows, bias, dtype, config):
    """The decode launch shapes of the FP8 GEMM (one 16-row tile, K split on 128-column groups,
    more splits than groups included; the last split to arrive adds the partials in order)
    equal float64 on the dequantized values for 1-16 rows, twice in a row with the same bits
    (the arrival counters are back to zero after each launch)."""
    check_decode_launch(device, m, n, k, block_rows, bias, dtype, config, seed=m * 7 + n + k + config.split_k)


@pytest.mark.parametrize("device", TRITON_TARGETS)
@pytest.mark.parametrize("config, rows", [(GemmConfig(16, 32, 4, 4, 3), (1, 12)),
                                          (Fp8GemvConfig(16, 4, 4, 2), (1, 7))], ids=["gemm", "gemv"])
def test_fp8_linear_decode_has_no_host_sync_or_per_token_work(device, config, rows, monkeypatch):
    """The Triton ``fp8_linear`` of a decode step (its launch measured once per shape on CUDA,
    pinned here to a split-K one of the GEMM or of the GEMV, which allocate the partial sums)
    issues allocations and views only, the same ones for 1 and more rows, and reads nothing on
    the host."""
    monkeypatch.setattr(triton_fp8, "decode_plan", lambda *args: config)
    gen = torch.Generator().manual_seed(5)
    weight, scales = (t.to(device) for t in random_fp8_weight(gen, n=64, k=300))
    recorded = []
    for m in rows:
        x = torch.randn(m, 300, generator=gen).to(device)
        triton_fp8.fp8_linear(x, weight, scales)  # warm-up: compile
        with HostOpRecorder() as host:
            ops = count_step(lambda: triton_fp8.fp8_linear(x, weight, scales), monkeypatch)
        assert ops.host_reads == [], ops.host_reads
        recorded.append(host.ops)
    assert set(recorded[1]) <= {"view", "unsqueeze", "empty"}, recorded[1]
    assert recorded[0] == recorded[1], recorded
