"""Host -> device copies of a step's inputs: ``to_device`` (one tensor) and ``to_device_packed``
(several int64 tensors in one copy).

The contract: the result is on ``device`` with the host tensor's values, dtype and shape. On CUDA
the copy is pinned and non-blocking: it is queued on the current stream and the caller may reuse
or drop the host tensor at once (the caching host allocator keeps the pinned block alive until
the copy has run); anything that reads the result on that stream sees the copied values. On any
other device it is a plain ``Tensor.to``. This module imports nothing of the engine, so every
worker module may use it."""
from __future__ import annotations

import torch


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """One host -> device copy: pinned and non-blocking on CUDA (the caching host allocator
    keeps the pinned block alive until the copy has run)."""
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def to_device_packed(parts: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """Int64 host tensors in one host -> device copy, returned by name (views of one device tensor)."""
    flat = to_device(torch.cat(list(parts.values())), device)
    return dict(zip(parts, flat.split([p.numel() for p in parts.values()])))
