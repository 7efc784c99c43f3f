"""Helpers shared by the phase-01 tests: random inputs, the error check, Hypothesis runs, poisoned allocations."""
from __future__ import annotations

import contextlib

import torch
from hypothesis import HealthCheck, given, settings


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


def run_cases(target, strategy, check) -> None:
    """Run ``check(case)`` on ``target.examples`` Hypothesis-drawn cases (deterministic across runs)."""
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
