"""``--model ORG/NAME``: a Hugging Face Hub id resolves through huggingface_hub's cache
(``engine.core.model_source``). The cache is written here as huggingface_hub lays it out
(``models--ORG--NAME/{blobs, refs/<branch>, snapshots/<commit>/...}``, the snapshot files relative
symlinks into the blobs), under a temporary HF_HOME with HF_HUB_OFFLINE=1 and every socket
connect refused: nothing here touches the network."""
import argparse
import hashlib
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import huggingface_hub
import pytest

from engine.core.engine_args import EngineArgs
from engine.core.llm_engine import LLMEngine
from engine.core.model_source import METADATA_FILES, resolve_model
from engine.scheduling.sequence import SamplingParams
from phases.checkpoints import make_tiny_checkpoint

REPO = Path(__file__).resolve().parents[2]
HUB_ID = "tiny-org/tiny-qwen3"
MAIN_COMMIT, V2_COMMIT = "1" * 40, "2" * 40
ENGINE_ARGS = dict(block_size=4, max_num_seqs=3, max_num_batched_tokens=64, max_model_len=128)
PROMPTS = [[5, 9, 2, 7, 11], [3, 4]]


def cache_snapshot(cache: Path, repo_id: str, source: Path, commit: str, refs: tuple[str, ...] = (),
                   files: list[str] | None = None) -> Path:
    """``files`` of ``source`` (default: all) written into ``cache`` as huggingface_hub stores a
    download of ``repo_id`` at ``commit``: each in blobs/ under its hash, linked from
    snapshots/<commit>/ by a relative symlink; refs/<ref> holds the commit of each of ``refs``."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    for name in files if files is not None else sorted(str(p.relative_to(source)) for p in source.rglob("*")
                                                       if p.is_file()):
        data = (source / name).read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.unlink(missing_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    for ref in refs:
        (repo / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)  # as huggingface_hub writes it: no newline
    return snapshot


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(main, v2): two tiny Qwen3 checkpoints with different weights, v2 sharded (an index)."""
    root = tmp_path_factory.mktemp("hub-sources")
    return (make_tiny_checkpoint(root / "main", seed=0),
            make_tiny_checkpoint(root / "v2", seed=1, sharded=True))


@pytest.fixture
def hub_cache(tmp_path, monkeypatch, checkpoints):
    """An offline Hugging Face cache under a temporary HF_HOME holding HUB_ID at two commits:
    refs/main -> MAIN_COMMIT (the first checkpoint), refs/v2 -> V2_COMMIT (the sharded second).
    huggingface_hub read its settings when imported: they are set on it too."""
    home = tmp_path / "hf-home"
    cache = home / "hub"
    for name, value in (("HF_HOME", home), ("HF_HUB_CACHE", cache), ("HF_HUB_OFFLINE", "1")):
        monkeypatch.setenv(name, str(value))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)

    def no_network(*args, **kwargs):
        raise AssertionError("a test of the offline cache opened a network connection")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setattr(socket.socket, "connect_ex", no_network)
    main, v2 = checkpoints
    cache_snapshot(cache, HUB_ID, main, MAIN_COMMIT, refs=("main",))
    cache_snapshot(cache, HUB_ID, v2, V2_COMMIT, refs=("v2",))
    return cache


def greedy(engine: LLMEngine) -> list[list[int]]:
    return engine.generate_tokens(PROMPTS, SamplingParams(temperature=0.0, max_tokens=8))


def test_a_hub_id_loads_its_cached_snapshot_offline(hub_cache):
    """``LLMEngine("org/name")`` loads the snapshot refs/main names and gives the tokens of that
    snapshot directory loaded directly; its name is the id as given, a directory's its name."""
    snapshot = hub_cache / "models--tiny-org--tiny-qwen3" / "snapshots" / MAIN_COMMIT
    by_id = LLMEngine(HUB_ID, **ENGINE_ARGS)
    by_dir = LLMEngine(snapshot, **ENGINE_ARGS)
    assert by_id.model_dir == snapshot
    assert by_id.engine_config.model.name == HUB_ID
    assert by_dir.engine_config.model.name == MAIN_COMMIT
    assert greedy(by_id) == greedy(by_dir)


def test_revision_picks_a_branch_or_a_commit(hub_cache, checkpoints):
    """``--revision`` (a refs/ branch or a commit hash) picks that snapshot; the default is main.
    The v2 snapshot's tokens are v2's (not main's), read through its index and shards."""
    snapshots = hub_cache / "models--tiny-org--tiny-qwen3" / "snapshots"

    def model_dir(**revision):
        return EngineArgs(model=HUB_ID, **revision).create_engine_config().model.model_dir

    assert model_dir() == model_dir(revision="main") == snapshots / MAIN_COMMIT
    assert model_dir(revision="v2") == model_dir(revision=V2_COMMIT) == snapshots / V2_COMMIT
    assert model_dir(revision=MAIN_COMMIT) == snapshots / MAIN_COMMIT
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    args = EngineArgs.from_cli_args(parser.parse_args(["--model", HUB_ID, "--revision", "v2"]))
    assert args.to_cli_args() == ["--model", HUB_ID, "--revision", "v2"]
    v2 = LLMEngine(args.create_engine_config())
    assert greedy(v2) == greedy(LLMEngine(checkpoints[1], **ENGINE_ARGS))
    assert greedy(v2) != greedy(LLMEngine(checkpoints[0], **ENGINE_ARGS))
    with pytest.raises(FileNotFoundError, match=r"'tiny-org/tiny-qwen3' \(revision 'v3'\).*HF_HUB_OFFLINE=1"):
        EngineArgs(model=HUB_ID, revision="v3").create_engine_config()


def test_a_local_directory_named_like_a_hub_id_wins(hub_cache, checkpoints, tmp_path, monkeypatch):
    """A directory ``tiny-org/tiny-qwen3`` under the working directory is loaded, not the cached
    id; a --revision beside a local directory is an error."""
    monkeypatch.chdir(tmp_path)
    shutil.copytree(checkpoints[1], tmp_path / HUB_ID)
    model = EngineArgs(model=HUB_ID).create_engine_config().model
    assert model.model_dir == Path(HUB_ID) and model.model_dir.resolve() == (tmp_path / HUB_ID).resolve()
    assert model.name == "tiny-qwen3"
    with pytest.raises(ValueError, match="--revision 'v2'.*local directory"):
        EngineArgs(model=HUB_ID, revision="v2").create_engine_config()


def test_an_incomplete_cached_snapshot_is_a_clear_error(hub_cache, checkpoints):
    """Offline, a cached snapshot that lacks a shard its index names is an error naming the shard."""
    v2 = checkpoints[1]
    shards = sorted(p.name for p in v2.glob("*.safetensors"))
    kept = [p.name for p in v2.iterdir() if p.name != shards[-1]]
    cache_snapshot(hub_cache, "tiny-org/partial", v2, "3" * 40, refs=("main",), files=kept)
    with pytest.raises(FileNotFoundError, match=f"'tiny-org/partial' \\(revision 'main'\\).*lacks {shards[-1]}"):
        resolve_model("tiny-org/partial")


def test_a_download_fetches_only_what_the_engine_reads(tmp_path, monkeypatch, checkpoints):
    """Online, resolution asks huggingface_hub for the configs, tokenizer and chat template files
    and then, at the commit the branch resolved to, exactly the safetensors the index names: no
    .bin / .pt / .gguf, no second copy of the weights. (snapshot_download is replaced by one that
    "downloads" from a local repository into the cache through huggingface_hub's own filter.)"""
    from huggingface_hub.utils import filter_repo_objects

    remote = tmp_path / "remote"
    shutil.copytree(checkpoints[1], remote)
    decoys = ["pytorch_model.bin", "model.gguf", "consolidated.safetensors", "original/consolidated.00.pth",
              "onnx/model.safetensors", "README.md", "training_args.bin"]
    for name in decoys:
        (remote / name).parent.mkdir(parents=True, exist_ok=True)
        (remote / name).write_bytes(b"decoy")
    cache = tmp_path / "hub"
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    calls = []

    def snapshot_download(repo_id, *, revision, allow_patterns, local_files_only, tqdm_class):
        assert repo_id == HUB_ID and not local_files_only and revision in ("main", V2_COMMIT)
        calls.append((revision, sorted(allow_patterns), tqdm_class))
        names = sorted(str(p.relative_to(remote)) for p in remote.rglob("*") if p.is_file())
        files = list(filter_repo_objects(names, allow_patterns=allow_patterns))
        return str(cache_snapshot(cache, repo_id, remote, V2_COMMIT, refs=("main",), files=files))

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    resolved = resolve_model(HUB_ID)
    assert resolved.path == cache / "models--tiny-org--tiny-qwen3" / "snapshots" / V2_COMMIT
    assert resolved.name == HUB_ID
    shards = sorted(p.name for p in checkpoints[1].glob("*.safetensors"))
    assert len(shards) > 1
    assert calls == [("main", sorted(METADATA_FILES), None), (V2_COMMIT, shards, None)]
    fetched = sorted(str(p.relative_to(resolved.path)) for p in resolved.path.rglob("*") if p.is_file())
    assert fetched == sorted(p.name for p in checkpoints[1].iterdir())
    calls.clear()
    resolve_model(HUB_ID, "main", weights=False, progress=False)
    assert len(calls) == 1 and calls[0][2] is not None  # configs and tokenizer only; bars off


def test_a_missing_hub_id_offline_is_a_one_line_error(tmp_path):
    """``python -m engine generate --model org/missing`` offline with an empty cache: exit code 2
    and one line naming the id, the revision and HF_HUB_OFFLINE; no traceback."""
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf-home"), "HF_HUB_CACHE": str(tmp_path / "hf-home" / "hub"),
           "HF_HUB_OFFLINE": "1", "HF_ENDPOINT": "http://127.0.0.1:9"}  # an endpoint nothing answers on
    out = subprocess.run([sys.executable, "-m", "engine", "generate", "--model", "org/missing", "--max-tokens", "1"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr, out.stderr
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, out.stderr
    assert "'org/missing' (revision 'main')" in errors[0] and "HF_HUB_OFFLINE=1" in errors[0], errors[0]
    assert "hf download org/missing" in errors[0], errors[0]
