"""One client's flood of sequences never makes another client wait for all of it (issue 57, item
6): the engine admits waiting sequences round robin over clients (the peer address here), so a
good client's request takes the next seats in turn with the flood's. Each attack enters the server
first, from 127.0.0.1; a greedy witness streams from 127.0.0.2 beside it (``Witness``: its text
unchanged, its longest wait for a chunk, the first included, bounded by its quiet stream's).

Under first come, first served (vLLM's and SGLang's order) the witness would wait for every
sequence of the flood to start: 1,024 sequences of one ``/v1/completions`` (64 prompts x n=16)
made a witness wait 55.6 s for its first token on a real model; eight unread n=16 streams, 30 s."""
from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from http.client import HTTPConnection

import pytest

from engine.core.llm_engine import LLMEngine
from engine.entrypoints.server.request_body import RequestLimits
from server_cases import HANG_GUARD_S, Witness, make_text_checkpoint, running_server, wait_idle

MAX_MODEL_LEN = 512
ATTACKER, WITNESS, SMALL_CLIENT = "127.0.0.1", "127.0.0.2", "127.0.0.3"
FLOOD_PROMPTS, N, FLOOD_MAX_TOKENS = 64, 16, 4  # 1,024 sequences
UNREAD_STREAMS, UNREAD_MAX_TOKENS = 8, 16  # 128 sequences whose streams are never read
FIRST_TOKEN_S = 10.0  # the acceptance: a small request's first token beside the flood
# 22 tokens each: the n choices of a prompt share its first block (they wait for its prefill)
PROMPTS = [f"prompt number {i}: the quick brown fox jumps over the lazy dog" for i in range(FLOOD_PROMPTS)]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    model = make_text_checkpoint(tmp_path_factory.mktemp("text-model"), seed=11,
                                 max_position_embeddings=MAX_MODEL_LEN)
    engine = LLMEngine(model, block_size=16, max_num_seqs=8, max_model_len=MAX_MODEL_LEN)
    with running_server(engine, limits=RequestLimits(sequences_per_request=FLOOD_PROMPTS * N)) as running:
        yield running


class AttackFirst:
    """Makes the attack enter the engine first, however the threads are scheduled: once ``arm``ed,
    the engine loop's submissions of other streams wait, in order, until ``size`` streams of the
    attack (``is_attack``) are submitted. (A ``Witness`` started with ``first`` sends its request
    right after the attack's thread starts, so its request could otherwise reach the engine first
    and first come, first served would pass.)"""

    def __init__(self, engine_client, is_attack, size: int):
        self.engine_client, self.is_attack, self.size = engine_client, is_attack, size
        self.submit = engine_client.submit
        self.held: list | None = None  # None: not armed
        self.num_attack_streams = 0

    def arm(self) -> None:
        self.held, self.num_attack_streams = [], 0
        self.engine_client.submit = self._submit

    def release(self) -> None:
        """Submit what waits and let everything through (the attack is in, or was refused)."""
        if self.held is not None:
            del self.engine_client.submit  # the class's submit again
            held, self.held = self.held, None
            for stream in held:
                self.submit(stream)

    def _submit(self, stream) -> None:
        if not self.is_attack(stream):
            self.held.append(stream)
            return
        self.submit(stream)
        self.num_attack_streams += 1
        if self.num_attack_streams >= self.size:
            self.release()


@dataclass
class WitnessBehind(Witness):
    """A ``Witness`` whose stream beside an attack enters the engine after the attack's (``door``)."""
    door: AttackFirst | None = None

    def run(self, during=None, first: bool = False):
        if during is not None:
            self.door.arm()
        return super().run(during, first)


def connect(url: str, source: str) -> HTTPConnection:
    host, port = url.removeprefix("http://").split(":")
    return HTTPConnection(host, int(port), timeout=HANG_GUARD_S, source_address=(source, 0))


def completion_body(prompt: str | list[str], max_tokens: int, stream: bool = False, n: int = 1) -> bytes:
    return json.dumps({"model": "tiny", "prompt": prompt, "n": n, "max_tokens": max_tokens, "temperature": 1.0,
                       "seed": 3, "ignore_eos": True, "stream": stream}).encode()


def flood(url: str, door: AttackFirst | None = None):
    """The attack: one ``/v1/completions`` of 64 prompts x n=16 from ATTACKER; returns its status
    and answer once every sequence has finished (then ``door`` is released, were it refused)."""
    body = completion_body(PROMPTS, FLOOD_MAX_TOKENS, n=N)  # built before the witness runs

    def attack() -> tuple[int, dict]:
        connection = connect(url, ATTACKER)
        try:
            connection.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
            response = connection.getresponse()
            return response.status, json.loads(response.read())
        finally:
            connection.close()
            if door is not None:
                door.release()

    return attack


def check_flood_answer(status: int, answer: dict) -> None:
    assert status == 200, answer
    assert len(answer["choices"]) == FLOOD_PROMPTS * N
    assert all(c["finish_reason"] == "length" for c in answer["choices"])
    assert answer["usage"]["completion_tokens"] == FLOOD_PROMPTS * N * FLOOD_MAX_TOKENS


def test_a_request_of_1024_sequences_does_not_hold_a_witness(served):
    """The 1,024-sequence request enters first; the witness's first chunk, and every later one,
    comes within its bound (under first come, first served it waits for all 1,024 to start)."""
    door = AttackFirst(served.engine_client, lambda s: s.params.max_tokens == FLOOD_MAX_TOKENS, FLOOD_PROMPTS * N)
    witness = WitnessBehind(served.url, max_tokens=64, source=WITNESS, door=door)
    check_flood_answer(*witness.beside(flood(served.url, door), first=True))
    wait_idle(served.engine_client)


def test_a_small_request_beside_1024_sequences_gets_its_first_token_within_10_s(served):
    """Once the 1,024 sequences are in the engine, a small request from another client streams its
    first token within 10 s, while most of the 1,024 have not even started."""
    results: list = []
    attack = threading.Thread(target=lambda: results.append(flood(served.url)()), daemon=True)
    attack.start()
    engine_client, deadline = served.engine_client, time.monotonic() + HANG_GUARD_S
    while engine_client.call(lambda e: len(e.request_ids())) < FLOOD_PROMPTS * N - 64:
        assert time.monotonic() < deadline and attack.is_alive(), "the flood never reached the engine"
        time.sleep(0.01)
    connection = connect(served.url, SMALL_CLIENT)
    start = time.monotonic()
    try:
        connection.request("POST", "/v1/completions", completion_body("def f(x):", 8, stream=True),
                           {"Content-Type": "application/json"})
        response = connection.getresponse()
        assert response.status == 200
        first = next(line for line in response if line.startswith(b"data: {"))
        first_token_s = time.monotonic() - start
        unfinished = engine_client.call(lambda e: len(e.request_ids()))
        assert json.loads(first[6:])["choices"][0]["text"]
        response.read()
    finally:
        connection.close()
    attack.join(HANG_GUARD_S)
    assert not attack.is_alive(), "the flood never finished"
    check_flood_answer(*results[0])
    assert first_token_s < FIRST_TOKEN_S, f"the small request's first token took {first_token_s:.1f} s"
    assert unfinished >= FLOOD_PROMPTS * N // 2, (
        f"only {unfinished} of the flood's {FLOOD_PROMPTS * N} sequences were unfinished at the small request's "
        "first token: it waited for the flood to start")
    wait_idle(engine_client)


def test_eight_unread_streams_do_not_hold_a_witness(served):
    """Eight streamed n=16 requests whose client never reads them (128 sequences) enter first;
    the witness streams beside them within its bound, and is done while most of them have not
    run (under first come, first served it starts once all 128 have); closing them frees
    everything."""
    body = completion_body(PROMPTS[0], UNREAD_MAX_TOKENS, stream=True, n=N)

    def unread() -> list[HTTPConnection]:
        connections = [connect(served.url, ATTACKER) for _ in range(UNREAD_STREAMS)]
        for connection in connections:
            connection.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        return connections  # never read

    door = AttackFirst(served.engine_client, lambda s: s.params.max_tokens == UNREAD_MAX_TOKENS, UNREAD_STREAMS * N)
    witness = WitnessBehind(served.url, max_tokens=64, source=WITNESS, door=door)
    connections = witness.beside(unread, first=True)
    unfinished = served.engine_client.call(lambda e: len(e.request_ids()))
    assert unfinished >= UNREAD_STREAMS * N // 4, (
        f"only {unfinished} of the unread streams' {UNREAD_STREAMS * N} sequences were unfinished once the witness "
        "was done: it waited for them to start")
    for connection in connections:
        connection.close()
    wait_idle(served.engine_client)
