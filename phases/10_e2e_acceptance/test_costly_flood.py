"""A flood of costly requests beside greedy streams on ``python -m engine serve`` (the demo model):
the streams' steps run in the engine core's process and the requests are read in worker processes,
so the streams keep their pace. Timing against a bound, so this file runs with nothing beside it
(``alone`` in gate.yaml, the ``alone`` marker under ``make test``)."""
import json
import re
import signal
import threading
import time
from http.client import HTTPConnection

import pytest

from server_cases import (
    ATTACK_STALL,
    HANG_GUARD_S,
    STALL_FLOOR_S,
    Witness,
    costly_tools,
    start_server_process,
    stop_server_process,
)
from test_engine_processes import DEMO

pytestmark = pytest.mark.alone
FLOOD_CLIENTS, FLOOD_S = 6, 40.0


def count_tokens_body(tools: list[dict]) -> bytes:
    """A costly request for the front alone: Anthropic's count_tokens of a chat with ``tools``,
    every value legal, parsed, typed, schema-checked, rendered and tokenized in full (nothing runs on
    the engine). On the demo model's 1,024-token context the count is then refused as too long, the
    count in the message showing the whole request was paid for."""
    return json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "Which tool?"}], "tools": [
        {"name": t["function"]["name"], "description": t["function"]["description"],
         "input_schema": t["function"]["parameters"]} for t in tools]}).encode()


def post_from(url: str, path: str, raw: bytes, source: str) -> tuple[int, bytes]:
    """POST ``raw`` JSON from the loopback address ``source`` (another client to the server)."""
    host, port = url.removeprefix("http://").split(":")
    connection = HTTPConnection(host, int(port), timeout=HANG_GUARD_S, source_address=(source, 0))
    try:
        connection.request("POST", path, raw, {"Content-Type": "application/json"})
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def test_a_flood_of_costly_requests_leaves_the_witness_streams_alone():
    """Six clients send costly requests (count_tokens of 128 large tool schemas, 2.6 MiB, each paid
    in full: ``count_tokens_body``) back to back for 40 s while greedy witness streams run one after
    another: their text is unchanged and every one's longest wait for a chunk, the first included,
    stays within max(0.5 s, 10 x) the same run's quiet stream's."""
    body = count_tokens_body(costly_tools())
    server = start_server_process(DEMO)
    stop, answered, failed = threading.Event(), [], []

    def flood(source: str) -> None:
        while not stop.is_set():
            status, raw = post_from(server.url, "/v1/messages/count_tokens", body, source)
            answered.append(status)
            counted = re.search(rb"prompt is too long: (\d+) tokens", raw)
            if status != 400 or not counted or int(counted[1]) < 20_000:
                failed.append(raw[:300])

    try:
        witness = Witness(server.url, max_tokens=256)
        _, _, quiet, _ = witness.run()
        bound = max(STALL_FLOOR_S, ATTACK_STALL * quiet)
        threads = [threading.Thread(target=flood, args=(f"127.0.0.{10 + i}",), daemon=True)
                   for i in range(FLOOD_CLIENTS)]
        for thread in threads:
            thread.start()
        waits, deadline = [], time.monotonic() + FLOOD_S
        while time.monotonic() < deadline:
            waits.append(witness.run()[2])  # the same greedy text each time (Witness.run checks it)
        stop.set()
        for thread in threads:
            thread.join(HANG_GUARD_S)
    finally:
        stop.set()
        stop_server_process(server, signal.SIGTERM)
    assert not failed, failed[0]
    assert len(answered) >= FLOOD_CLIENTS, f"the flood was answered {len(answered)} times in {FLOOD_S:g} s"
    assert max(waits) <= bound, (
        f"a witness waited {max(waits):.2f} s for a chunk beside {len(answered)} costly requests; the quiet "
        f"stream's longest wait was {quiet:.3f} s (the bound: {bound:.2f} s); waits {sorted(waits)[-5:]}")
