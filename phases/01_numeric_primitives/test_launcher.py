"""The cached Triton launcher (``engine.model.kernels.triton.launcher``) against Triton's own specialisation.

A cached launch reuses the kernel compiled for an earlier call whose ``arg_signature``s were equal,
so equal signatures must mean equal specialisations: checked against Triton's
``native_specialize_impl`` (the function its binder calls) on integers around every boundary it
draws, floats, bools, None and tensors of several dtypes at aligned and misaligned offsets.
"""
from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from primitives_checks import HAS_CUDA

BOUNDARIES = [0, 1, 2, 15, 16, 17, 32, -1, -16, 2**31 - 16, 2**31 - 1, 2**31, -2**31, -2**31 - 16, 2**63 - 16,
              2**63 - 1, 2**63, 2**64 - 16, 2**64 - 1]
INTS = st.one_of(st.sampled_from(BOUNDARIES), st.integers(-2**63, 2**64 - 1),
                 st.sampled_from(BOUNDARIES).flatmap(lambda b: st.integers(b - 40, b + 40)))
TENSORS = st.tuples(st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.int32, torch.int64,
                                     torch.uint8]), st.integers(0, 17)).map(
    lambda spec: torch.zeros(64, dtype=spec[0])[spec[1]:])
ARGS = st.one_of(INTS.filter(lambda v: -2**63 <= v < 2**64), st.floats(allow_nan=False), st.booleans(),
                 st.none(), TENSORS)


def triton_specialisation(value):
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.nvidia.compiler import CUDABackend

    return native_specialize_impl(CUDABackend, value, False, True, True)


@settings(max_examples=300, derandomize=True, database=None, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.lists(ARGS, min_size=2, max_size=12))
def test_equal_signatures_mean_equal_specialisations(values):
    from engine.model.kernels.triton.launcher import arg_signature

    for a in values:
        for b in values:
            if arg_signature(a) == arg_signature(b):
                assert triton_specialisation(a) == triton_specialisation(b), (a, b)


def test_a_runtime_argument_by_keyword_is_refused():
    """Keywords are keyed by value: a tensor there would key every call apart and stay referenced."""
    import triton
    import triton.language as tl

    from engine.model.kernels.triton.launcher import launch_kernel

    @triton.jit
    def add(x_ptr, n, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        tl.store(x_ptr + offs, tl.load(x_ptr + offs) + n)

    device = "cuda" if HAS_CUDA else "cpu"
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton kernels run on the CPU only under the interpreter")
    x = torch.zeros(16, device=device)
    launch_kernel(add, (1,), x, 2.0, BLOCK=16)
    assert x.tolist() == [2.0] * 16
    with pytest.raises(TypeError, match="pass n of add positionally"):
        launch_kernel(add, (1,), x, n=2.0, BLOCK=16)


@pytest.mark.cuda
def test_cached_launches_run_the_kernel_their_signature_compiled():
    """After a first launch through Triton, launches with the same signature skip Triton's
    ``JITFunction.run`` and give the same results; a misaligned input (another specialisation)
    is compiled and launched apart, and correct."""
    from triton.runtime.jit import JITFunction

    import engine.model.kernels.triton as ours
    from engine.model.kernels import reference
    from engine.model.kernels.triton import launcher

    calls = []
    real_run = JITFunction.run

    def counted(self, *args, **kwargs):
        calls.append(self)
        return real_run(self, *args, **kwargs)

    gen = torch.Generator(device="cuda").manual_seed(0)
    storage = torch.randn(8 * 4096 + 8, device="cuda", generator=gen).to(torch.bfloat16)
    weight = (1 + 0.1 * torch.randn(4096, device="cuda", generator=gen)).to(torch.bfloat16)
    aligned, misaligned = storage[:8 * 4096].view(8, 4096), storage[1:1 + 8 * 4096].view(8, 4096)
    JITFunction.run = counted
    try:
        for x in (aligned, aligned, aligned, misaligned, misaligned, aligned):
            before = len(calls)
            out, want = torch.empty_like(x), torch.empty_like(x)
            ours.rms_norm(out, x, weight, 1e-6)
            reference.rms_norm(want, x, weight, 1e-6)
            torch.testing.assert_close(out, want, atol=2e-2, rtol=2e-2)
            if x is misaligned and before == 3:
                assert len(calls) == before + 1, "a misaligned input reused the aligned input's kernel"
    finally:
        JITFunction.run = real_run
    assert len(calls) <= 2, f"{len(calls)} of 6 launches went through Triton's JITFunction.run, not the cache"
    assert any(key[0] == id(calls[0]) for key in launcher._compiled)
