"""RMSNorm with the fused residual chain."""
from __future__ import annotations

import torch
from torch import nn

from engine.model import kernels


class RMSNorm(nn.Module):
    """`forward(x, residual=None) -> (out, residual)`, always a 2-tuple.

    Without a residual: `out = rms_norm(x) * weight` (a new tensor) and the
    returned residual is `x` itself (the first layer's residual stream).
    With one: `residual += x; out = rms_norm(residual) * weight`, both in place
    (`out` is `x`). Normalises over the last dim; `x` needs a unit last stride
    (strided rows such as per-head views of a fused QKV output are fine).
    """

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            out = torch.empty_like(x)
            kernels.rms_norm(out, x, self.weight, self.eps)
            return out, x
        kernels.fused_add_rms_norm(x, residual, self.weight, self.eps)
        return x, residual

    def normalize_(self, x: torch.Tensor) -> torch.Tensor:
        """``x = rms_norm(x) * weight`` in place (e.g. MLA's latent, a column slice of the
        projection's output: no new tensor, no concatenation); returns ``x``."""
        kernels.rms_norm(x, x, self.weight, self.eps)
        return x
