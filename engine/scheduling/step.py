"""The step contract: what one step runs (``ScheduledBatch``, the scheduler's decision the runner
launches) and what it gave each sequence once read back (``SequenceOutput`` s in a ``StepResult``,
which ``Scheduler.postprocess`` returns and the output processor reads). Plain data over
``Sequence`` s; the scheduler makes them, the worker and the output processor only read them."""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.scheduling.sequence import Sequence


@dataclass
class ScheduledBatch:
    """One step: sequence ``seqs[i]`` computes ``num_tokens[i]`` tokens from position
    ``starts[i]`` on; ``samples[i]``: that chunk reaches the sequence's end, so the step samples
    its next token (output index ``starts[i] + num_tokens[i] - len(drafts[i]) - num_prompt_tokens``).
    Decodes come first. A token at a position the host does not know yet
    (``>= seq.num_known_tokens`` when the batch runs) was sampled by the previous step and must
    be fed from the device.

    ``drafts[i]``: tokens drafted for a decode entry (speculative decoding), computed after its
    last token at positions ``starts[i] + 1 ..``; ``num_tokens[i] = 1 + len(drafts[i])`` and the
    step samples after each of them too. The step's logits rows (what it samples from) are one per
    entry, then one per drafted token in entry order (``num_logits_rows``, ``logits_row_seqs``)."""

    seqs: list[Sequence] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)
    samples: list[bool] = field(default_factory=list)
    drafts: list[list[int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.drafts:  # a batch built without drafts has none for each entry
            self.drafts = [[] for _ in self.seqs]

    def __len__(self) -> int:
        return len(self.seqs)

    @property
    def is_decode(self) -> bool:
        """Every entry computes exactly one token plus its drafts (``num_tokens[i] == 1 +
        len(drafts[i])``), whether or not it samples: a one-token prefill chunk short of the
        prompt's end counts too. The runner then runs the step as a decode step (what a CUDA-graph
        decode can replay; its logits rows are computed and the samples mask picks what is kept);
        its mixed path takes the entries of that shape as decodes, so the two must agree."""
        return all(n == 1 + len(d) for n, d in zip(self.num_tokens, self.drafts))

    @property
    def draft_entries(self) -> list[int]:
        """The entry of each drafted token, in entry order."""
        return [i for i, draft in enumerate(self.drafts) for _ in draft]

    @property
    def num_logits_rows(self) -> int:
        """Logits rows the step samples: one per entry and one per drafted token."""
        return len(self.seqs) + sum(map(len, self.drafts))

    @property
    def logits_row_seqs(self) -> list[Sequence]:
        """The sequence of each logits row."""
        return self.seqs + [self.seqs[i] for i in self.draft_entries]

    @property
    def total_tokens(self) -> int:
        return sum(self.num_tokens)


@dataclass(slots=True)
class SequenceOutput:
    """What one step gave one sequence: ``new_token_ids``, the last ``len(new_token_ids)`` of its
    ``output_token_ids`` (more than one after accepted drafts), and the ``finish_reason`` when
    one of them ended it ("stop": EOS or a stop token id; "length"), else None."""

    seq: Sequence
    new_token_ids: list[int]
    finish_reason: str | None = None


@dataclass
class StepResult:
    """What ``postprocess`` made of a batch: one ``SequenceOutput`` per sequence that got new
    tokens, in batch order. ``appended`` / ``num_new`` / ``finished`` view them by field."""

    outputs: list[SequenceOutput] = field(default_factory=list)

    @property
    def appended(self) -> list[Sequence]:
        return [out.seq for out in self.outputs]

    @property
    def num_new(self) -> list[int]:
        return [len(out.new_token_ids) for out in self.outputs]

    @property
    def finished(self) -> list[Sequence]:
        return [out.seq for out in self.outputs if out.finish_reason is not None]
