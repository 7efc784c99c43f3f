"""Requests as the scheduler sees them: sampling parameters, status, tokens, blocks.

Pure Python (no torch): the model runner turns sequences into tensors on its
own device, so nothing here can leak a host tensor into a device forward.
"""
from __future__ import annotations

import enum
import math
import random
import time
import uuid
from dataclasses import dataclass
from typing import Any


class SequenceStatus(enum.Enum):
    """WAITING -> RUNNING_PREFILL -> RUNNING_DECODE -> FINISHED, or REJECTED at add time;
    RUNNING_PREFILL / RUNNING_DECODE -> WAITING when the scheduler preempts a sequence (it is
    recomputed). A prompt of several chunks stays RUNNING_PREFILL until its last chunk is
    scheduled (that step samples its first token). The scheduler assigns every transition."""

    WAITING = "waiting"
    RUNNING_PREFILL = "running_prefill"
    RUNNING_DECODE = "running_decode"
    FINISHED = "finished"
    REJECTED = "rejected"


MAX_SEED = 2**63 - 1
MAX_TOP_K = 2**31 - 1
MAX_STOP_STRINGS, MAX_STOP_STRING_CHARS = 16, 256
MAX_STOP_TOKEN_IDS = 64
MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0  # OpenAI's bound on a logit_bias value
MAX_BAD_WORDS = 64


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens for one request; invalid values raise ValueError naming the field.

    temperature 0 is greedy; top_k 0 or -1 and top_p 1.0 turn those filters off;
    stop strings are matched by the engine's detokenizer, stop_token_ids and EOS
    (unless ignore_eos) by the scheduler; seed None means a random seed per request.
    ``min_tokens``: EOS and stop_token_ids cannot be sampled before that many tokens.
    Penalties (vLLM's semantics, applied to the logits on the device before temperature):
    ``repetition_penalty`` divides the positive logits (multiplies the negative ones) of every
    token in the prompt or the output so far; ``frequency_penalty`` subtracts the token's count in
    the output, ``presence_penalty`` subtracts once for a token present in the output
    (bounds: ``repetition_penalty`` in (0, 10], the other two in [-2, 2]).
    ``logprobs``: return, for each output token, its log-probability under the model (the
    log-softmax of the logits before temperature and penalties) and the ``logprobs`` most
    likely tokens' (None: none returned); ``prompt_logprobs`` likewise for each prompt token after
    the first (a request asking for them reuses no cached prefix).
    Constraints on which token comes next, applied to the logits on the device before the
    penalties (so temperature, top-k/p/min-p, penalties and seeds act inside what they allow):
    ``logit_bias`` adds ``bias`` to token ``id`` for each ``(id, bias)`` pair (bias in [-100,
    100]; given as a dict ``{id: bias}`` or as pairs in any order, kept as a tuple of pairs sorted
    by token id, so equal biases make equal params); ``allowed_token_ids`` (None: any) leaves
    only those tokens; ``bad_words_token_ids`` bans, for each token sequence, its last token
    wherever the output so far ends with the others (a one-token bad word is always banned);
    ``structured`` (an ``engine.scheduling.structured.StructuredSpec``) makes the output match a
    JSON schema, regex, choice or grammar: the engine compiles it and masks each step's logits
    with the grammar's allowed tokens, and the request finishes with "stop" when the grammar is
    complete.
    ``min_p`` (after temperature) drops the tokens whose probability is below ``min_p`` times
    the most likely token's (0: off).
    Output text: ``include_stop_str_in_output`` keeps a matched stop string at the end of the
    text; ``skip_special_tokens`` leaves special tokens out of the text (token ids and
    logprobs keep them).
    Every value is bounded here, where the request enters: a value the step could not run
    (an int past int64, an infinite float) never reaches it.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 16
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    min_p: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    allowed_token_ids: tuple[int, ...] | None = None
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    structured: Any = None  # an engine.scheduling.structured.StructuredSpec: carried here, read by phase 14's code
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    def __post_init__(self):
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        object.__setattr__(self, "logit_bias", tuple(sorted((t, b) for t, b in bias)))
        if self.allowed_token_ids is not None:
            object.__setattr__(self, "allowed_token_ids", tuple(self.allowed_token_ids))
        object.__setattr__(self, "bad_words_token_ids", tuple(tuple(w) for w in self.bad_words_token_ids))
        checks = (
            ("temperature", _is_float(self.temperature) and self.temperature >= 0, "must be a finite number >= 0"),
            ("top_p", _is_float(self.top_p) and 0 < self.top_p <= 1, "must be in (0, 1]"),
            ("top_k", _is_int(self.top_k) and -1 <= self.top_k <= MAX_TOP_K,
             f"must be an int in [-1, {MAX_TOP_K}] (0 or -1 = off)"),
            ("max_tokens", _is_int(self.max_tokens) and 1 <= self.max_tokens <= MAX_SEED,
             f"must be an int in [1, {MAX_SEED}]"),
            ("stop", len(self.stop) <= MAX_STOP_STRINGS and all(
                isinstance(s, str) and 0 < len(s) <= MAX_STOP_STRING_CHARS for s in self.stop),
             f"must hold at most {MAX_STOP_STRINGS} non-empty strings of at most {MAX_STOP_STRING_CHARS} characters"),
            ("stop_token_ids", len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS and all(
                _is_int(t) and 0 <= t <= MAX_TOP_K for t in self.stop_token_ids),
             f"must hold at most {MAX_STOP_TOKEN_IDS} token ids (ints >= 0)"),
            ("ignore_eos", isinstance(self.ignore_eos, bool), "must be a bool"),
            ("seed", self.seed is None or (_is_int(self.seed) and 0 <= self.seed <= MAX_SEED),
             f"must be None or an int in [0, {MAX_SEED}]"),
            ("min_tokens", _is_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens,
             "must be an int in [0, max_tokens]"),
            ("presence_penalty", _is_float(self.presence_penalty) and -2 <= self.presence_penalty <= 2,
             "must be in [-2, 2]"),
            ("frequency_penalty", _is_float(self.frequency_penalty) and -2 <= self.frequency_penalty <= 2,
             "must be in [-2, 2]"),
            ("repetition_penalty", _is_float(self.repetition_penalty) and 0 < self.repetition_penalty <= 10,
             "must be in (0, 10]"),
            ("logprobs", self.logprobs is None or (_is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS),
             f"must be None or an int in [0, {MAX_LOGPROBS}]"),
            ("prompt_logprobs", self.prompt_logprobs is None or (
                _is_int(self.prompt_logprobs) and 0 <= self.prompt_logprobs <= MAX_LOGPROBS),
             f"must be None or an int in [0, {MAX_LOGPROBS}]"),
            ("min_p", _is_float(self.min_p) and 0 <= self.min_p <= 1, "must be in [0, 1]"),
            ("logit_bias", len({t for t, _ in self.logit_bias}) == len(self.logit_bias) and all(
                _is_int(t) and 0 <= t <= MAX_TOP_K and _is_float(b) and abs(b) <= MAX_LOGIT_BIAS
                for t, b in self.logit_bias),
             f"must map distinct token ids (ints >= 0) to biases in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]"),
            ("allowed_token_ids", self.allowed_token_ids is None or (self.allowed_token_ids and all(
                _is_int(t) and 0 <= t <= MAX_TOP_K for t in self.allowed_token_ids)),
             "must be None or a non-empty list of token ids (ints >= 0)"),
            ("bad_words_token_ids", len(self.bad_words_token_ids) <= MAX_BAD_WORDS and all(
                w and all(_is_int(t) and 0 <= t <= MAX_TOP_K for t in w) for w in self.bad_words_token_ids),
             f"must hold at most {MAX_BAD_WORDS} non-empty token-id sequences"),
            ("structured", self.structured is None or isinstance(getattr(self.structured, "key", None), str),
             "must be None or an engine.scheduling.structured.StructuredSpec"),
            ("include_stop_str_in_output", isinstance(self.include_stop_str_in_output, bool), "must be a bool"),
            ("skip_special_tokens", isinstance(self.skip_special_tokens, bool), "must be a bool"),
        )
        for name, ok, rule in checks:
            if not ok:
                got = repr(getattr(self, name))  # never the whole of a large value
                raise ValueError(f"SamplingParams.{name} {rule}, got {got if len(got) <= 80 else got[:77] + '...'}")

    @property
    def constrained(self) -> bool:
        """Any constraint (bias, allowed ids, bad words, grammar) changes the logits."""
        return bool(self.logit_bias or self.allowed_token_ids is not None or self.bad_words_token_ids
                    or self.structured is not None)

    @property
    def reads_output(self) -> bool:
        """Its constraints read the output so far on the host (a grammar, a bad word of more than
        one token): each step's mask needs the previous step's token read back, and it takes no
        drafted tokens."""
        return self.structured is not None or any(len(w) > 1 for w in self.bad_words_token_ids)

    @property
    def penalized(self) -> bool:
        """Any penalty changes the logits."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_float(x) -> bool:
    """A finite real number (an int counts; a bool does not)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


class Sequence:
    """One request: prompt and output token ids, status, and the KV blocks it owns.

    ``output_token_ids`` holds the tokens read back to the host; ``num_pending_tokens`` more
    have been sampled by steps still in flight (the engine keeps one step in flight while it
    schedules the next) and are not known here yet. ``num_tokens`` / ``num_output_tokens``
    count the pending ones too: they are the sequence's length once its in-flight steps land,
    which is what scheduling (positions, slots, budgets) works with.

    ``block_table`` and ``num_cached_tokens`` (prompt tokens found in the prefix cache at
    allocation) belong to the BlockManager; ``status``, ``finish_reason``, ``reject_reason``,
    ``num_computed_tokens`` (tokens whose K/V is written once every scheduled step has run) and
    ``num_in_flight`` (scheduled steps holding this sequence not yet postprocessed) to the Scheduler,
    which also records ``num_cached_prompt_tokens`` (the prompt tokens the prefix cache gave it at
    its first admission, as vLLM reports them; kept after its blocks are freed) and counts the
    drafted tokens verified for it (``num_draft_tokens``, speculative decoding) and those the
    target model accepted (``num_accepted_tokens``).
    ``seed`` is the request's sampling seed, drawn on the host when none is given.
    ``client`` names who sent the request (a server's client key; "" for one client): waiting
    sequences are admitted round robin over clients (``engine.scheduling.waiting``).
    """

    def __init__(self, prompt_token_ids: list[int], sampling_params: SamplingParams | None = None,
                 request_id: str | None = None, arrival_time: float | None = None, client: str = ""):
        if not prompt_token_ids:
            raise ValueError("prompt_token_ids must not be empty")
        if not all(_is_int(t) and t >= 0 for t in prompt_token_ids):
            raise ValueError("prompt_token_ids must hold ints >= 0")
        if not isinstance(client, str):
            raise TypeError(f"client must be a str, got {type(client).__name__}")
        self.request_id = request_id if request_id is not None else uuid.uuid4().hex
        self.client = client
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.num_pending_tokens = 0
        self.sampling_params = sampling_params if sampling_params is not None else SamplingParams()
        seed = self.sampling_params.seed
        self.seed = seed if seed is not None else random.getrandbits(63)
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" | "rejected"
        self.reject_reason: str | None = None
        self.block_table: list[int] = []
        self.num_cached_tokens = 0
        self.num_cached_prompt_tokens: int | None = None  # None: never admitted
        self.num_computed_tokens = 0
        self.num_in_flight = 0
        self.num_draft_tokens = self.num_accepted_tokens = 0

    @property
    def token_ids(self) -> list[int]:
        """Prompt and output tokens known on the host (pending ones not included)."""
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_known_tokens(self) -> int:
        """Tokens known on the host: the first ``num_known_tokens`` of the sequence."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def last_token_id(self) -> int:
        """The newest known token, without building ``token_ids``."""
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids) + self.num_pending_tokens

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_pending_tokens

    @property
    def is_finished(self) -> bool:
        return self.status in (SequenceStatus.FINISHED, SequenceStatus.REJECTED)

    def __repr__(self) -> str:
        return (f"Sequence({self.request_id!r}, {self.status.name}, prompt={self.num_prompt_tokens}, "
                f"output={len(self.output_token_ids)}+{self.num_pending_tokens} pending, blocks={self.block_table})")
