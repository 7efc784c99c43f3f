"""Structured outputs: a request's grammar spec (``spec``), its compilation with xgrammar off the
engine loop (``compiler``), and the per-row token masks that constrain sampling (``matchers``)."""
