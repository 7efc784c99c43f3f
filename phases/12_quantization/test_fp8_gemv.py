"""The FP8 decode GEMV of ``engine.model.kernels.triton.fp8_gemv`` (1-8 rows, forced) against float64 on
the dequantized values: Triton under its interpreter on CPU, the real kernel under ``cuda``."""
from __future__ import annotations

import pytest
import torch

from engine.model.kernels.triton.fp8_gemv import Fp8GemvConfig
from fp8_launch_check import check_decode_launch
from fp8_truth import TRITON_TARGETS


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
