"""Backend selection, input validation, and the eager gate: the decode-path wrappers never
read tensor values on the host, never copy or convert inputs, and issue the same host-side
ops whatever the number of tokens (so they are CUDA-graph safe and cheap to dispatch)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

import engine.model.kernels as K
from phases.harness import HostOpRecorder
from primitives_checks import HAS_CUDA, HAS_TRITON, vllm_importable


@pytest.fixture
def env():
    """Force a CUDA backend (``KernelSettings.backend``) for one test, the settings before it
    restored after (selection is cached per value, so no reload is needed)."""
    before = K.current()
    yield lambda value: K.configure(dataclasses.replace(before, backend=value))
    K.configure(before)


def test_cpu_tensors_always_use_the_torch_reference(env):
    for forced in (None, "torch", "triton", "vllm"):
        env(forced)
        assert K.backend("cpu") == "torch"


def test_unknown_backend_name_is_a_value_error():
    with pytest.raises(ValueError, match="AGENT_INFER_KERNELS='cudnn': expected one of torch, triton, vllm"):
        K.KernelSettings.from_env({"AGENT_INFER_KERNELS": "cudnn"})
    with pytest.raises(ValueError, match="AGENT_INFER_FP8_GEMM='cublas': use 'triton' or 'scaled_mm'"):
        K.KernelSettings(fp8_gemm="cublas")


def test_the_switches_are_read_from_the_environment_once(env, monkeypatch):
    """``KernelSettings.from_env`` maps each variable (an empty value is unset); dispatch reads the
    configured settings, never the environment: a variable set afterwards changes nothing."""
    assert K.KernelSettings.from_env({}) == K.KernelSettings(None, False, None)
    assert K.KernelSettings.from_env({"AGENT_INFER_KERNELS": "torch", "AGENT_INFER_DECODE_GEMV": "1",
                                      "AGENT_INFER_FP8_GEMM": "scaled_mm"}) == \
        K.KernelSettings("torch", True, "scaled_mm")
    assert K.KernelSettings.from_env({"AGENT_INFER_KERNELS": "", "AGENT_INFER_DECODE_GEMV": "0"}) == \
        K.KernelSettings()
    env(None)
    monkeypatch.setenv("AGENT_INFER_KERNELS", "cudnn")  # would be a ValueError if dispatch read it
    assert K.backend("cpu") == "torch"
    with K.using(backend="torch", decode_gemv=True) as inside:
        assert K.current() == inside and inside.decode_gemv and inside.backend == "torch"
    assert K.current().backend is None and not K.current().decode_gemv


@pytest.mark.parametrize("forced", ["triton", "vllm"])
def test_forcing_a_backend_that_cannot_run_is_a_value_error(env, forced):
    """FM-020: a forced backend that is missing fails at selection, naming it and why."""
    runnable = HAS_CUDA and HAS_TRITON and (forced == "triton" or vllm_importable())
    if runnable:
        pytest.skip(f"{forced} can run on this machine")
    env(forced)
    with pytest.raises(ValueError, match=f"AGENT_INFER_KERNELS={forced} but that backend cannot run here"):
        K.backend("cuda")


@pytest.mark.cuda
def test_cuda_default_backend_is_triton_and_vllm_is_opt_in(env):
    """Triton is the CUDA default even where vllm imports; vllm runs only when forced."""
    env(None)
    assert K.backend("cuda") == "triton"
    if vllm_importable():
        env("vllm")
        assert K.backend("cuda") == "vllm"
    env("torch")
    assert K.backend("cuda") == "torch"


def test_public_ops_reject_mismatched_shapes():
    x = torch.randn(4, 64)
    with pytest.raises(ValueError, match="rms_norm"):
        K.rms_norm(torch.empty(4, 32), x, torch.ones(64), 1e-6)
    with pytest.raises(ValueError, match="fused_add_rms_norm"):
        K.fused_add_rms_norm(x, torch.randn(4, 64), torch.ones(32), 1e-6)
    with pytest.raises(ValueError, match="silu_and_mul"):
        K.silu_and_mul(torch.empty(4, 64), x)
    cache, _ = K.get_cos_sin_cache(16, 64, 1e4)
    with pytest.raises(ValueError, match="rotary"):
        K.rotary_embedding(torch.arange(4), x, None, 32, cache, True)
    with pytest.raises(ValueError, match="store_kv_cache"):
        K.store_kv_cache(x, x, torch.empty(2, 16, 1, 64), None, torch.arange(4))
    with pytest.raises(ValueError, match="varlen_attention"):
        q, kv = torch.randn(4, 3, 64), torch.randn(4, 2, 64)
        K.varlen_attention(q, kv, kv, torch.tensor([0, 4]), torch.tensor([0, 4]), 4, 4, 0.1)
    with pytest.raises(ValueError, match="v_head_dim"):
        K.paged_decode_attention(torch.randn(1, 2, 64), torch.randn(2, 16, 1, 64), None,
                                 torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32), 0.1)


# Host-side aten ops a decode-path wrapper may issue: allocating outputs and taking views.
ALLOWED_HOST_OPS = {"empty", "empty_strided", "new_empty", "view", "slice", "alias", "as_strided", "select",
                    "unsqueeze", "squeeze", "expand"}


def decode_path_calls(tokens: int, device: str, dtype: torch.dtype):
    """One call of each decode-path op for ``tokens`` tokens (= sequences for attention)."""
    hidden, heads, kv_heads, head_dim, block_size = 256, 4, 2, 64, 16
    rand = lambda *shape: torch.randn(*shape, device=device).to(dtype)  # noqa: E731
    x, residual, weight = rand(tokens, hidden), rand(tokens, hidden), 1 + 0.1 * rand(hidden)
    qkv = rand(tokens, (heads + 2 * kv_heads) * head_dim)
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim: (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    v = qkv[:, (heads + kv_heads) * head_dim:].view(tokens, kv_heads, head_dim)
    cache, _ = K.get_cos_sin_cache(64, head_dim, 1e4, dtype=dtype, device=device)
    positions = torch.randint(0, 64, (tokens,), device=device)
    k_cache = rand(tokens + 1, block_size, kv_heads, head_dim)
    v_cache = rand(tokens + 1, block_size, kv_heads, head_dim)
    slots = torch.arange(tokens, device=device) * block_size + 3
    tables = torch.arange(tokens, device=device, dtype=torch.int32)[:, None]
    lens = torch.full((tokens,), 4, dtype=torch.int32, device=device)
    cu = torch.arange(tokens + 1, device=device, dtype=torch.int32)
    normed, activated = torch.empty_like(x), torch.empty(tokens, hidden // 2, device=device, dtype=dtype)
    experts, expert_ids = rand(3, 48, hidden), (torch.arange(2 * tokens, device=device) % 3).view(tokens, 2)
    return {
        "rms_norm": lambda: K.rms_norm(normed, x, weight, 1e-6),
        "fused_add_rms_norm": lambda: K.fused_add_rms_norm(x, residual, weight, 1e-6),
        "silu_and_mul": lambda: K.silu_and_mul(activated, x),
        "rotary_embedding": lambda: K.rotary_embedding(positions, q, k, head_size=head_dim, cos_sin_cache=cache,
                                                       is_neox=True),
        "store_kv_cache": lambda: K.store_kv_cache(k, v, k_cache, v_cache, slots),
        "paged_decode_attention": lambda: K.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.125),
        "varlen_attention": lambda: K.varlen_attention(q, k, v, cu, cu, 1, 1, 0.125),
        "expert_gemv": lambda: K.expert_gemv(x, experts, expert_ids),
        "decode_gemv": lambda: K.decode_gemv(x, experts[0][:, :hidden // 2], weight[:48], "silu_mul"),
        "qk_norm_rope_store": lambda: K.qk_norm_rope_store(positions, q, k, v, weight[:head_dim], weight[:head_dim],
                                                           1e-6, cache, k_cache, v_cache, slots),
    }


DEVICES = [pytest.param("cpu", id="triton-interpret",
                        marks=pytest.mark.skipif(HAS_CUDA or not HAS_TRITON, reason="interpreter runs without a GPU")),
           pytest.param("cuda", id="cuda", marks=pytest.mark.cuda)]


@pytest.mark.parametrize("device", DEVICES)
def test_wrappers_do_no_host_sync_copy_or_per_token_work(device, monkeypatch):
    """Eager gate: on the CUDA backend (Triton here, run by the interpreter without a GPU) every op issues
    only allocations and views on the host (no .item()/.tolist()/.to()/copies), the same ones for 1 and
    5 tokens. varlen_attention is prefill-only: it may send one sequence to cuDNN's attention (other
host ops, chosen by shape), never sync.
    decode_gemv's launch shape is measured per row count on CUDA (a choice, not per-token work):
    pinned here to a split-K one, which also allocates the partial sums."""
    from engine.model.kernels.triton import gemv

    split_k = next(config for config in gemv.CANDIDATES if config.split_k > 1)
    monkeypatch.setattr(gemv, "plan", lambda *args: split_k)
    if device == "cpu":
        monkeypatch.setattr(K, "_select", lambda device_type, forced: "triton")
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    small, large = decode_path_calls(1, device, dtype), decode_path_calls(5, device, dtype)
    for name in small:
        small[name](), large[name]()  # warm-up: compile, build caches
        recorded = []
        for calls in (small, large):
            with HostOpRecorder() as recorder:
                calls[name]()
            recorded.append(recorder.ops)
        syncs = {"_local_scalar_dense", "item", "nonzero", "masked_select", "_to_copy", "to"} & set(recorded[1])
        assert not syncs, f"{name} reads tensor values on the host or converts inputs: {syncs}"
        if name != "varlen_attention":
            assert set(recorded[1]) <= ALLOWED_HOST_OPS, f"{name} issues {set(recorded[1]) - ALLOWED_HOST_OPS}"
        if name != "varlen_attention":  # one sequence (the 1-token call) goes to cuDNN, five to Triton
            assert recorded[0] == recorded[1], f"{name}: host ops depend on the token count: {recorded}"
