"""The decode-step fusions behind the kernel interface, wired into the models: switched on, a
tiny Qwen3's and a tiny V2-Lite's decode logits equal those of the unfused path (which the
earlier phases check against transformers), and the launches they fuse are gone from the step.

The decode GEMV is a CUDA path (a layer built on CUDA with ``AGENT_INFER_DECODE_GEMV=1`` holds
``decode_gemv_rows = 8``, ``kernels.decode_gemv_rows``); here the CPU model's layers are given it,
so they hand their rows to ``kernels.decode_gemv`` on the torch reference backend: this checks the wiring (which
weight, which activation, which dtype); phase 01 checks the kernels against float64.
"""
from __future__ import annotations

import pytest
import torch

from engine.model import kernels
from engine.model.layers.moe import MoE
from engine.worker.kv_cache import bind_kv_cache
from phases.checkpoints import V2_LITE, make_tiny_checkpoint
from phases.harness import all_logits_step, load_engine_model, rel_err, run_paged

BLOCK = 16
DECODE_STEPS = 7  # sequences of 13 and 9 tokens after prompts of 6 and 5: 4 steps of 2 rows, 3 of 1
MODELS = {"qwen3": ("Qwen3ForCausalLM", {}),
          "deepseek-v2-lite": ("DeepseekV2ForCausalLM", {**V2_LITE, "n_routed_experts": 8, "num_experts_per_tok": 2})}


@pytest.fixture(scope="module", params=list(MODELS))
def model(request, tmp_path_factory):
    arch, overrides = MODELS[request.param]
    path = make_tiny_checkpoint(tmp_path_factory.mktemp(request.param), arch, seed=3, **overrides)
    model = load_engine_model(path)
    bind_kv_cache(model, num_blocks=16, block_size=BLOCK, dtype=torch.float32, device="cpu")
    return model


def decode_logits(model, seed: int = 0) -> list[torch.Tensor]:
    """Logits of two sequences: a ragged prefill, then decode steps of 2 and then 1 row."""
    gen = torch.Generator().manual_seed(seed)
    inputs = [torch.randint(0, model.config.vocab_size, (n,), generator=gen) for n in (13, 9)]
    with torch.no_grad():
        return run_paged(all_logits_step(model), inputs, [6, 5], BLOCK)


def test_decode_gemv_gives_the_unfused_logits_and_launches_no_activation(model, monkeypatch):
    """Every dense linear of a decode step (and MoE's router, float32 from the rows as they are)
    goes through decode_gemv, the SwiGLU MLPs' down projections read gate | up with the
    SiLU-and-mul in the GEMV (no silu_and_mul call at decode), and the logits are the unfused ones."""
    unfused = decode_logits(model)
    gemv_calls, silu_calls = [], []
    real_gemv, real_silu = kernels.decode_gemv, kernels.silu_and_mul
    for module in model.modules():
        if hasattr(module, "decode_gemv_rows"):
            monkeypatch.setattr(module, "decode_gemv_rows", kernels.DECODE_GEMV_MAX_ROWS)
    monkeypatch.setattr(kernels, "decode_gemv",
                        lambda x, w, bias=None, activation=None: gemv_calls.append((x.shape[0], activation))
                        or real_gemv(x, w, bias, activation))
    monkeypatch.setattr(kernels, "silu_and_mul", lambda out, x: silu_calls.append(x.shape[0]) or real_silu(out, x))
    fused = decode_logits(model)
    for ours, truth in zip(fused, unfused):
        assert rel_err(ours, truth) < 1e-5
    assert {rows for rows, _ in gemv_calls} == {1, 2} and ("silu_mul" in {act for _, act in gemv_calls})
    moe_layers = sum(isinstance(m, MoE) for m in model.modules())
    decode_silu = [rows for rows in silu_calls if rows <= 2]  # the prefill's 11 rows aside
    assert len(decode_silu) == DECODE_STEPS * moe_layers, silu_calls  # only the routed experts' own activation
