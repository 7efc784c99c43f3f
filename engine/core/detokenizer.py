"""Incremental detokenisation: output token ids -> text, one token at a time, many sequences at once.

Decoding each new token alone breaks multi-byte characters split across byte-level
BPE tokens and loses the spacing some decoders add between tokens. Instead the
text of a short window of recent tokens is decoded with and without the new
ones, and the difference is emitted only once it no longer ends in U+FFFD (an
incomplete UTF-8 sequence). A step's windows, for every sequence it advanced, go
to the tokenizer in one batched call.
"""
from __future__ import annotations

from typing import Callable

BatchDecode = Callable[[list[list[int]]], list[str]]


def batch_decoder(tokenizer, skip_special_tokens: bool = True) -> BatchDecode:
    """Decode many id lists in one call: the fast tokenizer's own ``decode_batch`` (Rust, no
    per-call Python work) when transformers would add nothing to its result (no clean-up of
    tokenization spaces), else transformers' ``batch_decode``. Either equals ``tokenizer.decode``
    of each list."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return lambda id_lists: backend.decode_batch(id_lists, skip_special_tokens=skip_special_tokens)
    return lambda id_lists: tokenizer.batch_decode(id_lists, skip_special_tokens=skip_special_tokens)


class IncrementalDetokenizer:
    """``add(token_id) -> new text`` (possibly ""); ``text`` is everything emitted so far,
    equal to ``tokenizer.decode(token_ids)`` once ``flush()`` has run. ``windows`` / ``emit``
    split ``add`` so a caller can decode many sequences' windows in one batched call
    (``detokenize``). The text is kept as its emitted pieces (never copied per token):
    ``length``, ``text_from(offset)`` and ``tail(n)`` read it, ``truncate(length)`` cuts it."""

    def __init__(self, tokenizer=None, skip_special_tokens: bool = True, decode: BatchDecode | None = None):
        self.decode = decode or batch_decoder(tokenizer, skip_special_tokens)
        self.token_ids: list[int] = []
        self.length = 0
        self._pieces: list[str] = []
        self._prefix_offset = 0  # window start: tokens before it are fully emitted
        self._read_offset = 0    # tokens before it are emitted

    @property
    def text(self) -> str:
        return "".join(self._pieces)

    def text_from(self, offset: int) -> str:
        """The text from character ``offset`` on (reads only the pieces after it)."""
        if offset >= self.length:
            return ""
        start, covered = len(self._pieces), self.length
        while covered > offset:
            start -= 1
            covered -= len(self._pieces[start])
        return "".join(self._pieces[start:])[offset - covered:]

    def tail(self, n: int) -> str:
        """The last ``n`` characters of the text."""
        return self.text_from(max(0, self.length - n))

    def truncate(self, length: int) -> None:
        """Cut the text to its first ``length`` characters."""
        kept = self.text_from(0)[:length] if length < self.length else None
        if kept is not None:
            self._pieces, self.length = [kept], len(kept)

    def add(self, token_id: int) -> str:
        return detokenize(self.decode, [(self, token_id, False)])[0]

    def flush(self) -> str:
        """Emit whatever is held back (an incomplete character at the very end)."""
        return self.emit(*self.decode(self.windows()), final=True)

    def windows(self, token_id: int | None = None) -> list[list[int]]:
        """The ids to decode: the window's emitted part, and the whole window (with ``token_id``
        appended, when given)."""
        window = self.token_ids[self._prefix_offset:]
        return [self.token_ids[self._prefix_offset:self._read_offset], window + [token_id] if token_id is not None
                else window]

    def emit(self, prefix: str, full: str, final: bool) -> str:
        """Take the decoded ``windows()`` and emit what is new and complete."""
        if len(full) <= len(prefix) or (full.endswith("\ufffd") and not final):
            return ""
        delta = full[len(prefix):]
        self._prefix_offset, self._read_offset = self._read_offset, len(self.token_ids)
        self._pieces.append(delta)
        self.length += len(delta)
        return delta


def detokenize(decode: BatchDecode, steps: list[tuple[IncrementalDetokenizer, int, bool]]) -> list[str]:
    """Append ``token_id`` to each detokenizer (``final``: flush it too) with one batched decode
    for all of them; returns each one's new text. A decode that raises changes no detokenizer."""
    windows = [ids for detok, token_id, _ in steps for ids in detok.windows(token_id)]
    texts = decode(windows)
    for detok, token_id, _ in steps:
        detok.token_ids.append(token_id)
    return [detok.emit(texts[2 * i], texts[2 * i + 1], final) for i, (detok, _, final) in enumerate(steps)]
