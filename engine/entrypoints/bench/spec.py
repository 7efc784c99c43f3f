"""``python -m engine bench spec``: speculative decoding (``--speculative``, alias ``--method``: ngram by
default, or draft, eagle3, mtp) at B=1.

Workloads (a checkpoint with a real tokenizer; default the demo model), each request alone,
greedy, through a plain engine (the default: overlapped steps) and a speculative one:

- ``edit``: a function from the held-out test split of the demo model's corpus
  (``spec_workload.json``, written by ``scripts/make_spec_workload.py``), then the same function
  begun again with a parameter renamed (its first two lines); the answer is asked to run as
  long as the edited rest of the function (+ 8 tokens). Much of it can be copied from the prompt.
- ``plain``: the first half of each function's lines, continued as long as the rest: little
  to copy.

The engines take the requests in turn (a host whose speed drifts slows both alike). Per
workload and engine: output tokens, target forwards (engine steps: each computes one forward of
the target model; the prefill counts), tokens per forward, seconds and tok/s; for the
speculative engine the drafted and accepted tokens, and whether its tokens equal the plain
engine's (they must). The verify step: the time of a B=1 decode step against a verify step of
the same sequence with k drafts (``--verify-context`` tokens of context; CUDA graphs unless
``--enforce-eager``), median of ``--verify-steps``, and their ratio; with a model drafter
(``--speculative draft|eagle3|mtp``) also the time of drafting k tokens (after a step that leaves
it one position to catch up) and (drafting + verifying) / decoding: the step's cost that an
acceptance must pay for.
"""
from __future__ import annotations

import json
import re
import statistics
import time
from pathlib import Path

import torch

from engine.scheduling.sequence import SamplingParams, Sequence
from engine.scheduling.step import ScheduledBatch

WORKLOAD = Path(__file__).with_name("spec_workload.json")
HEAD_LINES = 2  # lines of the edited function the edit prompt begins


def edit_workload() -> list[tuple[str, str]]:
    """(prompt, the rest of the edited function) per workload function."""
    items = []
    for item in json.loads(WORKLOAD.read_text())["functions"]:
        old, new = item["rename"]
        lines = re.sub(rf"\b{re.escape(old)}\b", new, item["code"]).splitlines()
        items.append((f"{item['code']}\n\n\n" + "\n".join(lines[:HEAD_LINES]),
                      "\n" + "\n".join(lines[HEAD_LINES:]) + "\n"))
    return items


def plain_workload() -> list[tuple[str, str]]:
    """(the first half of a function's lines, the rest) per workload function."""
    items = []
    for item in json.loads(WORKLOAD.read_text())["functions"]:
        lines = item["code"].splitlines()
        half = len(lines) // 2
        items.append(("\n".join(lines[:half]), "\n" + "\n".join(lines[half:]) + "\n"))
    return items


def run_request(engine, prompt: str, answer: str) -> dict:
    """``prompt`` alone, greedy, for ``answer`` 's token count + 8 tokens (EOS ends it sooner): its
    tokens, the target forwards it took, seconds, and the drafted and accepted tokens."""
    tokenizer = engine.tokenizer
    params = SamplingParams(temperature=0.0, max_tokens=len(tokenizer.encode(answer)) + 8)
    steps, start = engine.num_steps, time.perf_counter()
    rid = engine.add_request(tokenizer.encode(prompt, add_special_tokens=False), params)
    while engine.has_unfinished_requests():
        engine.step()
    out = engine.pop_request(rid)
    return {"token_ids": out.token_ids, "forwards": engine.num_steps - steps, "seconds": time.perf_counter() - start,
            "drafted": out.num_draft_tokens, "accepted": out.num_accepted_tokens}


def workload_figures(engine, runs: list[dict]) -> dict:
    """One engine's figures over its ``run_request`` results."""
    tokens = sum(len(run["token_ids"]) for run in runs)
    forwards, seconds = sum(run["forwards"] for run in runs), sum(run["seconds"] for run in runs)
    figures = {"requests": len(runs), "output_tokens": tokens, "forwards": forwards,
               "tokens_per_forward": tokens / forwards, "seconds": seconds, "tok_s": tokens / seconds}
    if engine.scheduler.drafter is not None:
        drafted, accepted = sum(run["drafted"] for run in runs), sum(run["accepted"] for run in runs)
        figures.update(draft_tokens=drafted, accepted_tokens=accepted, acceptance_rate=accepted / max(drafted, 1))
    return figures


def run_workloads(plain, spec, num_requests: int | None) -> dict:
    """Both workloads through both engines (warmed up on one request first), request by request
    in turn (plain first on even requests, speculative first on odd ones), so that a host whose
    speed drifts during the run slows both alike."""
    report = {}
    for name, items in (("edit", edit_workload()), ("plain", plain_workload())):
        items = items[:num_requests]
        for engine in (plain, spec):
            run_request(engine, *items[0])  # warm-up
        runs = {plain: [], spec: []}
        for i, item in enumerate(items):
            for engine in ((plain, spec) if i % 2 == 0 else (spec, plain)):
                runs[engine].append(run_request(engine, *item))
        plain_figures, spec_figures = workload_figures(plain, runs[plain]), workload_figures(spec, runs[spec])
        same = [a["token_ids"] for a in runs[plain]] == [b["token_ids"] for b in runs[spec]]
        report[name] = {"plain": plain_figures, "spec": spec_figures, "same_tokens": same,
                        "forwards_saved": 1 - spec_figures["forwards"] / plain_figures["forwards"],
                        "speedup": spec_figures["tok_s"] / plain_figures["tok_s"]}
    return report


def measure_verify_step(engine, num_drafts: int, context_len: int, steps: int) -> dict:
    """Median ms of a B=1 decode step and of a verify step with ``num_drafts`` drafted tokens
    after ``context_len`` tokens (the runner's launch and read-back of one step, repeated on the
    same sequence: each rewrites the same slots), and their ratio."""
    runner, bm = engine.runner, engine.block_manager
    context_len = min(context_len, engine.max_model_len - num_drafts - 1)
    seq = Sequence([(7 * i) % engine.config.vocab_size for i in range(context_len)],
                   SamplingParams(temperature=0.0, max_tokens=num_drafts + 1), request_id="verify-step")
    bm.allocate(seq)
    if bm.take_slots(seq, context_len + num_drafts) < context_len + num_drafts:
        raise ValueError(f"the KV cache cannot hold {context_len + num_drafts} tokens")
    drafter = getattr(runner, "drafter", None)
    times = {}

    def median_ms(run, before=lambda: None) -> float:
        samples = []
        for i in range(steps + 3):  # the first three warm up
            before()
            start = time.perf_counter()
            run()
            if i >= 3:
                samples.append(time.perf_counter() - start)
        return 1e3 * statistics.median(samples)

    try:
        for name, draft in (("decode", []), ("verify", [1] * num_drafts)):
            batch = ScheduledBatch([seq], [context_len - 1], [1 + len(draft)], [True], [draft])
            times[name] = median_ms(lambda: runner.launch(batch).token_ids())
        if drafter is not None:
            # the step before a draft: a verify entry one position back, so the drafter catches up one position
            before = ScheduledBatch([seq], [context_len - 2], [1 + num_drafts], [True], [[1] * num_drafts])

            def last_step():
                runner.launch(before).token_ids()
                drafter.kv_len[seq.request_id] = context_len - 2

            times["draft"] = median_ms(lambda: drafter.propose([seq], [num_drafts]), last_step)
    finally:
        runner.release(seq)
        bm.free(seq)
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)
    report = {"context_len": context_len, "num_drafts": num_drafts, "graphs": bool(getattr(runner, "graphs", None)),
              "decode_ms": times["decode"], "verify_ms": times["verify"], "ratio": times["verify"] / times["decode"]}
    if drafter is not None:
        report.update(method=drafter.method, draft_ms=times["draft"],
                      draft_and_verify_ratio=(times["draft"] + times["verify"]) / times["decode"])
    return report
