"""The shipped default model (engine/default_model, a tiny Qwen3 trained on the CPython standard
library by scripts/train_demo_model.py, then fine-tuned to chat by its --chat stage): our engine
follows transformers exactly on it. Trained weights make a sharper oracle than random ones: their
logits are far from flat. It has a chat template (Qwen3's shape, every turn ended by its EOS) and,
greedy, ends a held-out chat turn with EOS and calls a tool with schema-valid arguments."""
import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest
import torch

from engine.core.engine_config import DEFAULT_MODEL_DIR
from engine.core.llm_engine import LLMEngine
from engine.scheduling.sequence import SamplingParams
from engine_cases import assert_no_block_leaks, hf_greedy

CODE_PROMPTS = ["def fibonacci(n):", "import os\n", "class Stack:\n    def __init__(self):", "for i in range(",
                "    def __repr__(self):\n        return", "# Copyright"]
REPO = Path(__file__).resolve().parents[2]


def script(name: str):
    """scripts/NAME.py as a module (registered in sys.modules, as its dataclasses need)."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def held_out_text(max_chars: int = 6000) -> str:
    """Text the model never trained on: this interpreter's stdlib files in the script's test split."""
    return "\n".join(script("train_demo_model").stdlib_sources()["test"])[:max_chars]


@pytest.fixture(scope="module")
def engine():
    return LLMEngine(max_num_seqs=4, max_model_len=1024)


def test_default_model_is_shipped_and_small():
    """The demo model's checkpoint, and its two speculative drafters beside it (phase 13's: a draft
    model and an EAGLE-3 head, scripts/train_demo_drafters.py), 30 MiB at most together."""
    files = sorted(p.relative_to(DEFAULT_MODEL_DIR).as_posix() for p in DEFAULT_MODEL_DIR.rglob("*") if p.is_file())
    checkpoint = ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                  "tokenizer_config.json"]
    assert files == sorted(checkpoint + [f"draft/{name}" for name in checkpoint]
                           + ["eagle3/config.json", "eagle3/model.safetensors"])
    assert sum(p.stat().st_size for p in DEFAULT_MODEL_DIR.rglob("*") if p.is_file()) <= 30 * 2**20


def test_greedy_code_completions_equal_transformers(engine):
    tok = engine.tokenizer
    prompts = [tok.encode(p, add_special_tokens=False) for p in CODE_PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=32)
    ours = engine.generate_tokens(prompts, params)
    assert ours == hf_greedy(DEFAULT_MODEL_DIR, prompts, 32, eos_token_id=tok.eos_token_id)
    assert_no_block_leaks(engine)


def test_held_out_loss_matches_transformers(engine):
    """Mean next-token cross-entropy on held-out stdlib code, from our logits (one prefill over
    the paged cache) and from transformers' (float32): equal within 1e-4, and far below a
    uniform guess (the model learnt something)."""
    import transformers

    ids = engine.tokenizer.encode(held_out_text(), add_special_tokens=False)[:1000]
    assert len(ids) == 1000
    logits = engine_prefill_logits(engine, ids)
    targets = torch.tensor(ids[1:])
    ours = torch.nn.functional.cross_entropy(logits[:-1].double(), targets).item()
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(DEFAULT_MODEL_DIR), dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = torch.nn.functional.cross_entropy(hf(torch.tensor([ids])).logits[0, :-1].double(), targets).item()
    assert abs(ours - theirs) < 1e-4, (ours, theirs)
    assert ours < 0.6 * torch.log(torch.tensor(float(engine.config.vocab_size))).item()


def engine_prefill_logits(engine, ids: list[int]) -> torch.Tensor:
    """Logits of every position of one prompt, through the runner's own prefill path."""
    from engine.scheduling.sequence import Sequence
    from engine.scheduling.step import ScheduledBatch

    runner, seq = engine.runner, Sequence(ids, SamplingParams(max_tokens=1), request_id="held-out")
    engine.block_manager.allocate(seq)
    batch = ScheduledBatch([seq], [0], [len(ids)], [True])  # the whole prompt in one chunk
    try:
        with torch.inference_mode():
            step = runner.prepare(batch)
            step.logits_indices = None  # every position's logits, not only the last token's
            return runner.forward(step)
    finally:
        runner.release(seq)
        engine.block_manager.free(seq)


def test_sampling_defaults_come_from_generation_config(engine, tmp_path):
    """The demo checkpoint recommends sampling (greedy loops on a model this small); a checkpoint
    whose generation_config.json does not sample gives greedy defaults."""
    assert engine.sampling_defaults == {"temperature": 0.6, "top_p": 0.9, "top_k": 0, "min_p": 0.0,
                                        "repetition_penalty": 1.0}
    from phases.checkpoints import make_tiny_checkpoint

    tiny = LLMEngine(make_tiny_checkpoint(tmp_path, "Qwen3ForCausalLM", seed=1), max_num_seqs=2, max_model_len=64)
    assert tiny.sampling_defaults == {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0,
                                      "repetition_penalty": 1.0}


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Get the current weather in a city.",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}


def test_the_chat_template_renders_system_user_tools_and_thinking(engine):
    """Qwen3's shape: the system prompt and the tools (one JSON object a line) in the first turn,
    the user's turn, an assistant turn opened (an empty think block with enable_thinking=False);
    in an agent's history the call is a hermes block and the result a <tool_response> in a user
    turn. Every turn ends with <|endoftext|>, which is the EOS id itself, so a greedy answer stops."""
    tok = engine.tokenizer
    messages = [{"role": "system", "content": "You are Pico."}, {"role": "user", "content": "Weather in Oslo?"}]
    on = tok.apply_chat_template(messages, tools=[WEATHER], add_generation_prompt=True, tokenize=False)
    assert on.startswith("<|im_start|>system\nYou are Pico.\n\n# Tools\n")
    assert "\n<tools>\n" + json.dumps(WEATHER) + "\n</tools>\n" in on
    assert on.endswith("<|endoftext|>\n<|im_start|>user\nWeather in Oslo?<|endoftext|>\n<|im_start|>assistant\n")
    off = tok.apply_chat_template(messages, tools=[WEATHER], add_generation_prompt=True, tokenize=False,
                                  enable_thinking=False)
    assert off == on + "<think>\n\n</think>\n\n"
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'}}
    history = messages + [{"role": "assistant", "content": None, "tool_calls": [call]},
                          {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 3}'}]
    loop = tok.apply_chat_template(history, tools=[WEATHER], add_generation_prompt=True, tokenize=False)
    assert loop == on + ('<tool_call>\n{"name": "get_weather", "arguments": {"city":"Oslo"}}\n</tool_call>'
                         '<|endoftext|>\n<|im_start|>user\n<tool_response>\n{"temperature": 3}\n</tool_response>'
                         '<|endoftext|>\n<|im_start|>assistant\n')
    assert tok.encode("<|endoftext|>", add_special_tokens=False) == [tok.eos_token_id] == [0]


def test_greedy_chat_ends_its_turn_and_calls_a_tool(engine):
    """The shipped weights, greedy, on 10 held-out chat and 10 held-out tool prompts of
    scripts/demo_chat.py (seeds EVAL_SEED and EVAL_SEED + 1, the conversations the fine-tune
    skips; scripts/eval_demo_chat.py measures 50 of each, docs/agents.md): a chat answer ends with
    EOS within 64 tokens (at least 9 of 10), and asked for what the one tool offered does, the
    model ends its turn with one hermes block calling that tool, its arguments valid against the
    tool's JSON schema (at least 8 of 10)."""
    import jsonschema

    chat = script("demo_chat")
    tok = engine.tokenizer
    params = SamplingParams(temperature=0.0, max_tokens=64)

    def prompt(conv, messages: list[dict]) -> list[int]:
        text = tok.apply_chat_template(messages, tools=conv.tools, add_generation_prompt=True, tokenize=False,
                                       enable_thinking=False)
        return tok.encode(text, add_special_tokens=False)

    chats = chat.conversations(chat.EVAL_SEED, 10, "test", kinds=("chat",))
    answers = engine.generate_tokens([prompt(c, c.messages[:max(c.targets)]) for c in chats], params)
    ended = [a for a in answers if 1 < len(a) <= 64 and a[-1] == tok.eos_token_id and tok.eos_token_id not in a[:-1]]
    assert len(ended) >= 9, [tok.decode(a) for a in answers]

    asks = chat.conversations(chat.EVAL_SEED + 1, 10, "test", kinds=("tool",), n_tools=1, direct=False)
    calls = engine.generate_tokens([prompt(c, c.messages[:max(c.targets) - 2]) for c in asks], params)
    valid = 0
    for conv, call in zip(asks, calls):
        block = re.fullmatch(r"<tool_call>\n(.*)\n</tool_call>", tok.decode(call[:-1]), re.DOTALL)
        if call[-1] != tok.eos_token_id or not block:
            continue
        try:
            written = json.loads(block.group(1))
            jsonschema.validate(written["arguments"], conv.tools[0]["function"]["parameters"])
        except (ValueError, KeyError, TypeError, jsonschema.ValidationError):
            continue
        valid += written["name"] == conv.tool == conv.tools[0]["function"]["name"]
    assert valid >= 8, [tok.decode(c) for c in calls]
    assert_no_block_leaks(engine)
