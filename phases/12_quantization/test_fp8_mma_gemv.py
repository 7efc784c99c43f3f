"""The FP8 GEMM with the weight on the tensor cores' large side (``engine.model.kernels.triton.fp8_mma_gemv``,
1-128 rows, forced) against float64 on the dequantized values: Triton under its interpreter on CPU, the real
kernel (wgmma) under ``cuda``."""
from __future__ import annotations

import pytest
import torch

from engine.model.kernels.triton.fp8_mma_gemv import Fp8MmaGemvConfig
from fp8_launch_check import check_decode_launch
from fp8_truth import TRITON_TARGETS

# sm90's FP8 wgmma adds the products of a 128-column group with fewer mantissa bits than float32
# (about 14 retained: DeepSeek-V3's report, section 3.3.2); the kernel promotes each group's sum to
# float32 before scaling it, as DeepGEMM and the checkpoints' reference kernels do. The interpreter
# sums exactly. Either bound still fails on FP8 partial sums and on every mis-indexed scale.
FLOAT32_BOUND = {"cpu": 1e-5, "cuda": 1e-3}


@pytest.mark.parametrize("device", TRITON_TARGETS)
@pytest.mark.parametrize("m, n, k, block_rows, bias, dtype, config", [
    (1, 200, 300, 128, True, torch.float32, Fp8MmaGemvConfig(64, 1, 3)),
    (1, 200, 300, 128, False, torch.bfloat16, Fp8MmaGemvConfig(128, 2, 3)),
    (3, 96, 256, 1, False, torch.float32, Fp8MmaGemvConfig(64, 2, 2)),
    (8, 130, 384, 128, False, torch.bfloat16, Fp8MmaGemvConfig(64, 8, 3)),
    (1, 64, 1, 128, True, torch.float32, Fp8MmaGemvConfig(64, 8, 3)),
    (5, 40, 520, 1, True, torch.float32, Fp8MmaGemvConfig(64, 3, 4)),
    (2, 300, 1000, 128, True, torch.float32, Fp8MmaGemvConfig(256, 4, 3)),
    (12, 130, 384, 128, True, torch.float32, Fp8MmaGemvConfig(64, 2, 3)),
    (40, 200, 300, 1, False, torch.bfloat16, Fp8MmaGemvConfig(64, 1, 4)),
    (100, 96, 520, 128, True, torch.float32, Fp8MmaGemvConfig(128, 3, 3)),
    (128, 64, 256, 128, False, torch.float32, Fp8MmaGemvConfig(64, 2, 3))], ids=str)
def test_fp8_mma_gemv_matches_float64(device, m, n, k, block_rows, bias, dtype, config):
    """The MMA GEMV (up to 8 rows: the real rows quantized per group in the kernel and placed in a
    zero 16-row tile; beyond, up to 128 rows quantized first and loaded in one tile zero-padded to
    a power of two; the weight tile as the MMA's M side; unsplit, split on 128-column groups,
    more splits than groups, row counts that are not powers of two, partial column blocks, row
    tiles and K groups) equals float64 on the dequantized values, with block and per-row scales
    whose groups differ in magnitude, bit-identical twice in a row, the arrival counters left at
    zero."""
    check_decode_launch(device, m, n, k, block_rows, bias, dtype, config, seed=m * 13 + n + k + config.split_k,
                        float32_bound=FLOAT32_BOUND[device])
