"""Tiny HF-format checkpoints with every weight random, for the oracle tests.

`make_tiny_checkpoint` writes config.json, safetensors (single or sharded with
an index), generation_config.json and a small word-level tokenizer; the root
conftest's `tiny_checkpoint` fixture wraps it.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

# Tiny configs per architecture: small enough for CPU, shaped to catch bugs
# (head_dim != hidden/heads for Qwen3, GQA, QKV bias and tied embeddings for Qwen2;
# rope_theta and rms_norm_eps differ from every default, so a value not read from
# config.json shows up as a logits mismatch).
TINY_CONFIGS: dict[str, dict] = {
    "Qwen3ForCausalLM": dict(
        vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        max_position_embeddings=1024, rope_theta=50000.0, rms_norm_eps=1e-5,
        tie_word_embeddings=False, attention_bias=False,
    ),
    "Qwen2ForCausalLM": dict(
        vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=1024, rope_theta=20000.0, rms_norm_eps=3e-6,
        tie_word_embeddings=True,
    ),
}

WORDS = ("the quick brown fox jumps over lazy dog a an of to in is it on and for with as "
         "that this by at from be are was were garden city river mountain light dark").split()



def randomize_weights(model: torch.nn.Module, seed: int) -> None:
    """Fill every parameter with random values in place: norms 1 + 0.1*randn,
    everything else 0.02*randn (biases too), from ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if "norm" in name:
                p.copy_(1.0 + 0.1 * noise)
            else:
                p.copy_(0.02 * noise)


def write_tokenizer(path: Path, vocab_size: int) -> None:
    """A small word-level tokenizer (tokenizer.json + tokenizer_config.json)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders

    vocab = {"<unk>": 0, "<|endoftext|>": 1}
    for w in WORDS:
        vocab.setdefault(w, len(vocab))
    assert len(vocab) <= vocab_size
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|endoftext|>", "unk_token": "<unk>", "pad_token": "<|endoftext|>",
    }))


def tiny_hf_config(arch: str = "Qwen3ForCausalLM", **overrides):
    """The transformers config of the tiny ``arch``; ``overrides`` replace its entries."""
    import transformers

    config_cls = getattr(transformers, arch.replace("ForCausalLM", "Config"))
    return config_cls(**{**TINY_CONFIGS[arch], **overrides}, bos_token_id=1, eos_token_id=1)


def make_tiny_checkpoint(path: Path, arch: str = "Qwen3ForCausalLM", seed: int = 0,
                         sharded: bool = False, **overrides) -> Path:
    """Write an HF checkpoint for ``arch`` into ``path`` and return it.

    Every weight is random (see ``randomize_weights``); ``sharded`` splits the
    safetensors into several files with a ``model.safetensors.index.json``.
    ``overrides`` replace entries of the tiny config.
    """
    import transformers

    config = tiny_hf_config(arch, **overrides)
    torch.manual_seed(seed)
    model = getattr(transformers, arch)(config).float()
    randomize_weights(model, seed)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(path), max_shard_size="100KB" if sharded else "10GB")
    write_tokenizer(path, config.vocab_size)
    return path
