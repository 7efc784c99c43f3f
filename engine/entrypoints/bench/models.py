"""What a benchmark runs: an LLMEngine over a checkpoint directory or over a preset (an HF
config dict) with random weights made directly on the device, and, for ``--compare hf``,
transformers' model holding the same weights.

Random weights are a function of (seed, tensor name): every checkpoint tensor the model
expects is drawn from its own generator, norms ``1 + 0.1*randn``, the rest ``0.02*randn``, so
our model (through the checkpoint loader, sharding and padding included) and HF's get
identical values without writing a checkpoint."""
from __future__ import annotations

import argparse
import functools
import json
import shutil
import tempfile
import zlib
from contextlib import contextmanager
from pathlib import Path

import torch

QWEN3 = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", max_position_embeddings=40960,
             rope_theta=1000000.0, rms_norm_eps=1e-6, attention_bias=False, head_dim=128, torch_dtype="bfloat16")
DEEPSEEK_V2 = dict(architectures=["DeepseekV2ForCausalLM"], model_type="deepseek_v2", q_lora_rank=None,
                   topk_method="greedy", n_group=1, topk_group=1, norm_topk_prob=False, routed_scaling_factor=1.0,
                   scoring_func="softmax", first_k_dense_replace=1, moe_layer_freq=1, max_position_embeddings=163840,
                   rope_theta=10000.0, rope_scaling=dict(type="yarn", factor=40.0, beta_fast=32, beta_slow=1,
                                                         original_max_position_embeddings=4096, mscale=0.707,
                                                         mscale_all_dim=0.707),
                   rms_norm_eps=1e-6, attention_bias=False, tie_word_embeddings=False, torch_dtype="bfloat16")
LLAMA3 = dict(architectures=["LlamaForCausalLM"], model_type="llama", max_position_embeddings=131072,
              rope_theta=500000.0, rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                                     high_freq_factor=4.0, original_max_position_embeddings=8192),
              rms_norm_eps=1e-5, attention_bias=False, mlp_bias=False, torch_dtype="bfloat16")
QWEN3_MOE = dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", max_position_embeddings=40960,
                 rope_theta=1000000.0, rms_norm_eps=1e-6, attention_bias=False, head_dim=128, norm_topk_prob=True,
                 decoder_sparse_step=1, mlp_only_layers=[], torch_dtype="bfloat16")
PRESETS: dict[str, dict] = {
    "qwen3-8b": {**QWEN3, "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 12288,
                 "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
                 "tie_word_embeddings": False},
    "qwen3-0.6b": {**QWEN3, "vocab_size": 151936, "hidden_size": 1024, "intermediate_size": 3072,
                   "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
                   "tie_word_embeddings": True},
    "deepseek-v2-lite": {**DEEPSEEK_V2, "vocab_size": 102400, "hidden_size": 2048, "intermediate_size": 10944,
                         "moe_intermediate_size": 1408, "num_hidden_layers": 27, "num_attention_heads": 16,
                         "num_key_value_heads": 16, "n_routed_experts": 64, "num_experts_per_tok": 6,
                         "n_shared_experts": 2, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
                         "v_head_dim": 128},
    "llama3-8b": {**LLAMA3, "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
                  "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                  "tie_word_embeddings": False},
    "qwen3-30b-a3b": {**QWEN3_MOE, "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144,
                      "moe_intermediate_size": 768, "num_hidden_layers": 48, "num_attention_heads": 32,
                      "num_key_value_heads": 4, "num_experts": 128, "num_experts_per_tok": 8,
                      "tie_word_embeddings": False},
    # the CPU tests' models: phases/checkpoints.py's tiny Qwen3 shape, and a tiny V2-Lite
    "tiny-deepseek-v2-lite": {**DEEPSEEK_V2, "vocab_size": 512, "hidden_size": 64, "intermediate_size": 96,
                              "moe_intermediate_size": 32, "num_hidden_layers": 3, "num_attention_heads": 4,
                              "num_key_value_heads": 4, "n_routed_experts": 8, "num_experts_per_tok": 3,
                              "n_shared_experts": 2, "kv_lora_rank": 32, "qk_nope_head_dim": 16,
                              "qk_rope_head_dim": 8, "v_head_dim": 24, "max_position_embeddings": 1024},
    "tiny-qwen3": {**QWEN3, "vocab_size": 512, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
                   "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
                   "max_position_embeddings": 1024, "rope_theta": 50000.0, "rms_norm_eps": 1e-5,
                   "tie_word_embeddings": False},
}


def hf_config(preset: dict):
    import transformers

    fields = {k: v for k, v in preset.items() if k not in ("model_type", "torch_dtype")}
    return transformers.AutoConfig.for_model(preset["model_type"], **fields)


def random_tensor(name: str, shape, seed: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """The random value of checkpoint tensor ``name``: its own generator, seeded by (seed, name)."""
    gen = torch.Generator(device).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    noise = torch.randn(tuple(shape), generator=gen, device=device, dtype=dtype)
    return noise.mul_(0.1).add_(1.0) if "norm" in name else noise.mul_(0.02)


# transformers 5 stacks routed experts into one parameter each (gate and up concatenated per
# expert); checkpoints hold one tensor per expert and projection: experts.<e>.<proj>.weight
FUSED_EXPERTS = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


def _fused_experts(name: str) -> tuple[str, tuple[str, ...]] | None:
    """(prefix, per-expert projections) when HF parameter ``name`` stacks routed experts."""
    prefix, _, last = name.rpartition(".")
    return (prefix, FUSED_EXPERTS[last]) if prefix.endswith("experts") and last in FUSED_EXPERTS else None


def random_checkpoint(preset: dict, seed: int, device: torch.device, dtype: torch.dtype):
    """(name, tensor) for every tensor of the preset's HF checkpoint, each made when asked for.
    Names and shapes come from HF's model built on the meta device, stacked experts split
    into the checkpoint's per-expert tensors."""
    import transformers

    with torch.device("meta"):
        meta = transformers.AutoModelForCausalLM.from_config(hf_config(preset))
    for name, param in meta.named_parameters():
        fused = _fused_experts(name)
        if fused is None:
            yield name, random_tensor(name, param.shape, seed, device, dtype)
            continue
        prefix, parts = fused
        for e in range(param.shape[0]):
            for part in parts:
                shape = (param.shape[1] // len(parts), param.shape[2])
                yield f"{prefix}.{e}.{part}.weight", random_tensor(f"{prefix}.{e}.{part}.weight", shape, seed,
                                                                   device, dtype)


def hf_parameter_value(name: str, shape, seed: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """HF parameter ``name``'s value under ``random_checkpoint``'s weights (stacked experts
    assembled from the per-expert tensors)."""
    fused = _fused_experts(name)
    if fused is None:
        return random_tensor(name, shape, seed, device, dtype)
    prefix, parts = fused
    rows = (shape[1] // len(parts), shape[2])
    return torch.stack([torch.cat([random_tensor(f"{prefix}.{e}.{part}.weight", rows, seed, device, dtype)
                                   for part in parts]) for e in range(shape[0])])


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                   "tokenizer.model", "chat_template.jinja")


@contextmanager
def preset_model_dir(preset: dict, tokenizer_dir: str | None = None):
    """A temporary model directory holding the preset's config.json and a one-word tokenizer
    (benchmarks feed token ids; the engine still wants a tokenizer to exist), or the tokenizer
    files of ``tokenizer_dir`` (structured outputs need a real vocabulary; ids past its size are
    never generated under a grammar)."""
    from tokenizers import Tokenizer, models

    with tempfile.TemporaryDirectory(prefix="bench-preset-") as tmp:
        path = Path(tmp)
        (path / "config.json").write_text(json.dumps(preset))
        if tokenizer_dir is None:
            Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>")).save(str(path / "tokenizer.json"))
            (path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
        else:
            for name in TOKENIZER_FILES:
                if (Path(tokenizer_dir) / name).is_file():
                    shutil.copy(Path(tokenizer_dir) / name, path / name)
        yield path


@contextmanager
def weights_instead_of_checkpoint(tensors_for):
    """While inside, a ModelRunner fills its model from ``tensors_for(model)`` (an iterable of
    checkpoint-named tensors, loaded by ``load_weights``) instead of reading safetensors.
    ModelRunner has no weights hook; this swaps the one name it loads through."""
    from engine.worker import model_runner

    real = model_runner.load_checkpoint
    model_runner.load_checkpoint = _loader(tensors_for)
    try:
        yield
    finally:
        model_runner.load_checkpoint = real


@contextmanager
def random_weights_args(args: argparse.Namespace):
    """Inside: ``args`` with ``model`` set to a directory of ``args.preset``'s config (and the
    tokenizer of ``args.tokenizer``, when given), and every ModelRunner built filling its model
    with the preset's random weights (``args.seed``)."""
    preset = PRESETS[args.preset]
    with preset_model_dir(preset, getattr(args, "tokenizer", None)) as model_dir, \
            weights_instead_of_checkpoint(functools.partial(_random_tensors, preset, args.seed)):
        yield argparse.Namespace(**{**vars(args), "model": str(model_dir)})


def _random_tensors(preset: dict, seed: int, model):
    param = next(model.parameters())
    return random_checkpoint(preset, seed, param.device, param.dtype)


def _loader(tensors_for):
    """A stand-in for ``load_checkpoint`` that loads ``tensors_for(model)`` instead."""
    from engine.model.weight_loading import load_weights

    return lambda model, _dir, progress=False: load_weights(model, tensors_for(model), progress=progress)


def use_random_weights(preset_name: str, seed: int) -> None:
    """From now on in this process, every ModelRunner fills its model with ``preset_name`` 's random
    weights (``seed``): what an engine core process of a preset's server runs before its engine."""
    from engine.worker import model_runner

    model_runner.load_checkpoint = _loader(functools.partial(_random_tensors, PRESETS[preset_name], seed))


@contextmanager
def open_engine(args: argparse.Namespace):
    """The LLMEngine the options name: ``--model DIR`` (default: the demo model), or ``--preset
    NAME --random-weights``. Yields (engine, weights) where ``weights`` says where they came from."""
    from engine.core.engine_args import EngineArgs
    from engine.core.llm_engine import LLMEngine

    if args.preset is None:
        yield LLMEngine(EngineArgs.from_cli_args(args).create_engine_config()), "checkpoint"
        return
    with random_weights_args(args) as preset_args:
        yield LLMEngine(EngineArgs.from_cli_args(preset_args).create_engine_config()), f"random (seed {args.seed})"


def hf_model(engine, args: argparse.Namespace):
    """transformers' model with the engine's weights, dtype and device. Built under the dtype as
    the default (as from_pretrained does), never ``.to(dtype)``, which would also round the
    rotary ``inv_freq`` buffer."""
    import transformers

    from engine.model.models.registry import creating_in

    if args.preset is None:
        model = transformers.AutoModelForCausalLM.from_pretrained(str(engine.model_dir), dtype=engine.dtype)
        return model.to(engine.device).eval()
    with creating_in(engine.dtype, engine.device):
        model = transformers.AutoModelForCausalLM.from_config(hf_config(PRESETS[args.preset]), dtype=engine.dtype)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(hf_parameter_value(name, param.shape, args.seed, engine.device, engine.dtype))
    return model.eval()
