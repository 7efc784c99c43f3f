"""No client can hold the server's connections or its event loop (issue 57, items 4 and 5): gzip
bombs are refused under the body cap, after the API key, without inflating on the event loop
(``/health`` answers within 0.3 s meanwhile) and their connections closed rather than drained;
slow and idle connections are closed by their deadlines; one client address has a cap of open
connections; the process's file descriptors are never exhausted; a malformed request is one log
line. Each attack runs beside a good streaming client (``Witness``) whose greedy text must not
change and which must never wait long for its next chunk.

The servers run with deadlines of a second and small caps (``ConnectionLimits``), so every
deadline is seen; each wait polls its condition (a socket reading EOF) under a hang guard and no
assertion depends on how long anything took but the issue's bound on ``/health``."""
from __future__ import annotations

import gzip
import http.client
import json
import logging
import re
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor

import pytest

from engine.core.llm_engine import LLMEngine
from engine.entrypoints.server.connections import ConnectionLimits
from server_cases import (
    Witness,
    assert_error_object,
    make_text_checkpoint,
    running_server,
    start_server_process,
    stop_server_process,
    wait_idle,
)

KEY = "sk-conn-0123456789"
MAX_MODEL_LEN = 1024
HEALTH_BOUND_S = 0.3  # the bound on /health during gzip bombs
GUARD_S = 15.0  # a hang guard on each deadline of a second (never what a test asserts)
# deadlines of a second: every one is seen within the guard
SHORT = ConnectionLimits(header_timeout=1.0, body_timeout=2.0, keep_alive_timeout=2.0, max_connections_per_client=16)
# deadlines that never end a connection during a test; a cap of 4 connections per client address
LONG = ConnectionLimits(header_timeout=60.0, body_timeout=60.0, keep_alive_timeout=60.0, max_connections_per_client=4)
PER_CLIENT = LONG.max_connections_per_client


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_text_checkpoint(tmp_path_factory.mktemp("text-model"), seed=11, max_position_embeddings=MAX_MODEL_LEN)


@pytest.fixture(scope="module")
def served(model):
    """An open server with deadlines of a second."""
    engine = LLMEngine(model, block_size=16, max_num_seqs=8, max_model_len=MAX_MODEL_LEN)
    with running_server(engine, connection_limits=SHORT) as running:
        yield running


@pytest.fixture(scope="module")
def keyed(model):
    """A server with an API key, long deadlines and a cap of 4 connections per client address."""
    engine = LLMEngine(model, block_size=16, max_num_seqs=8, max_model_len=MAX_MODEL_LEN)
    with running_server(engine, api_key=KEY, connection_limits=LONG) as running:
        yield running


@pytest.fixture(scope="module")
def witness(served):
    return Witness(served.url)


@pytest.fixture(scope="module")
def bomb() -> bytes:
    """4 GiB of zeros in 4 MB of gzip: a 1 MiB block of zeros compressed after a full flush is the
    same bytes every time, so 4,096 of them are built from two (the gzip trailer is left off:
    nothing reads that far)."""
    compressor, zeros = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS), bytes(1 << 20)
    first = compressor.compress(zeros) + compressor.flush(zlib.Z_FULL_FLUSH)
    block = compressor.compress(zeros) + compressor.flush(zlib.Z_FULL_FLUSH)
    return first + block * 4095


def address(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").removeprefix("https://").split(":")
    return host, int(port)


def connect(url: str, source: str = "127.0.0.1") -> socket.socket:
    sock = socket.create_connection(address(url), timeout=GUARD_S, source_address=(source, 0))
    sock.settimeout(GUARD_S)
    return sock


def request_bytes(method: str, path: str, body: bytes = b"", headers: dict | None = None) -> bytes:
    head = {"Host": "127.0.0.1", **({"Content-Length": str(len(body))} if method == "POST" else {}), **(headers or {})}
    return f"{method} {path} HTTP/1.1\r\n".encode() + "".join(f"{k}: {v}\r\n" for k, v in head.items()).encode() + \
        b"\r\n"


def answer(sock: socket.socket) -> http.client.HTTPResponse:
    """The response waiting on ``sock``, read whole (its ``.body`` set)."""
    response = http.client.HTTPResponse(sock)
    response.begin()
    response.body = response.read()
    return response


def closed(sock: socket.socket, drip: bytes = b"") -> bytes:
    """Wait until the server closes ``sock`` (it reads EOF or a reset), sending ``drip`` a byte
    every 0.3 s meanwhile; returns what it read. Fails when it is still open after the guard."""
    deadline, received = time.monotonic() + GUARD_S, b""
    sock.settimeout(0.3)
    while time.monotonic() < deadline:
        if drip:
            try:
                sock.send(drip[:1])
                drip = drip[1:]
            except OSError:  # closed: what the server sent before is still to be read
                drip = b""
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            continue
        except OSError:  # reset: closed
            return received
        if not chunk:
            return received
        received += chunk
    raise AssertionError(f"the connection is still open {GUARD_S:g} s on (read {received[:200]!r})")


def still_open(sock: socket.socket) -> bool:
    """Whether the server has neither closed ``sock`` nor written to it yet (a look, no wait)."""
    sock.setblocking(False)
    try:
        sock.recv(1, socket.MSG_PEEK)
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        sock.settimeout(GUARD_S)
    return False


def health(url: str, source: str | None = None, context: ssl.SSLContext | None = None) -> int:
    """The status of ``GET /health`` on a new connection, from ``source`` if given (HTTPS with
    ``context``). Without one the system picks the port, which may reuse one in TIME_WAIT: polled
    often, a bound source port could be refused (EADDRINUSE)."""
    options = {"timeout": GUARD_S, "source_address": (source, 0) if source else None}
    connection = (http.client.HTTPSConnection(*address(url), context=context, **options) if context
                  else http.client.HTTPConnection(*address(url), **options))
    try:
        connection.request("GET", "/health")
        return connection.getresponse().status
    finally:
        connection.close()


def served_again(url: str, source: str | None = None, context: ssl.SSLContext | None = None) -> bool:
    """Whether a new connection from ``source`` is served (a 200 on ``/health``) within the guard,
    asked again while it is refused (a 503 or 429, or closed: the server sees a close a moment late)."""
    deadline = time.monotonic() + GUARD_S
    while time.monotonic() < deadline:
        try:
            if health(url, source, context) == 200:
                return True
        except (OSError, http.client.HTTPException):  # ssl.SSLError is an OSError
            pass
        time.sleep(0.05)
    return False


def health_times(url: str, done: threading.Event) -> list[float]:
    """``GET /health`` on a new connection, again and again until ``done`` is set: each answer's seconds."""
    times = []
    while not done.is_set() or not times:
        start = time.monotonic()
        assert health(url) == 200
        times.append(time.monotonic() - start)
    return times


def beside_health(url: str, attacks: list) -> tuple[list, list[float]]:
    """Run ``attacks`` (callables) at once while ``/health`` is polled: their results, the polls' seconds."""
    done = threading.Event()
    with ThreadPoolExecutor(len(attacks) + 1) as pool:
        polls = pool.submit(health_times, url, done)
        try:
            results = [f.result(timeout=2 * GUARD_S) for f in [pool.submit(a) for a in attacks]]
        finally:
            done.set()
        return results, polls.result(timeout=GUARD_S)


def takes_no_more(sock: socket.socket, rest: bytes) -> bool:
    """Whether the server, having answered on ``sock``, refuses ``rest`` of the request's body
    (sending it fails: the connection is closed) instead of reading it (draining)."""
    try:
        for i in range(0, len(rest), 1 << 20):
            sock.sendall(rest[i:i + (1 << 20)])
    except OSError:
        return True
    return False


def bomb_attack(url: str, bomb: bytes, source: str, key: str | None, answered_unread: bool):
    """One gzip bomb from ``source`` (with the API key ``key`` or none). ``answered_unread``: the
    server answers after its first 64 KiB, then must close the connection, never reading the rest;
    else it reads the whole bomb before it answers. Returns the status, the body and whether the
    server closed the connection without reading the rest (None: it read it all)."""
    def attack() -> tuple[int, bytes, bool | None]:
        headers = {"Content-Type": "application/json", "Content-Encoding": "gzip",
                   **({"Authorization": f"Bearer {key}"} if key else {})}
        sent = (1 << 16) if answered_unread else len(bomb)
        with connect(url, source) as sock:
            sock.sendall(request_bytes("POST", "/v1/completions", bomb, headers) + bomb[:sent])
            response = answer(sock)
            refused = takes_no_more(sock, bomb[sent:]) if answered_unread else None
            return response.status, response.body, refused
    return attack


def test_gzip_bombs_are_refused_under_the_cap_off_the_event_loop(served, keyed, witness, bomb):
    """4 GiB of zeros in 4 MB of gzip, 4 at once, again and again: with the key (or on an open
    server) each a 413 once its inflated bytes pass the body cap, inflated in pieces on a request
    worker; without the key a 401 before its body is read, its connection then closed rather than
    drained (the rest of the bomb is never read). /health answers each poll within 0.3 s
    meanwhile; a good stream keeps its text and its time bound."""
    sources = [f"127.0.0.{10 + i}" for i in range(4)]

    def on(url: str, key: str | None, status: int):
        return lambda: (status, beside_health(url, [bomb_attack(url, bomb, s, key, status == 401)
                                                    for s in sources * 2]))

    for expected, (results, polls) in (witness.beside(on(served.url, None, 413)), on(keyed.url, KEY, 413)(),
                                       on(keyed.url, None, 401)()):
        assert max(polls) <= HEALTH_BOUND_S, f"/health took {max(polls):.2f} s beside gzip bombs"
        for status, raw, refused in results:
            assert status == expected, (status, raw[:200])
            assert_error_object(raw, code="invalid_api_key" if status == 401 else "request_entity_too_large")
            assert refused in (None, True), "the server read the rest of a body it had refused (drained it)"
    wait_idle(served.engine_client)


def post(url: str, body: bytes, headers: dict, source: str = "127.0.0.1") -> http.client.HTTPResponse:
    with connect(url, source) as sock:
        sock.sendall(request_bytes("POST", "/tokenize", body, {"Content-Type": "application/json", **headers}) + body)
        return answer(sock)


def test_compressed_bodies_are_inflated_and_other_codings_refused(served, bomb):
    """A gzip (x-gzip), deflate (zlib's format or raw) or identity body gets the plain body's
    answer; br, zstd or stacked codings are a 415 naming those taken; a stream that is not valid
    or ends early a 400; an over-large body by Content-Length a 413 at once, its connection closed."""
    plain = json.dumps({"prompt": "def fibonacci(n): the quick brown fox"}).encode()
    expected = post(served.url, plain, {})
    assert expected.status == 200 and json.loads(expected.body)["count"] > 5
    raw = zlib.compressobj(6, zlib.DEFLATED, -zlib.MAX_WBITS)
    for coding, body in [("gzip", gzip.compress(plain)), ("x-gzip", gzip.compress(plain)),
                         ("deflate", zlib.compress(plain)), ("deflate", raw.compress(plain) + raw.flush()),
                         ("identity", plain), ("gzip", gzip.compress(plain[:20]) + gzip.compress(plain[20:]))]:
        got = post(served.url, body, {"Content-Encoding": coding})
        assert (got.status, got.body) == (200, expected.body), (coding, got.status, got.body[:200])
    for coding in ("br", "zstd", "gzip, br", "compress"):
        got = post(served.url, gzip.compress(plain), {"Content-Encoding": coding})
        error = assert_error_object(got.body, code="unsupported_content_encoding")
        assert got.status == 415 and "gzip or deflate" in error["message"], (coding, got.status, error)
    for body in (plain, gzip.compress(plain)[:-12], bomb[:1000]):
        got = post(served.url, body, {"Content-Encoding": "gzip"})
        assert got.status == 400, (got.status, got.body[:200])
        assert_error_object(got.body)
    with connect(served.url) as sock:  # 9 MiB by Content-Length: refused before a byte of it is read
        sock.sendall(request_bytes("POST", "/tokenize", headers={"Content-Length": str(9 << 20)}))
        got = answer(sock)
        assert got.status == 413 and got.getheader("Connection") == "close", (got.status, got.body[:200])
        assert takes_no_more(sock, bytes(9 << 20)), "the server read the rest of a body it had refused"
    wait_idle(served.engine_client)


def test_slow_and_idle_connections_are_closed_by_their_deadlines(served, witness):
    """Beside a good stream: a connection sending a header byte every 0.3 s (slowloris) gets a 408
    at the header deadline and is closed; one sending nothing, or idling after a request, is
    closed by the header deadline or the keep-alive timeout; a body trickled slower than the body
    deadline gets a 408 and its connection closed."""
    header = request_bytes("GET", "/health", headers={"X-Slow": "a" * 200})

    def slowloris() -> bytes:
        with connect(served.url, "127.0.0.20") as sock:
            sock.sendall(header[:20])
            return closed(sock, drip=header[20:-4])

    def silent() -> bytes:
        with connect(served.url, "127.0.0.21") as sock:
            return closed(sock)

    def idle() -> bytes:
        with connect(served.url, "127.0.0.22") as sock:
            sock.sendall(request_bytes("GET", "/health"))
            assert answer(sock).status == 200
            return closed(sock)

    def trickled() -> bytes:
        with connect(served.url, "127.0.0.23") as sock:
            body = json.dumps({"prompt": "x" * 200}).encode()
            sock.sendall(request_bytes("POST", "/tokenize", body, {"Content-Type": "application/json"}) + body[:10])
            return closed(sock, drip=body[10:])

    def attack() -> list[bytes]:
        with ThreadPoolExecutor(8) as pool:
            return [f.result() for f in [pool.submit(a) for a in (slowloris, silent, idle, trickled) * 2]]

    reads = witness.beside(attack)
    assert [reads[i] for i in (1, 2, 5, 6)] == [b""] * 4, reads  # nothing sent: closed without a word
    for read, flag in [(reads[0], b"--header-timeout"), (reads[3], b"--body-timeout"),
                       (reads[4], b"--header-timeout"), (reads[7], b"--body-timeout")]:
        assert read.startswith(b"HTTP/1.1 408 "), read[:200]
        assert b"connection: close" in read.lower() and flag in read, read[:300]
    wait_idle(served.engine_client)


def test_a_client_address_has_a_cap_of_open_connections(keyed):
    """The (cap+1)-th open connection of one address is refused at once (a 429, then closed)
    while the open ones keep being served and another address still connects; once one of them
    closes the address connects again."""
    def get_health(sock: socket.socket) -> int:
        sock.sendall(request_bytes("GET", "/health"))
        return answer(sock).status

    held = [connect(keyed.url, "127.0.0.30") for _ in range(PER_CLIENT)]
    try:
        assert [get_health(sock) for sock in held] == [200] * PER_CLIENT  # admitted, kept alive
        with connect(keyed.url, "127.0.0.30") as sock:
            refused = closed(sock)
        assert refused.startswith(b"HTTP/1.1 429 "), refused[:200]
        assert b"--max-connections-per-client" in refused and b"connection: close" in refused.lower()
        assert [get_health(sock) for sock in held] == [200] * PER_CLIENT
        with connect(keyed.url, "127.0.0.31") as sock:
            assert get_health(sock) == 200
        held.pop().close()
        assert served_again(keyed.url, "127.0.0.30"), "the address never connected again after a connection closed"
    finally:
        for sock in held:
            sock.close()


def test_a_malformed_request_is_one_log_line(served, caplog):
    """A request line or header aiohttp cannot parse is a 400 and one log line naming the peer and
    the fault, never a traceback."""
    caplog.set_level(logging.DEBUG, logger="aiohttp.server")
    bad = [b"GARBAGE\r\n\r\n", b"GET / HTTP/1.1\r\nBad Header\r\n\r\n", b"GET /" + b"a" * 10_000 + b" HTTP/1.1\r\n\r\n",
           request_bytes("GET", "/health") + b"G@RBAGE / HTTP/1.1\r\n\r\n"]
    for i, raw in enumerate(bad):
        with connect(served.url, f"127.0.0.{40 + i}") as sock:
            sock.sendall(raw)
            read = closed(sock)
        assert b"HTTP/1.0 400 " in read or b"HTTP/1.1 400 " in read, read[:300]
    lines = {f"127.0.0.{40 + i}": [r for r in caplog.records if f"127.0.0.{40 + i}" in r.getMessage()]
             for i in range(len(bad))}
    assert all(len(records) == 1 for records in lines.values()), {k: [r.getMessage() for r in v]
                                                                   for k, v in lines.items()}
    for records in lines.values():
        assert records[0].exc_info is None and "\n" not in records[0].getMessage(), records[0].getMessage()
    assert not [r for r in caplog.records if r.exc_info is not None], "a client's malformed request logged a traceback"


def certificate(directory) -> tuple[str, str]:
    """A self-signed certificate for 127.0.0.1 and its key, written in ``directory``: their paths."""
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    return str(cert), str(key)


needs_openssl = pytest.mark.skipif(shutil.which("openssl") is None,
                                   reason="needs the openssl command to make a certificate")


@needs_openssl
def test_tls_serves_keep_alive_streams_and_closes_a_stalled_handshake(model, tmp_path):
    """Over HTTPS a keep-alive client streams twice on one connection; a connection that never
    finishes its TLS handshake is closed by the header deadline."""
    cert, key = certificate(tmp_path)
    engine = LLMEngine(model, block_size=16, max_num_seqs=8, max_model_len=MAX_MODEL_LEN)
    with running_server(engine, ssl_files=(cert, key), connection_limits=SHORT) as running:
        host, port = address(running.url)
        connection = http.client.HTTPSConnection(host, port, timeout=GUARD_S,
                                                 context=ssl.create_default_context(cafile=cert))
        body = json.dumps({"prompt": "def f(x):", "max_tokens": 8, "temperature": 0, "stream": True})
        texts = []
        for _ in range(2):
            connection.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
            response = connection.getresponse()
            assert response.status == 200
            lines = response.read().decode().split("\n\n")
            texts.append("".join(json.loads(x[6:])["choices"][0]["text"] for x in lines if x.startswith("data: {")))
        assert texts[0] == texts[1] and texts[0]
        connection.close()
        with connect(f"https://{host}:{port}") as sock:
            assert closed(sock) == b""  # never sent its ClientHello
        wait_idle(running.engine_client)


@needs_openssl
def test_a_tls_connection_counts_against_the_caps_from_its_accept(model, tmp_path):
    """Over TLS a connection counts against its address's cap from its accept, its handshake
    included: with 4 connections of one address open and none of them handshaking, its fifth is
    closed at once without a byte (no response can be read before a handshake) while another
    address is served; once one of the four closes, the address is served again. (Counted from
    the handshake's end, a flood of connections that never handshake would be under no cap.)"""
    cert, key = certificate(tmp_path)
    context = ssl.create_default_context(cafile=cert)
    engine = LLMEngine(model, block_size=16, max_num_seqs=8, max_model_len=MAX_MODEL_LEN)
    with running_server(engine, ssl_files=(cert, key), connection_limits=LONG) as running:
        held = [connect(running.url, "127.0.0.50") for _ in range(PER_CLIENT)]
        try:
            with connect(running.url, "127.0.0.50") as sock:
                assert closed(sock) == b"", "a connection past its address's cap waited for its handshake"
            assert health(running.url, "127.0.0.51", context) == 200
            held.pop().close()
            assert served_again(running.url, "127.0.0.50", context), \
                "the address was never served again after a connection closed"
        finally:
            for sock in held:
                sock.close()


def test_the_file_descriptor_budget_refuses_connections_and_keeps_serving(model):
    """A server started with a soft file descriptor limit of 256 and a hard one of 512 takes more
    than 256 connections (it raises its soft limit). Flooded with 600 idle connections: those past
    its budget are refused at once (a 503, then closed), the others closed by the header deadline;
    a connection open before the flood is served during it, a new one once the flood has closed;
    the server never runs out of descriptors (no EMFILE in its log) and stops cleanly."""
    command = ["bash", "-c", 'ulimit -Sn 256 && ulimit -Hn 512 && exec "$@"', "serve",
               sys.executable, "-m", "engine", "serve", "--model", str(model), "--port", "0", "--max-model-len", "64",
               "--header-timeout", "5", "--keep-alive-timeout", "60", "--max-connections-per-client", "0"]
    server = start_server_process(command)
    try:
        before = http.client.HTTPConnection(*address(server.url), timeout=GUARD_S)
        before.request("GET", "/health")
        first = before.getresponse()
        assert first.status == 200 and first.read()
        flood = []
        try:
            for _ in range(600):
                flood.append(connect(server.url))
            # the flood's first connection still open: all 600 were open at once, past the budget
            all_at_once = still_open(flood[0])
            before.request("GET", "/health")
            assert before.getresponse().status == 200, "a connection open before the flood was not served"
            reads = [closed(sock) for sock in flood]
        finally:
            for sock in flood:
                sock.close()
        assert all(read == b"" or read.startswith(b"HTTP/1.1 503 ") for read in reads), {r[:100] for r in reads}
        assert not all_at_once or any(reads), "600 connections at once and none refused"
        assert served_again(server.url), "a new connection is never served after the flood"
        before.close()
    finally:
        rc = stop_server_process(server, signal.SIGINT)
    log = "".join(server.stderr)
    assert rc == 0, log
    capacity = int(re.search(r"connections: at most (\d+) open", log)[1])
    assert 256 < capacity < 512, f"{capacity} connections: the soft limit was not raised to the hard one"
    assert "Too many open files" not in log and "out of system resource" not in log and "Traceback" not in log, log
