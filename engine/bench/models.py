"""What a benchmark runs: an LLMEngine over a checkpoint directory or over a preset (an HF
config dict) with random weights made directly on the device, and, for ``--compare hf``,
transformers' model holding the same weights.

Random weights are a function of (seed, tensor name): every checkpoint tensor the model
expects is drawn from its own generator, norms ``1 + 0.1*randn``, the rest ``0.02*randn``, so
our model (through the checkpoint loader, sharding and padding included) and HF's get
identical values without writing a checkpoint."""
from __future__ import annotations

import argparse
import json
import tempfile
import zlib
from contextlib import contextmanager
from pathlib import Path

import torch

QWEN3 = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", max_position_embeddings=40960,
             rope_theta=1000000.0, rms_norm_eps=1e-6, attention_bias=False, head_dim=128, torch_dtype="bfloat16")
PRESETS: dict[str, dict] = {
    "qwen3-8b": {**QWEN3, "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 12288,
                 "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
                 "tie_word_embeddings": False},
    "qwen3-0.6b": {**QWEN3, "vocab_size": 151936, "hidden_size": 1024, "intermediate_size": 3072,
                   "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
                   "tie_word_embeddings": True},
    # the CPU tests' model: phases/checkpoints.py's tiny Qwen3 shape
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


def random_checkpoint(preset: dict, seed: int, device: torch.device, dtype: torch.dtype):
    """(name, tensor) for every tensor of the preset's HF checkpoint (names and shapes read from
    HF's model built on the meta device), each made when asked for."""
    import transformers

    with torch.device("meta"):
        meta = transformers.AutoModelForCausalLM.from_config(hf_config(preset))
    for name, param in meta.named_parameters():
        yield name, random_tensor(name, param.shape, seed, device, dtype)


@contextmanager
def preset_model_dir(preset: dict):
    """A temporary model directory holding the preset's config.json and a one-word tokenizer
    (benchmarks feed token ids; the engine still wants a tokenizer to exist)."""
    from tokenizers import Tokenizer, models

    with tempfile.TemporaryDirectory(prefix="bench-preset-") as tmp:
        path = Path(tmp)
        (path / "config.json").write_text(json.dumps(preset))
        Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>")).save(str(path / "tokenizer.json"))
        (path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
        yield path


@contextmanager
def weights_instead_of_checkpoint(tensors_for):
    """While inside, a ModelRunner fills its model from ``tensors_for(model)`` (an iterable of
    checkpoint-named tensors, loaded by ``load_weights``) instead of reading safetensors.
    ModelRunner has no weights hook; this swaps the one name it loads through."""
    from engine import model_runner
    from engine.loader import load_weights

    real = model_runner.load_checkpoint
    model_runner.load_checkpoint = lambda model, _dir, progress=False: load_weights(
        model, tensors_for(model), progress=progress)
    try:
        yield
    finally:
        model_runner.load_checkpoint = real


@contextmanager
def random_weights_args(args: argparse.Namespace):
    """Inside: ``args`` with ``model`` set to a directory of ``args.preset``'s config, and every
    ModelRunner built filling its model with the preset's random weights (``args.seed``)."""
    preset = PRESETS[args.preset]

    def tensors_for(model):
        param = next(model.parameters())
        return random_checkpoint(preset, args.seed, param.device, param.dtype)

    with preset_model_dir(preset) as model_dir, weights_instead_of_checkpoint(tensors_for):
        yield argparse.Namespace(**{**vars(args), "model": str(model_dir)})


@contextmanager
def open_engine(args: argparse.Namespace):
    """The LLMEngine the options name: ``--model DIR`` (default: the demo model), or ``--preset
    NAME --random-weights``. Yields (engine, weights) where ``weights`` says where they came from."""
    from engine.__main__ import build_engine

    if args.preset is None:
        yield build_engine(args), "checkpoint"
        return
    with random_weights_args(args) as preset_args:
        yield build_engine(preset_args), f"random (seed {args.seed})"


def hf_model(engine, args: argparse.Namespace):
    """transformers' model with the engine's weights, dtype and device. Built under the dtype as
    the default (as from_pretrained does), never ``.to(dtype)``, which would also round the
    rotary ``inv_freq`` buffer."""
    import transformers

    from engine.models.registry import creating_in

    if args.preset is None:
        model = transformers.AutoModelForCausalLM.from_pretrained(str(engine.model_dir), dtype=engine.dtype)
        return model.to(engine.device).eval()
    with creating_in(engine.dtype, engine.device):
        model = transformers.AutoModelForCausalLM.from_config(hf_config(PRESETS[args.preset]), dtype=engine.dtype)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(random_tensor(name, param.shape, args.seed, engine.device, engine.dtype))
    return model.eval()
