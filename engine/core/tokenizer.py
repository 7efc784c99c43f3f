"""A checkpoint's tokenizer, as the engine and a front (which never builds the engine) both load it."""
from __future__ import annotations

import json
from pathlib import Path


def load_tokenizer(model_dir: Path):
    """The checkpoint's tokenizer. A ``tokenizer_config.json`` naming the generic
    PreTrainedTokenizerFast gets exactly that (AutoTokenizer would prefer the model type's
    own tokenizer class, which rebuilds a different vocabulary for a plain tokenizer.json)."""
    import transformers

    if not any((model_dir / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        raise FileNotFoundError(f"{str(model_dir)!r} has no tokenizer (tokenizer.json / tokenizer_config.json)")
    config_file = model_dir / "tokenizer_config.json"
    declared = json.loads(config_file.read_text()).get("tokenizer_class") if config_file.is_file() else None
    if declared == "PreTrainedTokenizerFast":
        return transformers.PreTrainedTokenizerFast.from_pretrained(str(model_dir))
    return transformers.AutoTokenizer.from_pretrained(str(model_dir))
