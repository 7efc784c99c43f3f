"""Where a checkpoint comes from: ``--model`` names a local directory or a Hugging Face Hub id.

``resolve_model(model, revision)`` gives the checkpoint directory and the model's name. An
existing local directory always wins. Otherwise a string that is a Hub id (``name`` or
``org/name``, the Hub's naming rules) is fetched with ``huggingface_hub.snapshot_download`` into
the standard cache (``HF_HOME`` / ``HF_HUB_CACHE``) at ``revision`` (a branch, tag or commit;
default "main"), only the files the engine reads: the configs, the tokenizer and chat template
files, and the safetensors the index names (never .bin / .pt / .gguf, nor a second copy of the
weights such as Mistral's consolidated.safetensors). Under ``HF_HUB_OFFLINE=1``, or when the Hub
cannot be reached, the snapshot must already be in the cache, complete; offline nothing touches
the network. A failure is a one-line FileNotFoundError or ValueError naming the id, the revision
and what to do.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import NamedTuple

log = logging.getLogger(__name__)

DEFAULT_REVISION = "main"
WEIGHTS_INDEX = "model.safetensors.index.json"
SINGLE_WEIGHTS = "model.safetensors"  # without an index: the whole checkpoint (engine.model.loader.checkpoint_files)
TOKENIZERS = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")  # one of them: engine.core.llm_engine
METADATA_FILES = ("config.json", "generation_config.json", WEIGHTS_INDEX, *TOKENIZERS, "special_tokens_map.json",
                  "added_tokens.json", "vocab.json", "merges.txt", "chat_template.jinja", "chat_template.json")


class ResolvedModel(NamedTuple):
    path: Path  # the checkpoint directory (a Hub id's: its snapshot in the cache)
    name: str  # the Hub id as given, else the directory's name: the served model name's default


def resolve_model(model: str | Path, revision: str | None = None, *, weights: bool = True,
                  progress: bool = True) -> ResolvedModel:
    """The checkpoint ``model`` names: a local directory (``revision`` must be None), else a Hub
    id at ``revision`` (None: "main"), fetched into the cache with huggingface_hub's progress bars
    (``progress``: on a terminal) or found there offline. ``weights=False`` fetches and checks the
    configs and the tokenizer only (what a client of a server needs)."""
    local = Path(model)
    if local.is_dir():
        if revision is not None:
            raise ValueError(f"--revision {revision!r} picks a Hub revision, but {str(model)!r} is a local directory")
        return ResolvedModel(local, local.name)
    if isinstance(model, Path) or not is_hub_id(model):
        raise FileNotFoundError(f"model directory {str(model)!r} does not exist (nor is it a Hugging Face Hub id "
                                f"ORG/NAME)")
    return ResolvedModel(_snapshot(model, revision or DEFAULT_REVISION, weights, progress), model)


def is_hub_id(name: str) -> bool:
    """Whether ``name`` follows the Hub's naming rules for a repository: ``name`` or ``org/name``."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def _snapshot(repo_id: str, revision: str, weights: bool, progress: bool) -> Path:
    """The cached snapshot of ``repo_id`` at ``revision`` holding the metadata files and (with
    ``weights``) the safetensors the index names; fetched first unless offline."""
    import huggingface_hub
    from huggingface_hub import constants, errors

    offline = constants.HF_HUB_OFFLINE
    which = f"{repo_id!r} (revision {revision!r})"
    fetch = dict(local_files_only=offline, tqdm_class=None if progress else _quiet_bars())
    if not offline:
        log.info("model %s: looking it up on the Hugging Face Hub (cache %s)", which, constants.HF_HUB_CACHE)
    try:
        snapshot = Path(huggingface_hub.snapshot_download(repo_id, revision=revision,
                                                          allow_patterns=list(METADATA_FILES), **fetch))
        absent = [f for f in _weight_files(snapshot) if not (snapshot / f).is_file()] if weights else []
        if absent:  # at the commit just resolved: a moving branch cannot mix two commits' files
            huggingface_hub.snapshot_download(repo_id, revision=snapshot.name, allow_patterns=absent, **fetch)
    except errors.RevisionNotFoundError:
        raise ValueError(f"model {repo_id!r} has no revision {revision!r} on the Hugging Face Hub (--revision "
                         f"takes a branch, tag or commit)") from None
    except errors.RepositoryNotFoundError:  # gated ones too
        raise ValueError(f"model {which} is neither a local directory nor a Hugging Face Hub repository this "
                         f"token can read (a private or gated one needs `hf auth login` or HF_TOKEN)") from None
    except errors.LocalEntryNotFoundError:
        why = "HF_HUB_OFFLINE=1 forbids fetching it" if offline else "the Hugging Face Hub cannot be reached"
        raise FileNotFoundError(f"model {which} is neither a local directory nor complete in the Hugging Face "
                                f"cache {constants.HF_HUB_CACHE}, and {why}: fetch it once online (`hf download "
                                f"{repo_id} --revision {revision}`) or pass a checkpoint directory") from None
    except OSError as e:  # HTTP errors, a full disk
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"model {which}: fetching it from the Hugging Face Hub failed: {first_line}") from None
    missing = _missing_files(snapshot, weights)
    if missing:
        fix = ("fetch it again online (without HF_HUB_OFFLINE)" if offline else
               "the repository does not publish them (agent-infer reads safetensors checkpoints)")
        raise FileNotFoundError(f"model {which}: its snapshot {snapshot} lacks {', '.join(missing)}: {fix}")
    log.info("model %s: commit %s, from the Hugging Face cache: %s", which, snapshot.name, snapshot)
    return snapshot


def _weight_files(snapshot: Path) -> list[str]:
    """The safetensors files of the checkpoint: those its index names, else the single file."""
    index = snapshot / WEIGHTS_INDEX
    if not index.is_file():
        return [SINGLE_WEIGHTS]
    return sorted(set(json.loads(index.read_text())["weight_map"].values()))


def _missing_files(snapshot: Path, weights: bool) -> list[str]:
    """What the engine reads that ``snapshot`` lacks: config.json, a tokenizer, the weights."""
    missing = [] if (snapshot / "config.json").is_file() else ["config.json"]
    if not any((snapshot / f).is_file() for f in TOKENIZERS):
        missing.append(" / ".join(TOKENIZERS))
    if weights:
        missing += [f for f in _weight_files(snapshot) if not (snapshot / f).is_file()]
    return missing


def _quiet_bars():
    """huggingface_hub's progress bar class, always off (a rank other than 0, or ``progress`` off)."""
    from huggingface_hub.utils import tqdm

    class QuietBars(tqdm):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **{**kwargs, "disable": True})

    return QuietBars
