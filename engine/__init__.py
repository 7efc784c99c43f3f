"""agent-infer: a small, fast LLM inference engine."""
from __future__ import annotations

import importlib.metadata
import tomllib
from pathlib import Path


def version() -> str:
    """agent-infer's version: the installed package's, else (a checkout run without installing it,
    ``PYTHONPATH=.``) the one ``pyproject.toml`` declares."""
    try:
        return importlib.metadata.version("agent-infer")
    except importlib.metadata.PackageNotFoundError:
        return tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]["version"]
