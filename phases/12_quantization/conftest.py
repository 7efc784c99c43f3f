"""Phase 12 fixtures. Importing ``fp8_truth`` first switches Triton's interpreter on (without a
GPU) before any test module defines or imports a kernel."""
from __future__ import annotations

import pytest

import fp8_truth  # noqa: F401
from phases.checkpoints import make_tiny_fp8_checkpoint, written_once


@pytest.fixture
def tiny_fp8_checkpoint(tmp_path_factory):
    """Factory: ``tiny_fp8_checkpoint(arch, seed=0, per_channel=False, ignored=(), **overrides)``
    (``phases.checkpoints.make_tiny_fp8_checkpoint``), written once under torchrun."""
    def make(arch: str = "Qwen3ForCausalLM", seed: int = 0, **kwargs):
        return written_once(lambda: make_tiny_fp8_checkpoint(tmp_path_factory.mktemp(f"{arch}-fp8-{seed}"), arch,
                                                               seed, **kwargs))
    return make
