"""Safetensors loading: single and sharded files, every tensor consumed and
every parameter filled, clear errors, lazy per-rank reads."""

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.distributed import TPGroup
from engine.model import loader
from engine.model.config import ModelConfig
from engine.model.loader import load_checkpoint
from engine.model.models.registry import build_model
from phases.harness import load_engine_model


def checkpoint_state(model_dir):
    """Every tensor of a checkpoint, read straight from its files."""
    state = {}
    for f in loader.checkpoint_files(model_dir):
        state.update(load_file(f))
    return state


def expected_parameters(state, config):
    """What our parameters must hold at tp = 1, computed from the raw tensors."""
    want = {}
    for name, t in state.items():
        for a, b in (("q_proj", "qkv_proj"), ("gate_proj", "gate_up_proj")):
            if f".{a}." in name:
                parts = [state[name.replace(a, x)] for x in
                         (("q_proj", "k_proj", "v_proj") if a == "q_proj" else ("gate_proj", "up_proj"))]
                want[name.replace(a, b)] = torch.cat(parts)
        if not any(f".{x}." in name for x in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")):
            want[name] = t
    if config.tie_word_embeddings:
        want["lm_head.weight"] = state["model.embed_tokens.weight"]
    return want


@pytest.mark.parametrize("arch", ["Qwen3ForCausalLM", "Qwen2ForCausalLM", "LlamaForCausalLM", "MistralForCausalLM"])
@pytest.mark.parametrize("sharded", [False, True])
def test_every_parameter_holds_its_checkpoint_tensor(tiny_checkpoint, arch, sharded):
    model_dir = tiny_checkpoint(arch, seed=7, sharded=sharded)
    if sharded:
        assert len(loader.checkpoint_files(model_dir)) > 1
    model = load_engine_model(model_dir)
    want = expected_parameters(checkpoint_state(model_dir), model.config)
    got = dict(model.named_parameters(remove_duplicate=False))
    assert set(got) == set(want)
    for name, p in got.items():
        assert torch.equal(p.detach(), want[name]), name


def rewrite(model_dir, edit):
    """Apply edit(state) to a single-file checkpoint in place."""
    path = model_dir / "model.safetensors"
    state = load_file(path)
    edit(state)
    save_file(state, path, metadata={"format": "pt"})


@pytest.mark.parametrize("edit,message", [
    (lambda s: s.pop("model.layers.1.self_attn.k_proj.weight"), r"model\.layers\.1\.self_attn\.qkv_proj\.weight.*k"),
    (lambda s: s.pop("model.layers.0.self_attn.q_norm.weight"), r"model\.layers\.0\.self_attn\.q_norm\.weight"),
    (lambda s: s.__setitem__("model.layers.0.mlp.extra.weight", torch.zeros(3)),
     r"model\.layers\.0\.mlp\.extra\.weight"),
    (lambda s: s.__setitem__("model.layers.0.mlp.down_proj.weight", torch.zeros(64, 95)),
     r"model\.layers\.0\.mlp\.down_proj\.weight.*95"),
    (lambda s: s.__setitem__("model.norm.weight", torch.zeros(65)), r"model\.norm\.weight.*65"),
])
def test_broken_checkpoints_are_clear_errors(tiny_checkpoint, edit, message):
    model_dir = tiny_checkpoint("Qwen3ForCausalLM", seed=8)
    rewrite(model_dir, edit)
    with pytest.raises(ValueError, match=message):
        load_engine_model(model_dir)


def test_missing_weights_file_is_a_clear_error(tiny_checkpoint):
    model_dir = tiny_checkpoint("Qwen3ForCausalLM", seed=8)
    (model_dir / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_engine_model(model_dir)


def test_q_norm_and_k_norm_are_really_loaded(tiny_checkpoint):
    """Perturbing only q_norm/k_norm in the checkpoint must change the logits
    (the seed's silent garbage-output bug when they are not mapped)."""
    model_dir = tiny_checkpoint("Qwen3ForCausalLM", seed=9)
    from engine.worker.kv_cache import bind_kv_cache
    from phases.harness import all_logits_step, run_paged

    def logits():
        model = load_engine_model(model_dir)
        bind_kv_cache(model, 1, 16, torch.float32, "cpu")
        with torch.no_grad():
            return run_paged(all_logits_step(model), [torch.arange(2, 12)], [10], 16)[0]

    before = logits()
    for which in ("q_norm", "k_norm"):
        rewrite(model_dir, lambda s: s[f"model.layers.0.self_attn.{which}.weight"].mul_(1.5))
        after = logits()
        assert (after - before).abs().max() > 1e-3, which
        before = after


@pytest.mark.parametrize("size", [2, 4])
def test_a_rank_reads_and_holds_only_its_shard(tiny_checkpoint, monkeypatch, size):
    """Built as rank r of n in one process: parameter bytes and bytes read from
    disk are about 1/n of the model (only norms are replicated)."""
    model_dir = tiny_checkpoint("Qwen3ForCausalLM", seed=10, num_key_value_heads=4)
    read = []
    for method in ("__getitem__", "materialize"):
        real = getattr(loader.LazyTensor, method)

        def recording(self, *args, _real=real):
            out = _real(self, *args)
            read.append(out)
            return out
        monkeypatch.setattr(loader.LazyTensor, method, recording)
    config = ModelConfig.from_model_dir(model_dir)
    full = sum(t.numel() for t in checkpoint_state(model_dir).values())
    for rank in range(size):
        read.clear()
        model = build_model(config, "cpu", tp=TPGroup(rank=rank, size=size))
        load_checkpoint(model, model_dir, progress=False)
        held = sum(p.numel() for p in model.parameters())
        assert full / size <= held <= 1.1 * full / size
        assert 0.9 * full / size <= sum(t.numel() for t in read) <= 1.1 * full / size


def test_tied_head_present_in_the_checkpoint_must_equal_the_embedding(tiny_checkpoint):
    """Qwen2 tiny ties lm_head to the embedding. A checkpoint that also stores
    lm_head.weight loads when it is the same tensor and is an error when not."""
    model_dir = tiny_checkpoint("Qwen2ForCausalLM", seed=12)
    rewrite(model_dir, lambda s: s.__setitem__("lm_head.weight", s["model.embed_tokens.weight"].clone()))
    model = load_engine_model(model_dir)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    rewrite(model_dir, lambda s: s["lm_head.weight"].add_(0.5))
    with pytest.raises(ValueError, match=r"(lm_head|embed_tokens)\.weight.*differs from.*(embed_tokens|lm_head)"):
        load_engine_model(model_dir)
