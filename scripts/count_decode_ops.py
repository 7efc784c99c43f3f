"""What one B=1 decode step dispatches, counted on the CPU: the non-view aten ops that model and
runner code issue outside the kernel interface, and the calls through it. On the GPU nearly each
is a kernel launch, so the count is a device-free proxy for the small kernels of a graph replay
(and for the host dispatch of an eager step).

    python scripts/count_decode_ops.py [--arch qwen3 | deepseek-v2-lite]

A tiny random checkpoint of the architecture's shape (DeepSeek-V2-Lite: greedy top-6 of 16
experts, so one token takes the gathered expert path). Prints one JSON object.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # phases/ (the tiny checkpoints) is not installed

VIEW_OPS = {"view", "_unsafe_view", "split", "split_with_sizes", "slice", "select", "transpose", "expand",
            "as_strided", "t", "unsqueeze", "squeeze", "detach", "alias", "empty", "new_empty", "empty_strided",
            "permute", "unbind", "reshape", "flatten", "lift_fresh", "_reshape_alias", "scalar_tensor"}
ARCHS = {"qwen3": ("Qwen3ForCausalLM", {}),
         "deepseek-v2-lite": ("DeepseekV2ForCausalLM", {"n_routed_experts": 16, "num_experts_per_tok": 6})}


def main() -> None:
    from engine.llm_engine import LLMEngine
    from engine.sequence import SamplingParams
    from phases.checkpoints import V2_LITE, make_tiny_checkpoint
    from phases.harness import count_step

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", choices=sorted(ARCHS), default="deepseek-v2-lite")
    args = parser.parse_args()
    arch, overrides = ARCHS[args.arch]
    if arch.startswith("Deepseek"):
        overrides = {**V2_LITE, **overrides}
    with tempfile.TemporaryDirectory() as tmp:
        path = make_tiny_checkpoint(Path(tmp), arch, seed=0, **overrides)
        engine = LLMEngine(path, device="cpu", block_size=16, max_num_seqs=2, max_model_len=256, progress=False)
    engine.add_request([5] * 20, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    engine.step()  # prefill
    engine.step()  # a first decode step: anything lazily built is built
    patch = pytest.MonkeyPatch()
    try:
        ops = count_step(engine.step, patch)
    finally:
        patch.undo()
    model_ops = {k: v for k, v in sorted(ops.model_ops.items()) if k not in VIEW_OPS}
    print(json.dumps({"arch": args.arch, "layers": engine.config.num_hidden_layers,
                      "non_view_ops": sum(model_ops.values()), "kernel_calls": sum(ops.kernel_calls.values()),
                      "ops": model_ops, "kernels": dict(sorted(ops.kernel_calls.items()))}))


if __name__ == "__main__":
    main()
