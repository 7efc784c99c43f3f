"""Host -> device copies of a step's inputs."""
from __future__ import annotations

import torch


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """One host -> device copy: pinned and non-blocking on CUDA (the caching host allocator
    keeps the pinned block alive until the copy has run)."""
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
