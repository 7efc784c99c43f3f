"""Shared by phase 14's constrained-decoding tests: a tiny random Qwen3 checkpoint over the demo
model's byte-level tokenizer, random prompts, and greedy decoding by the definitions on
transformers' logits (the grammar's bitmask unpacked here, bias, allowed ids, bad words)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from engine.core.engine_config import DEFAULT_MODEL_DIR
from engine.scheduling.sequence import SamplingParams
from engine.scheduling.structured.compiler import GrammarCompiler
from engine.scheduling.structured.matchers import GrammarMatchers
from phases.checkpoints import make_tiny_checkpoint, written_once

EOS = 0  # the demo tokenizer's <|endoftext|>
VOCAB = 8192


def demo_tokenizer_checkpoint(path: Path, seed: int) -> Path:
    """A tiny Qwen3 (every weight random, from ``seed``) over the demo tokenizer's 8192 tokens,
    EOS its <|endoftext|> (0); under torchrun written by rank 0 only."""
    def make() -> Path:
        make_tiny_checkpoint(path, "Qwen3ForCausalLM", seed=seed, vocab_size=VOCAB)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(DEFAULT_MODEL_DIR / name, path / name)
        for name in ("config.json", "generation_config.json"):
            config = json.loads((path / name).read_text())
            config.update(bos_token_id=EOS, eos_token_id=EOS)
            (path / name).write_text(json.dumps(config))
        return path
    return written_once(make)


def prompts(count: int, seed: int = 0, length: int = 30) -> list[list[int]]:
    """Random prompts of ``length`` tokens."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(2, VOCAB, (length,), generator=gen).tolist() for _ in range(count)]


def run(engine, requests: list[tuple[list[int], SamplingParams]]) -> list:
    """The outputs of ``requests`` ((prompt, params)) run together to the end."""
    ids = [engine.add_request(p, params) for p, params in requests]
    while engine.has_unfinished_requests():
        engine.step()
    return [engine.pop_request(rid) for rid in ids]


def allowed_by(bitmask_row: torch.Tensor) -> torch.Tensor:
    """Bool [VOCAB]: bit t % 32 of word t // 32 of an int32 bitmask row (xgrammar's layout)."""
    shifts = torch.arange(32, dtype=torch.int64).repeat(VOCAB // 32)
    return ((bitmask_row.to(torch.int64).repeat_interleave(32) >> shifts) & 1).bool()


def reference_greedy(hf, compiler: GrammarCompiler, prompt: list[int], params: SamplingParams) -> list[int]:
    """Greedy tokens by the definitions on ``hf``'s float32 logits: the grammar's allowed tokens
    only, plus the biases, only the allowed ids, the bad words' last tokens banned where the
    output ends with their other tokens; stop at EOS (unless ignore_eos), a complete grammar,
    a refused token or max_tokens."""
    matchers = None
    if params.structured is not None:
        matchers = GrammarMatchers(VOCAB)
        matchers.add(0, compiler.compile(params.structured))
        bitmask = matchers.allocate(1)
    out: list[int] = []
    while len(out) < params.max_tokens:
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + out])).logits[0, -1].float()
        if matchers is not None:
            matchers.fill([(0, 0)], bitmask)
            logits[~allowed_by(bitmask[0])] = float("-inf")
        for token, bias in params.logit_bias:
            logits[token] += bias
        if params.allowed_token_ids is not None:
            keep = torch.zeros(VOCAB, dtype=torch.bool)
            keep[list(params.allowed_token_ids)] = True
            logits[~keep] = float("-inf")
        for word in params.bad_words_token_ids:
            if len(word) == 1 or (len(out) >= len(word) - 1 and tuple(out[len(out) - len(word) + 1:]) == word[:-1]):
                logits[word[-1]] = float("-inf")
        out.append(int(logits.argmax()))
        if matchers is not None and (not matchers.accept(0, out[-1:]) or matchers.is_terminated(0)):
            break
        if out[-1] == EOS and not params.ignore_eos:
            break
    return out
