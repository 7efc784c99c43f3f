"""The phase-gate runner: ``python -m gates run | list | show | status``.

Each ``phases/NN_name/gate.yaml`` (schema in ``gates.schema``) declares the
pytest runs of a phase; ``gates.runner`` runs them as subprocesses in
dependency order and ``gates.report`` prints and records the outcome.
"""
