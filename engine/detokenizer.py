"""Incremental detokenisation: output token ids -> text, one token at a time.

Decoding each new token alone breaks multi-byte characters split across byte-level
BPE tokens and loses the spacing some decoders add between tokens. Instead the
text of a short window of recent tokens is decoded with and without the new
ones, and the difference is emitted only once it no longer ends in U+FFFD (an
incomplete UTF-8 sequence).
"""
from __future__ import annotations


class IncrementalDetokenizer:
    """``add(token_id) -> new text`` (possibly ""); ``text`` is everything emitted so far,
    equal to ``tokenizer.decode(token_ids)`` once ``flush()`` has run."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self.text = ""
        self._prefix_offset = 0  # window start: tokens before it are fully emitted
        self._read_offset = 0    # tokens before it are emitted

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_id: int) -> str:
        self.token_ids.append(token_id)
        return self._emit(final=False)

    def flush(self) -> str:
        """Emit whatever is held back (an incomplete character at the very end)."""
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        prefix = self._decode(self.token_ids[self._prefix_offset:self._read_offset])
        full = self._decode(self.token_ids[self._prefix_offset:])
        if len(full) <= len(prefix) or (full.endswith("\ufffd") and not final):
            return ""
        delta = full[len(prefix):]
        self._prefix_offset, self._read_offset = self._read_offset, len(self.token_ids)
        self.text += delta
        return delta
