"""Phase 02 under torchrun (gloo on CPU, NCCL on CUDA): every collective against
values each rank can compute for every other rank from shared seeds. The tensors
live on ``tp_device``: the CPU by default, ``cuda:LOCAL_RANK`` with
``GATES_TORCHRUN_DEVICE=cuda`` (conftest.py)."""
import pytest
import torch
import torch.distributed as dist

from engine.distributed import (
    all_gather_last_dim,
    all_reduce_sum,
    broadcast_object,
    broadcast_tensor,
    get_tp_group,
    init_custom_all_reduce,
    init_tp_distributed,
)

pytestmark = pytest.mark.torchrun


def rank_input(rank: int, shape, dtype=torch.float32) -> torch.Tensor:
    """The tensor rank ``rank`` contributes; every rank can rebuild any rank's."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(1000 + rank)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(5,), (3, 7), (2, 3, 16)])
def test_all_reduce_sum_equals_sum_of_rank_inputs(tp_group, tp_device, shape, dtype):
    x = rank_input(tp_group.rank, shape, dtype).to(tp_device)
    before = x.clone()
    out = all_reduce_sum(x)
    expected = sum(rank_input(r, shape, dtype).double() for r in range(tp_group.size))
    assert out.shape == x.shape and out.dtype == dtype and out.device == tp_device
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-6
    torch.testing.assert_close(out.double().cpu(), expected, rtol=tol, atol=tol)
    torch.testing.assert_close(x, before, rtol=0, atol=0)  # the input is not reduced in place


def test_all_reduce_sum_makes_one_copy_only(tp_group, tp_device):
    """The output buffer is the only copy (custom ops may not return their input)."""
    x = rank_input(tp_group.rank, (4, 8)).to(tp_device)
    with torch.profiler.profile() as prof:
        all_reduce_sum(x)
    names = [e.name for e in prof.events()]
    assert names.count("agent_infer::all_reduce_sum") == 1
    assert names.count("aten::copy_") == 1


def test_all_gather_last_dim_in_rank_order(tp_group, tp_device):
    x = rank_input(tp_group.rank, (2, 3, 4)).to(tp_device)
    out = all_gather_last_dim(x)
    expected = torch.cat([rank_input(r, (2, 3, 4)) for r in range(tp_group.size)], dim=-1)
    assert out.shape == (2, 3, 4 * tp_group.size) and out.device == tp_device
    torch.testing.assert_close(out.cpu(), expected, rtol=0, atol=0)


@pytest.mark.parametrize("src", [0, -1], ids=["src-first", "src-last"])
def test_broadcasts_deliver_the_source_rank_values(tp_group, tp_device, src):
    src = src % tp_group.size
    obj = broadcast_object({"rank": tp_group.rank, "ids": [tp_group.rank] * 3}, src=src)  # gloo on purpose
    assert obj == {"rank": src, "ids": [src] * 3}
    t = rank_input(tp_group.rank, (6,)).to(tp_device)
    out = broadcast_tensor(t, src=src)
    assert out is t
    torch.testing.assert_close(t.cpu(), rank_input(src, (6,)), rtol=0, atol=0)
    # by default both send rank 0's (the sampler's ids, the engine's requests)
    assert broadcast_object(tp_group.rank) == 0
    t = rank_input(tp_group.rank, (6,)).to(tp_device)
    torch.testing.assert_close(broadcast_tensor(t).cpu(), rank_input(0, (6,)), rtol=0, atol=0)


def test_collectives_on_the_test_device_use_its_backend(tp_group, tp_device, capsys):
    """The torchrun tests' tensors reach the backend their device implies: gloo for the CPU
    (the default), NCCL for ``cuda:LOCAL_RANK`` (``GATES_TORCHRUN_DEVICE=cuda``), seen in the
    profiler's events; each rank prints what it used, so a run on NCCL shows in its output."""
    backend = "nccl" if tp_device.type == "cuda" else "gloo"
    assert f"{tp_device.type}:{backend}" in dist.get_backend_config(), dist.get_backend_config()
    if tp_device.type == "cuda":
        assert torch.cuda.current_device() == tp_device.index
    x = rank_input(tp_group.rank, (16,)).to(tp_device)
    with torch.profiler.profile() as prof:
        dist.all_reduce(x)
    names = sorted({e.name for e in prof.events() if backend in e.name.lower()})
    assert names, f"no {backend} event in the profile of an all-reduce on {tp_device}"
    expected = sum(rank_input(r, (16,)).double() for r in range(tp_group.size))
    torch.testing.assert_close(x.double().cpu(), expected, rtol=1e-6, atol=1e-6)
    with capsys.disabled():
        print(f"rank {tp_group.rank}: torchrun tests on {tp_device}, all-reduce over {backend} "
              f"({dist.get_backend_config()}; {', '.join(names[:2])})")


def test_init_is_idempotent(tp_group):
    assert init_tp_distributed() == tp_group == get_tp_group()
    assert tp_group.size > 1 and 0 <= tp_group.rank < tp_group.size


@pytest.mark.parametrize("device", ["cpu", "cuda"], ids=["ask-cpu", "ask-cuda"])
def test_custom_all_reduce_init_on_cpu_leaves_the_fallback_working(tp_group, device):
    """On a machine without GPUs, asking for the CUDA custom all-reduce runs the whole
    try / vote / fall back path: nothing raises, the handle stays unset, sums stay right."""
    import engine.distributed as distributed

    if device == "cuda" and torch.cuda.is_available():
        pytest.skip("checks the failure path; this machine has a GPU")
    init_custom_all_reduce(device)
    assert distributed._custom_all_reduce is None
    x = rank_input(tp_group.rank, (9,))
    expected = sum(rank_input(r, (9,)).double() for r in range(tp_group.size))
    torch.testing.assert_close(all_reduce_sum(x).double(), expected, rtol=1e-6, atol=1e-6)


@pytest.mark.cuda
@pytest.mark.parametrize("numel", [8, 64 << 10, 2 << 20, 8 << 20], ids=["tiny", "one-shot", "two-shot", "nccl"])
def test_cuda_all_reduce_is_exact_on_every_path(tp_group, numel, capsys):
    """On GPUs (NCCL, with the custom all-reduce initialised when it can be): message sizes that take
    the one-shot, two-shot and NCCL paths all return the sum of every rank's input."""
    import engine.distributed as distributed

    device = torch.device("cuda", torch.cuda.current_device())
    init_custom_all_reduce(device)
    active = distributed._custom_all_reduce is not None
    with capsys.disabled():
        print(f"rank {tp_group.rank}: custom all-reduce {'active' if active else 'off (NCCL)'}")
    if numel in (64 << 10, 2 << 20) and not active:
        pytest.skip("the symmetric-memory all-reduce is unavailable here (no peer access?), so its paths cannot run")
    for dtype in (torch.bfloat16, torch.float32):
        x = rank_input(tp_group.rank, (numel,), dtype).to(device)
        out = all_reduce_sum(x)
        expected = sum(rank_input(r, (numel,), dtype).double() for r in range(tp_group.size))
        tol = 1e-2 if dtype == torch.bfloat16 else 1e-6
        torch.testing.assert_close(out.double().cpu(), expected, rtol=tol, atol=tol)
