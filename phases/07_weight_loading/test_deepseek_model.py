"""DeepSeek-V2 / V2-Lite / V3 whole model from tiny random checkpoints (published
per-expert tensor names, as transformers saves them) against HF transformers' logits
through a ragged prefill and decode steps over the latent paged cache; config read in
both forms; the loader's expert mapping (another rank's experts skipped unread, every
other key strict); and a decode step with no host sync."""
import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from engine.distributed import TPGroup
from engine.model import loader
from engine.model.config import ModelConfig
from engine.model.loader import load_checkpoint
from engine.model.models.deepseek_v2 import DeepseekV2ForCausalLM
from engine.model.models.registry import creating_in
from engine.worker.kv_cache import bind_kv_cache, kv_bytes_per_token
from phases.checkpoints import V2_LITE
from phases.harness import (
    all_logits_step,
    assert_no_host_sync_and_no_copies,
    decode_step_ops,
    num_blocks_for,
    rel_err,
    run_paged,
)

VARIANTS = {"V2": ("DeepseekV2ForCausalLM", {}), "V2-Lite": ("DeepseekV2ForCausalLM", V2_LITE),
            "V3": ("DeepseekV3ForCausalLM", {})}


def load_deepseek(model_dir, tp=None, ep=None, dtype=torch.float32, device="cpu"):
    config = ModelConfig.from_model_dir(model_dir)
    with creating_in(dtype, device):
        model = DeepseekV2ForCausalLM(config, tp, ep)
    load_checkpoint(model, model_dir, progress=False)
    return model


def make_checkpoint(tiny_checkpoint, variant, seed, **extra):
    arch, overrides = VARIANTS[variant]
    return tiny_checkpoint(arch, seed=seed, **{**overrides, **extra})


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("block_size", [16, 256])
def test_deepseek_logits_match_hf_through_prefill_and_decode(tiny_checkpoint, variant, block_size):
    model_dir = make_checkpoint(tiny_checkpoint, variant, seed=1)
    model = load_deepseek(model_dir)
    prompt_lens = [6, 17, 1, 60]  # prefill of 84 tokens takes the grouped expert path; decode the dense, then gathered
    gen = torch.Generator().manual_seed(0)
    sequences = [torch.randint(0, model.config.vocab_size, (n + d,), generator=gen)
                 for n, d in zip(prompt_lens, [9, 8, 12, 10])]
    bind_kv_cache(model, num_blocks_for(map(len, sequences), block_size), block_size, torch.float32, "cpu")
    with torch.no_grad():
        got = run_paged(all_logits_step(model), sequences, prompt_lens, block_size)
        hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        want = [hf(ids[None]).logits[0] for ids in sequences]
    for g, w in zip(got, want):
        assert g.shape == w.shape
        assert rel_err(g, w) < 1e-4


def test_deepseek_layers_are_dense_then_moe_and_cache_one_latent(tiny_checkpoint):
    from engine.model.layers.moe import MoE

    model = load_deepseek(make_checkpoint(tiny_checkpoint, "V2", seed=2))
    ds = model.deepseek
    kinds = [isinstance(layer.mlp, MoE) for layer in model.model.layers]
    assert kinds == [False] + [True] * (model.config.num_hidden_layers - 1)
    width = ds.kv_lora_rank + ds.qk_rope_head_dim
    assert kv_bytes_per_token(model, torch.bfloat16) == model.config.num_hidden_layers * width * 2


def rewrite(model_dir, edit):
    path = model_dir / "model.safetensors"
    state = load_file(path)
    edit(state)
    save_file(state, path, metadata={"format": "pt"})


@pytest.mark.parametrize("edit,message", [
    (lambda s: s.pop("model.layers.1.mlp.experts.5.up_proj.weight"),
     r"model\.layers\.1\.mlp\.experts\.gate_up_proj.*\(5, 1\)"),
    (lambda s: s.__setitem__("model.layers.1.mlp.experts.8.down_proj.weight", torch.zeros(64, 32)),
     r"model\.layers\.1\.mlp\.experts\.8\.down_proj\.weight.*expert 8 does not exist"),
    (lambda s: s.__setitem__("model.layers.1.mlp.experts.2.down_proj.weight", torch.zeros(32, 64)),
     r"model\.layers\.1\.mlp\.experts\.2\.down_proj\.weight.*does not match"),
    (lambda s: s.pop("model.layers.2.mlp.gate.e_score_correction_bias"),
     r"model\.layers\.2\.mlp\.gate\.e_score_correction_bias"),
    (lambda s: s.pop("model.layers.0.self_attn.kv_a_layernorm.weight"),
     r"model\.layers\.0\.self_attn\.kv_a_layernorm\.weight"),
])
def test_broken_deepseek_checkpoints_are_clear_errors(tiny_checkpoint, edit, message):
    model_dir = make_checkpoint(tiny_checkpoint, "V3", seed=3)
    rewrite(model_dir, edit)
    with pytest.raises(ValueError, match=message):
        load_deepseek(model_dir, tp=TPGroup(rank=0, size=1))


@pytest.mark.parametrize("size", [2, 4])
def test_each_rank_reads_and_holds_only_its_experts(tiny_checkpoint, monkeypatch, size):
    """Built as rank r of n in one process: a rank instantiates E / n experts, reads only
    their tensors (another rank's are skipped unread), and holds about 1 / n of the
    expert bytes; every checkpoint key is accounted for (no error)."""
    model_dir = make_checkpoint(tiny_checkpoint, "V2", seed=4)
    read_names = []
    real_checkpoint_tensors = loader.checkpoint_tensors

    def recording(model_dir):
        for name, lazy in real_checkpoint_tensors(model_dir):
            yield name, _Recorder(lazy, name, read_names)
    monkeypatch.setattr(loader, "checkpoint_tensors", recording)
    state = load_file(model_dir / "model.safetensors")
    expert_keys = [k for k in state if ".experts." in k]
    expert_total = sum(state[k].numel() for k in expert_keys)
    num_experts = 8
    for rank in range(size):
        read_names.clear()
        model = load_deepseek(model_dir, tp=TPGroup(rank=rank, size=size))
        local = range(rank * num_experts // size, (rank + 1) * num_experts // size)
        read_experts = {int(n.split(".experts.")[1].split(".")[0]) for n in read_names if ".experts." in n}
        assert read_experts == set(local)
        held = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
        assert held == expert_total // size
        for layer in model.model.layers[1:]:
            assert layer.mlp.experts.gate_up_proj.shape[0] == num_experts // size


class _Recorder:
    """A LazyTensor stand-in that records the name of every tensor read (sliced or whole)."""

    def __init__(self, lazy, name, log):
        self._lazy, self._name, self._log, self.shape = lazy, name, log, lazy.shape

    def __getitem__(self, index):
        self._log.append(self._name)
        return self._lazy[index]

    def narrow(self, dim, start, length):
        self._log.append(self._name)
        return self._lazy.narrow(dim, start, length)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        def read(a):
            if isinstance(a, _Recorder):
                a._log.append(a._name)
                return a._lazy.materialize()
            return a
        return func(*map(read, args), **{k: read(v) for k, v in (kwargs or {}).items()})


def test_deepseek_decode_step_has_no_host_sync_and_no_clone(tiny_checkpoint, monkeypatch):
    model = load_deepseek(make_checkpoint(tiny_checkpoint, "V3", seed=5))
    assert_no_host_sync_and_no_copies(decode_step_ops(model, monkeypatch))
