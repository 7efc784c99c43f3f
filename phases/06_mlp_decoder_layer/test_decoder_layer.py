"""MLP and the decoder layer against HF transformers with the same
random weights; the fused residual chain uses each layer's own norm weights."""
import pytest
import torch
from transformers.models.llama import modeling_llama
from transformers.models.qwen2 import modeling_qwen2
from transformers.models.qwen3 import modeling_qwen3

from engine.distributed import TPGroup
from engine.model import kernels
from engine.model.layers.mlp import SwiGLUMLP
from engine.model.models.dense import DenseDecoderLayer, DenseForCausalLM
from engine.worker.kv_cache import bind_kv_cache
from phases.assertions import assert_close, assert_steps_close
from phases.checkpoints import randomize_weights
from phases.harness import causal_mask, engine_config, hf_config, load_from_hf, num_blocks_for, run_paged

HF = {"Qwen3ForCausalLM": modeling_qwen3, "Qwen2ForCausalLM": modeling_qwen2, "LlamaForCausalLM": modeling_llama}
PACKED = DenseForCausalLM.packed_modules


def hf_module(arch, kind, seed, **kwargs):
    cls = getattr(HF[arch], arch.replace("ForCausalLM", kind))
    module = cls(hf_config(arch), **kwargs).eval()
    randomize_weights(module, seed)
    return module


@pytest.mark.parametrize("arch", ["Qwen3ForCausalLM", "Qwen2ForCausalLM"])
def test_mlp_matches_hf(arch):
    torch.manual_seed(0)
    hf = hf_module(arch, "MLP", seed=3)
    config = engine_config(arch)
    ours = SwiGLUMLP(config.hidden_size, config.intermediate_size, TPGroup())
    load_from_hf(ours, hf, PACKED)
    x = torch.randn(37, hf_config(arch).hidden_size)
    with torch.no_grad():
        assert_close(ours(x), hf(x), 1e-5, "MLP output", arch)


@pytest.mark.parametrize("arch", ["Qwen3ForCausalLM", "Qwen2ForCausalLM", "LlamaForCausalLM"])
@pytest.mark.parametrize("first_layer", [True, False])
def test_decoder_layer_matches_hf(arch, first_layer):
    """Paged prefill + decode through one decoder layer; the layer's output is
    hidden + residual. A later layer receives a residual stream too."""
    torch.manual_seed(0)
    cfg = hf_config(arch)
    hf = hf_module(arch, "DecoderLayer", seed=4, layer_idx=0)
    rotary = getattr(HF[arch], arch.replace("ForCausalLM", "RotaryEmbedding"))(cfg)
    ours = DenseDecoderLayer(engine_config(arch), TPGroup())
    load_from_hf(ours, hf, PACKED)
    block_size, prompt_lens = 16, [3, 19, 30]
    lengths = [n + 9 for n in prompt_lens]
    bind_kv_cache(ours, num_blocks_for(lengths, block_size), block_size, torch.float32, "cpu")
    hidden = [torch.randn(n, cfg.hidden_size) for n in lengths]
    residual = [torch.randn(n, cfg.hidden_size) for n in lengths]
    width = cfg.hidden_size

    def step(x, positions):
        h, r = (x, None) if first_layer else (x[:, :width].contiguous(), x[:, width:].contiguous())
        out, res = ours(positions, h, r)
        return out + res

    inputs = hidden if first_layer else [torch.cat([h, r], -1) for h, r in zip(hidden, residual)]
    with torch.no_grad():
        got = run_paged(step, inputs, prompt_lens, block_size)
        for i, (g, h, r, n) in enumerate(zip(got, hidden, residual, prompt_lens)):
            x = h if first_layer else h + r
            pos = torch.arange(len(x))[None]
            want = hf(x[None], attention_mask=causal_mask(len(x)), position_ids=pos,
                      position_embeddings=rotary(x[None], pos))
            want = want[0] if isinstance(want, tuple) else want
            assert_steps_close(g, want[0], n, 1e-4, "decoder layer output (hidden + residual)",
                               f"{'first' if first_layer else 'later'} layer, sequence {i} of {arch}")


def test_every_norm_uses_its_own_layers_weight(monkeypatch):
    """Spy on the norm kernels during a forward: the weights passed, in call
    order, are exactly each layer's own norms (no cross-layer reference)."""
    cfg = engine_config("Qwen3ForCausalLM", num_hidden_layers=3)
    model = DenseForCausalLM(cfg, TPGroup())
    randomize_weights(model, seed=6)
    seen = []
    for name in ("rms_norm", "fused_add_rms_norm"):
        real = getattr(kernels, name)

        def spy(*args, _real=real, _name=name):
            weight = args[2]
            seen.append((_name, id(weight)))
            return _real(*args)
        monkeypatch.setattr(kernels, name, spy)
    real_prologue = kernels.qk_norm_rope_store

    def prologue_spy(*args):
        seen.extend([("q_norm", id(args[4])), ("k_norm", id(args[5]))])
        return real_prologue(*args)
    monkeypatch.setattr(kernels, "qk_norm_rope_store", prologue_spy)
    bind_kv_cache(model, 2, 16, torch.float32, "cpu")
    from engine.model.attention_context import forward_context
    from phases.harness import prefill_context
    positions, ctx = prefill_context([5], [0], [[0]], 16, "cpu")
    with forward_context(ctx), torch.no_grad():
        model(torch.randint(0, cfg.vocab_size, (5,)), positions)
    expected = []
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        expected += [("rms_norm" if i == 0 else "fused_add_rms_norm", id(layer.input_layernorm.weight)),
                     ("q_norm", id(attn.q_norm.weight)), ("k_norm", id(attn.k_norm.weight)),
                     ("fused_add_rms_norm", id(layer.post_attention_layernorm.weight))]
    expected.append(("fused_add_rms_norm", id(model.model.norm.weight)))
    assert seen == expected


def test_keep_rows_selects_hidden_and_residual_alike_after_attention():
    """keep_rows (a reversed subset) gives exactly the full layer's rows in that order, for both
    outputs: hidden and residual are selected by the same indices, after attention saw every row."""
    from engine.model.attention_context import forward_context
    from phases.harness import prefill_context

    layer = DenseDecoderLayer(engine_config("Qwen3ForCausalLM"), TPGroup())
    randomize_weights(layer, seed=8)
    bind_kv_cache(layer, 2, 16, torch.float32, "cpu")
    width = layer.input_layernorm.weight.shape[0]
    gen = torch.Generator().manual_seed(8)
    hidden, residual = torch.randn(12, width, generator=gen), torch.randn(12, width, generator=gen)
    keep = torch.tensor([11, 7, 3, 0])
    positions, ctx = prefill_context([8, 4], [0, 0], [[0], [1]], 16, "cpu")
    with forward_context(ctx), torch.no_grad():
        full = layer(positions, hidden.clone(), residual.clone())
        kept = layer(positions, hidden.clone(), residual.clone(), keep)
    for name, f, k in zip(("hidden", "residual"), full, kept):
        assert_close(k, f[keep], 1e-5, f"decoder layer {name} at the kept rows", "rows 11, 7, 3, 0")


def test_decode_step_of_a_decoder_layer_has_no_clone_and_no_host_sync(monkeypatch):
    from engine.model.attention_context import forward_context
    from phases.harness import assert_no_host_sync_and_no_copies, count_step, decode_context, prefill_context

    layer = DenseDecoderLayer(engine_config("Qwen3ForCausalLM"), TPGroup())
    randomize_weights(layer, seed=7)
    bind_kv_cache(layer, 2, 16, torch.float32, "cpu")
    width = layer.input_layernorm.weight.shape[0]
    positions, ctx = prefill_context([8, 4], [0, 0], [[0], [1]], 16, "cpu")
    with forward_context(ctx), torch.no_grad():
        layer(positions, torch.randn(12, width), None)
    hidden, residual = torch.randn(2, width), torch.randn(2, width)
    positions, ctx = decode_context([9, 5], [[0], [1]], 16, "cpu")
    with forward_context(ctx):
        assert_no_host_sync_and_no_copies(count_step(lambda: layer(positions, hidden, residual), monkeypatch))


def test_mlp_decode_gemv_path_equals_the_unfused_mlp():
    """With the decode GEMV on (down_proj.decode_gemv_rows, set by the kernel switches), a decode
    step's rows take down_proj through kernels.decode_gemv with silu(gate) * up in its prologue:
    the same output as the unfused MLP; more rows than the GEMV takes go the unfused way."""
    config = engine_config("Qwen3ForCausalLM")
    mlp = SwiGLUMLP(config.hidden_size, config.intermediate_size, TPGroup())
    randomize_weights(mlp, seed=9)
    x = torch.randn(6, config.hidden_size, generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        unfused = mlp(x)
        mlp.down_proj.decode_gemv_rows = 4
        assert_close(mlp(x[:3]), unfused[:3], 1e-5, "MLP output", "decode GEMV path, 3 rows")
        assert_close(mlp(x), unfused, 1e-5, "MLP output", "6 rows, past the GEMV's 4")


def test_keep_rows_reach_only_the_last_layer_and_give_the_full_models_rows():
    """DecoderModel with keep_rows (a reversed subset) gives exactly the full forward's hidden
    states at those rows: only the last layer selects them, every earlier layer runs every row."""
    from engine.model.attention_context import forward_context
    from phases.harness import prefill_context

    cfg = engine_config("Qwen3ForCausalLM", num_hidden_layers=3)
    model = DenseForCausalLM(cfg, TPGroup())
    randomize_weights(model, seed=12)
    bind_kv_cache(model, 4, 16, torch.float32, "cpu")
    ids = torch.randint(0, cfg.vocab_size, (12,), generator=torch.Generator().manual_seed(12))
    keep = torch.tensor([11, 7, 3])
    positions, ctx = prefill_context([8, 4], [0, 0], [[0], [1]], 16, "cpu")
    with forward_context(ctx), torch.no_grad():
        full = model(ids, positions)
        kept = model(ids, positions, keep)
    assert kept.shape[0] == 3
    assert_close(kept, full[keep], 1e-5, "hidden states at the kept rows", "3 layers, rows 11, 7, 3")


def test_captured_features_are_the_residual_stream_entering_the_named_layers():
    """With ``capture_layers`` (what a draft head reads) the model's ``features`` are, per token,
    transformers' ``output_hidden_states[i]`` of each named layer in the named order (0: the
    embedding; the number of layers: the final normed state), with or without keep_rows; the
    hidden states it returns are unchanged."""
    from transformers import Qwen3ForCausalLM

    from engine.model.attention_context import forward_context
    from phases.harness import prefill_context

    cfg = engine_config("Qwen3ForCausalLM", num_hidden_layers=3)
    model = DenseForCausalLM(cfg, TPGroup())
    hf = Qwen3ForCausalLM(hf_config("Qwen3ForCausalLM", num_hidden_layers=3)).eval()
    randomize_weights(hf, seed=13)
    load_from_hf(model, hf, PACKED)
    bind_kv_cache(model, 4, 16, torch.float32, "cpu")
    ids = torch.randint(0, cfg.vocab_size, (10,), generator=torch.Generator().manual_seed(13))
    positions, ctx = prefill_context([10], [0], [[0]], 16, "cpu")
    with torch.no_grad():
        out = hf.model(ids[None], output_hidden_states=True)
        with forward_context(ctx):
            plain = model(ids, positions)
        model.model.capture_layers = (2, 0, 3)
        for keep in (None, torch.tensor([9, 4])):
            with forward_context(ctx):
                hidden = model(ids, positions, keep)
            expected = torch.cat([out.hidden_states[2][0], out.hidden_states[0][0], out.last_hidden_state[0]], -1)
            assert_close(model.model.features, expected, 1e-5, "captured features", "layers 2, 0 and the final norm")
            assert_close(hidden, plain if keep is None else plain[keep], 1e-5, "hidden states", "while capturing")
