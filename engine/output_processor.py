"""Requests' text: the tokens each step appended, detokenised together, and stop strings.

The one place that turns output tokens into text: every sequence a step advanced is
detokenised in one batched tokenizer call per new token (``engine.detokenizer``; one call
unless a step appended accepted drafted tokens), and a stop string found in the new text cuts
the text there (the stop string is not part of it), drops any later token of the step, and
ends the request.
Requests created without text (``generate_tokens``, or another TP rank's copy of a request
without stop strings) cost nothing here.
"""
from __future__ import annotations

import logging

from engine.detokenizer import IncrementalDetokenizer, batch_decoder, detokenize
from engine.sequence import Sequence

log = logging.getLogger(__name__)


class OutputProcessor:
    """``add(seq, detokenize)`` when a request arrives; ``process(seqs, num_new)`` after each step
    with the sequences it appended tokens to (the last ``num_new`` of ``output_token_ids``) and
    ``add_logprobs`` for those that asked; ``text(request_id)``, ``logprobs(request_id)``;
    ``remove(request_id)`` when the request is forgotten."""

    def __init__(self, tokenizer):
        self._decode = batch_decoder(tokenizer)
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        self._logprobs: dict[str, list] = {}

    def add(self, seq: Sequence, detokenize: bool) -> None:
        if detokenize:
            self._detokenizers[seq.request_id] = IncrementalDetokenizer(decode=self._decode)
        if seq.sampling_params.logprobs is not None:
            self._logprobs[seq.request_id] = []

    def remove(self, request_id: str) -> None:
        self._detokenizers.pop(request_id, None)
        self._logprobs.pop(request_id, None)

    def add_logprobs(self, request_id: str, item: tuple[int, float, list[tuple[int, float]]]) -> None:
        """The logprobs of the token just appended: (its id, its logprob, the most likely tokens')."""
        self._logprobs[request_id].append(item)

    def logprobs(self, request_id: str) -> list | None:
        """Per output token (its id, its logprob, [(token id, logprob)]), or None when not asked for."""
        items = self._logprobs.get(request_id)
        return None if items is None else list(items)

    def logprobs_from(self, request_id: str, index: int) -> list:
        """The logprobs of output tokens ``index`` on ([] when not asked for)."""
        return self._logprobs.get(request_id, [])[index:]

    def text(self, request_id: str) -> str:
        detok = self._detokenizers.get(request_id)
        return detok.text if detok is not None else ""

    def text_from(self, request_id: str, offset: int) -> tuple[str, int]:
        """(the text from character ``offset`` on, the text's length) without copying the rest."""
        detok = self._detokenizers.get(request_id)
        return (detok.text_from(offset), detok.length) if detok is not None else ("", 0)

    def streamed_token_ids(self, request_id: str) -> list[int]:
        """The tokens detokenised for this request so far (each once, in order)."""
        detok = self._detokenizers.get(request_id)
        return detok.token_ids if detok is not None else []

    def process(self, seqs: list[Sequence], num_new: list[int]) -> tuple[list[Sequence], list[Sequence]]:
        """Detokenise each sequence's ``num_new`` newest tokens one at a time, one batched decode
        per token index (an accepted run of drafted tokens reads exactly as the same tokens one
        step at a time; a finished sequence is flushed with its last), and match its stop strings
        in each token's new text. A stop string ends the output at the token that completed it:
        the text is cut before the stop string and the run's later tokens leave
        ``output_token_ids``. Returns (the unfinished sequences whose stop string matched: the
        caller ends them with "stop" — a finished one that matched gets "stop" as its reason; the
        sequences whose text could not be decoded: the caller fails them alone). When a batched
        decode raises, each sequence is decoded on its own to find the culprits."""
        work = [(seq, self._detokenizers[seq.request_id], n) for seq, n in zip(seqs, num_new)
                if seq.request_id in self._detokenizers]
        stopped, failed = [], []
        for index in range(max((n for _, _, n in work), default=0)):
            work = [(seq, detok, n) for seq, detok, n in work if index < n]
            steps = [(detok, seq.output_token_ids[index - n], seq.is_finished and index == n - 1)
                     for seq, detok, n in work]
            ended = set()
            for (seq, detok, n), delta in zip(work, self._detokenize([seq for seq, _, _ in work], steps, failed)):
                if delta and self._cut_at_stop_string(seq, detok, delta):
                    del seq.output_token_ids[len(seq.output_token_ids) - n + index + 1:]
                    ended.add(seq.request_id)
                    if seq.is_finished:
                        seq.finish_reason = "stop"
                    else:
                        stopped.append(seq)
            ended.update(seq.request_id for seq in failed)
            work = [item for item in work if item[0].request_id not in ended]
        return stopped, failed

    def _detokenize(self, seqs: list[Sequence], steps: list, failed: list[Sequence]) -> list[str]:
        """``detokenize`` the ``steps`` of ``seqs`` in one batched call; when it raises, one call
        per sequence, adding those that still fail to ``failed`` (their new text is "")."""
        try:
            return detokenize(self._decode, steps)
        except Exception:
            deltas = []
            for seq, step in zip(seqs, steps):
                try:
                    deltas += detokenize(self._decode, [step])
                except Exception:
                    log.exception("request %s: its output could not be detokenised", seq.request_id)
                    failed.append(seq)
                    deltas.append("")
            return deltas

    @staticmethod
    def _cut_at_stop_string(seq: Sequence, detok: IncrementalDetokenizer, delta: str) -> bool:
        """Cut the text before the first of ``seq``'s stop strings that ends in the new text
        ``delta``; True when one did."""
        stops = seq.sampling_params.stop
        if not stops:
            return False
        window = detok.tail(len(delta) + max(map(len, stops)) - 1)  # a stop string ending in the delta
        hits = [i for i in (window.find(s) for s in stops) if i >= 0]
        if hits:
            detok.truncate(detok.length - len(window) + min(hits))
        return bool(hits)
