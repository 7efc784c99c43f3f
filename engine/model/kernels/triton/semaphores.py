"""Arrival counters for kernels whose last program of a group finishes the group's work (split-K
merges in one launch). A kernel's program stores its partial result, then increments its group's
counter; the program that sees ``count == group size - 1`` reads every partial, writes the
result and sets the counter back to 0, so the counters are all zero between launches and a
launch needs no zeroing (no memset: CUDA-graph safe). Every such kernel of a device shares one
buffer from its first counter: launches that use them must not run concurrently (one stream, as
the engine runs its steps).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

_COUNTERS: dict[torch.device, torch.Tensor] = {}
MIN_COUNTERS = 1 << 16


def zeroed_counters(device: torch.device, count: int) -> torch.Tensor:
    """At least ``count`` int32 counters on ``device``, all zero: one buffer per device, kept (and
    kept zero by the kernels that use it). A larger buffer is made outside a CUDA-graph capture
    only (a graph keeps the address it captured)."""
    counters = _COUNTERS.get(device)
    if counters is None or counters.numel() < count:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"{count} arrival counters needed during a CUDA-graph capture; run the step once "
                               "eagerly first (the warm-up does)")
        counters = torch.zeros(max(count, MIN_COUNTERS), dtype=torch.int32, device=device)
        _COUNTERS[device] = counters
    return counters


@triton.jit
def arrive_last(counter_ptr, group_size):
    """Count this program's arrival at its group's counter (after its partial results are stored;
    release / acquire order makes every earlier partial visible to the last program); True for the
    last of ``group_size`` programs to arrive, which also resets the counter to 0."""
    tl.debug_barrier()  # every thread of this program has stored its part
    last = tl.atomic_add(counter_ptr, 1, sem="acq_rel") == group_size - 1
    if last:
        tl.atomic_xchg(counter_ptr, 0, sem="relaxed")
    return last
