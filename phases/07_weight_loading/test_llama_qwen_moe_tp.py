"""Llama, Qwen3-MoE and Qwen2-MoE under tensor parallelism, the MoE models' routed experts
expert-parallel over the same ranks (torchrun: gloo on the CPU, NCCL on
``cuda:LOCAL_RANK`` with ``GATES_TORCHRUN_DEVICE=cuda``), against transformers (float32, CPU):
every rank's logits equal transformers' (so TP = 1's) while each holds only its E / ep experts.
Mistral is Llama's code with another config (its GQA replication under TP is Qwen3's, tested)."""
import pytest
import torch
import transformers

from engine.kv_cache import bind_kv_cache
from engine.layers.moe import MoE
from phases.assertions import assert_steps_close
from phases.harness import all_logits_step, load_engine_model, num_blocks_for, run_paged

pytestmark = pytest.mark.torchrun


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM"])
def test_tp_ep_logits_match_hf(tp_group, tp_device, tiny_checkpoint, arch):
    model_dir = tiny_checkpoint(arch, seed=25, sharded=True)
    model = load_engine_model(model_dir, tp=tp_group, device=tp_device, dtype=torch.float32)
    for layer in model.model.layers:
        if isinstance(layer.mlp, MoE):
            routed = layer.mlp.experts
            assert routed.gate_up_proj.shape[0] == routed.num_experts // tp_group.size
            assert routed.expert_start == tp_group.rank * routed.gate_up_proj.shape[0]
    block_size, prompt_lens = 16, [6, 70, 1]  # 77 prompt tokens: the grouped expert path; positions past 64
    gen = torch.Generator().manual_seed(0)
    sequences = [torch.randint(0, model.config.vocab_size, (n + 8,), generator=gen) for n in prompt_lens]
    bind_kv_cache(model, num_blocks_for(map(len, sequences), block_size), block_size, torch.float32, tp_device)
    with torch.no_grad():
        got = run_paged(all_logits_step(model), [s.to(tp_device) for s in sequences], prompt_lens, block_size)
        hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        want = [hf(ids[None]).logits[0] for ids in sequences]
    for i, (g, w, n) in enumerate(zip(got, want, prompt_lens)):
        assert_steps_close(g, w, n, 1e-4, "logits", f"rank {tp_group.rank} of {tp_group.size}, sequence {i} of {arch}")
