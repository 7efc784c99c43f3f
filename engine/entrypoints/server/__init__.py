"""The OpenAI-compatible server (``python -m engine serve``), split along its seams:

- ``generation``: a request's streams on the engine, through an ``engine.core.engine_client.EngineClient``
  (the engine itself runs in ``engine.core``: in processes of its own under ``serve``);
- ``request_processes``: large bodies read in worker processes;
- ``protocol``: request parsing and validation, response objects;
- ``metrics``: Prometheus metrics and the periodic stats line;
- ``app``: HTTP routes, Server-Sent Events, /metrics, /health, /tokenize, graceful shutdown,
  the ``serve`` command.

Phase 14's agent modules beside them: ``tool_parsers`` and ``reasoning`` (reading model text),
``chat_output`` (a chat choice as OpenAI returns it, whole or streamed), ``tools`` (tool fields
and forced calls), ``access`` (API key, CORS, TLS), with ``json_stream``, ``stream_text`` and
``call_object`` under the parsers.
"""
