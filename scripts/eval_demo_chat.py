"""How well the demo model chats and calls tools, greedy, through this engine
(issue 58's acceptance figures; docs/agents.md, "The demo model as an agent").

    python scripts/eval_demo_chat.py                      # engine/default_model, about a minute on a CPU
    python scripts/eval_demo_chat.py --model DIR --out figures.json

The prompts are held out: demo_chat.conversations(--seed, ..., split="test") draws them from a seed
the fine-tune never uses (demo_chat.EVAL_SEED), and keeps only conversations whose first user
message falls in the held-out hash bucket, which the fine-tune skips. Each prompt is rendered by
the model's own chat template (tokenizer_config.json) and run by LLMEngine at temperature 0.

- chat: the last user turn of --chat-prompts plain conversations (system prompts, multi-turn),
  with thinking off (enable_thinking=False) and on (the template's default): the share whose
  answer ends with EOS within 64 tokens.
- tools: --tool-prompts requests for what one tool does, that tool alone in the system turn, as
  with ``tool_choice: auto`` (nothing constrains the output): the output is read as the server
  does (the qwen3 reasoning parser, then the hermes tool parser knowing the tool's name); a call
  counts when there is exactly one, of that tool, and its arguments validate against the tool's
  JSON schema (jsonschema). The loop then goes on as an agent's would: the assistant message with
  that call (or the reference call where the model made none) and the tool's result are appended,
  and the answer must be text: no call, some content, EOS within 64 tokens.
- direct: --direct-prompts questions no tool is for, with one tool offered: the share answered
  without a call (reported, no threshold).
Prints progress, a table of the figures and a last line of JSON (also written to --out).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jsonschema

sys.path.insert(0, str(Path(__file__).resolve().parent))  # demo_chat, beside this script
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the engine, when run from elsewhere

import demo_chat  # noqa: E402

from engine.core.engine_config import DEFAULT_MODEL_DIR  # noqa: E402
from engine.core.llm_engine import LLMEngine  # noqa: E402
from engine.entrypoints.server.reasoning import reasoning_parser  # noqa: E402
from engine.entrypoints.server.tool_parsers import HermesToolParser  # noqa: E402
from engine.scheduling.sequence import SamplingParams  # noqa: E402

TURN_TOKENS = 64    # an answer must end (EOS) within this many tokens
CALL_TOKENS = 128   # room for a thought and a call


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL_DIR)
    p.add_argument("--seed", type=int, default=demo_chat.EVAL_SEED, help="the held-out generator's seed")
    p.add_argument("--chat-prompts", type=int, default=50)
    p.add_argument("--tool-prompts", type=int, default=50)
    p.add_argument("--direct-prompts", type=int, default=20)
    p.add_argument("--out", type=Path, help="also write the JSON figures here")
    p.add_argument("--show", type=int, default=3, help="print this many transcripts of each kind")
    return p.parse_args(argv)


def generate(engine: LLMEngine, prompts: list[str], max_tokens: int) -> list:
    """Greedy outputs (RequestOutput: text, token_ids, finish_reason) of text prompts, in order."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    ids = [engine.add_request(p, params) for p in prompts]
    while engine.has_unfinished_requests():
        engine.step()
    engine.take_outputs()
    return [engine.pop_request(i) for i in ids]


def render(engine: LLMEngine, messages: list[dict], tools: list[dict] | None, thinking: bool) -> str:
    options = {} if thinking else {"enable_thinking": False}
    return engine.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False,
                                                **options)


def ended(out) -> bool:
    """The answer ended its turn: EOS within the token budget."""
    return out.finish_reason == "stop" and out.token_ids[-1] == 0 and len(out.token_ids) <= TURN_TOKENS


def read(prompt: str, text: str, names: set[str]) -> tuple[str | None, str | None, list]:
    """(reasoning, content, calls) of an output, read as the server reads it with
    --reasoning-parser qwen3 and the hermes tool parser."""
    reasoning, content = reasoning_parser("qwen3", prompt).extract(text)
    content, calls = HermesToolParser(names=names).extract(content or "")
    return reasoning, content, calls


def eval_chat(engine: LLMEngine, convs: list, show: int) -> dict:
    figures = {}
    for thinking in (False, True):
        prompts = [render(engine, c.messages[:max(c.targets)], None, thinking) for c in convs]
        outs = generate(engine, prompts, TURN_TOKENS)
        ok = [ended(o) for o in outs]
        key = "thinking_on" if thinking else "thinking_off"
        figures[key] = {"ended_within_64": sum(ok), "prompts": len(convs),
                        "mean_tokens": round(sum(len(o.token_ids) for o in outs) / len(outs), 1)}
        for c, o, good in list(zip(convs, outs, ok))[:show]:
            print(f"[chat, thinking {'on' if thinking else 'off'}] {c.messages[max(c.targets) - 1]['content']!r}\n"
                  f"  -> {o.text!r} ({len(o.token_ids)} tokens, {'EOS' if good else o.finish_reason})")
    return figures


def eval_tools(engine: LLMEngine, convs: list, show: int) -> dict:
    figures = {}
    for thinking in (False, True):
        first = [c.messages[:max(c.targets) - 2] for c in convs]  # system?, user
        prompts = [render(engine, m, c.tools, thinking) for c, m in zip(convs, first)]
        outs = generate(engine, prompts, CALL_TOKENS)
        valid, exact, loops = 0, 0, []
        for c, m, prompt, out in zip(convs, first, prompts, outs):
            tool = demo_chat.TOOLS_BY_NAME[c.tool]
            _, content, calls = read(prompt, out.text, {c.tool})
            good = False
            if len(calls) == 1 and out.finish_reason == "stop":
                try:
                    arguments = json.loads(calls[0].arguments)
                    jsonschema.validate(arguments, tool.spec()["function"]["parameters"])
                    good = True
                except (ValueError, jsonschema.ValidationError):
                    pass
            valid += good
            exact += good and arguments == c.arguments
            reference = c.messages[max(c.targets) - 2]  # the generator's assistant message with the call
            call = ({"id": "call_0", "type": "function",
                     "function": {"name": c.tool, "arguments": calls[0].arguments}} if good
                    else {**reference["tool_calls"][0], "id": "call_0"})
            result = c.messages[max(c.targets) - 1]["content"]
            if good:
                try:
                    result = json.dumps(tool.result(demo_chat.random.Random(0), arguments), ensure_ascii=False)
                except Exception:  # the simulated tool cannot take these (valid) arguments: the reference result
                    pass
            loops.append(m + [{"role": "assistant", "content": content, "tool_calls": [call]},
                              {"role": "tool", "tool_call_id": "call_0", "content": result}])
        prompts2 = [render(engine, m, c.tools, thinking) for c, m in zip(convs, loops)]
        answers = generate(engine, prompts2, TURN_TOKENS)
        texts = 0
        for c, prompt, o in zip(convs, prompts2, answers):
            _, content, calls = read(prompt, o.text, {c.tool})
            texts += bool(not calls and content and content.strip() and "<tool_call>" not in o.text and ended(o))
        key = "thinking_on" if thinking else "thinking_off"
        figures[key] = {"schema_valid_calls": valid, "exact_arguments": exact, "text_after_result": texts,
                        "prompts": len(convs)}
        for c, o, o2 in list(zip(convs, outs, answers))[:show]:
            print(f"[tool, thinking {'on' if thinking else 'off'}] {c.messages[max(c.targets) - 3]['content']!r}\n"
                  f"  -> {o.text!r}\n  -> after the result: {o2.text!r}")
    return figures


def eval_direct(engine: LLMEngine, convs: list) -> dict:
    figures = {}
    for thinking in (False, True):
        prompts = [render(engine, c.messages[:max(c.targets)], c.tools, thinking) for c in convs]
        outs = generate(engine, prompts, TURN_TOKENS)
        names = {c.tools[0]["function"]["name"] for c in convs}
        direct = sum(not read(p, o.text, names)[2] and "<tool_call>" not in o.text and ended(o)
                     for p, o in zip(prompts, outs))
        figures["thinking_on" if thinking else "thinking_off"] = {"answered_without_a_call": direct,
                                                                  "prompts": len(convs)}
    return figures


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t0 = time.perf_counter()
    engine = LLMEngine(args.model, max_num_seqs=16, max_model_len=1024)
    if not engine.tokenizer.chat_template:
        print(f"{args.model} has no chat template", file=sys.stderr)
        return 1
    chat = demo_chat.conversations(args.seed, args.chat_prompts, "test", kinds=("chat",))
    tools = demo_chat.conversations(args.seed + 1, args.tool_prompts, "test", kinds=("tool",), n_tools=1,
                                    direct=False)
    direct = demo_chat.conversations(args.seed + 2, args.direct_prompts, "test", kinds=("tool",), n_tools=1,
                                     direct=True)
    report = {"model": str(args.model), "seed": args.seed, "greedy": True, "turn_tokens": TURN_TOKENS,
              "chat": eval_chat(engine, chat, args.show),
              "tools": eval_tools(engine, tools, args.show),
              "direct": eval_direct(engine, direct),
              "seconds": 0.0}
    report["seconds"] = round(time.perf_counter() - t0, 1)
    for mode in ("thinking_off", "thinking_on"):
        c, t, d = report["chat"][mode], report["tools"][mode], report["direct"][mode]
        print(f"{mode:12s}  chat ended within {TURN_TOKENS}: {c['ended_within_64']}/{c['prompts']}  "
              f"schema-valid calls: {t['schema_valid_calls']}/{t['prompts']} "
              f"(exact arguments {t['exact_arguments']})  "
              f"text after the result: {t['text_after_result']}/{t['prompts']}"
              f"  no call when none is needed: {d['answered_without_a_call']}/{d['prompts']}")
    line = json.dumps(report)
    if args.out:
        args.out.write_text(line + "\n")
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
