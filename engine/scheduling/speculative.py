"""Speculative decoding's drafters: tokens proposed for a running sequence, which the target
model then verifies in one forward (``engine.scheduling.scheduler``: verify entries and acceptance).

A drafter is any object with ``num_speculative_tokens`` (the most it drafts for one sequence) and
``propose(seqs, rooms) -> list[list[int]]``: per sequence at most ``rooms[i]`` tokens (possibly
none) that may follow ``seqs[i].token_ids``, a deterministic function of them, so every TP rank
proposes the same drafts from the same tokens and only the sampled ids need to travel (rank 0
samples and broadcasts them). The scheduler has taken each sequence's slots for its room before
it asks. The model-based drafters (a draft model, EAGLE-3, DeepSeek's MTP layer:
``engine.worker.drafting``) draft greedily on the device behind the same interface.
"""
from __future__ import annotations

from array import array

from engine.scheduling.sequence import Sequence

SPECULATIVE_METHODS = ("ngram", "draft", "eagle3", "mtp")
DRAFT_CHECKPOINT_METHODS = ("draft", "eagle3")  # read a checkpoint of their own (--draft-model)
MAX_SPECULATIVE_TOKENS = 16
INT32 = array("i").itemsize


class NgramDrafter:
    """Prompt lookup: the longest suffix of the sequence's tokens (prompt and output), from
    ``prompt_lookup_max`` down to ``prompt_lookup_min`` tokens, that occurred earlier, and up to
    ``num_speculative_tokens`` tokens that followed its most recent earlier occurrence. The copy
    may run into the suffix itself and on into its own proposal (LZ77-style), so a repeating
    pattern is drafted at full length. Invalid values raise ValueError naming the option."""

    def __init__(self, num_speculative_tokens: int = 4, prompt_lookup_min: int = 2, prompt_lookup_max: int = 4):
        checks = (
            ("num_speculative_tokens", num_speculative_tokens, 1, MAX_SPECULATIVE_TOKENS),
            ("prompt_lookup_min", prompt_lookup_min, 1, 64),
            ("prompt_lookup_max", prompt_lookup_max, prompt_lookup_min, 64),
        )
        for name, value, low, high in checks:
            if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
                raise ValueError(f"{name} must be an int in [{low}, {high}], got {value!r}")
        self.num_speculative_tokens = num_speculative_tokens
        self.prompt_lookup_min, self.prompt_lookup_max = prompt_lookup_min, prompt_lookup_max

    def propose(self, seqs: list[Sequence], rooms: list[int]) -> list[list[int]]:
        return [self.lookup(seq.token_ids, min(room, self.num_speculative_tokens)) for seq, room in zip(seqs, rooms)]

    def lookup(self, tokens: list[int], num: int) -> list[int]:
        """Up to ``num`` tokens that followed the latest earlier occurrence of the longest
        matching suffix of ``tokens`` ([] when no suffix of at least ``prompt_lookup_min`` tokens
        occurred before). The search runs on the tokens' bytes (C speed)."""
        if num <= 0:
            return []
        data = array("i", tokens).tobytes()
        length = len(tokens)
        for n in range(min(self.prompt_lookup_max, length - 1), self.prompt_lookup_min - 1, -1):
            suffix = data[-n * INT32:]
            end = (length - 1) * INT32  # an occurrence starting before the suffix's own start
            while (found := data.rfind(suffix, 0, end)) >= 0 and found % INT32:
                end = found + len(suffix) - 1  # misaligned (inside a token): look further back
            if found >= 0:
                source = found // INT32 + n
                draft = []
                for j in range(num):
                    draft.append(tokens[source + j] if source + j < length else draft[source + j - length])
                return draft
        return []
