"""Requests' output: the one place that turns what the scheduler appended into what a caller sees.

``add`` when a request arrives. After each step ``process_outputs`` takes the scheduler's
``SequenceOutput``s (new token ids, finish reason) and the step's logprobs: every request's new
tokens are detokenised together, one batched tokenizer call per token index
(``engine.core.detokenizer``; one call unless a step appended accepted drafted tokens); a stop string
found in a token's new text cuts the text before it and ends the output at that token; the
logprobs of each new token are kept; each request's reported finish reason is decided. It
returns the unfinished requests the engine must end (a stop string, text that cannot be
decoded). ``finish`` takes a finish made outside a step's outputs (rejected, aborted, failed
with its step, ended by its grammar) and why, when known.

The finish state is the sequence's, which the scheduler writes (``status``, ``finish_reason``):
an output is finished when its sequence is, and reports the sequence's reason, except where
its text decided: "stop" when a stop string ended it (``stop_reason``), "error" with an
``error`` (text that could not be decoded, a failed step, a grammar's refusal). The engine ends
a request in the scheduler in the same call that ends its output, so no reader sees the two
apart.

Outputs are pushed: ``take_outputs`` returns, once, what each request's output gained since the
last call (its new tokens, text and logprobs, and its finish), one ``RequestOutput`` delta per
request that gained anything; ``LLMEngine.step`` returns them. ``output(request_id)`` is a
request's whole output. While a request runs its text stops short of the characters that could
still become the start of a stop string (the hold-back: len(longest stop string) - 1 characters,
none without stop strings), so text once pushed is never taken back; at its finish the whole
text is pushed. Requests created without text (``generate_tokens``, or another TP rank's copy of a request
without stop strings: only rank 0's text is read) cost nothing here.

The scheduler owns each ``Sequence``; this class only reads it.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

from engine.core.detokenizer import IncrementalDetokenizer, batch_decoder, detokenize
from engine.scheduling.sequence import Sequence
from engine.scheduling.step import SequenceOutput

log = logging.getLogger(__name__)

Logprobs = tuple[int, float, list[tuple[int, float]]]  # (token id, its logprob, [(token id, logprob)] most likely)


@dataclass
class RequestOutput:
    """A request's output: ``token_ids`` and ``text`` (from a reader's cursor on when it asked for
    a delta), ``finished`` and ``finish_reason`` (None while it runs, else "stop", "length",
    "abort", "error" or "rejected"; ``reject_reason`` says why a request was rejected,
    ``error`` why one failed or was aborted when that is known). ``logprobs`` (when the request
    asked for them; from the cursor on): per output token, its id, its logprob and the
    [(token id, logprob)] of the most likely tokens. Speculative decoding: the tokens drafted
    for it and verified (``num_draft_tokens``) and those accepted (``num_accepted_tokens``).
    ``num_cached_tokens``: its prompt tokens found in the prefix cache at its first admission
    (``Sequence.num_cached_prompt_tokens``; 0 before it was admitted). ``prompt_logprobs`` (when
    the request asked for them; always whole): per prompt token, None for the first, then as
    ``logprobs`` (the token, its logprob given the tokens before it, the most likely tokens),
    as far as its prefill chunks have computed (read on TP rank 0 only). ``stop_reason``: the stop
    string that ended it (finish reason "stop"; None when EOS or a stop token did, as vLLM's)."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None = None
    reject_reason: str | None = None
    logprobs: list[Logprobs] | None = None
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    error: str | None = None
    num_cached_tokens: int = 0
    prompt_logprobs: list[Logprobs | None] | None = None
    stop_reason: str | None = None


@dataclass
class RequestState:
    """What the output processor holds for one request: its ``seq`` (read only), the
    ``detokenizer`` of its text (None: no text), its ``logprobs`` and ``prompt_logprobs`` (None:
    not asked for; the prompt's start with None for its first token), how many
    characters a running request's text holds back (``hold_back``: its longest stop string - 1),
    how many of its output tokens reached the output (``num_tokens``), why it failed (``error``),
    the stop string that ended it (``stop_reason``), and how much of the output ``take_outputs``
    pushed already (``tokens_pushed``, ``text_pushed``: tokens and logprobs, characters)."""

    seq: Sequence
    detokenizer: IncrementalDetokenizer | None
    logprobs: list[Logprobs] | None
    hold_back: int
    num_tokens: int = 0
    error: str | None = None
    prompt_logprobs: list[Logprobs | None] | None = None
    stop_reason: str | None = None
    tokens_pushed: int = 0
    text_pushed: int = 0


class OutputProcessor:
    """Every request's output over ``tokenizer``. ``keeps_text``: this process reads the text
    (TP rank 0); elsewhere only requests with stop strings are detokenised (every rank must end
    them at the same token). ``decode`` is the batched decoder (``batch_decoder``)."""

    def __init__(self, tokenizer, keeps_text: bool = True):
        self.decode = batch_decoder(tokenizer)
        self.decode_special = batch_decoder(tokenizer, skip_special_tokens=False)
        self.keeps_text = keeps_text
        self.num_generation_tokens = 0  # tokens that reached an output
        self._requests: dict[str, RequestState] = {}
        self._changed: dict[str, None] = {}  # requests whose output gained since the last take_outputs()

    def add(self, seq: Sequence, detokenize: bool = True) -> None:
        params = seq.sampling_params
        text = detokenize and (self.keeps_text or bool(params.stop))
        self._requests[seq.request_id] = RequestState(
            seq, IncrementalDetokenizer(decode=self.decode if params.skip_special_tokens else self.decode_special)
            if text else None,
            [] if params.logprobs is not None else None, max(map(len, params.stop), default=1) - 1,
            prompt_logprobs=[None] if params.prompt_logprobs is not None else None)

    def remove(self, request_id: str) -> None:
        del self._requests[request_id]
        self._changed.pop(request_id, None)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    def request_ids(self) -> list[str]:
        return list(self._requests)

    def sequence(self, request_id: str) -> Sequence:
        return self._requests[request_id].seq

    def finish(self, request_id: str, error: str | None = None) -> None:
        """The request's sequence was finished outside a step's outputs (rejected, aborted, failed
        with its step, ended by its grammar): its output is pushed; ``error`` says why it failed."""
        state = self._requests[request_id]
        state.error = error
        self._changed[request_id] = None

    def take_outputs(self) -> list[RequestOutput]:
        """Per request whose output gained anything since the last call (new tokens, text or
        logprobs, or its finish; requests removed meanwhile left out), in the order they gained
        it: a ``RequestOutput`` of what it gained, its finish state whole."""
        changed, self._changed = self._changed, {}
        deltas = []
        for request_id in changed:
            state = self._requests.get(request_id)
            if state is None:
                continue
            delta = self._output(state, state.tokens_pushed, state.text_pushed)
            state.tokens_pushed += len(delta.token_ids)
            state.text_pushed += len(delta.text)
            deltas.append(delta)
        return deltas

    def output(self, request_id: str) -> RequestOutput:
        """The request's whole output so far."""
        return self._output(self._requests[request_id], 0, 0)

    def _output(self, state: RequestState, tokens_from: int, text_from: int) -> RequestOutput:
        """The request's output with its token ids and logprobs from output index ``tokens_from``
        on and its text from character ``text_from`` on (copying nothing before them)."""
        seq, detok, finished = state.seq, state.detokenizer, state.seq.is_finished
        text = ""
        if detok is not None:
            end = detok.length if finished else detok.length - state.hold_back
            text = detok.text_from(text_from)[:max(0, end - text_from)]
        return RequestOutput(seq.request_id, seq.prompt_token_ids, seq.output_token_ids[tokens_from:state.num_tokens],
                             text, finished, _finish_reason(state), seq.reject_reason,
                             None if state.logprobs is None else state.logprobs[tokens_from:],
                             seq.num_draft_tokens, seq.num_accepted_tokens, state.error,
                             seq.num_cached_prompt_tokens or 0, state.prompt_logprobs, state.stop_reason)

    def streamed_token_ids(self, request_id: str) -> list[int]:
        """The tokens detokenised for this request so far (each once, in order)."""
        detok = self._requests[request_id].detokenizer
        return detok.token_ids if detok is not None else []

    def add_prompt_logprobs(self, prompt_logprobs: dict[str, tuple[int, list[Logprobs]]]) -> None:
        """Take one step's prompt logprobs (request id -> (first target position, one ``Logprobs``
        per target)): the targets past those the request holds are kept (a recomputed request
        gives its prompt again, in chunks that need not end where the first pass's did)."""
        for request_id, (first, items) in prompt_logprobs.items():
            state = self._requests.get(request_id)
            held = None if state is None else len(state.prompt_logprobs)
            if held is not None and first <= held < first + len(items):
                state.prompt_logprobs = state.prompt_logprobs + items[held - first:]  # new list: outputs read stay

    def process_outputs(self, outputs: list[SequenceOutput], logprobs: dict[str, tuple]) -> list[tuple[str, str]]:
        """Take one step's outputs (``logprobs``: request id -> (the new token's logprob, [(token id,
        logprob)])) and return the (request id, reason) of the unfinished requests whose outputs
        it ended, which the engine must end in the same call: "stop" (a stop string matched) or
        "error" (its text could not be decoded)."""
        to_finish: list[tuple[str, str]] = []
        texts = []
        for out in outputs:
            state = self._requests[out.seq.request_id]
            if state.logprobs is not None and out.seq.request_id in logprobs:
                state.logprobs.append((out.new_token_ids[-1], *logprobs[out.seq.request_id]))
            if state.detokenizer is None:
                self._advance(state, len(out.new_token_ids), out.finish_reason is not None)
            else:
                texts.append((state, out))
        if texts:
            self._process_text(texts, to_finish)
        return to_finish

    def _advance(self, state: RequestState, num_tokens: int, ends: bool) -> None:
        """``num_tokens`` more output tokens reach the output; ``ends``: they end it."""
        state.num_tokens += num_tokens
        self.num_generation_tokens += num_tokens
        if num_tokens or ends:
            self._changed[state.seq.request_id] = None

    def _process_text(self, texts: list[tuple[RequestState, SequenceOutput]], to_finish: list) -> None:
        """Detokenise each output's new tokens one at a time, one batched decode per token index (an
        accepted run of drafted tokens reads exactly as the same tokens one step at a time; a
        finished request is flushed with its last), matching its stop strings in each token's new
        text. A stop string ends the output at the token that completed it; text that cannot be
        decoded ends it with "error" (each request decoded alone finds the culprits)."""
        ended: set[int] = set()  # id() of the states whose output ended inside the step's tokens
        for index in range(max(len(out.new_token_ids) for _, out in texts)):
            work = [(state, out) for state, out in texts if index < len(out.new_token_ids) and id(state) not in ended]
            steps = [(state.detokenizer, out.new_token_ids[index],
                      out.finish_reason is not None and index == len(out.new_token_ids) - 1) for state, out in work]
            for (state, out), delta in zip(work, self._detokenize([state for state, _ in work], steps)):
                if delta is None:
                    self._end(state, out, index, "error", to_finish)
                    ended.add(id(state))
                elif delta and (matched := self._cut_at_stop_string(state, delta)) is not None:
                    state.stop_reason = matched
                    self._end(state, out, index + 1, "stop", to_finish)
                    ended.add(id(state))
        for state, out in texts:
            if id(state) not in ended:
                self._advance(state, len(out.new_token_ids), out.finish_reason is not None)

    def _end(self, state: RequestState, out: SequenceOutput, num_tokens: int, reason: str, to_finish: list) -> None:
        """End the output after ``num_tokens`` of the step's new tokens ("error": all of them, and
        ``error`` says the text could not be decoded), with ``reason``; an unfinished request is
        handed to the engine to end with it."""
        if reason == "error":
            state.error = "its output could not be detokenised"
        self._advance(state, len(out.new_token_ids) if reason == "error" else num_tokens, True)
        if out.finish_reason is None:
            to_finish.append((state.seq.request_id, reason))

    def _detokenize(self, states: list[RequestState], steps: list) -> list[str | None]:
        """``detokenize`` the ``steps`` in one batched call per decoder (special tokens skipped or
        kept); when one raises, one call per request, None for those that still fail."""
        deltas: list[str | None] = [None] * len(steps)
        for decode in (self.decode, self.decode_special):
            group = [i for i, (detok, _, _) in enumerate(steps) if detok.decode is decode]
            for i, delta in zip(group, self._detokenize_with(decode, [states[i] for i in group],
                                                            [steps[i] for i in group])):
                deltas[i] = delta
        return deltas

    @staticmethod
    def _detokenize_with(decode, states: list[RequestState], steps: list) -> list[str | None]:
        try:
            return detokenize(decode, steps)
        except Exception:
            deltas = []
            for state, step in zip(states, steps):
                try:
                    deltas += detokenize(decode, [step])
                except Exception:
                    log.exception("request %s: its output could not be detokenised", state.seq.request_id)
                    deltas.append(None)
            return deltas

    @staticmethod
    def _cut_at_stop_string(state: RequestState, delta: str) -> str | None:
        """Cut the text before the first of the request's stop strings that ends in the new text
        ``delta`` (after it with ``include_stop_str_in_output``); the stop string when one did."""
        stops = state.seq.sampling_params.stop
        if not stops:
            return None
        detok = state.detokenizer
        window = detok.tail(len(delta) + max(map(len, stops)) - 1)  # a stop string ending in the delta
        hits = [(i, len(s)) for i, s in ((window.find(s), s) for s in stops) if i >= 0]
        if not hits:
            return None
        at, length = min(hits, key=lambda hit: hit[0])
        kept = at + length if state.seq.sampling_params.include_stop_str_in_output else at
        detok.truncate(detok.length - len(window) + kept)
        return window[at:at + length]


def _finish_reason(state: RequestState) -> str | None:
    """The reason a finished request's output reports (None while it runs): "rejected", "error"
    when it failed (``error``), "stop" when a stop string ended its text (the scheduler may have
    ended it in the same step for its length), else its sequence's."""
    seq = state.seq
    if not seq.is_finished:
        return None
    if seq.reject_reason is not None:
        return "rejected"
    if state.error is not None:
        return "error"
    return "stop" if state.stop_reason is not None else seq.finish_reason
