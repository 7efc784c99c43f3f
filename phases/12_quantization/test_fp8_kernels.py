"""The FP8 ops (``engine.model.kernels.fp8``) against the format written out in ``fp8_truth`` and
float64 products, on every backend present (torch reference on CPU, Triton under its
interpreter on CPU, Triton on CUDA)."""
from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from engine.model import kernels
from engine.model.kernels import fp8
from engine.model.kernels.triton import fp8 as triton_fp8
from engine.model.kernels.triton.fp8 import GemmConfig, _group_by_expert
from engine.model.kernels.triton.fp8_tiles import saturate_to_fp8
from fp8_truth import TARGETS, dequantize, quantize_groups, random_fp8_weight, rel_error
from phases.harness import count_step


@pytest.fixture(params=TARGETS)
def target(request, monkeypatch):
    """A backend; the public ops (``engine.model.kernels.fp8``) run on it: CPU tensors go to the Triton
    interpreter for the triton-interpret target (by default they take the torch reference)."""
    if request.param.name == "triton-interpret":
        monkeypatch.setattr(kernels, "_select", lambda device_type, forced: "triton")
    return request.param


def group_scaled_input(gen, m: int, k: int, target) -> torch.Tensor:
    """[M, K] activations whose 128-column groups differ in magnitude by up to 10^6 (a group
    that crossed a multiple of 128 would quantize small values with a large scale), a row of
    zeros (when M > 2), taken as a column slice of a wider buffer (row stride != K)."""
    magnitude = 10.0 ** torch.randint(-3, 4, (m, -(-k // 128)), generator=gen).double()
    x = torch.randn(m, k + 5, generator=gen, dtype=torch.float64)[:, 2:2 + k]
    x = x * magnitude.repeat_interleave(128, dim=1)[:, :k]
    if m > 2:
        x[m // 2] = 0.0
    return x.to(target.dtype).to(target.device)


@pytest.mark.parametrize("m, k", [(1, 128), (5, 300), (3, 130), (70, 256), (2, 1)])
def test_quantize_per_token_group_follows_the_format(target, m, k):
    """Each row's groups are columns [128 g, 128 g + 128) (the last one shorter), scale =
    max|group| / 448 exactly, q = e4m3(x / scale) saturated: equal to the format's values
    (below e4m3's normal range, 2^-6 of a scale, within one subnormal step)."""
    gen = torch.Generator().manual_seed(m * 1000 + k)
    x = group_scaled_input(gen, m, k, target)
    q, scales = target.ops.quantize_per_token_group(x)
    want_q, want_scales = quantize_groups(x.cpu())
    assert q.dtype == torch.float8_e4m3fn and q.shape == (m, k) and scales.shape == (m, -(-k // 128))
    torch.testing.assert_close(scales.cpu(), want_scales, rtol=0, atol=0)
    normal = want_q.float().abs() >= 2.0 ** -6
    assert torch.equal(q.cpu().float()[normal], want_q.float()[normal]), "quantized values differ from e4m3(x / s)"
    assert (q.cpu().float() - want_q.float()).abs().max() <= 2.0 ** -9


@pytest.mark.parametrize("m", [1, 7, 64, 65, 150])
@pytest.mark.parametrize("n, k, block_rows, bias", [(256, 384, 128, False), (200, 300, 128, True), (96, 256, 1, True),
                                                    (130, 128, 1, False)])
def test_fp8_linear_matches_float64(target, m, n, k, block_rows, bias):
    """``x W^T + b`` with W's e4m3 values times their block (or per-row) scales and x quantized
    per token group, against float64 on the dequantized values: up to 64 rows the GEMM
    quantizes its own activations, beyond them it reads the quantize kernel's; partial blocks
    in N and K."""
    gen = torch.Generator().manual_seed(m + n + k)
    x = group_scaled_input(gen, m, k, target)
    weight, scales = random_fp8_weight(gen, n=n, k=k, block_rows=block_rows)
    b = torch.randn(n, generator=gen).to(target.dtype) if bias else None
    out = fp8.fp8_linear(x, weight.to(target.device), scales.to(target.device),
                         None if b is None else b.to(target.device))
    q, s = quantize_groups(x.cpu())
    truth = dequantize(q, s) @ dequantize(weight, scales, block_rows).T + (0 if b is None else b.double())
    assert out.dtype == x.dtype and out.shape == (m, n)
    assert rel_error(out, truth) < (1e-5 if target.dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("tokens, per_token, experts", [(1, 1, 1), (1, 6, 8), (3, 2, 4), (40, 3, 8), (9, 1, 2)])
@pytest.mark.parametrize("block_rows", [128, 1])
def test_fp8_expert_linear_matches_float64(target, tokens, per_token, experts, block_rows):
    """``out[t, j] = W[ids[t, j]] @ x[t]`` over stacked FP8 experts: repeated and unused
    experts, id -1 (another rank's expert) a zero row, few assignments (decode) and many
    (prefill), K and N with partial blocks."""
    gen = torch.Generator().manual_seed(tokens * 10 + per_token + experts)
    n, k = 200, 300
    x = group_scaled_input(gen, tokens, k, target)
    weights, scales = random_fp8_weight(gen, experts, n=n, k=k, block_rows=block_rows)
    ids = torch.randint(-1, experts, (tokens, per_token), generator=gen)
    out = fp8.fp8_expert_linear(x, weights.to(target.device), scales.to(target.device), ids.to(target.device))
    q, s = quantize_groups(x.cpu())
    rows, w = dequantize(q, s), dequantize(weights, scales, block_rows)
    truth = torch.stack([torch.stack([w[e] @ rows[t] if e >= 0 else torch.zeros(n, dtype=torch.float64)
                                      for e in ids[t].tolist()]) for t in range(tokens)])
    assert out.shape == (tokens, per_token, n)
    foreign = ids < 0
    assert torch.equal(out.cpu()[foreign].float(), torch.zeros(int(foreign.sum()), n)), "id -1 row not zero"
    if not foreign.all():
        assert rel_error(out.cpu()[~foreign], truth[~foreign]) < (1e-5 if target.dtype == torch.float32 else 1e-2)


def test_weight_quantization_round_trips():
    """Online quantization (``quantize_weight``): scales are max|block| / 448 per 128 x 128 block
    (partial last blocks included), and the dequantized weight is within half an e4m3 step of
    the original (2^-4 relative in the normal range, one subnormal step of the scale below it)."""
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(300, 200, generator=gen) * torch.exp2(torch.randint(-8, 8, (300, 1), generator=gen).float())
    q, scales = fp8.quantize_weight(w)
    assert q.dtype == torch.float8_e4m3fn and scales.shape == (3, 2)
    blocks = torch.tensor([[w[i:i + 128, j:j + 128].abs().max() / 448 for j in (0, 128)] for i in (0, 128, 256)])
    torch.testing.assert_close(scales, blocks, rtol=1e-6, atol=0)
    back = fp8.dequantize_weight(q, scales).double()
    step = scales.double().repeat_interleave(128, 0)[:300].repeat_interleave(128, 1)[:, :200]
    assert ((back - w.double()).abs() <= torch.maximum(w.double().abs() * 2.0 ** -4, step * 2.0 ** -10)).all()


@triton.jit
def _cast_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, saturate_to_fp8(tl.load(x_ptr + offs, mask=offs < n)), mask=offs < n)


def test_every_e4m3_cast_saturates():
    """The kernels' e4m3 cast (``saturate_to_fp8``) clamps to ±448: a value past the range is
    ±448, never NaN (Triton's cast makes NaN of it), and every value in range is rounded to
    the nearest e4m3 value, as torch's cast does."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = torch.tensor([448.0, 449.0, 470.0, 500.0, 1e6, -1e30, -463.0, 447.9, 124.3, -0.3, 7.1, 0.02], device=device)
    out = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=device)
    _cast_kernel[(1,)](x, out, x.numel(), BLOCK=16)
    want = x.cpu().clamp(-448, 448).to(torch.float8_e4m3fn).float()
    assert torch.equal(out.cpu().float(), want), (out.cpu().float(), want)


def test_grouping_by_expert_reads_nothing_on_the_host(monkeypatch):
    """The Triton expert GEMM groups assignments by expert with device ops only (counted: no
    item / tolist / cpu), every assignment with an expert in exactly one tile of that expert."""
    ids = torch.tensor([[3, -1, 0], [3, 3, 1], [-1, 0, 5]])
    result = {}
    ops = count_step(lambda: result.update(zip(("rows", "experts"), _group_by_expert(ids, 6, 4))), monkeypatch)
    assert ops.host_reads == [] and ops.counts.get("_local_scalar_dense", 0) == 0, ops.host_reads
    rows, tile_expert = result["rows"].view(-1, 4), result["experts"]
    seen = {}
    for tile, expert in zip(rows.tolist(), tile_expert.tolist()):
        for assignment in tile:
            if assignment >= 0:
                assert expert < 6 and ids.flatten()[assignment] == expert
                seen[assignment] = seen.get(assignment, 0) + 1
    assert seen == {a: 1 for a in range(ids.numel()) if ids.flatten()[a] >= 0}


def test_scales_of_another_shape_are_refused():
    """A scale grid that is neither [ceil(N/128), ceil(K/128)] nor [N, ceil(K/128)] (e.g. one
    stored transposed) is a ValueError naming both shapes."""
    weight = torch.zeros(256, 384, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"\(256, 384\).*\(3, 2\)"):
        fp8.fp8_linear(torch.zeros(1, 384), weight, torch.ones(3, 2))


@pytest.mark.cuda
def test_fp8_ops_replay_in_a_cuda_graph(monkeypatch):
    """Captured in a CUDA graph (no host sync may happen inside), the linear GEMM (at a split-K
    decode launch shape: partials, arrival counters) and the expert GEMM replay to the eager
    results on new inputs."""
    monkeypatch.setattr(triton_fp8, "decode_plan", lambda *args: GemmConfig(16, 32, 4, 4, 3))
    gen = torch.Generator().manual_seed(0)
    weight, scales = (t.cuda() for t in random_fp8_weight(gen, n=512, k=384))
    experts, expert_scales = (t.cuda() for t in random_fp8_weight(gen, 8, n=256, k=384))
    x = torch.randn(4, 384, device="cuda", dtype=torch.bfloat16)
    ids = torch.randint(-1, 8, (4, 2), device="cuda")
    run = lambda: (fp8.fp8_linear(x, weight, scales), fp8.fp8_expert_linear(x, experts, expert_scales, ids))  # noqa: E731
    run()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = run()
    x.copy_(torch.randn(4, 384, device="cuda", dtype=torch.bfloat16))
    ids.copy_(torch.randint(-1, 8, (4, 2), device="cuda"))
    graph.replay()
    for got, want in zip(captured, run()):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.cuda
@pytest.mark.parametrize("rows", [300, 200, 130, 40, 8])
def test_scaled_mm_switch_matches_triton(rows):
    """cuBLAS block-wise scaling (the default for prefill rows on sm90, a timed candidate for 17-128
    rows, forced by ``AGENT_INFER_FP8_GEMM=scaled_mm``), the Triton kernels (``=triton``) and the
    default's choice give float64's result on
    the dequantized values within bf16 rounding, where cuBLAS applies (whole 128-blocks), also for
    a row count that is not a multiple of 4 (130: cuBLAS refused its scales unpadded); an unknown
    choice is an error naming the variable."""
    gen = torch.Generator().manual_seed(1)
    weight, scales = random_fp8_weight(gen, n=512, k=384)
    x = torch.randn(rows, 384, generator=gen).to(torch.bfloat16)
    q, s = quantize_groups(x)
    truth = dequantize(q, s) @ dequantize(weight, scales, 128).T
    for choice in ("triton", "scaled_mm", None):
        with kernels.using(fp8_gemm=choice):
            assert rel_error(fp8.fp8_linear(x.cuda(), weight.cuda(), scales.cuda()).cpu(), truth) < 1e-2, choice
    with pytest.raises(ValueError, match="AGENT_INFER_FP8_GEMM"):
        kernels.KernelSettings.from_env({"AGENT_INFER_FP8_GEMM": "cublas"})
