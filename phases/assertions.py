"""Assertions the phases share: a failure names the failing quantity in one line
("logits: relative error 2.4e-04 > 1e-04 at decode step 3 (worst element [1, 17]: 0.513 vs 0.498)"),
never a truncated tensor repr, so the gate report's first error line says what broke.

All comparisons run in float64 on the CPU; ``where`` says where in the test the
comparison sits (layer, step, rank, path) and is appended after "at".
"""
from __future__ import annotations

import torch


def _f64(t) -> torch.Tensor:
    return torch.as_tensor(t).detach().double().cpu()


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """‖actual - expected‖ / ‖expected‖ in float64 (the absolute error norm when ``expected`` is zero)."""
    a, e = _f64(actual), _f64(expected)
    denom = e.norm()
    return float((a - e).norm() / (denom if denom > 0 else 1.0))


def _at(where: str) -> str:
    return f" at {where}" if where else ""


def _index(flat: int, shape: torch.Size) -> list[int]:
    return list(torch.unravel_index(torch.tensor(flat), shape)) if shape else []


def assert_close(actual: torch.Tensor, expected: torch.Tensor, tol: float, what: str, where: str = "") -> None:
    """Same shape, every element finite where ``expected`` is, and relative error <= ``tol``."""
    __tracebackhide__ = True
    a, e = _f64(actual), _f64(expected)
    if a.shape != e.shape:
        raise AssertionError(f"{what}: shape {tuple(a.shape)} != expected {tuple(e.shape)}{_at(where)}")
    bad = ~a.isfinite() & e.isfinite()
    if bad.any():
        first = _index(int(bad.flatten().nonzero()[0]), a.shape)
        raise AssertionError(f"{what}: {int(bad.sum())} of {a.numel()} elements are NaN/inf (first at {first})"
                             f"{_at(where)}")
    err = relative_error(a, e)
    if not err <= tol:
        diff = (a - e).abs().flatten()
        worst = int(diff.argmax())
        idx = _index(worst, a.shape)
        raise AssertionError(f"{what}: relative error {err:.1e} > {tol:.0e}{_at(where)} (worst element {idx}: "
                             f"{a.flatten()[worst].item():.4g} vs {e.flatten()[worst].item():.4g})")


def assert_equal(actual: torch.Tensor, expected: torch.Tensor, what: str, where: str = "") -> None:
    """Bit-for-bit equal values (dtypes may differ); names how many elements differ and the first one."""
    __tracebackhide__ = True
    a, e = torch.as_tensor(actual).detach().cpu(), torch.as_tensor(expected).detach().cpu()
    if a.shape != e.shape:
        raise AssertionError(f"{what}: shape {tuple(a.shape)} != expected {tuple(e.shape)}{_at(where)}")
    differ = a.double() != e.double()
    if differ.any():
        first = int(differ.flatten().nonzero()[0])
        raise AssertionError(f"{what}: {int(differ.sum())} of {a.numel()} elements differ{_at(where)} (first at "
                             f"{_index(first, a.shape)}: {a.flatten()[first].item():.6g} vs "
                             f"{e.flatten()[first].item():.6g})")


def assert_steps_close(actual: torch.Tensor, expected: torch.Tensor, prompt_len: int, tol: float, what: str,
                       where: str = "") -> None:
    """``assert_close`` for one sequence's rows from a paged run: rows ``[0, prompt_len)`` come
    from the prefill, each later row from one decode step. On failure the message names the
    first part that is off (prefill or decode step k) with its own error, since a fault in the
    cache write shows in decode while one in the projections shows from the prefill on."""
    __tracebackhide__ = True
    a, e = _f64(actual), _f64(expected)
    if a.shape != e.shape:
        raise AssertionError(f"{what}: shape {tuple(a.shape)} != expected {tuple(e.shape)}{_at(where)}")
    err = relative_error(a, e)
    if err <= tol and a.isfinite().all():
        return
    parts = [("prefill", slice(0, prompt_len))] + [(f"decode step {i - prompt_len + 1}", slice(i, i + 1))
                                                  for i in range(prompt_len, len(e))]
    errors = [(name, relative_error(a[rows], e[rows]), bool(a[rows].isfinite().all())) for name, rows in parts]
    name, part_err, finite = next((p for p in errors if p[1] > tol or not p[2]), max(errors, key=lambda p: p[1]))
    state = "NaN/inf" if not finite else f"{part_err:.1e}"
    raise AssertionError(f"{what}: relative error {err:.1e} > {tol:.0e}{_at(where)} (first off: {name}, {state}; "
                         f"prefill {errors[0][1]:.1e})")
