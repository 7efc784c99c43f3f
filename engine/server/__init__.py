"""The OpenAI-compatible server (``python -m engine serve``), split along its seams:

- ``engine_loop``: the one thread that calls the engine (streams, queues, the TP lock-step
  protocol, the error policy, draining);
- ``protocol``: request parsing and validation, response objects;
- ``metrics``: Prometheus metrics and the periodic stats line;
- ``app``: HTTP routes, Server-Sent Events, /metrics, /health, graceful shutdown, the
  ``serve`` command.
"""
