"""``bench serve --structured json_schema | tools``: constrained requests beside plain ones, in
one run under the same load (the same prompts, ``max_tokens`` and concurrency), and the host cost
of the grammars.

json_schema  /v1/completions over the prompts' token ids; plain requests ``ignore_eos`` (fixed
             lengths), constrained ones with ``response_format`` ``json_schema`` (``SCHEMA``)
tools        /v1/chat/completions, the prompts decoded to a user message; plain requests
             ``ignore_eos``, constrained ones with ``TOOLS`` and ``tool_choice: "required"`` (a
             forced call; a server whose tokenizer has no chat template refuses chat: the
             workload is reported skipped)

A constrained answer ends when its grammar completes, so it has fewer tokens than a plain one:
each side's throughput is its output tokens (from usage) per second of its own load, as measured.
Every constrained answer is validated here with ``jsonschema`` (the JSON text, or each call's
name and arguments against the tool's parameters); an answer cut off by ``max_tokens`` is invalid.
Besides the load: the grammar's compile ms on a fresh ``GrammarCompiler`` over the server model's
tokenizer (cold), then again (cached), and the host us per step of ``GrammarMatchers.fill`` at 64
rows, each matcher advanced by a random allowed token after every fill (restarted once complete).
"""
from __future__ import annotations

import json
import random
import time

import jsonschema

WORKLOADS = ("json_schema", "tools")
MASK_ROWS = 64

# every string, array and integer bounded: an answer is at most ~110 characters
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "minLength": 1, "maxLength": 16},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "status": {"type": "string", "enum": ["active", "inactive", "pending"]},
    "tags": {"type": "array", "items": {"type": "string", "minLength": 1, "maxLength": 8}, "minItems": 1,
             "maxItems": 3},
    "verified": {"type": "boolean"}},
    "required": ["name", "age", "status", "tags", "verified"], "additionalProperties": False}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The current weather in a city",
                                      "parameters": {"type": "object", "properties": {
                                          "city": {"type": "string", "minLength": 1, "maxLength": 16},
                                          "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                                          "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "search_products", "description": "Search the product catalogue",
                                      "parameters": {"type": "object", "properties": {
                                          "query": {"type": "string", "minLength": 1, "maxLength": 24},
                                          "max_results": {"type": "integer", "minimum": 1, "maximum": 20},
                                          "in_stock": {"type": "boolean"}},
                                          "required": ["query", "max_results", "in_stock"],
                                          "additionalProperties": False}}},
]


NOTES = {
    "both": "output tok/s as measured (usage tokens / wall of each side): a constrained answer ends when its grammar "
            "completes, plain ones run to max_tokens (ignore_eos)",
    "json_schema": "",
    "tools": "; constrained prompts carry the rendered tools (see input_tokens), their first chunk is the call's "
             "head, sent once the parser has read the function's name, and a step may send several chunks (the "
             "parser's deltas; their gaps count in ITL)",
}


def request_body(workload: str, constrained: bool, prompt, max_tokens: int) -> tuple[str, dict]:
    """(route, body) of one streamed request: ``prompt`` is token ids (json_schema) or the user
    message's text (tools)."""
    body = {"max_tokens": max_tokens, "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
    if not constrained:
        body["ignore_eos"] = True
    if workload == "json_schema":
        return "/v1/completions", {**body, "prompt": prompt, **({"response_format": RESPONSE_FORMAT} if constrained
                                                               else {})}
    extra = {"tools": TOOLS, "tool_choice": "required"} if constrained else {}
    return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": prompt}], **extra}


def validate(workload: str, result) -> str | None:
    """Why a constrained answer (a ``serve.RequestResult``) does not follow its schema, or None."""
    if result.finish_reason == "length":
        return "cut off by max_tokens"
    try:
        if workload == "json_schema":
            jsonschema.validate(json.loads(result.text), SCHEMA)
            return None
        if len(result.tool_calls) != 1:
            return f"{len(result.tool_calls)} tool calls, expected one"
        call = result.tool_calls[0]
        tool = next((t["function"] for t in TOOLS if t["function"]["name"] == call["name"]), None)
        if tool is None:
            return f"unknown tool {call['name']!r}"
        jsonschema.validate(json.loads(call["arguments"]), tool["parameters"])
        return None
    except (ValueError, jsonschema.ValidationError) as e:
        return f"{type(e).__name__}: {e}"[:300]


def workload_spec(workload: str, architecture: str):
    """The ``StructuredSpec`` the server compiles for the workload's constrained requests (for
    tools, as ``OpenAIProtocol`` builds it with the architecture's default tool-call parser)."""
    from engine.entrypoints.server.openai_types import ChatRequest
    from engine.entrypoints.server.request_body import RequestLimits
    from engine.entrypoints.server.request_model import validated
    from engine.entrypoints.server.tool_parsers import default_tool_parser, tool_parser
    from engine.entrypoints.server.tools import call_schema, validate_tools
    from engine.scheduling.structured.spec import spec_from_request, tool_call_spec

    if workload == "json_schema":
        return spec_from_request({"response_format": RESPONSE_FORMAT})
    parser = tool_parser(default_tool_parser(architecture))
    tools = validate_tools(validated(ChatRequest, {"messages": [{"role": "user", "content": "x"}], "tools": TOOLS,
                                                   "tool_choice": "required"}, RequestLimits()))
    return tool_call_spec(parser.call_prefix, call_schema(tools, parser.arguments_key), parser.call_suffix)


def grammar_costs(spec, tokenizer, vocab_size: int, stop_token_ids, mask_steps: int, seed: int) -> dict:
    """Compile ms of ``spec`` on a fresh compiler (cold) and again (cached), and the host us of one
    ``GrammarMatchers.fill`` of ``MASK_ROWS`` rows, averaged over ``mask_steps`` steps."""
    from engine.scheduling.structured.compiler import GrammarCompiler

    compiler = GrammarCompiler(tokenizer, vocab_size, stop_token_ids, timeout_s=600.0)
    try:
        start = time.perf_counter()
        compiled = compiler.compile(spec)
        cold = time.perf_counter() - start
        start = time.perf_counter()
        compiler.compile(spec)
        cached = time.perf_counter() - start
    finally:
        compiler.close()
    return {"compile_ms_cold": 1e3 * cold, "compile_ms_cached": 1e3 * cached,
            "mask_fill_us_per_step": mask_fill_us(compiled, vocab_size, MASK_ROWS, mask_steps, seed),
            "mask_rows": MASK_ROWS, "mask_steps": mask_steps}


def mask_fill_us(compiled, vocab_size: int, rows: int, steps: int, seed: int) -> float:
    """Host us per ``GrammarMatchers.fill`` of ``rows`` matchers of ``compiled``: after each fill
    every matcher accepts a random token its row allows; a terminated one starts again."""
    import torch

    from engine.scheduling.structured.matchers import GrammarMatchers

    rng = random.Random(seed)
    matchers = GrammarMatchers(vocab_size)
    bitmask = matchers.allocate(rows)
    ids = list(range(rows))
    for i in ids:
        matchers.add(i, compiled)
    fresh, shifts, spent = rows, torch.arange(32, dtype=torch.int32), 0.0
    for _ in range(steps):
        start = time.perf_counter()
        matchers.fill(list(enumerate(ids)), bitmask)
        spent += time.perf_counter() - start
        allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).flatten(1)[:, :vocab_size]
        for row, request_id in enumerate(ids):
            choices = allowed[row].nonzero().flatten().tolist()
            if not matchers.accept(request_id, [rng.choice(choices)]):
                raise RuntimeError("a matcher refused a token its own mask allowed")
            if matchers.is_terminated(request_id):
                matchers.remove(request_id)
                ids[row], fresh = fresh, fresh + 1
                matchers.add(ids[row], compiled)
    return 1e6 * spent / steps


def compare(workload: str, plain: dict, constrained: dict, invalid: list[str], costs: dict) -> dict:
    """The workload's report: each side's serve metrics, the ratios constrained / plain and the
    grammar's costs."""
    def ratio(a, b):
        return a / b if a is not None and b else None

    return {
        "workload": workload, "plain": plain, "constrained": constrained,
        "constrained_valid": constrained["completed"] - len(invalid), "constrained_invalid": len(invalid),
        "first_invalid": invalid[0] if invalid else None,
        "structured_vs_plain_throughput_ratio": ratio(constrained["output_throughput"], plain["output_throughput"]),
        "itl_p99_ratio": ratio(constrained["itl_ms"]["p99"], plain["itl_ms"]["p99"]),
        **costs,
        "note": NOTES["both"] + NOTES[workload],
    }


def bench_structured(url: str, workload: str, prompts: list[list[int]], output_lens: list[int], tokenizer,
                     vocab_size: int, stop_token_ids, architecture: str, request_rate: float,
                     max_concurrency: int | None, seed: int, mask_steps: int) -> dict:
    """Run ``workload``'s plain load, then its constrained load (the same prompts, the first
    token changed so that neither side finds the other's prompts in the prefix cache; tools: the
    prompts decoded to text, ids past the tokenizer's taken modulo its size), each after one
    untimed request (the server's grammar compiled and cached before the constrained load);
    validate the constrained answers; add the grammar's costs.
    A tools workload on a server without a chat template is ``{"workload", "skipped": why}``."""
    import asyncio

    from engine.entrypoints.bench.serve import run_load, send_request, serve_metrics

    if workload == "json_schema":
        sides = {"plain": prompts, "constrained": [[(p[0] + 1) % vocab_size, *p[1:]] for p in prompts]}
    else:
        texts = [tokenizer.decode([t % len(tokenizer) for t in p], skip_special_tokens=True) for p in prompts]
        sides = {"plain": texts, "constrained": texts}
    report = {}
    for side, side_prompts in sides.items():
        def shape(prompt, max_tokens, constrained=side == "constrained"):
            return request_body(workload, constrained, prompt, max_tokens)

        warm = asyncio.run(_one(url, side_prompts[0], output_lens[0], shape, send_request))
        if not warm.ok and "no_chat_template" in (warm.error or ""):
            return {"workload": workload, "skipped": f"the server has no chat template: {warm.error}"}
        results, seconds = asyncio.run(run_load(url, side_prompts, output_lens, request_rate, max_concurrency, seed,
                                                shape, desc=f"{workload} {side}"))
        report[side] = serve_metrics(results, seconds)
    invalid = [why for r in results if r.ok and (why := validate(workload, r)) is not None]  # the constrained
    spec = workload_spec(workload, architecture)
    return compare(workload, report["plain"], report["constrained"], invalid,
                   grammar_costs(spec, tokenizer, vocab_size, stop_token_ids, mask_steps, seed))


async def _one(url: str, prompt, max_tokens: int, shape, send_request):
    import aiohttp

    async with aiohttp.ClientSession() as session:
        return await send_request(session, url, prompt, max_tokens, shape)
