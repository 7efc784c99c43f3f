"""Entrypoints: the OpenAI / Anthropic server, ``generate`` and the benchmark suite, each a client
of the engine core (``engine.core``)."""
