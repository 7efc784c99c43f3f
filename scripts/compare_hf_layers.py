"""Where does our bf16 model drift from HF transformers? Layer by layer, on a
Qwen3-8B-shaped model with random weights (CUDA).

    python scripts/compare_hf_layers.py [--tokens 300]

One prefill of a random sequence; after every decoder layer, the residual
stream of our model (bf16) and of HF's (bf16) against HF's in float32 on the
same weights. Prints one line per layer: relative error of each.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.attention_context import forward_context  # noqa: E402
from engine.kv_cache import bind_kv_cache  # noqa: E402
from phases.harness import prefill_context, random_qwen3_8b_pair, rel_err  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=300)
    n = parser.parse_args().tokens
    hf, ours = random_qwen3_8b_pair()
    ids = torch.randint(0, ours.config.vocab_size, (n,), device="cuda")

    streams = []
    hooks = [layer.register_forward_hook(lambda m, args, out: streams.append((out[0] + out[1]).float()))
             for layer in ours.model.layers]
    bind_kv_cache(ours, -(-n // 256), 256, torch.bfloat16, "cuda")
    positions, ctx = prefill_context([n], [0], [list(range(-(-n // 256)))], 256, "cuda")
    with forward_context(ctx), torch.no_grad():
        ours(ids, positions)
    for h in hooks:
        h.remove()
    with torch.no_grad():
        hf_bf16 = [h[0].float() for h in hf(ids[None], output_hidden_states=True).hidden_states[1:-1]]
        hf.float()
        truth = [h[0] for h in hf(ids[None], output_hidden_states=True).hidden_states[1:-1]]
    print(f"{'layer':>5} {'ours bf16':>10} {'hf bf16':>10}   (relative error of the residual stream vs HF fp32)")
    for i, (o, b, t) in enumerate(zip(streams, hf_bf16, truth)):
        print(f"{i:5d} {rel_err(o, t):10.4f} {rel_err(b, t):10.4f}")


if __name__ == "__main__":
    main()
