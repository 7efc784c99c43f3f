"""Shared by the phase-13 tests: tiny word-vocabulary checkpoints (every token a word, so stop
strings and texts are real), prompts that repeat themselves (so n-gram drafts exist), an engine
driver that records how many tokens each step gave each request, and the tokens per step that
greedy speculation must give, computed from a plain greedy run with the drafting rule written
here (test_drafter checks the drafter against the same rule)."""
from __future__ import annotations

import importlib
import random

from engine.core.llm_engine import LLMEngine
from phases.checkpoints import WORDS

VOCAB = 2 + len(WORDS)  # ids 0 and 1 are <unk> and <|endoftext|> (the EOS)
engine_cases = importlib.import_module("phases.09_engine_integration.engine_cases")
assert_no_block_leaks = engine_cases.assert_no_block_leaks
shrink_kv_pool = engine_cases.shrink_kv_pool
hf_greedy = engine_cases.hf_greedy
SPEC = dict(speculative="ngram", num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3)


def repeating_prompts(seed: int) -> list[list[int]]:
    """Word-id prompts of 3..40 tokens, some made of a repeated phrase, three sharing a prefix."""
    rng = random.Random(seed)

    def words(n):
        return [rng.randrange(2, VOCAB) for _ in range(n)]

    phrase, prefix = words(5), words(20)
    return [words(3), words(9), phrase * 3, words(17) + phrase + words(2) + phrase[:3], prefix + words(3),
            prefix + words(6), prefix + phrase * 4]


def covering_prompt(seed: int) -> list[int]:
    """Every token id once, in a random order, then a few of them again: whatever token a model
    samples first occurred before, so the first decode drafts (prompt_lookup_min = 1)."""
    rng = random.Random(seed)
    tokens = list(range(VOCAB))
    rng.shuffle(tokens)
    return tokens + tokens[:5]


def run(engine: LLMEngine, prompts: list[list[int]], params, abort_after: dict[int, int] | None = None):
    """Submit every prompt, step until done, aborting prompt i once ``abort_after[i]`` steps have
    given it tokens. Returns the outputs (token ids, text, finish reason) and, per prompt, the
    number of tokens each step that gave it any gave it."""
    params = params if isinstance(params, list) else [params] * len(prompts)
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    runs = {rid: [] for rid in ids}
    abort_after = abort_after or {}
    while engine.has_unfinished_requests():
        engine.step()
        for i, rid in enumerate(ids):
            out = engine.request_output(rid)
            count, finished = len(out.token_ids), out.finished
            if count > sum(runs[rid]):
                runs[rid].append(count - sum(runs[rid]))
                if len(runs[rid]) == abort_after.get(i) and not finished:
                    assert engine.abort_request(rid)
    outs = [engine.pop_request(rid) for rid in ids]
    return [(o.token_ids, o.text, o.finish_reason) for o in outs], [runs[rid] for rid in ids], outs


def reference_draft(tokens: list[int], num: int, n_min: int, n_max: int) -> list[int]:
    """Prompt lookup by brute force: the latest earlier occurrence of the longest suffix of
    n_max..n_min tokens, and the ``num`` tokens after it (copied on into the proposal)."""
    for n in range(min(n_max, len(tokens) - 1), n_min - 1, -1):
        starts = [i for i in range(len(tokens) - n) if tokens[i:i + n] == tokens[len(tokens) - n:]]
        if starts:
            extended = list(tokens)
            for j in range(num):
                extended.append(extended[starts[-1] + n + j])
            return extended[len(tokens):]
    return []


def expected_runs(prompt: list[int], output: list[int], max_tokens: int, max_model_len: int, k: int = 4,
                  n_min: int = 1, n_max: int = 3) -> list[int]:
    """Tokens per step of greedy speculation whose plain greedy output is ``output``: the prefill
    gives one; each later step drafts from the known tokens within the room max_tokens and
    max_model_len leave, accepts the drafts equal to the plain output and gives one more."""
    runs, known = [1], prompt + output[:1]
    while len(known) - len(prompt) < len(output):
        done = len(known) - len(prompt)
        draft = reference_draft(known, min(k, max_tokens - done - 1, max_model_len - len(known) - 1), n_min, n_max)
        accepted = 0
        while accepted < len(draft) and draft[accepted] == output[done + accepted]:
            accepted += 1
        run = min(accepted + 1, len(output) - done)
        runs.append(run)
        known += output[done:done + run]
    return runs
