"""Eager-gate rules measured at run time over whole-model steps."""
import pytest
import torch

from engine.model.attention_context import forward_context
from engine.worker.kv_cache import bind_kv_cache
from phases.harness import (
    OpCounter,
    assert_no_host_sync_and_no_copies,
    count_step,
    decode_context,
    load_engine_model,
    prefill_context,
)


def model_and_prefill(tiny_checkpoint, arch="Qwen3ForCausalLM"):
    model = load_engine_model(tiny_checkpoint(arch, seed=11))
    bind_kv_cache(model, 4, 16, torch.float32, "cpu")
    positions, ctx = prefill_context([7, 3], [0, 0], [[0], [1]], 16, "cpu")
    with forward_context(ctx), torch.no_grad():
        model(torch.arange(2, 12), positions)
    return model


def count_decode_ops(model, monkeypatch) -> OpCounter:
    """What one decode step does (inputs and context built before)."""
    positions, ctx = decode_context([8, 4], [[0], [1]], 16, "cpu")
    ids = torch.tensor([5, 6])
    with forward_context(ctx):
        return count_step(lambda: model.compute_logits(model(ids, positions)), monkeypatch)


@pytest.mark.parametrize("arch", ["Qwen3ForCausalLM", "LlamaForCausalLM", "Qwen3MoeForCausalLM",
                                  "Qwen2MoeForCausalLM"])
def test_decode_step_has_no_host_sync_and_no_clone(tiny_checkpoint, monkeypatch, arch):
    """No host read of a device value anywhere in a decode step (kernels included),
    and no clone or dtype/device copy in the model's own code; the Qwen MoE models' routed
    experts, dense layers and gated shared expert included (what a CUDA graph captures)."""
    assert_no_host_sync_and_no_copies(count_decode_ops(model_and_prefill(tiny_checkpoint, arch), monkeypatch))


def test_one_gemm_each_for_qkv_o_gate_up_and_down(tiny_checkpoint, monkeypatch):
    """Per layer exactly four GEMMs (merged QKV, o_proj, merged gate-up,
    down_proj), plus one for the LM head."""
    model = model_and_prefill(tiny_checkpoint)
    counts = count_decode_ops(model, monkeypatch).model_ops
    assert counts.get("mm", 0) + counts.get("addmm", 0) == 4 * model.config.num_hidden_layers + 1, counts
