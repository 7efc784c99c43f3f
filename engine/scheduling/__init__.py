"""Requests and scheduling: a request's ``Sequence`` and ``SamplingParams``, the ``BlockManager``
(paged blocks, prefix caching), the ``Scheduler`` that builds each step, the n-gram drafter, and
structured-output grammars compiled off the engine loop. Plain Python: no tensor, no device."""
