"""Whole-model logits under tensor parallelism (torchrun: gloo on the CPU, NCCL on
``cuda:LOCAL_RANK`` with ``GATES_TORCHRUN_DEVICE=cuda``) against HF transformers
(float32, on the CPU): every rank must produce the full, correct logits. Qwen2/Qwen3, Llama
(Mistral is the same code with another config), and the Qwen MoE models, whose routed experts
are expert-parallel over the same ranks: each rank holds only its E / ep experts."""
import pytest
import torch
import transformers

from engine.model.layers.moe import MoE
from engine.worker.kv_cache import bind_kv_cache
from phases.assertions import assert_steps_close
from phases.harness import all_logits_step, load_engine_model, num_blocks_for, run_paged

pytestmark = pytest.mark.torchrun


@pytest.mark.parametrize("arch", ["Qwen3ForCausalLM", "Qwen2ForCausalLM", "LlamaForCausalLM", "Qwen3MoeForCausalLM",
                                  "Qwen2MoeForCausalLM"])
def test_tp_logits_match_hf(tp_group, tp_device, tiny_checkpoint, arch):
    model_dir = tiny_checkpoint(arch, seed=6, sharded=True)
    model = load_engine_model(model_dir, tp=tp_group, device=tp_device, dtype=torch.float32)
    for layer in model.model.layers:
        if isinstance(layer.mlp, MoE):
            routed = layer.mlp.experts
            assert routed.gate_up_proj.shape[0] == routed.num_experts // tp_group.size
            assert routed.expert_start == tp_group.rank * routed.gate_up_proj.shape[0]
    block_size, prompt_lens = 16, [6, 70, 1]  # 77 prompt tokens: MoE's grouped path; Llama past its original 64
    gen = torch.Generator().manual_seed(0)
    sequences = [torch.randint(0, model.config.vocab_size, (n + 8,), generator=gen) for n in prompt_lens]
    bind_kv_cache(model, num_blocks_for(map(len, sequences), block_size), block_size, torch.float32, tp_device)
    with torch.no_grad():
        got = run_paged(all_logits_step(model), [s.to(tp_device) for s in sequences], prompt_lens, block_size)
        hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        want = [hf(ids[None]).logits[0] for ids in sequences]
    for i, (g, w, n) in enumerate(zip(got, want, prompt_lens)):
        assert_steps_close(g, w, n, 1e-4, "logits", f"rank {tp_group.rank} of {tp_group.size}, sequence {i} of {arch}")
