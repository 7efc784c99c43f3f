"""Whole-model logits under tensor parallelism (torchrun: gloo on the CPU, NCCL on
``cuda:LOCAL_RANK`` with ``GATES_TORCHRUN_DEVICE=cuda``) against HF transformers
(float32, on the CPU): every rank must produce the full, correct logits."""
import pytest
import torch
import transformers

from engine.kv_cache import bind_kv_cache
from phases.assertions import assert_steps_close
from phases.harness import all_logits_step, load_engine_model, num_blocks_for, run_paged

pytestmark = pytest.mark.torchrun


@pytest.mark.parametrize("arch", ["Qwen3ForCausalLM", "Qwen2ForCausalLM"])
def test_tp_logits_match_hf(tp_group, tp_device, tiny_checkpoint, arch):
    model_dir = tiny_checkpoint(arch, seed=6, sharded=True)
    model = load_engine_model(model_dir, tp=tp_group, device=tp_device, dtype=torch.float32)
    block_size, prompt_lens = 16, [6, 17, 1]
    gen = torch.Generator().manual_seed(0)
    sequences = [torch.randint(0, model.config.vocab_size, (n + 8,), generator=gen) for n in prompt_lens]
    bind_kv_cache(model, num_blocks_for(map(len, sequences), block_size), block_size, torch.float32, tp_device)
    with torch.no_grad():
        got = run_paged(all_logits_step(model), [s.to(tp_device) for s in sequences], prompt_lens, block_size)
        hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        want = [hf(ids[None]).logits[0] for ids in sequences]
    for i, (g, w, n) in enumerate(zip(got, want, prompt_lens)):
        assert_steps_close(g, w, n, 1e-4, "logits", f"rank {tp_group.rank} of {tp_group.size}, sequence {i} of {arch}")
