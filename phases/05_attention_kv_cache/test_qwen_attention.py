"""GQAAttention over the paged KV cache against HF transformers' attention
with the same random weights: ragged prefill, decode steps, prefix-cached
prefill, block sizes 16 and 256."""
import pytest
import torch
from transformers.models.qwen2 import modeling_qwen2
from transformers.models.qwen3 import modeling_qwen3

from engine.distributed import TPGroup
from engine.model.layers.gqa_attention import GQAAttention
from engine.model.models.dense import DenseForCausalLM
from engine.worker.kv_cache import bind_kv_cache
from phases.assertions import assert_close, assert_steps_close
from phases.checkpoints import randomize_weights
from phases.harness import causal_mask, engine_config, hf_config, load_from_hf, num_blocks_for, run_paged

HF = {"Qwen3ForCausalLM": modeling_qwen3, "Qwen2ForCausalLM": modeling_qwen2}


def hf_attention(arch, seed, **overrides):
    cfg = hf_config(arch, **overrides)
    mod = HF[arch]
    attn = getattr(mod, arch.replace("ForCausalLM", "Attention"))(cfg, layer_idx=0).eval()
    randomize_weights(attn, seed)
    rotary = getattr(mod, arch.replace("ForCausalLM", "RotaryEmbedding"))(cfg)
    return cfg, attn, rotary


def hf_attention_reference(attn, rotary, x):
    """Full causal forward of one sequence x [L, H] -> [L, H]."""
    pos = torch.arange(len(x))[None]
    cos_sin = rotary(x[None], pos)
    return attn(x[None], cos_sin, causal_mask(len(x)))[0][0]


def make_engine_attention(arch, cfg, hf_attn, block_size, lengths, **overrides):
    ours = GQAAttention(engine_config(arch, **overrides), TPGroup())
    load_from_hf(ours, hf_attn, DenseForCausalLM.packed_modules)
    bind_kv_cache(ours, num_blocks_for(lengths, block_size), block_size, torch.float32, "cpu")
    return ours


@pytest.mark.parametrize("arch", ["Qwen3ForCausalLM", "Qwen2ForCausalLM"])
@pytest.mark.parametrize("block_size", [16, 256])
def test_prefill_then_decode_matches_hf(arch, block_size):
    torch.manual_seed(0)
    cfg, hf_attn, rotary = hf_attention(arch, seed=1)
    prompt_lens = [5, 17, 1, 250] if block_size == 256 else [5, 17, 1, 40]
    lengths = [n + d for n, d in zip(prompt_lens, [9, 8, 12, 10])]  # crosses 16- and 256-blocks
    inputs = [torch.randn(n, cfg.hidden_size) for n in lengths]
    ours = make_engine_attention(arch, cfg, hf_attn, block_size, lengths)
    with torch.no_grad():
        got = run_paged(lambda x, pos: ours(pos, x), inputs, prompt_lens, block_size)
        want = [hf_attention_reference(hf_attn, rotary, x) for x in inputs]
    for i, (g, w, n) in enumerate(zip(got, want, prompt_lens)):
        assert_steps_close(g, w, n, 1e-4, "attention output", f"sequence {i} of {arch}, block size {block_size}")


def test_the_q_k_norms_take_the_configs_eps():
    """Qwen3's per-head q/k norms use config.json's rms_norm_eps (0.25 here, where the default
    1e-6 gives other outputs), as transformers' do."""
    torch.manual_seed(0)
    cfg, hf_attn, rotary = hf_attention("Qwen3ForCausalLM", seed=2, rms_norm_eps=0.25)
    inputs = [0.1 * torch.randn(n, cfg.hidden_size) for n in (7, 3)]
    ours = make_engine_attention("Qwen3ForCausalLM", cfg, hf_attn, 16, [7, 3], rms_norm_eps=0.25)
    with torch.no_grad():
        got = run_paged(lambda x, pos: ours(pos, x), inputs, [7, 3], 16)
        want = [hf_attention_reference(hf_attn, rotary, x) for x in inputs]
    for i, (g, w) in enumerate(zip(got, want)):
        assert_steps_close(g, w, len(g), 1e-4, "attention output", f"sequence {i}, rms_norm_eps 0.25")


@pytest.mark.parametrize("window,refused", [(64, True), (None, False)])
def test_a_sliding_window_that_can_bind_is_refused_by_the_attention(window, refused):
    """A window below max_position_embeddings would bind (attention here is full causal): the
    layer refuses it with a ValueError naming sliding_window; none builds."""
    from dataclasses import replace

    cfg = replace(engine_config("Qwen3ForCausalLM"), sliding_window=window)
    if refused:
        with pytest.raises(ValueError, match="sliding_window = 64"):
            GQAAttention(cfg, TPGroup())
    else:
        GQAAttention(cfg, TPGroup())


@pytest.mark.parametrize("block_size", [16, 256])
def test_prefix_cached_prefill_reads_prefix_from_cache(block_size):
    """Prefill a prefix, then the rest of the prompt in a second prefill whose
    attention must read the prefix's K/V back from the paged cache."""
    torch.manual_seed(0)
    arch = "Qwen3ForCausalLM"
    cfg, hf_attn, rotary = hf_attention(arch, seed=2)
    prompt_lens, cached = [20, 33, 7], [16, 32, 3]
    lengths = [n + 4 for n in prompt_lens]
    inputs = [torch.randn(n, cfg.hidden_size) for n in lengths]
    ours = make_engine_attention(arch, cfg, hf_attn, block_size, lengths)
    with torch.no_grad():
        got = run_paged(lambda x, pos: ours(pos, x), inputs, prompt_lens, block_size, cached_lens=cached)
        want = [hf_attention_reference(hf_attn, rotary, x) for x in inputs]
    for i, (g, w, n) in enumerate(zip(got, want, prompt_lens)):
        assert_steps_close(g, w, n, 1e-4, "attention output", f"sequence {i} ({cached[i]} tokens cached)")


@pytest.mark.parametrize("rank,size", [(0, 1), (1, 2), (3, 4)])
def test_heads_per_rank_and_kv_replication(rank, size):
    """Q heads split evenly; KV heads split, or replicated (one per rank) when
    tp > num_kv_heads; K/V use the local KV-head count."""
    cfg = engine_config("Qwen3ForCausalLM")
    attn = GQAAttention(cfg, TPGroup(rank=rank, size=size))
    assert attn.attn.num_heads == cfg.num_attention_heads // size
    assert attn.attn.num_kv_heads == max(1, cfg.num_key_value_heads // size)
    q_out = attn.qkv_proj.weight.shape[0]
    assert q_out == (attn.attn.num_heads + 2 * attn.attn.num_kv_heads) * cfg.head_dim


def test_decode_step_of_the_attention_layer_has_no_host_sync(monkeypatch):
    from engine.model.attention_context import forward_context
    from phases.harness import assert_no_host_sync_and_no_copies, count_step, decode_context, prefill_context

    cfg, hf_attn, _ = hf_attention("Qwen3ForCausalLM", seed=3)
    ours = make_engine_attention("Qwen3ForCausalLM", cfg, hf_attn, 16, [9, 5])
    positions, ctx = prefill_context([8, 4], [0, 0], [[0], [1]], 16, "cpu")
    with forward_context(ctx), torch.no_grad():
        ours(positions, torch.randn(12, cfg.hidden_size))
    positions, ctx = decode_context([9, 5], [[0], [1]], 16, "cpu")
    x = torch.randn(2, cfg.hidden_size)
    with forward_context(ctx):
        assert_no_host_sync_and_no_copies(count_step(lambda: ours(positions, x), monkeypatch))


@pytest.mark.parametrize("rank,size", [(1, 2), (2, 4), (3, 4)])
def test_rank_caches_its_own_kv_head(rank, size):
    """Built as rank r of n (one process): the K/V written to the cache are
    [T, local KV heads, D] and hold exactly HF's KV head r * total_kv // tp."""
    from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb

    from engine.distributed import TPGroup
    from engine.model.attention_context import forward_context
    from phases.harness import prefill_context

    arch = "Qwen3ForCausalLM"
    cfg, hf_attn, rotary = hf_attention(arch, seed=4)
    ours = GQAAttention(engine_config(arch), TPGroup(rank=rank, size=size))
    load_from_hf(ours, hf_attn, DenseForCausalLM.packed_modules)
    bind_kv_cache(ours, 1, 16, torch.float32, "cpu")
    n, d = 11, cfg.head_dim
    torch.manual_seed(0)
    x = torch.randn(n, cfg.hidden_size)
    positions, ctx = prefill_context([n], [0], [[0]], 16, "cpu")
    with forward_context(ctx), torch.no_grad():
        ours(positions, x)
        pos = torch.arange(n)[None]
        k = hf_attn.k_norm(hf_attn.k_proj(x[None]).view(1, n, -1, d)).transpose(1, 2)
        v = hf_attn.v_proj(x[None]).view(1, n, -1, d).transpose(1, 2)
        _, k = apply_rotary_pos_emb(k, k, *rotary(x[None], pos))
    head = rank * cfg.num_key_value_heads // size
    assert ours.attn.k_cache.shape[2] == max(1, cfg.num_key_value_heads // size)
    assert_close(ours.attn.k_cache[0, :n, 0], k[0, head], 1e-5, "cached K", f"rank {rank} of {size} (KV head {head})")
    assert_close(ours.attn.v_cache[0, :n, 0], v[0, head], 1e-5, "cached V", f"rank {rank} of {size} (KV head {head})")


def test_batch_reuses_prefix_blocks_another_sequence_writes_in_the_same_step():
    """The scheduler may give a later sequence prefix blocks an earlier sequence of
    the same prefill batch is computing: the layer stores the whole batch's K/V
    before attending, so both match HF."""
    from engine.model.attention_context import forward_context
    from phases.harness import prefill_context

    arch = "Qwen3ForCausalLM"
    cfg, hf_attn, rotary = hf_attention(arch, seed=5)
    ours = make_engine_attention(arch, cfg, hf_attn, 16, [32, 32])
    torch.manual_seed(0)
    first = torch.randn(20, cfg.hidden_size)
    second = torch.cat([first[:16], torch.randn(8, cfg.hidden_size)])  # same first block
    positions, ctx = prefill_context([20, 24], [0, 16], [[0, 1], [0, 2]], 16, "cpu")
    assert ctx.prefill_kv_slots is not None
    with forward_context(ctx), torch.no_grad():
        out = ours(positions, torch.cat([first, second[16:]]))
        want_first = hf_attention_reference(hf_attn, rotary, first)
        want_second = hf_attention_reference(hf_attn, rotary, second)
    assert_close(out[:20], want_first, 1e-4, "attention output", "the sequence writing the shared block")
    assert_close(out[20:], want_second[16:], 1e-4, "attention output", "the sequence reusing the shared block")


@pytest.mark.parametrize("edit,message", [
    (lambda t: t.update({"m.o_proj.bias": torch.zeros(4)}), "'m.o_proj.bias' matches no model parameter"),
    (lambda t: t.pop("m.k_proj.weight"), r"no tensor for parameter\(s\): m.qkv_proj.weight \(shards \['k'\]\)"),
    (lambda t: t.pop("m.q_norm.weight"), r"no tensor for parameter\(s\): m.q_norm.weight"),
    (lambda t: t.update({"m.q_norm.weight": torch.ones(3)}), "'m.q_norm.weight': shape \\(3,\\) does not match"),
], ids=["unknown", "missing-shard", "missing", "shape"])
def test_load_weights_uses_every_tensor_and_fills_every_parameter(edit, message):
    """load_weights (contract: blueprint/contracts.md#phase-05) on the attention layer: HF's separate
    q/k/v tensors fill the packed QKV parameter; a tensor matching no parameter, a missing shard or
    parameter, or a wrong shape is a ValueError naming the key."""
    from torch import nn

    from engine.model.weight_loading import load_weights

    _, hf_attn, _ = hf_attention("Qwen3ForCausalLM", seed=3)
    tensors = {"m." + n: p.detach() for n, p in hf_attn.named_parameters()}
    holder = nn.Module()
    holder.packed_modules, holder.m = DenseForCausalLM.packed_modules, GQAAttention(
        engine_config("Qwen3ForCausalLM"), TPGroup())
    load_weights(holder, dict(tensors).items(), progress=False)
    q, k, v = (tensors[f"m.{x}_proj.weight"] for x in "qkv")
    assert torch.equal(holder.m.qkv_proj.weight, torch.cat([q, k, v]))
    edit(tensors)
    with pytest.raises(ValueError, match=message):
        load_weights(holder, tensors.items(), progress=False)
