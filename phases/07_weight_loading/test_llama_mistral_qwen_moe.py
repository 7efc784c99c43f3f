"""Llama 3.1 / 3.2, Mistral, Qwen3-MoE and Qwen2-MoE from tiny random checkpoints (transformers'
own save_pretrained, every weight random) against transformers' logits: a ragged paged prefill,
the same prompts prefilled over a cached prefix, and decode steps; positions run past the tiny
Llama's 64-token original context, so all three bands of its llama3 RoPE scaling matter. The MoE
layers sit where mlp_only_layers / decoder_sparse_step put them; a sliding window is run only
where it can never bind; broken MoE checkpoints are errors naming the key."""
import pytest
import torch
import transformers

from engine.model.layers.moe import GatedSharedExpertMoE, MoE
from engine.worker.kv_cache import bind_kv_cache
from phases.assertions import assert_steps_close
from phases.harness import all_logits_step, load_engine_model, num_blocks_for, run_paged
from test_loader import rewrite

VARIANTS = {
    "llama3.1": ("LlamaForCausalLM", {}),
    "llama3.2-tied": ("LlamaForCausalLM", dict(tie_word_embeddings=True)),
    "mistral": ("MistralForCausalLM", {}),
    "qwen3-moe": ("Qwen3MoeForCausalLM", {}),
    "qwen2-moe": ("Qwen2MoeForCausalLM", {}),
}
# 113 prompt tokens (MoE: the grouped expert path), then decode batches of 4, 3 and 2 (dense and
# gathered paths); the longest reaches position 82 of a 64-token original context
PROMPT_LENS, DECODE_LENS, CACHED_LENS = [6, 72, 2, 33], [9, 11, 4, 6], [3, 40, 1, 16]


def hf_logits(model_dir, sequences):
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return [hf(ids[None]).logits[0] for ids in sequences]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_hf_through_prefill_prefix_hit_and_decode(tiny_checkpoint, variant):
    arch, overrides = VARIANTS[variant]
    model_dir = tiny_checkpoint(arch, seed=21, **overrides)
    model = load_engine_model(model_dir)
    gen = torch.Generator().manual_seed(0)
    sequences = [torch.randint(0, model.config.vocab_size, (n + d,), generator=gen)
                 for n, d in zip(PROMPT_LENS, DECODE_LENS)]
    bind_kv_cache(model, num_blocks_for(map(len, sequences), 16), 16, torch.float32, "cpu")
    want = hf_logits(model_dir, sequences)
    for cached in (None, CACHED_LENS):
        with torch.no_grad():
            got = run_paged(all_logits_step(model), sequences, PROMPT_LENS, 16, cached_lens=cached)
        for i, (g, w, n) in enumerate(zip(got, want, PROMPT_LENS)):
            assert_steps_close(g, w, n, 1e-4, "logits", f"sequence {i} of {variant}, "
                               f"{'prefix of ' + str(cached[i]) + ' cached' if cached else 'one prefill'}")


@pytest.mark.parametrize("arch", ["Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM"])
def test_moe_layers_are_where_transformers_puts_them(tiny_checkpoint, arch):
    """FM-052: layer by layer, the MLP is dense exactly where transformers' model has a dense MLP
    (the tiny Qwen3-MoE lists layer 0 in mlp_only_layers; the tiny Qwen2-MoE's
    decoder_sparse_step 2 makes layers 1 and 3 sparse), and Qwen2-MoE's sparse blocks carry the
    gated shared expert."""
    model_dir = tiny_checkpoint(arch, seed=22)
    ours = load_engine_model(model_dir)
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    want = [("gated" if hasattr(layer.mlp, "shared_expert_gate") else "moe") if hasattr(layer.mlp, "experts")
            else "dense" for layer in hf.model.layers]
    got = [{GatedSharedExpertMoE: "gated", MoE: "moe"}.get(type(layer.mlp), "dense") for layer in ours.model.layers]
    assert got == want
    assert "dense" in want and len(set(want)) == 2


def test_mistral_sliding_window_runs_only_where_it_never_binds(tiny_checkpoint):
    """FM-053: a window shorter than the context is refused when the model is built; one that covers
    max_position_embeddings changes nothing, and transformers' logits (window applied) agree."""
    with pytest.raises(ValueError, match="sliding_window = 16 .*not implemented"):
        load_engine_model(tiny_checkpoint("MistralForCausalLM", seed=23, sliding_window=16))
    model_dir = tiny_checkpoint("MistralForCausalLM", seed=23, sliding_window=1024)
    model = load_engine_model(model_dir)
    sequence = torch.randint(0, model.config.vocab_size, (40,), generator=torch.Generator().manual_seed(1))
    bind_kv_cache(model, 3, 16, torch.float32, "cpu")
    with torch.no_grad():
        got = run_paged(all_logits_step(model), [sequence], [30], 16)[0]
    assert_steps_close(got, hf_logits(model_dir, [sequence])[0], 30, 1e-4, "logits", "window 1024")


@pytest.mark.parametrize("arch,edit,message", [
    ("Qwen2MoeForCausalLM", lambda s: s.pop("model.layers.1.mlp.shared_expert_gate.weight"),
     r"model\.layers\.1\.mlp\.shared_expert_gate\.weight"),
    ("Qwen2MoeForCausalLM", lambda s: s.pop("model.layers.3.mlp.shared_expert.up_proj.weight"),
     r"model\.layers\.3\.mlp\.shared_expert\.gate_up_proj\.weight.*1"),
    ("Qwen2MoeForCausalLM", lambda s: s.pop("model.layers.2.mlp.down_proj.weight"),
     r"model\.layers\.2\.mlp\.down_proj\.weight"),
    ("Qwen3MoeForCausalLM", lambda s: s.pop("model.layers.2.mlp.gate.weight"), r"model\.layers\.2\.mlp\.gate\.weight"),
    ("Qwen3MoeForCausalLM", lambda s: s.pop("model.layers.1.mlp.experts.7.down_proj.weight"),
     r"model\.layers\.1\.mlp\.experts\.down_proj.*\(7, 0\)"),
    ("Qwen3MoeForCausalLM", lambda s: s.__setitem__("model.layers.0.mlp.experts.0.gate_proj.weight",
                                                    torch.zeros(32, 64)),
     r"model\.layers\.0\.mlp\.experts\.0\.gate_proj\.weight.*matches no model parameter"),
])
def test_broken_qwen_moe_checkpoints_are_clear_errors(tiny_checkpoint, arch, edit, message):
    """Strict loading: a missing shared-expert gate, shared-expert half, dense MLP, router or expert,
    or expert tensors for a dense layer, is an error naming the key."""
    model_dir = tiny_checkpoint(arch, seed=24)
    rewrite(model_dir, edit)
    with pytest.raises(ValueError, match=message):
        load_engine_model(model_dir)
