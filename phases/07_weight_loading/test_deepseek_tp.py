"""DeepSeek under tensor + expert parallelism (torchrun: gloo on the CPU, NCCL on
``cuda:LOCAL_RANK`` with ``GATES_TORCHRUN_DEVICE=cuda``) against HF transformers (float32, CPU):
every rank produces the full, correct logits while holding and reading only its own
experts; the expert-parallel group's all-reduce sums over its ranks."""
import pytest
import torch
import transformers

from engine.distributed import all_reduce_sum, get_ep_group
from engine.worker.kv_cache import bind_kv_cache
from phases.checkpoints import V2_LITE
from phases.harness import all_logits_step, num_blocks_for, rel_err, run_paged
from test_deepseek_model import load_deepseek

pytestmark = pytest.mark.torchrun

VARIANTS = {"V2": ("DeepseekV2ForCausalLM", {}), "V2-Lite": ("DeepseekV2ForCausalLM", V2_LITE),
            "V3": ("DeepseekV3ForCausalLM", {})}


def test_ep_group_spans_the_tp_ranks_and_all_reduce_sums_over_it(tp_group, tp_device):
    ep = get_ep_group()
    assert (ep.rank, ep.size, ep.name) == (tp_group.rank, tp_group.size, "ep")
    x = torch.full((3, 4), float(ep.rank + 1), device=tp_device)
    torch.testing.assert_close(all_reduce_sum(x, "ep").cpu(), torch.full((3, 4), ep.size * (ep.size + 1) / 2))


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_deepseek_tp_ep_logits_match_hf(tp_group, tp_device, tiny_checkpoint, variant):
    arch, overrides = VARIANTS[variant]
    model_dir = tiny_checkpoint(arch, seed=7, sharded=True, **overrides)
    model = load_deepseek(model_dir, tp=tp_group, device=tp_device)
    experts = model.deepseek.n_routed_experts
    local = experts // tp_group.size
    for layer in model.model.layers[1:]:
        routed = layer.mlp.experts
        assert routed.gate_up_proj.shape[0] == routed.down_proj.shape[0] == local
        assert routed.expert_start == tp_group.rank * local
    block_size, prompt_lens = 16, [6, 70, 1]
    gen = torch.Generator().manual_seed(0)
    sequences = [torch.randint(0, model.config.vocab_size, (n + 8,), generator=gen) for n in prompt_lens]
    bind_kv_cache(model, num_blocks_for(map(len, sequences), block_size), block_size, torch.float32, tp_device)
    with torch.no_grad():
        got = run_paged(all_logits_step(model), [s.to(tp_device) for s in sequences], prompt_lens, block_size)
        hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        want = [hf(ids[None]).logits[0] for ids in sequences]
    for g, w in zip(got, want):
        assert rel_err(g.cpu(), w) < 1e-4
