"""Continuous batching with mixed prefill + decode steps, chunked prefill, preemption by
recompute, and one step of lookahead. Pure Python.

Every step is one ``ScheduledBatch`` under ``max_num_batched_tokens``: first one token for
every running sequence that decodes (admission order), then the next chunks of running
sequences whose prompt is only partly computed, then waiting sequences admitted in the waiting
queue's order (below). A prompt longer than what is left of the budget is prefilled in chunks over several
steps (any prompt of the step may be cut, so the step fills its budget); a chunk that stops
short of the prompt's end samples nothing. No decode waits for a prefill. A step that decodes
(or whose decodes wait for a block) carries at most ``prefill_tokens_beside_decodes`` prompt
tokens (0: no cap beyond the budget): every decode of a step waits for the whole step, so capping
the prompt tokens beside them bounds the gap between two tokens of a stream (stall-free
batching, as in Sarathi-Serve), while a step with nothing to decode still takes the whole
budget. Drafted tokens (below) are the streams' own work: they take the budget before the prompt
tokens and do not count against the cap.

Lookahead: the engine may schedule step N+1 while step N still runs on the device, so a
sequence's newest token can be *pending* (sampled on the device, not yet read back).
``schedule`` counts it (``Sequence.num_tokens``), the model runner feeds it from the device,
and ``postprocess(batch, token_ids)`` — called for each batch in the order they were
scheduled — makes it known. A sequence whose in-flight tokens already reach ``max_tokens``
or ``max_model_len`` is not scheduled again; one that finishes on a token only the host can
judge (EOS, a stop token id, a stop string, an abort) may have been scheduled once more:
that step's token is dropped, and its blocks are freed when the last step holding it is
postprocessed, never while a step may still write them.

Admission order (``engine.scheduling.waiting``): preempted sequences first (recomputed before
anything new), then round robin over clients (``Sequence.client``, a server's client key), first
come, first served within one client: a client's request of a thousand sequences takes one seat
in turn with each other client's, so a small request beside it waits for one seat per client
waiting, not for the thousand.
One client (``LLMEngine``'s default) is plain FCFS. A head whose blocks do not fit stops
admission for the step: no sequence behind it, of any client, passes it, so a large sequence is
never starved by a stream of smaller ones (it waits only for running sequences to finish or be
preempted). A head whose next prefix block another running sequence is computing
(``BlockManager.prefix_is_coming``: shared once published, a step or a chunked prefill later)
waits too, with its client's later sequences, but passes its client's turn for the step, keeping
its place: the next client's head may go (a preempted head waiting so stops admission). vLLM and
SGLang admit first come, first served.

Admission (``admission``):

- ``"watermark"`` (default): a waiting sequence starts when its blocks (after prefix-cache
  hits) fit while ``watermark_blocks`` stay free for the running sequences to grow into (no
  watermark when nothing runs). When a decode finds no free block for a running sequence's
  next token, the newest running sequence is preempted (repeatedly, possibly the sequence
  itself): its blocks are freed, it goes back to the FRONT of the waiting queue with its
  generated tokens, and is later recomputed by prefilling prompt + output so far. The oldest
  running sequence is never preempted for a younger one, so it always progresses. Preemption
  happens only while no step is in flight: a decode that finds no block while one is sets
  ``needs_drain`` (it and the newer decodes wait this step, nothing is admitted), and the
  engine postprocesses the in-flight step before scheduling again.
- ``"reserve"``: a sequence starts only when the cache can hold its worst case (prompt +
  max_tokens, capped by max_model_len) on top of the worst cases of all running sequences, so a
  running sequence can always append and nothing is ever preempted.

A request that could never run (prompt over max_model_len, or a worst case over the whole
pool) is REJECTED at ``add``; anything else is admitted once the engine is idle, so the
scheduler cannot deadlock.

Prefix-cache hashes of a step's blocks are published in ``postprocess``, once that step's
K/V exists and only for the tokens computed so far; sequences prefilled in one step therefore
never share blocks computed in that same step, and a failed step (``fail_in_flight``)
publishes nothing.

Speculative decoding (a ``drafter``; only with nothing in flight, so every token is known):
after the step's decodes and before its prefill chunks and admissions (as vLLM schedules
running requests' drafts first, so a request's drafts never depend on the prompts beside it
while the budget holds them), each decode entry — oldest first, from the token budget and the
free blocks left — may carry drafted tokens: its last token
plus ``k`` drafts at positions ``start .. start + k``, every one of them sampled (a verify
entry). ``postprocess`` accepts the longest prefix of the drafts that equals the tokens the
step sampled after them, appends those and the sampled token that follows (1 .. k + 1 tokens,
cut at a token that ends the sequence), counts only the accepted positions as computed (the
K/V of rejected drafts is never attended to and is overwritten later), publishes hashes of
accepted positions only, and frees the blocks that hold only rejected drafts. Drafts never
run past ``max_model_len`` or the room ``max_tokens`` leaves, and requests with penalties or
logprobs, or whose constraints read the output (a grammar, multi-token bad words), take none
(their sampling state advances one token per step).
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from itertools import islice

from engine.scheduling.block_manager import BlockManager
from engine.scheduling.sequence import Sequence, SequenceStatus
from engine.scheduling.step import ScheduledBatch, SequenceOutput, StepResult
from engine.scheduling.waiting import WaitingQueue

ADMISSION_POLICIES = ("watermark", "reserve")  # the first is the default


@dataclass(frozen=True)
class SchedulerSettings:
    """Continuous batching's limits, checked here once (a value that cannot work is a ValueError
    naming it, raised where the settings are made: for an engine, when its config is resolved,
    before any weight is read). At most ``max_num_seqs`` sequences run and a step carries at most
    ``max_num_batched_tokens`` tokens (never below ``max_num_seqs``: a decode step has one token
    per sequence); ``max_model_len`` bounds prompt + output; ``admission`` is one of
    ``ADMISSION_POLICIES``; ``prefill_tokens_beside_decodes``: most prompt tokens in a step that
    decodes (0: no cap beyond the budget); ``overlap``: the engine schedules a step while the
    previous one runs (the scheduler's lookahead; it schedules correctly either way).
    ``engine.core.engine_config`` decides the defaults an engine gets."""
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    admission: str = ADMISSION_POLICIES[0]
    prefill_tokens_beside_decodes: int = 0
    overlap: bool = True

    def __post_init__(self):
        if self.max_num_seqs < 1 or self.max_model_len < 1:
            raise ValueError(f"max_num_seqs and max_model_len must be >= 1, got {self.max_num_seqs}, "
                             f"{self.max_model_len}")
        if self.prefill_tokens_beside_decodes < 0:
            raise ValueError(f"prefill_tokens_beside_decodes must be >= 0 (0: no cap), got "
                             f"{self.prefill_tokens_beside_decodes}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                             f"max_num_seqs ({self.max_num_seqs}): a decode step has one token per sequence")
        if self.admission not in ADMISSION_POLICIES:
            raise ValueError(f"admission must be one of {', '.join(ADMISSION_POLICIES)}, got {self.admission!r}")


def accepted_length(draft: list[int], sampled: list[int]) -> int:
    """Speculative decoding's acceptance: how many leading drafted tokens equal the tokens the
    target model sampled after the tokens before them (``sampled[j]`` follows ``draft[:j]``).

    Greedy, ``sampled`` is the argmax. Sampling, each row draws with the request's seed at its
    own output index, so ``draft[j]`` is accepted with probability p_j(draft[j]) and on rejection
    the token taken is ``sampled[j]``, distributed as p_j without ``draft[j]``, renormalised:
    the rejection sampling of a deterministic drafter (q one-hot: accept with min(1, p/q),
    resample from the normalised max(0, p - q)), with exactly the tokens plain decoding samples."""
    accepted = 0
    while accepted < len(draft) and sampled[accepted] == draft[accepted]:
        accepted += 1
    return accepted


class Scheduler:
    """Owns waiting/running sequences and assigns every status transition. ``waiting`` is a
    ``WaitingQueue`` (iterated in admission order), ``running`` a list in admission order.

    ``watermark`` is the fraction of the pool (at least one block) that watermark admission
    leaves free. ``num_preemptions`` counts preemptions; ``preempted`` holds the sequences the
    last ``schedule()`` preempted. ``on_free(seq)`` is called for every sequence whose blocks it
    frees (finished, or preempted), once no step in flight holds it: the engine drops its runner
    state there.
    ``drafter``: speculative decoding's proposer, any object with ``num_speculative_tokens`` and
    ``propose(seqs, rooms) -> list[list[int]]`` (per sequence at most ``rooms[i]`` tokens, never
    more than ``num_speculative_tokens``, to follow ``seqs[i].token_ids``, whose slots it holds;
    None: no drafts);
    ``num_draft_tokens`` / ``num_accepted_tokens`` count the drafted tokens verified and accepted,
    ``num_drafts`` the verify entries with drafts, ``num_accepted_per_position[j]`` those whose
    draft token ``j`` was accepted.
    ``settings``'s limits (``SchedulerSettings``) are copied onto the scheduler's attributes
    (``max_num_seqs``, ``max_num_batched_tokens``, ``prefill_tokens_beside_decodes``,
    ``max_model_len``, ``admission``), plain attributes read at every ``schedule()``: a caller may
    change one between steps (the engine's tests hold admission with ``max_num_seqs = 0``).
    ``settings``, ``watermark``, ``drafter`` and ``on_free`` are kept as given, and
    ``eos_token_ids`` is the frozenset of the ids given (an int, an iterable, or None: none).
    """

    def __init__(self, settings: SchedulerSettings, block_manager: BlockManager,
                 eos_token_id: int | Iterable[int] | None, drafter=None,
                 on_free: Callable[[Sequence], None] | None = None, watermark: float = 0.01):
        if not 0 <= watermark < 1:
            raise ValueError(f"watermark must be in [0, 1), got {watermark}")
        self.settings = settings
        self.block_manager = block_manager
        self.max_num_seqs = settings.max_num_seqs
        self.max_num_batched_tokens = settings.max_num_batched_tokens
        self.prefill_tokens_beside_decodes = settings.prefill_tokens_beside_decodes
        self.max_model_len = settings.max_model_len
        self.admission = settings.admission
        self.watermark = watermark
        self.watermark_blocks = max(1, int(watermark * block_manager.num_blocks))
        self.drafter = drafter
        self.on_free = on_free
        if eos_token_id is None:
            eos_token_id = ()
        self.eos_token_ids = frozenset([eos_token_id] if isinstance(eos_token_id, int) else eos_token_id)
        self.waiting = WaitingQueue()
        self.running: list[Sequence] = []
        self.preempted: list[Sequence] = []
        self.num_preemptions = 0
        self.num_draft_tokens = self.num_accepted_tokens = self.num_drafts = 0
        # entry j: drafts whose token at position j (0-based) was accepted
        self.num_accepted_per_position = [0] * (drafter.num_speculative_tokens if drafter is not None else 0)
        self.needs_drain = False
        self._unfinished: dict[str, Sequence] = {}  # waiting and running, by request id
        self._in_flight: deque[ScheduledBatch] = deque()  # scheduled, not yet postprocessed, oldest first

    @property
    def num_in_flight(self) -> int:
        """Scheduled batches not yet postprocessed (at most two: one running, one being scheduled)."""
        return len(self._in_flight)

    @property
    def in_flight(self) -> tuple[ScheduledBatch, ...]:
        """The scheduled batches not yet postprocessed, oldest first."""
        return tuple(self._in_flight)

    def add(self, seq: Sequence) -> bool:
        """Queue a WAITING sequence; False (and status REJECTED with ``reject_reason``)
        when it could never run."""
        if seq.status is not SequenceStatus.WAITING:
            raise ValueError(f"{seq.request_id} is {seq.status.name}, not WAITING")
        if seq.request_id in self._unfinished:
            raise ValueError(f"request id {seq.request_id!r} is already scheduled")
        reason = self._reject_reason(seq)
        if reason is not None:
            seq.status = SequenceStatus.REJECTED
            seq.reject_reason = reason
            return False
        self.waiting.append(seq)
        self._unfinished[seq.request_id] = seq
        return True

    def has_unfinished(self) -> bool:
        return bool(self._unfinished)

    def schedule(self) -> ScheduledBatch:
        """The next step (possibly empty). At most one earlier batch may still be in flight
        (not postprocessed); preemption happens only when none is. Each scheduled sequence's
        ``num_computed_tokens`` already counts the step's tokens, and a sampling step adds a
        pending token."""
        if len(self._in_flight) > 1:
            raise RuntimeError("schedule() with two batches in flight: postprocess() the oldest first")
        self.preempted = []
        self.needs_drain = False
        batch = ScheduledBatch()
        self._schedule_decodes(batch)
        if self.drafter is not None and not self._in_flight:
            self._draft(batch)
        budget = self.max_num_batched_tokens - batch.total_tokens
        if self.prefill_tokens_beside_decodes and (batch.seqs or self.needs_drain):  # decodes run, or wait
            budget = min(budget, self.prefill_tokens_beside_decodes)
        for seq in self.running:
            if seq.status is SequenceStatus.RUNNING_PREFILL and budget > 0:
                budget -= self._add(batch, seq, min(seq.num_tokens - seq.num_computed_tokens, budget))
        if not self.needs_drain:
            self._admit(batch, budget)
        if batch.seqs:
            self._in_flight.append(batch)
        return batch

    def postprocess(self, batch: ScheduledBatch, token_ids: list[int]) -> StepResult:
        """Record a batch that has run (the oldest in flight): its computed tokens (publishing
        their full blocks), and the token it sampled for each sequence whose chunk reached its
        end; finish (and free) those that sampled EOS (unless ignore_eos) or a stop token id, or
        reached max_tokens or max_model_len. A sequence finished since the batch was scheduled
        gets no token (it is dropped; what the step computed from known tokens is still
        published); its blocks are freed once no batch in flight holds it.

        ``token_ids`` holds one id per logits row (``batch.num_logits_rows``: the entries, then
        each drafted token), else a ValueError "N sampled rows but M token ids". An entry with a
        draft accepts its longest prefix equal to the ids sampled after the tokens before it
        (``accepted_length``), appends it and the id sampled after it (cut where a token ends the
        sequence), adds the accepted positions to ``num_computed_tokens`` and releases the blocks
        past them (``BlockManager.release_slots(seq, seq.num_computed_tokens)``)."""
        if not self._in_flight or self._in_flight[0] is not batch:
            raise RuntimeError("postprocess() takes the batches in the order they were scheduled")
        if batch.num_logits_rows != len(token_ids):
            raise ValueError(f"{batch.num_logits_rows} sampled rows but {len(token_ids)} token ids")
        self._in_flight.popleft()
        result = StepResult()
        draft_rows = iter(token_ids[len(batch):])
        for seq, start, num, samples, draft, token_id in zip(batch.seqs, batch.starts, batch.num_tokens, batch.samples,
                                                              batch.drafts, token_ids):
            sampled = [token_id, *islice(draft_rows, len(draft))]
            seq.num_in_flight -= 1
            seq.num_pending_tokens -= samples
            computed = start + num - len(draft)  # K/V of the entry's own tokens; drafts follow if accepted
            reason = None
            if samples and not seq.is_finished:
                accepted = accepted_length(draft, sampled)
                computed += accepted
                seq.num_computed_tokens += accepted
                seq.num_draft_tokens += len(draft)
                seq.num_accepted_tokens += accepted
                self.num_draft_tokens += len(draft)
                self.num_accepted_tokens += accepted
                self.num_drafts += bool(draft)
                per_position = self.num_accepted_per_position  # grows with a drafter set later
                per_position.extend([0] * (accepted - len(per_position)))
                for position in range(accepted):
                    per_position[position] += 1
                for new, token in enumerate(sampled[:accepted + 1], start=1):
                    seq.output_token_ids.append(token)
                    reason = self._finish_reason(seq, token)
                    if reason is not None:
                        break
                result.outputs.append(SequenceOutput(seq, seq.output_token_ids[-new:], reason))
            # the step's K/V exists now: publish it (a finished sequence's too, up to its known tokens)
            self.block_manager.publish(seq, min(computed, seq.num_known_tokens))
            if seq.is_finished:
                if seq.num_in_flight == 0:
                    self._free(seq)
            elif reason is not None:
                self._finish(seq, reason)
            elif draft:
                self.block_manager.release_slots(seq, seq.num_computed_tokens)
        return result

    def abort(self, request_id: str) -> bool:
        """``finish(request_id, "abort")``."""
        return self.finish(request_id, "abort")

    def finish(self, request_id: str, reason: str) -> bool:
        """Finish a waiting or running sequence with ``reason`` (e.g. "abort", or "stop" for a
        stop string the engine matched) and free its blocks (for a sequence a batch in flight
        holds: when the last such batch is postprocessed, once its K/V is written, so no prefix
        hit lands on blocks never computed and no step writes a block handed to another
        sequence); False when no unfinished sequence has this id."""
        seq = self._unfinished.get(request_id)
        if seq is None:
            return False
        self._finish(seq, reason)
        return True

    def reject_waiting(self, reason: str) -> list[Sequence]:
        """Finish every waiting sequence as "rejected" with ``reject_reason`` ``reason`` (what an
        idle engine does when none of them fits); returns them."""
        rejected = list(self.waiting)
        for seq in rejected:
            self._finish(seq, "rejected")
            seq.reject_reason = reason
        return rejected

    def fail_in_flight(self) -> list[Sequence]:
        """A scheduled batch's forward failed: finish every sequence of every batch in flight
        with reason "error" and free their blocks without publishing any hash (their K/V may not
        exist). Returns the sequences it finished."""
        failed = []
        for batch in self._in_flight:
            for seq in batch.seqs:
                seq.num_in_flight = 0
                seq.num_pending_tokens = 0
                if not seq.is_finished:
                    self._finish(seq, "error")
                    failed.append(seq)
                elif seq.block_table:
                    self._free(seq)
        self._in_flight.clear()
        return failed

    # ---- scheduling --------------------------------------------------------------------------

    def _add(self, batch: ScheduledBatch, seq: Sequence, num: int) -> int:
        """Schedule ``num`` tokens of ``seq`` from ``num_computed_tokens`` on; returns ``num``."""
        start = seq.num_computed_tokens
        seq.num_computed_tokens += num
        samples = seq.num_computed_tokens == seq.num_tokens
        if samples:
            seq.num_pending_tokens += 1
            seq.status = SequenceStatus.RUNNING_DECODE
        seq.num_in_flight += 1
        batch.seqs.append(seq)
        batch.starts.append(start)
        batch.num_tokens.append(num)
        batch.samples.append(samples)
        batch.drafts.append([])
        return num

    def _schedule_decodes(self, batch: ScheduledBatch) -> int:
        """One token for every decoding sequence, oldest first, with a slot for it; a sequence
        with no free block for it preempts the newest running ones (itself last) when nothing is
        in flight, else it and the newer decodes wait (``needs_drain``). Sequences whose pending
        tokens already end them are skipped. Returns the tokens scheduled."""
        bm = self.block_manager
        can_preempt = not self._in_flight
        for seq in list(self.running):
            if seq.status is not SequenceStatus.RUNNING_DECODE or self._ends_in_flight(seq):
                continue  # preempted by an older sequence in this loop, prefilling, or ending
            while not bm.can_append(seq) and can_preempt:
                self._preempt(self.running[-1])
                if seq.status is SequenceStatus.WAITING:
                    break
            if seq.status is SequenceStatus.WAITING:
                continue
            if not bm.can_append(seq):
                self.needs_drain = True
                break
            bm.append_slot(seq)
            self._add(batch, seq, 1)
        return len(batch.seqs)

    def _admit(self, batch: ScheduledBatch, budget: int) -> None:
        """Admit waiting sequences in the waiting queue's order (preempted first, then round robin
        over clients) while they fit the sequence and block budgets and the token budget left; the
        last one admitted may be cut into chunks. A head whose blocks do not fit stops admission.
        (Sequences prefilled in one step cannot share the prefix blocks they compute: one whose next
        prefix block another is computing waits, with its client's later sequences, until that
        block is published, ``BlockManager.prefix_is_coming``; the other clients' heads go on,
        unless it is a preempted one.)

        A sequence gets blocks for its whole context when it is admitted, not chunk by
        chunk: admission is the one place that decides whether it fits, so a later chunk
        never waits for a block and no prefill ever needs preempting."""
        bm = self.block_manager
        reserve = self.admission == "reserve"
        reserved = sum(self._max_blocks(s) - len(s.block_table) for s in self.running) if reserve else 0
        passed: set[str] = set()  # clients whose head waits for its prefix this step
        while len(self.running) < self.max_num_seqs and budget > 0:
            seq = self.waiting.head(passed)
            if seq is None:
                break
            if bm.prefix_is_coming(seq):  # being computed for another sequence: share it a step later
                if self.waiting.has_preempted:
                    break  # a preempted sequence goes before anything new
                passed.add(seq.client)
                continue
            if reserve:
                growth = self._max_blocks(seq) - bm.blocks_for(seq.num_tokens)
                if not bm.can_allocate(seq, num_reserved=reserved + growth):
                    break
                reserved += growth
            elif not bm.can_allocate(seq, num_reserved=self.watermark_blocks if self.running else 0):
                break
            bm.allocate(seq)
            seq.status = SequenceStatus.RUNNING_PREFILL
            seq.num_computed_tokens = seq.num_cached_tokens
            if seq.num_cached_prompt_tokens is None:  # its first admission: what usage reports
                seq.num_cached_prompt_tokens = seq.num_cached_tokens
            self.waiting.take(seq)
            self.running.append(seq)
            budget -= self._add(batch, seq, min(seq.num_tokens - seq.num_computed_tokens, budget))

    def _draft(self, batch: ScheduledBatch) -> None:
        """Give the batch's entries (its decodes, before any prefill joins) drafted tokens, oldest
        first, while the token budget and free blocks last: at most what keeps the step within
        ``max_tokens`` and ``max_model_len`` once every draft is accepted. Requests with penalties,
        logprobs or constraints that read the output take none. Each drafting entry's blocks for
        its room come from ``BlockManager.take_slots`` before the drafter runs (a model drafter
        writes its own KV there), and those its draft leaves unused go back
        (``release_slots``). A draft goes to ``batch.drafts[i]`` and adds to
        ``batch.num_tokens[i]`` only: ``seq.num_computed_tokens`` keeps counting the entry's own
        token until ``postprocess`` adds the accepted drafts."""
        budget = self.max_num_batched_tokens - batch.total_tokens
        entries, rooms = [], []
        for i, (seq, start) in enumerate(zip(batch.seqs, batch.starts)):
            params = seq.sampling_params
            # the step samples len(draft) + 1 tokens; num_tokens already counts the first
            room = min(budget, self.drafter.num_speculative_tokens, params.max_tokens - seq.num_output_tokens,
                       self.max_model_len - seq.num_tokens)
            if room <= 0 or params.penalized or params.logprobs is not None or params.reads_output:
                continue
            room = min(room, self.block_manager.take_slots(seq, start + 1 + room) - start - 1)
            if room > 0:
                entries.append(i)
                rooms.append(room)
                budget -= room
        if not entries:
            return
        drafts = self.drafter.propose([batch.seqs[i] for i in entries], rooms)
        for i, room, draft in zip(entries, rooms, drafts):
            draft = draft[:room]
            self.block_manager.release_slots(batch.seqs[i], batch.starts[i] + 1 + len(draft))
            batch.drafts[i] = draft
            batch.num_tokens[i] += len(draft)

    def _preempt(self, seq: Sequence) -> None:
        """Free ``seq``'s blocks and put it back at the front of the waiting queue, keeping its
        output: it is recomputed (prompt + output so far) when admitted again."""
        if seq.num_in_flight:
            raise RuntimeError(f"{seq.request_id} is preempted while a step in flight holds it")
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        self.waiting.appendleft(seq)
        self.preempted.append(seq)
        self.num_preemptions += 1
        if self.on_free is not None:
            self.on_free(seq)

    def _finish(self, seq: Sequence, reason: str) -> None:
        """End an unfinished sequence: out of the queues now, its blocks freed once no batch in
        flight holds it."""
        del self._unfinished[seq.request_id]
        if seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        else:
            self.running.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        if seq.num_in_flight == 0:
            self._free(seq)

    def _free(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        if self.on_free is not None:
            self.on_free(seq)

    # ---- limits ------------------------------------------------------------------------------

    def _ends_in_flight(self, seq: Sequence) -> bool:
        """Its pending tokens already reach max_tokens or max_model_len: nothing more to compute."""
        return seq.num_output_tokens >= seq.sampling_params.max_tokens or seq.num_tokens >= self.max_model_len

    def _max_blocks(self, seq: Sequence) -> int:
        """Most KV blocks ``seq`` can ever hold: every token but the last sampled one
        gets KV, and generation stops at max_tokens or max_model_len tokens."""
        max_kv_tokens = min(seq.num_prompt_tokens + seq.sampling_params.max_tokens - 1, self.max_model_len)
        return self.block_manager.blocks_for(max_kv_tokens)

    def _reject_reason(self, seq: Sequence) -> str | None:
        """Why ``seq`` can never run (None: it can), in these words, which the CLI and the server
        print as they are: ``prompt has N tokens, more than max_model_len (M)``, or ``prompt +
        max_tokens need N KV blocks, the cache has M`` (its worst case, ``_max_blocks``)."""
        n = seq.num_prompt_tokens
        if n > self.max_model_len:
            return f"prompt has {n} tokens, more than max_model_len ({self.max_model_len})"
        need, total = self._max_blocks(seq), self.block_manager.num_blocks
        if need > total:
            return f"prompt + max_tokens need {need} KV blocks, the cache has {total}"
        return None

    def _finish_reason(self, seq: Sequence, token_id: int) -> str | None:
        """Why the token just read back ends ``seq`` (None: it continues); counts known tokens only."""
        params = seq.sampling_params
        if (token_id in self.eos_token_ids and not params.ignore_eos) or token_id in params.stop_token_ids:
            return "stop"
        if len(seq.output_token_ids) >= params.max_tokens or seq.num_known_tokens >= self.max_model_len:
            return "length"
        return None
