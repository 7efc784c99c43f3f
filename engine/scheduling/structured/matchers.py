"""Grammar state per constrained request and the token bitmask that constrains its logits row.

Bitmask layout (xgrammar's): int32 ``[rows, ceil(V / 32)]``; token ``t`` of row ``r`` is allowed
when bit ``t % 32`` of word ``bitmask[r, t // 32]`` is set (bit 0 the least significant; int32
because torch lacks uint32 ops, bit 31 is the sign bit). Row ``r`` of the bitmask masks row
``r`` of the logits. Masks are filled on the host (xgrammar writes CPU tensors only); the caller
copies the filled rows to the logits' device and masks there with :func:`apply_bitmask`.
"""
from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch
import xgrammar as xgr


class GrammarMatchers:
    """The grammar matchers of the constrained requests of one engine, over a ``vocab_size``
    vocabulary (the model's, the logits' width). Lives where sampling happens (rank 0 under TP)
    and is used from one thread (the engine loop). A request id is any hashable (use one per
    sequence: each of ``n`` choices has its own grammar state).

    A matcher advances only with the tokens that reach the request's output (``accept``). Once
    its grammar is complete the mask allows exactly the stop tokens the compiler was given;
    accepting one of them terminates it (``is_terminated``), after which it must not be filled.
    """

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self._matchers: dict[Hashable, xgr.GrammarMatcher] = {}
        self._batch = xgr.BatchGrammarMatcher()

    def allocate(self, max_rows: int) -> torch.Tensor:
        """A CPU int32 bitmask ``[max_rows, ceil(vocab_size / 32)]``, every token allowed."""
        return xgr.allocate_token_bitmask(max_rows, self.vocab_size)

    def add(self, request_id: Hashable, compiled: xgr.CompiledGrammar) -> None:
        """Start ``request_id``'s grammar state at the beginning of ``compiled`` (from a
        GrammarCompiler of this vocabulary size)."""
        if request_id in self._matchers:
            raise ValueError(f"request {request_id!r} already has a grammar")
        if compiled.tokenizer_info.vocab_size != self.vocab_size:
            raise ValueError(f"the grammar was compiled for a vocabulary of {compiled.tokenizer_info.vocab_size} "
                             f"tokens, the matchers mask {self.vocab_size}")
        self._matchers[request_id] = xgr.GrammarMatcher(compiled)

    def remove(self, request_id: Hashable) -> None:
        """Forget ``request_id``'s grammar state (finished, aborted, failed); a no-op if it has none."""
        self._matchers.pop(request_id, None)

    def fill(self, rows: Sequence[tuple[int, Hashable]], bitmask: torch.Tensor) -> None:
        """For each ``(row, request_id)``, write the request's allowed next tokens into
        ``bitmask[row]`` (CPU int32 ``[R, ceil(vocab_size / 32)]``, rows distinct); other rows are
        left as they are. Reads the matchers' state, does not change it (parallel in xgrammar's
        threads for many rows)."""
        if rows:
            self._batch.batch_fill_next_token_bitmask([self._matchers[r] for _, r in rows], bitmask,
                                                      [row for row, _ in rows])

    def accept(self, request_id: Hashable, token_ids: Sequence[int]) -> bool:
        """Advance ``request_id``'s grammar by ``token_ids`` (the tokens that reached its output,
        in order). False when the grammar refuses one of them: then none is accepted (the state
        is as before the call) and the caller fails this request alone."""
        matcher = self._matchers[request_id]
        for i, token_id in enumerate(token_ids):
            if not matcher.accept_token(int(token_id)):
                if i:
                    matcher.rollback(i)
                return False
        return True

    def is_terminated(self, request_id: Hashable) -> bool:
        """Whether ``request_id``'s grammar accepted a stop token (its output is complete)."""
        return self._matchers[request_id].is_terminated()


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int]) -> None:
    """Set ``logits[r, t] = -inf`` in place for each ``r`` in ``rows`` (distinct) and each token
    ``t`` that ``bitmask[r]`` does not allow; other rows are untouched.

    logits: float32 / bfloat16 / float16 ``[R, V]`` with unit stride along V (a row slice of a
    larger tensor is fine); bitmask: int32 ``[R', ceil(V / 32)]``, contiguous, on the logits'
    device; every row in ``rows`` below both R and R'. On the CPU this is xgrammar's C++ loop, on
    CUDA its Triton kernel (one launch on the current CUDA device, after the row indices are
    copied there from the host): apply it to a graph's output logits, not inside a captured graph.
    """
    if not rows:
        return
    width = (logits.shape[-1] + 31) // 32
    if logits.dim() != 2 or logits.stride(-1) != 1:
        raise ValueError(f"logits must be [R, V] with unit stride along V, got shape {tuple(logits.shape)} "
                         f"strides {logits.stride()}")
    if bitmask.dtype != torch.int32 or bitmask.dim() != 2 or bitmask.shape[1] != width or not bitmask.is_contiguous():
        raise ValueError(f"bitmask must be contiguous int32 [R, {width}], got {bitmask.dtype} "
                         f"{tuple(bitmask.shape)}")
    if min(rows) < 0 or max(rows) >= min(logits.shape[0], bitmask.shape[0]):
        raise ValueError(f"rows must index both logits ({logits.shape[0]} rows) and bitmask "
                         f"({bitmask.shape[0]} rows), got {min(rows)}..{max(rows)}")
    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[-1], indices=list(rows))
