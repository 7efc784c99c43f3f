"""Phase 02, single process: the no-torchrun guard, all_reduce_sum as a custom op,
and the custom all-reduce falling back without raising."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from engine.distributed import (
    TPGroup,
    all_gather_last_dim,
    all_reduce_sum,
    broadcast_object,
    broadcast_tensor,
    get_tp_group,
    init_custom_all_reduce,
)

REPO = Path(__file__).resolve().parents[2]
PROBE = ("import torch.distributed as dist; from engine.distributed import init_tp_distributed, get_tp_group; "
         "tp = init_tp_distributed(timeout_s=5); print(tp.rank, tp.size, tp.group, dist.is_initialized(), "
         "get_tp_group() == tp)")


@pytest.mark.parametrize("world_size", [None, "1"])
def test_single_process_init_returns_at_once(world_size):
    """A run without torchrun must not wait for a master (the seed's phase-9 hang)."""
    torchrun_vars = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in torchrun_vars}
    if world_size is not None:
        env["WORLD_SIZE"] = world_size
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    # A hang fails through the timeout; the guard must return long before it.
    done = subprocess.run([sys.executable, "-c", PROBE], env=env, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["0", "1", "None", "False", "True"]


CLOSE_PROBE = ("import sys, torch.distributed as dist; from pathlib import Path; from engine.distributed import "
               "TPGroup, close_tp_distributed, get_tp_group, init_tp_distributed; "
               "tp = init_tp_distributed(timeout_s=30); close_tp_distributed(); "
               "Path(sys.argv[1], f'rank{tp.rank}').write_text("
               "f'{tp.size} {not dist.is_initialized()} {get_tp_group() == TPGroup()}')")


def test_close_leaves_the_group_on_every_rank(tmp_path):
    """Two torchrun ranks join and leave: afterwards no process group and the one-rank default,
    and both exit 0 (the end of every ``python -m engine`` command under torchrun)."""
    probe = tmp_path / "probe.py"
    probe.write_text(CLOSE_PROBE)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           str(probe), str(tmp_path)], env=env, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert [(tmp_path / f"rank{r}").read_text() for r in range(2)] == ["2 True True"] * 2  # size, left, default


@pytest.mark.parametrize("gpus, want_backend", [(0, "gloo"), (1, "gloo"), (2, "cpu:gloo,cuda:nccl")])
def test_ranks_use_nccl_only_with_a_gpu_for_every_local_rank(monkeypatch, gpus, want_backend):
    """Two local ranks: NCCL (each on cuda:LOCAL_RANK) only where the host has two GPUs; with one
    GPU, rank 1 asking for cuda:1 would fail ("invalid device ordinal"), so every rank takes gloo."""
    import engine.distributed as D

    calls = []
    monkeypatch.setattr(D, "_groups", {})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: calls.append(("set_device", device)))
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda **kwargs: calls.append(("init", kwargs["backend"])))
    monkeypatch.setattr(dist, "barrier", lambda: None)
    monkeypatch.setattr(dist, "get_rank", lambda: 1)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    for name, value in {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1"}.items():
        monkeypatch.setenv(name, value)
    tp = D.init_tp_distributed(timeout_s=5)
    assert (tp.rank, tp.size) == (1, 2)
    assert calls[-1] == ("init", want_backend)
    assert (("set_device", torch.device("cuda", 1)) in calls) == (want_backend != "gloo")


def test_tp_group_defaults_to_one_rank():
    assert get_tp_group() == TPGroup(rank=0, size=1, group=None)
    assert not dist.is_initialized()


def test_all_reduce_sum_at_tp1_returns_a_new_equal_tensor():
    x = torch.randn(3, 5)
    before = x.clone()
    out = all_reduce_sum(x)
    assert out.data_ptr() != x.data_ptr()
    torch.testing.assert_close(out, before, rtol=0, atol=0)
    out.fill_(float("nan"))
    torch.testing.assert_close(x, before, rtol=0, atol=0)


@pytest.mark.parametrize("transposed", [False, True], ids=["contiguous", "strided"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_all_reduce_sum_is_a_registered_custom_op(dtype, transposed):
    """Schema, fake (meta) implementation, strides and aliasing rules checked by torch itself."""
    x = torch.randn(4, 8, dtype=dtype)
    x = x.t() if transposed else x
    torch.library.opcheck(torch.ops.agent_infer.all_reduce_sum.default, (x,))
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
        fake = all_reduce_sum(mode.from_tensor(x))
    assert fake.shape == x.shape and fake.dtype == dtype


def test_other_collectives_are_identities_at_tp1():
    x = torch.randn(2, 3)
    assert all_gather_last_dim(x) is x
    obj = {"temperature": 0.7}
    assert broadcast_object(obj) is obj
    assert broadcast_tensor(x) is x


@pytest.mark.parametrize("device", ["cpu", "cuda"], ids=["cpu-device", "absent-gpu-device"])
def test_custom_all_reduce_init_is_a_noop_at_tp1(device):
    """Never raises (even naming a CUDA device that is absent), and all_reduce_sum still sums."""
    init_custom_all_reduce(device)
    x = torch.randn(6)
    torch.testing.assert_close(all_reduce_sum(x), x, rtol=0, atol=0)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_all_reduce_sum_at_tp1(dtype):
    init_custom_all_reduce(torch.device("cuda"))
    x = torch.randn(7, 33, device="cuda", dtype=dtype)
    out = all_reduce_sum(x)
    assert out.device == x.device and out.dtype == dtype and out.data_ptr() != x.data_ptr()
    torch.testing.assert_close(out, x, rtol=0, atol=0)
