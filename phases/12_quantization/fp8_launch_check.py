"""One forced FP8 decode launch against float64, shared by ``test_fp8_decode.py`` (the GEMM's
split-K shapes) and ``test_fp8_gemv.py`` (the GEMV)."""
from __future__ import annotations

import torch

from engine.model.kernels.triton import fp8 as triton_fp8
from engine.model.kernels.triton.semaphores import zeroed_counters
from fp8_truth import dequantize, quantize_groups, random_fp8_weight, rel_error


def check_decode_launch(device, m, n, k, block_rows, bias, dtype, config, seed, float32_bound=1e-5) -> None:
    """One forced decode launch (``config``) of ``fp8_linear`` on ``[m, k]`` activations whose
    128-column groups differ in magnitude by up to 10^6 (a strided row view), against float64 on
    the dequantized values (relative error below ``float32_bound`` in float32, 1e-2 in bf16); the
    same bits twice in a row; the arrival counters back at zero."""
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
    error = rel_error(out, truth)
    assert error < (float32_bound if dtype == torch.float32 else 1e-2), f"relative error {error:.3g}"
