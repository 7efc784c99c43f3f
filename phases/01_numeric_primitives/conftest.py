"""Kernel targets for phase 01: every backend present, each on its device and dtype.

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

import importlib
import importlib.util
import os
from dataclasses import dataclass

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
HAS_TRITON = importlib.util.find_spec("triton") is not None
if HAS_TRITON and not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _patch_triton_interpreter() -> None:
    """Triton 3.6's interpreter calls int() on one-element arrays (loop bounds held in
    tensors), which numpy >= 2.4 rejects; make it take the element instead."""
    import triton.runtime.interpreter as interpreter

    original = interpreter._patch_lang_tensor

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    interpreter._patch_lang_tensor = patched


if HAS_TRITON and not HAS_CUDA:
    _patch_triton_interpreter()


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


def _vllm_importable() -> bool:
    try:
        importlib.import_module("vllm._custom_ops")
        importlib.import_module("flash_attn")
    except Exception:
        return False
    return True


TARGETS = [
    pytest.param(Target("torch-cpu", "engine.kernels.reference", "cpu", torch.float32, 1e-4, 12, 300), id="torch-cpu"),
    pytest.param(Target("triton-interpret", "engine.kernels.triton", "cpu", torch.float32, 1e-4, 3, 24),
                 id="triton-interpret",
                 marks=pytest.mark.skipif(HAS_CUDA or not HAS_TRITON, reason="interpreter runs only without a GPU, "
                                          "with triton installed")),
    pytest.param(Target("torch-cuda", "engine.kernels.reference", "cuda", torch.bfloat16, 1e-2, 15, 300),
                 id="torch-cuda", marks=pytest.mark.cuda),
    pytest.param(Target("triton-cuda", "engine.kernels.triton", "cuda", torch.bfloat16, 1e-2, 25, 300),
                 id="triton-cuda", marks=pytest.mark.cuda),
    pytest.param(Target("vllm-cuda", "engine.kernels.vllm_backend", "cuda", torch.bfloat16, 1e-2, 15, 300),
                 id="vllm-cuda", marks=[pytest.mark.cuda,
                                        pytest.mark.skipif(not _vllm_importable(), reason="vllm/flash_attn absent")]),
]


@pytest.fixture(params=TARGETS)
def target(request) -> Target:
    return request.param
