"""The server under torchrun (float32 on ``tp_device``: the CPU with gloo, or ``cuda:LOCAL_RANK``
with NCCL under ``GATES_TORCHRUN_DEVICE=cuda``): rank 0 serves HTTP to a client in its own
process, the other ranks mirror rank 0's broadcast commands, and every rank runs the same steps.
A worker that never gets rank 0's stop fails its test within STOP_TIMEOUT_S instead of hanging."""
import asyncio
import time

import pytest
import torch.distributed as dist

from engine.core.llm_engine import LLMEngine
from server_cases import (
    HANG_GUARD_S,
    PROMPTS,
    TP_STOP_TIMEOUT_S,
    engine_cases,
    make_word_checkpoint,
    mirror_until_stopped,
    paused_until,
    running_server,
    wait_idle,
)

openai = pytest.importorskip("openai")  # a test dependency; absent on the GPU image

pytestmark = pytest.mark.torchrun
GREEDY = dict(temperature=0, extra_body={"ignore_eos": True})
STOP_TIMEOUT_S = TP_STOP_TIMEOUT_S
PAUSE_S = 30  # rank 0 waiting for its clients: the other ranks wait in a broadcast, whose timeout is 60 s


@pytest.fixture
def model_dir(tp_group, tmp_path_factory):
    """One word-level checkpoint written by rank 0, its path on every rank."""
    path = [make_word_checkpoint(tmp_path_factory.mktemp("word-model"), seed=4) if tp_group.rank == 0 else None]
    dist.broadcast_object_list(path, src=0)
    return path[0]


def test_tp_server_ranks_stay_in_step(tp_group, tp_device, model_dir, monkeypatch):
    """Concurrent requests (streaming, JSON, one client leaving mid-stream) through a TP server
    get the greedy text each gets alone; every rank ran the same batches and tokens; every
    rank's KV blocks are free at the end. Rank 0's engine waits until every client has
    submitted, so the requests start together however the HTTP thread is scheduled."""
    assert tp_group.size > 1
    engine = LLMEngine(model_dir, block_size=4, max_num_seqs=8, max_model_len=96, device=tp_device, dtype="float32")
    lengths = [3, 9, 5, 12, 7, 4]
    expected = [engine.generate(p, max_new_tokens=n, ignore_eos=True) for p, n in zip(PROMPTS, lengths)]
    trace = []
    real_launch = engine.runner.launch

    def launch(batch, previous=None):
        launched = real_launch(batch, previous)
        trace.append((list(zip([s.request_id for s in batch.seqs], batch.starts, batch.num_tokens)),
                      launched.token_ids()))
        return launched

    monkeypatch.setattr(engine.runner, "launch", launch)
    if tp_group.rank == 0:
        with running_server(engine) as running:
            def all_submitted():  # every client's request, the leaver's too
                return running.engine_client.num_streams >= len(lengths) + 1

            with paused_until(running.engine_client, all_submitted, PAUSE_S) as gave_up:
                got = asyncio.run(_clients(running.url, lengths))
            wait_idle(running.engine_client)
        assert not gave_up, gave_up[0]
        assert got == expected
    else:
        mirror_until_stopped(engine)
    traces = [None] * tp_group.size
    dist.all_gather_object(traces, trace)
    assert len(trace) > 1 and all(t == traces[0] for t in traces), "ranks ran different steps"
    assert any(len(entries) > 1 for entries, _ in trace), "the requests were never batched"
    engine_cases.assert_no_block_leaks(engine)


async def _clients(url: str, lengths: list[int]) -> list[str]:
    """PROMPTS[:len(lengths)] at once (every other one streamed) while one more client leaves
    mid-stream; the texts in prompt order."""
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0,
                                  timeout=STOP_TIMEOUT_S) as client:
        async def one(i: int, n: int) -> str:
            if i % 2:
                out = await client.completions.create(model="tiny", prompt=PROMPTS[i], max_tokens=n, **GREEDY)
                return out.choices[0].text
            stream = await client.completions.create(model="tiny", prompt=PROMPTS[i], max_tokens=n, stream=True,
                                                     **GREEDY)
            return "".join([c.choices[0].text async for c in stream if c.choices])

        async def leaver() -> None:
            stream = await client.completions.create(model="tiny", prompt=PROMPTS[-1], max_tokens=80, stream=True,
                                                     **GREEDY)
            async for _ in stream:
                break
            await stream.close()

        *texts, _ = await asyncio.gather(*(one(i, n) for i, n in enumerate(lengths)), leaver())
        return texts


def test_workers_exit_when_rank0_stops(tp_group, tp_device, model_dir):
    """Worker ranks leave their loop when rank 0's engine core fails (its finally sends the stop;
    the waiting request gets a 503 and the server ends). (When rank 0's ``serve`` fails before
    serving: test_cli_shutdown.py, whose ``serve`` runs its core in a process of its own.)"""
    engine = LLMEngine(model_dir, block_size=4, max_num_seqs=4, max_model_len=64, device=tp_device, dtype="float32")
    if tp_group.rank == 0:
        with running_server(engine) as running:
            def fail():
                raise RuntimeError("injected failure on rank 0")

            running.engine_client.core.take_commands = fail  # the next iteration fails
            with openai.OpenAI(base_url=running.url + "/v1", api_key="none", max_retries=0,
                               timeout=STOP_TIMEOUT_S) as client:
                with pytest.raises(openai.APIStatusError) as e:
                    client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=50, **GREEDY)
            assert e.value.status_code == 503
            assert running.engine_client.failure == "RuntimeError: injected failure on rank 0"
            running.engine_client.join(STOP_TIMEOUT_S)
            assert not running.engine_client.alive
            deadline = time.monotonic() + HANG_GUARD_S  # on_exit only queues done.set on the HTTP loop
            while not running.server.done.is_set() and time.monotonic() < deadline:
                time.sleep(0.05)
            assert running.server.done.is_set(), "the server did not stop after its engine failed"
    else:
        mirror_until_stopped(engine)
    dist.barrier()
