"""What the grammar compiler's tests share: the demo model's vocabulary size, compilers whose
compiles are counted, and schema specs (one that compiles far past any time limit)."""
from __future__ import annotations

import functools
from collections.abc import Iterator

from engine.scheduling.structured.compiler import GrammarCompiler
from engine.scheduling.structured.spec import StructuredSpec, spec_from_request

VOCAB = 8192  # the demo model's


def counted_compilers(tokenizer) -> Iterator:
    """A fixture's body: yields ``make(**kwargs)``, which builds a fresh compiler (own cache and
    worker processes) whose ``calls`` lists the specs sent to a worker, in the order the workers
    took them; every compiler made is closed at the end."""
    made = []

    def make(**kwargs):
        compiler = GrammarCompiler(tokenizer, VOCAB, [tokenizer.eos_token_id], **kwargs)
        compiler.calls = []
        outcome = compiler._outcome

        def counted(worker, spec):
            compiler.calls.append(spec)
            return outcome(worker, spec)
        compiler._outcome = counted
        made.append(compiler)
        return compiler
    yield make
    for compiler in made:
        compiler.close()


def schema_spec(schema: dict) -> StructuredSpec:
    return spec_from_request({"structured_outputs": {"json": schema}})


@functools.cache
def slow_spec(tag: str) -> StructuredSpec:
    """An enum of 100,000 strings: its compile takes far longer than any test's time limit (30,000
    take 12 s on one core here, and the time grows faster than the count)."""
    return schema_spec({"enum": [f"{tag}-{i}" for i in range(100_000)]})
