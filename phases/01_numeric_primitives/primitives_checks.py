"""Helpers shared by the phase-01 tests: the kernel targets, random inputs, the error check,
Hypothesis runs and poisoned allocations.

Kernel targets: every backend present, each on its device and dtype.

- ``torch-cpu``: the reference backend in float32 (the CPU engine path).
- ``triton-interpret``: the Triton kernels run by Triton's interpreter on CPU
  tensors in float32 (only without a GPU, when triton is installed; the
  interpreter must be switched on before any kernel is defined, so this file
  sets TRITON_INTERPRET=1 at import).
- ``torch-cuda``, ``triton-cuda``, ``vllm-cuda``: bf16 on the GPU (``cuda`` marker).

Tolerances are on ‖out - truth‖ / ‖truth‖ against float64 math in the tests:
float32 well under 1e-4, bf16 operands up to 1e-2 (the device tool's METHOD.md).
"""
from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, given, settings

HAS_CUDA = torch.cuda.is_available()
HAS_TRITON = importlib.util.find_spec("triton") is not None
if HAS_TRITON and not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


@dataclass(frozen=True)
class Target:
    name: str
    module: str      # the backend module under test
    device: str
    dtype: torch.dtype
    tol: float       # bound on the relative error norm against float64 truth
    examples: int    # Hypothesis examples per property
    max_tokens: int  # largest token count drawn (the interpreter runs one program at a time)

    @property
    def ops(self):
        return importlib.import_module(self.module)


def vllm_importable() -> bool:
    try:
        importlib.import_module("vllm._custom_ops")
        importlib.import_module("flash_attn")
    except Exception:
        return False
    return True


TARGETS = [
    pytest.param(Target("torch-cpu", "engine.model.kernels.reference", "cpu", torch.float32, 1e-4, 12, 300),
                 id="torch-cpu"),
    pytest.param(Target("triton-interpret", "engine.model.kernels.triton", "cpu", torch.float32, 1e-4, 3, 24),
                 id="triton-interpret",
                 marks=pytest.mark.skipif(HAS_CUDA or not HAS_TRITON, reason="interpreter runs only without a GPU, "
                                          "with triton installed")),
    pytest.param(Target("torch-cuda", "engine.model.kernels.reference", "cuda", torch.bfloat16, 1e-2, 15, 300),
                 id="torch-cuda", marks=pytest.mark.cuda),
    pytest.param(Target("triton-cuda", "engine.model.kernels.triton", "cuda", torch.bfloat16, 1e-2, 25, 300),
                 id="triton-cuda", marks=pytest.mark.cuda),
    pytest.param(Target("vllm-cuda", "engine.model.kernels.vllm_backend", "cuda", torch.bfloat16, 1e-2, 15, 300),
                 id="vllm-cuda", marks=[pytest.mark.cuda,
                                        pytest.mark.skipif(not vllm_importable(), reason="vllm/flash_attn absent")]),
]



def rand(gen: torch.Generator, *shape: int, target, scale: float = 1.0) -> torch.Tensor:
    """Random normal tensor drawn in float64 on the CPU, then cast to the target's dtype and device."""
    return (torch.randn(shape, generator=gen, dtype=torch.float64) * scale).to(target.dtype).to(target.device)


def assert_close(out: torch.Tensor, truth: torch.Tensor, tol: float, what: str = "") -> None:
    """No NaN anywhere (poisoned elements must all be written) and ‖out - truth‖ / ‖truth‖ <= tol,
    with no single element off by more than 20 * tol * max|truth|."""
    out64, truth64 = out.detach().double().cpu(), truth.detach().double().cpu()
    assert out64.shape == truth64.shape, f"{what}: shape {tuple(out64.shape)} != {tuple(truth64.shape)}"
    assert not out64.isnan().any(), f"{what}: {int(out64.isnan().sum())} elements unwritten (NaN)"
    err = (out64 - truth64).norm() / truth64.norm()
    assert err <= tol, f"{what}: relative error {err:.3e} > {tol:.1e}"
    worst = (out64 - truth64).abs().max()
    assert worst <= 20 * tol * truth64.abs().max(), f"{what}: worst element off by {worst:.3e}"


def run_cases(target, strategy, check, must=()) -> None:
    """Run ``check(case)`` on every case in ``must`` (the cases that matter most, run on every
    target however few examples it draws), then on ``target.examples`` Hypothesis-drawn cases
    (deterministic across runs)."""
    for case in must:
        check(case)
    settings(max_examples=target.examples, deadline=None, derandomize=True, database=None,
             suppress_health_check=list(HealthCheck))(given(strategy)(check))()


@contextlib.contextmanager
def poisoned_allocations():
    """Inside, torch.empty fills floating tensors with NaN, so an op's own outputs start poisoned."""
    previous = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(previous[0], warn_only=previous[1])
        torch.utils.deterministic.fill_uninitialized_memory = fill
