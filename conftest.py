"""Shared pytest setup for every phase.

- Markers (registered in pyproject.toml): ``cuda`` tests skip without a GPU;
  ``torchrun`` tests skip unless the process was started by torchrun
  (WORLD_SIZE > 1), so ``pytest phases/NN_x`` works directly.
- ``tp_group``: the tensor-parallel group of this process (size 1 outside
  torchrun), with a short collective timeout; under torchrun a rank that fails
  a test aborts (``gates.pytest_plugin``), so no rank waits for it.
- ``tp_device``: where the torchrun tests put their tensors, models and KV
  caches: the CPU (gloo) by default; ``GATES_TORCHRUN_DEVICE=cuda`` puts them on
  ``cuda:LOCAL_RANK``, so their collectives run over NCCL. One GPU per rank: a
  machine with no GPU fails the torchrun tests with that message; one with fewer
  GPUs than ranks skips them (the 4-rank runs of a 2-GPU host), as it skips the
  ``cuda``-marked torchrun tests, which take a GPU per rank whatever the switch. Under it Triton's
  float32 ``tl.dot`` is IEEE float32 (``TRITON_F32_DEFAULT=ieee``, unless set):
  its default TF32 would put errors near 1e-3 into the float32 attention that the
  TP tests compare with float32 HF (on the CPU) at the CPU tolerances.
- ``tiny_checkpoint``: a factory writing a tiny HF-format checkpoint directory
  (``phases/checkpoints.py``)
  whose every weight (norms included) is random, from a seed.
"""
from __future__ import annotations

import os
import sys
import tempfile

import pytest
import torch

from phases.checkpoints import make_tiny_checkpoint

# Also when torchrun runs pytest directly: a rank that fails a test aborts instead of leaving
# the others waiting in a collective (it records results only under `python -m gates`).
pytest_plugins = ["gates.pytest_plugin"]

# Under `python -m gates audit` a failure is expected and only its report matters: Hypothesis
# stops at the first failing example instead of spending minutes shrinking it, and draws the same
# examples in every run (derandomized, no example database), so a mutation that only a property
# catches gets the same verdict on every machine and every run (one escaped some audits and not
# others: random draws). Imported only then: Hypothesis takes 1.5 s to import, in every process of
# a gate run, most of which never use it.
if os.environ.get("GATES_AUDIT"):
    from hypothesis import Phase, settings

    settings.register_profile("gates-audit", phases=[Phase.explicit, Phase.generate], derandomize=True,
                              database=None)
    settings.load_profile("gates-audit")


@pytest.hookimpl(trylast=True)
def pytest_collection_finish(session):
    """When no collected test module imported Hypothesis, drop its pytest plugin: its end-of-session
    summary would import Hypothesis (1.5 s) for nothing, in each rank of a torchrun run."""
    if "hypothesis" not in sys.modules:
        session.config.pluginmanager.unregister(name="hypothesispytest")


TORCHRUN_DEVICE_VAR = "GATES_TORCHRUN_DEVICE"
WORLD_SIZE = int(os.environ.get("WORLD_SIZE", "1"))
IN_TORCHRUN = WORLD_SIZE > 1


def _switch() -> str:
    return os.environ.get(TORCHRUN_DEVICE_VAR, "").strip().lower() or "cpu"


if IN_TORCHRUN and _switch() == "cuda":
    os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")  # read when a kernel compiles; part of its cache key


def torchrun_device() -> torch.device:
    """This process's test device: ``cuda:LOCAL_RANK`` under torchrun with
    ``GATES_TORCHRUN_DEVICE=cuda``, else the CPU. Fails the test (not a crash deep in
    the process group) when the switch is on but the machine has no GPU; with fewer GPUs than
    ranks the torchrun tests are skipped at collection."""
    kind = _switch()
    if kind not in ("cpu", "cuda"):
        pytest.fail(f"{TORCHRUN_DEVICE_VAR}={os.environ[TORCHRUN_DEVICE_VAR]!r}: expected cpu (the default, gloo) "
                    f"or cuda (NCCL)", pytrace=False)
    if kind == "cpu" or not IN_TORCHRUN:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        pytest.fail(f"{TORCHRUN_DEVICE_VAR}=cuda but torch.cuda.is_available() is False on this machine: "
                    f"the torchrun tests cannot run on NCCL here (unset it to run them on the CPU with gloo)",
                    pytrace=False)
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))


def pytest_configure(config):
    """Under torchrun every rank is a separate pytest: give each its own
    temporary-directory root so ranks never share or clean up each other's."""
    if IN_TORCHRUN and not config.option.basetemp:
        config.option.basetemp = tempfile.mkdtemp(prefix=f"pytest-rank{os.environ.get('RANK', '0')}-")


def pytest_collection_modifyitems(config, items):
    has_cuda = torch.cuda.is_available()
    skip_cuda = pytest.mark.skip(reason="needs a CUDA GPU")
    skip_tr = pytest.mark.skip(reason="runs only under torchrun (WORLD_SIZE > 1)")
    gpus = torch.cuda.device_count() if has_cuda else 0
    too_few_gpus = IN_TORCHRUN and 0 < gpus < WORLD_SIZE  # every rank sees the same: all skip
    skip_gpus = pytest.mark.skip(reason=f"{WORLD_SIZE} ranks on CUDA need {WORLD_SIZE} GPUs, {gpus} here")
    for item in items:
        if item.get_closest_marker("cuda") and not has_cuda:
            item.add_marker(skip_cuda)
        if item.get_closest_marker("torchrun") and not IN_TORCHRUN:
            item.add_marker(skip_tr)
        # a GPU per rank: every torchrun test with the switch on, and a `cuda` torchrun test always
        on_cuda = _switch() == "cuda" or item.get_closest_marker("cuda")
        if item.get_closest_marker("torchrun") and on_cuda and too_few_gpus:
            item.add_marker(skip_gpus)


# A collective that waits longer than this has lost a peer: fail in a minute, not the engine's 300 s
# (a rank that fails a test also aborts at once, see gates.pytest_plugin).
COLLECTIVE_TIMEOUT_S = float(os.environ.get("GATES_COLLECTIVE_TIMEOUT_S", "60"))


@pytest.fixture(scope="session")
def tp_group():
    """This process's TP group; initialises gloo/NCCL once under torchrun, with a short collective timeout."""
    from engine.distributed import init_tp_distributed

    torchrun_device()  # a bad GATES_TORCHRUN_DEVICE fails here, before a rank without a GPU joins the group
    return init_tp_distributed(timeout_s=COLLECTIVE_TIMEOUT_S)


@pytest.fixture(scope="session")
def tp_device(tp_group) -> torch.device:
    """Where a torchrun test puts its tensors, model and KV cache: the CPU (collectives over
    gloo), or ``cuda:LOCAL_RANK`` (NCCL) with ``GATES_TORCHRUN_DEVICE=cuda``."""
    return torchrun_device()


@pytest.fixture
def tiny_checkpoint(tmp_path_factory):
    """Factory: ``tiny_checkpoint(arch="Qwen3ForCausalLM", seed=0, sharded=False, **overrides)``.

    Under torchrun (a process group initialised) rank 0 writes one checkpoint
    and every rank gets its path after a barrier.
    """
    import torch.distributed as dist

    def make(arch: str = "Qwen3ForCausalLM", seed: int = 0, sharded: bool = False, **overrides):
        if not (dist.is_available() and dist.is_initialized()):
            return make_tiny_checkpoint(tmp_path_factory.mktemp(f"{arch}-{seed}"), arch, seed, sharded, **overrides)
        path = [None]
        if dist.get_rank() == 0:
            path[0] = make_tiny_checkpoint(tmp_path_factory.mktemp(f"{arch}-{seed}"), arch, seed, sharded,
                                           **overrides)
        dist.broadcast_object_list(path, src=0)
        dist.barrier()
        return path[0]
    return make
