"""The FP8 arithmetic written out in the tests, independent of the engine: activation
quantization per token and group of 128 as the format defines it (float32 scale =
max|group| / 448, the quotient saturated at ±448 and rounded to e4m3 by torch's cast), weights
dequantized block by block, products in float64; kernel targets (every backend present)."""
from __future__ import annotations

import importlib
import importlib.util
import os
from dataclasses import dataclass

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
HAS_TRITON = importlib.util.find_spec("triton") is not None
if HAS_TRITON and not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel is defined


@dataclass(frozen=True)
class Target:
    name: str
    module: str
    device: str
    dtype: torch.dtype  # the activations' dtype

    @property
    def ops(self):
        return importlib.import_module(self.module)


TARGETS = [
    pytest.param(Target("torch-cpu", "engine.model.kernels.fp8_reference", "cpu", torch.float32), id="torch-cpu"),
    pytest.param(Target("triton-interpret", "engine.model.kernels.triton.fp8", "cpu", torch.float32),
                 id="triton-interpret", marks=pytest.mark.skipif(HAS_CUDA or not HAS_TRITON,
                                                                 reason="the interpreter runs only without a GPU")),
    pytest.param(Target("triton-cuda", "engine.model.kernels.triton.fp8", "cuda", torch.bfloat16), id="triton-cuda",
                 marks=pytest.mark.cuda),
]
# The Triton kernels alone: the interpreter on a CPU-only machine, the real kernels under ``cuda``.
TRITON_TARGETS = [pytest.param("cpu", id="triton-interpret",
                               marks=pytest.mark.skipif(HAS_CUDA or not HAS_TRITON,
                                                        reason="the interpreter runs only without a GPU")),
                  pytest.param("cuda", id="triton-cuda", marks=pytest.mark.cuda)]


def group_scales(x: torch.Tensor) -> torch.Tensor:
    """[M, ceil(K/128)] float32: max|x| over columns [128 g, 128 g + 128) of each row, / 448."""
    m, k = x.shape
    return torch.stack([x[:, g:g + 128].float().abs().amax(dim=1).clamp(min=1e-10) / 448.0
                        for g in range(0, k, 128)], dim=1)


def quantize_groups(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 [M, K], scales) per token group, as ``quantize_per_token_group`` must give them."""
    scales = group_scales(x)
    full = scales.repeat_interleave(128, dim=1)[:, :x.shape[1]]
    return (x.float() / full).clamp(-448.0, 448.0).to(torch.float8_e4m3fn), scales


def dequantize(q: torch.Tensor, scales: torch.Tensor, block_rows: int = 1) -> torch.Tensor:
    """float64 of e4m3 ``q [..., N, K]`` times its scales, one per ``block_rows`` x 128 block."""
    n, k = q.shape[-2:]
    full = scales.double().repeat_interleave(block_rows, dim=-2)[..., :n, :].repeat_interleave(128, dim=-1)
    return q.double() * full[..., :k]


def random_fp8_weight(gen: torch.Generator, *lead: int, n: int, k: int, block_rows: int = 128):
    """(e4m3 weight [*lead, N, K], float32 scales) with random values and scales that differ by
    up to 2^6 between blocks (a scale read from the wrong block shows)."""
    q = (torch.randn(*lead, n, k, generator=gen) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    rows = -(-n // block_rows) if block_rows > 1 else n
    scales = torch.exp2(torch.empty(*lead, rows, -(-k // 128)).uniform_(-9, -3, generator=gen))
    return q, scales


def rel_error(out: torch.Tensor, truth: torch.Tensor) -> float:
    out, truth = out.detach().double().cpu(), truth.detach().double().cpu()
    assert out.shape == truth.shape, (tuple(out.shape), tuple(truth.shape))
    assert out.isfinite().all(), "non-finite output"
    return float((out - truth).norm() / truth.norm())
