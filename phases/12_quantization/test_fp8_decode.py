"""The FP8 decode launches of ``engine.kernels.triton.fp8`` (up to 16 rows: the GEMM's split-K
shapes and the FP8 GEMV, forced one at a time) against float64 on the dequantized values, and
their host work: Triton under its interpreter on CPU, the real kernels under ``cuda``. A file of
its own so that pytest-xdist runs these interpreter cases beside ``test_fp8_kernels.py``'s."""
from __future__ import annotations

import pytest
import torch

from engine.kernels.triton import fp8 as triton_fp8
from engine.kernels.triton.fp8 import GemmConfig
from engine.kernels.triton.fp8_gemv import Fp8GemvConfig
from engine.kernels.triton.semaphores import zeroed_counters
from fp8_truth import TRITON_TARGETS, dequantize, quantize_groups, random_fp8_weight, rel_error
from phases.harness import HostOpRecorder, count_step


def check_decode_launch(device, m, n, k, block_rows, bias, dtype, config, seed) -> None:
    """One forced decode launch (``config``) of ``fp8_linear`` on ``[m, k]`` activations whose
    128-column groups differ in magnitude by up to 10^6 (a strided row view), against float64 on
    the dequantized values; the same bits twice in a row; the arrival counters back at zero."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k + 3, generator=gen, dtype=torch.float64)[:, 1:1 + k]
    x = (x * 10.0 ** torch.randint(-3, 4, (m, -(-k // 128)), generator=gen).repeat_interleave(128, 1)[:, :k])
    x = x.to(dtype).to(device)
    weight, scales = random_fp8_weight(gen, n=n, k=k, block_rows=block_rows)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    args = weight.to(device), scales.to(device), None if b is None else b.to(device)
    out = triton_fp8.fp8_linear(x, *args, config=config)
    assert torch.equal(triton_fp8.fp8_linear(x, *args, config=config), out), "split-K sum not deterministic"
    assert not zeroed_counters(out.device, 1).any(), "an arrival counter was left non-zero"
    q, s = quantize_groups(x.cpu())
    truth = dequantize(q, s) @ dequantize(weight, scales, block_rows).T + (0 if b is None else b.double())
    assert out.dtype == dtype and out.shape == (m, n)
    assert rel_error(out, truth) < (1e-5 if dtype == torch.float32 else 1e-2)


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
@pytest.mark.parametrize("m, n, k, block_rows, bias, dtype, config", [
    (1, 200, 300, 128, True, torch.float32, Fp8GemvConfig(16, 1, 4, 2)),
    (1, 200, 300, 128, False, torch.bfloat16, Fp8GemvConfig(32, 2, 4, 1)),
    (3, 96, 256, 1, False, torch.float32, Fp8GemvConfig(16, 2, 4, 2)),
    (8, 130, 384, 128, False, torch.bfloat16, Fp8GemvConfig(16, 8, 4, 2)),
    (1, 64, 1, 128, True, torch.float32, Fp8GemvConfig(32, 8, 4, 2)),
    (5, 40, 520, 1, True, torch.float32, Fp8GemvConfig(16, 3, 4, 2)),
    (2, 200, 1000, 128, True, torch.float32, Fp8GemvConfig(16, 0, 4, 2)),
    (1, 136, 640, 128, False, torch.bfloat16, Fp8GemvConfig(8, 0, 4, 4))], ids=str)
def test_fp8_decode_gemv_matches_float64(device, m, n, k, block_rows, bias, dtype, config):
    """The FP8 decode GEMV (1-8 rows, activations quantized per group in its prologue; unsplit
    with several loads per program, one load per split (``split_k`` 0), split on 128-column groups,
    more splits than groups, a last chunk of fewer groups) equals float64 on
    the dequantized values, with block and per-row scales whose 128-column groups differ in
    magnitude (a scale read for the wrong group or row is off by up to 10^3), bit-identical
    twice in a row, the arrival counters left at zero."""
    check_decode_launch(device, m, n, k, block_rows, bias, dtype, config, seed=m * 11 + n + k + config.split_k)


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
    weight, scales = (t.to(device) for t in random_fp8_weight(gen, n=200, k=300))
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
