"""The sampling values a request gets for the fields it leaves out: the checkpoint's
``generation_config.json``, then the API's own defaults. One resolver for every entry point:
``LLMEngine.sampling_defaults`` (what ``generate`` and the offline API use: ``GREEDY``) and the
server (``OPENAI``: temperature 1, as OpenAI's API has it).

The checkpoint's values count when its generation config samples (``do_sample: true``), as
transformers reads it: Qwen3's ``temperature 0.6, top_p 0.95, top_k 20``. A checkpoint that
does not sample, or gives none of them, leaves the API's defaults (vLLM reads the values whatever
``do_sample`` says; real checkpoints that give them also set it).
"""
from __future__ import annotations

import json
from pathlib import Path

# the sampling fields a generation config may give defaults for, each with its neutral value
GREEDY = {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}
OPENAI = {**GREEDY, "temperature": 1.0}


def read_generation_config(model_dir: Path) -> dict:
    """The checkpoint's ``generation_config.json`` ({} when it has none)."""
    path = Path(model_dir) / "generation_config.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def sampling_defaults(generation_config: dict, api_defaults: dict) -> dict:
    """``api_defaults`` (``GREEDY`` or ``OPENAI``) with the checkpoint's values where its
    ``generation_config`` samples and gives them (numbers of the default's type)."""
    defaults = dict(api_defaults)
    if generation_config.get("do_sample") is not True:
        return defaults
    for name, default in api_defaults.items():
        value = generation_config.get(name)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            defaults[name] = type(default)(value)
    return defaults
