"""RMSNorm, the module the attention layers use (Qwen3's q/k norms, MLA's latent norms) and the
decoder layers chain: its two branches against float64 math, with random weights."""
import torch

from engine.model.layers.norm import RMSNorm
from phases.assertions import assert_close


def rms_norm_f64(x, weight, eps):
    x = x.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.double()


def test_rmsnorm_returns_a_pair_in_both_branches():
    """Without a residual: (a new normalised tensor, x itself: the first layer's residual stream).
    With one: residual += x and out = norm(residual), both in place."""
    torch.manual_seed(0)
    norm = RMSNorm(64, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(64))
    x, res = torch.randn(5, 64), torch.randn(5, 64)
    given = x.clone()
    out, residual = norm(given)
    assert residual is given and torch.equal(given, x), "the first layer's residual is its input, unchanged"
    assert out is not given
    assert_close(out, rms_norm_f64(x, norm.weight, 1e-6), 1e-6, "RMSNorm output", "no residual")
    x2, res2 = x.clone(), res.clone()
    out, residual = norm(x2, res2)
    assert out is x2 and residual is res2  # in place
    assert_close(residual, x.double() + res.double(), 1e-6, "RMSNorm residual", "with a residual")
    assert_close(out, rms_norm_f64(x.double() + res.double(), norm.weight, 1e-6), 1e-6, "RMSNorm output",
                 "with a residual")
