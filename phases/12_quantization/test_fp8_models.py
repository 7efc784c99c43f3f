"""Whole models from FP8 checkpoints (block-wise, compressed-tensors per channel, ignored
layers) and from online quantization, against transformers' reading of the same checkpoint
(``fp8_oracle``); the format errors and the 128-block shard check; no host sync in an FP8
decode step; the engine option."""
from __future__ import annotations

import pytest
import torch

from engine.core.llm_engine import LLMEngine
from engine.distributed import TPGroup
from engine.model.config import ModelConfig
from engine.model.layers.linear import UNQUANTIZED
from engine.model.loader import load_checkpoint
from engine.model.models.registry import build_model
from engine.scheduling.sequence import SamplingParams
from fp8_oracle import (
    W8A8,
    assert_w8a8_rows,
    dequantized_checkpoint,
    engine_logits,
    hf_model,
    quantized_weights,
)
from phases.checkpoints import FP8_CONFIGS, make_tiny_checkpoint
from phases.harness import assert_no_host_sync_and_no_copies, decode_step_ops, load_engine_model

PROMPT_LENS = [5, 17, 1]
IGNORED = ("model.layers.0.self_attn.o_proj", "model.layers.1.mlp.gate_proj", "model.layers.1.mlp.up_proj")
IGNORED_MODULES = ("model.layers.0.self_attn.o_proj", "model.layers.1.mlp.gate_up_proj")  # ours, merged
CASES = {"qwen3-block": ("Qwen3ForCausalLM", {}), "deepseek-v3-block": ("DeepseekV3ForCausalLM", {}),
         "qwen3-per-channel": ("Qwen3ForCausalLM", {"per_channel": True}),
         "qwen3-ignored-layers": ("Qwen3ForCausalLM", {"ignored": IGNORED})}
FP8_GAP = 0.25  # relative logits gap W8A8 may leave on these tiny random models (measured: 0.04-0.15)


def sequences_for(vocab: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (n + 4,), generator=gen) for n in PROMPT_LENS]


def assert_fp8_gap(got, plain) -> None:
    gap = float((torch.cat(got) - torch.cat(plain)).norm() / torch.cat(plain).norm())
    assert gap < FP8_GAP, f"FP8 logits {gap:.3f} (relative) from the unquantized model's, more than {FP8_GAP}"


def hf_logits(hf, sequences, mode=None):
    with torch.no_grad(), (mode or torch.no_grad()):
        return [hf(s[None]).logits[0] for s in sequences]


@pytest.mark.parametrize("case", list(CASES))
def test_fp8_checkpoint_logits_match_transformers_reading(tiny_fp8_checkpoint, case):
    """An FP8 checkpoint's logits through ragged paged prefill and decode equal the W8A8 oracle
    (transformers' dequantized model with activations quantized per token group) row for row,
    and stay within the FP8 gap of the dequantized model itself; ignored layers load unquantized."""
    arch, kwargs = CASES[case]
    model_dir = tiny_fp8_checkpoint(arch, seed=3, **kwargs)
    model = load_engine_model(model_dir)
    for name in IGNORED_MODULES if "ignored" in kwargs else ():
        layer = model.get_submodule(name)
        assert layer.weight.dtype == torch.float32 and layer.quant_method is UNQUANTIZED, name
    sequences = sequences_for(model.config.vocab_size)
    got = engine_logits(model, sequences, PROMPT_LENS)
    hf = hf_model(dequantized_checkpoint(model_dir))
    assert_w8a8_rows(got, hf_logits(hf, sequences, W8A8(quantized_weights(hf, kwargs.get("ignored", ())))), case)
    assert_fp8_gap(got, hf_logits(hf, sequences))


@pytest.mark.parametrize("arch", ["Qwen3ForCausalLM", "DeepseekV3ForCausalLM"])
def test_online_quantization_matches_block_quantized_weights(tiny_checkpoint, arch):
    """``quantization="fp8"`` on a float checkpoint: every projection FP8 (MLA's kv_b_proj stays
    in the model dtype), logits equal the W8A8 oracle whose weights the test quantized in 128 x
    128 blocks itself, and stay within the FP8 gap of the unquantized model."""
    model_dir = tiny_checkpoint(arch, seed=4, **FP8_CONFIGS[arch])
    config = ModelConfig.from_model_dir(model_dir, quantization="fp8")
    model = build_model(config, "cpu")
    load_checkpoint(model, model_dir, progress=False)
    dtypes = {n: p.dtype for n, p in model.named_parameters()}
    assert dtypes["model.layers.0.mlp.gate_up_proj.weight"] == torch.float8_e4m3fn
    assert dtypes["model.layers.1.self_attn.o_proj.weight"] == torch.float8_e4m3fn
    if arch.startswith("Deepseek"):
        assert dtypes["model.layers.1.mlp.experts.gate_up_proj"] == torch.float8_e4m3fn
        assert dtypes["model.layers.0.self_attn.kv_b_proj.weight"] == torch.float32
    sequences = sequences_for(config.vocab_size)
    got = engine_logits(model, sequences, PROMPT_LENS)
    hf = hf_model(model_dir)
    assert_w8a8_rows(got, hf_logits(hf, sequences, W8A8(quantized_weights(hf), quantize_weights=True)), arch)
    assert_fp8_gap(got, hf_logits(hf, sequences))


def test_each_rank_holds_its_own_scale_blocks(tiny_fp8_checkpoint):
    """Built as rank r of 2 (one process), every FP8 layer holds exactly its shard's scale blocks
    of the checkpoint (Q, K, V, gate and up of the merged layers; o_proj and down_proj split along
    K; a DeepSeek rank's own experts), sliced here from the checkpoint's full grids."""
    from safetensors.torch import load_file

    for arch in ("Qwen3ForCausalLM", "DeepseekV3ForCausalLM"):
        model_dir = tiny_fp8_checkpoint(arch, seed=8)
        full = load_file(str(model_dir / "model.safetensors"))
        for rank in (0, 1):
            model = load_engine_model(model_dir, tp=TPGroup(rank=rank, size=2))

            def rows(name, r=rank):   # this rank's half of a column-parallel grid
                grid = full[f"model.layers.0.{name}.weight_scale_inv"]
                return grid.chunk(2, dim=0)[r]

            layer = model.model.layers[0]
            mlp = layer.mlp
            torch.testing.assert_close(mlp.gate_up_proj.weight_scale_inv, torch.cat([rows("mlp.gate_proj"),
                                                                                     rows("mlp.up_proj")]))
            torch.testing.assert_close(mlp.down_proj.weight_scale_inv,
                                       full["model.layers.0.mlp.down_proj.weight_scale_inv"].chunk(2, dim=1)[rank])
            attn = layer.self_attn
            if arch.startswith("Qwen"):
                torch.testing.assert_close(attn.qkv_proj.weight_scale_inv, torch.cat(
                    [rows("self_attn.q_proj"), rows("self_attn.k_proj"), rows("self_attn.v_proj")]))
            else:
                torch.testing.assert_close(attn.q_b_proj.weight_scale_inv, rows("self_attn.q_b_proj"))
                experts = model.model.layers[1].mlp.experts
                for local, e in enumerate(range(rank * 4, rank * 4 + 4)):
                    want = torch.cat([full[f"model.layers.1.mlp.experts.{e}.{p}_proj.weight_scale_inv"]
                                      for p in ("gate", "up")])
                    torch.testing.assert_close(experts.gate_up_proj_scale_inv[local], want)
            torch.testing.assert_close(attn.o_proj.weight_scale_inv,
                                       full["model.layers.0.self_attn.o_proj.weight_scale_inv"].chunk(2, dim=1)[rank])


def test_a_shard_boundary_inside_a_block_is_refused(tiny_fp8_checkpoint, tiny_checkpoint, caplog):
    """An FP8 checkpoint whose TP shard (or merged part) would cut a 128-block is refused before any
    weight is read, naming the layer, the size per rank and the TP degree; online, such a layer
    stays in the model dtype (logged)."""
    model_dir = tiny_fp8_checkpoint("Qwen3ForCausalLM", seed=1, intermediate_size=384)
    config = ModelConfig.from_model_dir(model_dir)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.gate_up_proj.*192.*tensor parallel 2"):
        build_model(config, "meta", torch.float32, TPGroup(rank=0, size=2))
    build_model(config, "meta", torch.float32, TPGroup(rank=0, size=1))  # whole blocks at TP 1
    plain = tiny_checkpoint("Qwen3ForCausalLM", seed=1, **{**FP8_CONFIGS["Qwen3ForCausalLM"], "intermediate_size": 384})
    with caplog.at_level("INFO"):
        model = build_model(ModelConfig.from_model_dir(plain, "fp8"), "meta", torch.float32, TPGroup(rank=0, size=2))
    assert model.model.layers[0].mlp.gate_up_proj.weight.dtype == torch.float32
    assert model.model.layers[0].self_attn.qkv_proj.weight.dtype == torch.float8_e4m3fn
    assert "model.layers.0.mlp.gate_up_proj" in caplog.text


@pytest.mark.parametrize("edit, message", [
    ({"quant_method": "awq"}, "quant_method = 'awq'"),
    ({"fmt": "e5m2"}, "fmt = 'e5m2'"),
    ({"weight_block_size": [64, 64]}, r"weight_block_size = \[64, 64\]"),
    ({"weight_block_size": None}, "weight_block_size = None"),
    ({"activation_scheme": "static"}, "activation_scheme = 'static'"),
])
def test_unsupported_formats_are_clear_errors(tiny_fp8_checkpoint, edit, message):
    """Another quant_method, an fmt other than e4m3, another block size, static activations: an
    error naming the field and the value, when the model is built (before any weight is read)."""
    config = ModelConfig.from_model_dir(tiny_fp8_checkpoint("Qwen3ForCausalLM"))
    edited = ModelConfig.from_dict({**config.raw, "quantization_config": {**config.quantization, **edit}})
    with pytest.raises(ValueError, match=f"quantization_config.{message}"):
        build_model(edited, "meta")
    with pytest.raises(ValueError, match="quantization='int8'"):
        ModelConfig.from_dict(config.raw, quantization="int8")


def test_an_ignore_list_that_splits_a_merged_layer_is_an_error(tiny_fp8_checkpoint):
    """q_proj ignored but k_proj and v_proj quantized cannot share one QKV weight: an error
    naming the merged layer."""
    model_dir = tiny_fp8_checkpoint("Qwen3ForCausalLM", ignored=("model.layers.1.self_attn.q_proj",))
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.qkv_proj.*some of"):
        build_model(ModelConfig.from_model_dir(model_dir), "meta")


@pytest.mark.parametrize("arch", ["Qwen3ForCausalLM", "DeepseekV3ForCausalLM"])
def test_fp8_decode_step_has_no_host_sync(tiny_fp8_checkpoint, monkeypatch, arch):
    """An FP8 decode step (quantized projections and experts) reads nothing on the host and
    copies nothing in the model's own code: what a CUDA graph captures."""
    model = load_engine_model(tiny_fp8_checkpoint(arch, seed=2))
    assert_no_host_sync_and_no_copies(decode_step_ops(model, monkeypatch))


def test_llm_engine_quantization_option(tmp_path):
    """``LLMEngine(..., quantization="fp8")`` serves a float checkpoint with FP8 weights; its greedy
    tokens are the argmax of the same FP8 model's logits (teacher-forced over prompt + output)."""
    model_dir = make_tiny_checkpoint(tmp_path, "Qwen3ForCausalLM", seed=9, **FP8_CONFIGS["Qwen3ForCausalLM"])
    engine = LLMEngine(model_dir, quantization="fp8", device="cpu", max_num_seqs=2, max_model_len=64)
    assert engine.runner.model.model.layers[0].mlp.down_proj.weight.dtype == torch.float8_e4m3fn
    prompt = [5, 17, 3, 9]
    [out] = engine.generate_tokens([prompt], SamplingParams(temperature=0.0, max_tokens=4))
    model = build_model(ModelConfig.from_model_dir(model_dir, "fp8"), "cpu")
    load_checkpoint(model, model_dir, progress=False)
    tokens = prompt + out
    logits = engine_logits(model, [torch.tensor(tokens)], [len(tokens)])[0]
    assert logits[len(prompt) - 1:-1].argmax(-1).tolist() == out
