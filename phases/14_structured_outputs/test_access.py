"""Who may call the server (``engine.entrypoints.server.access``): the API key on every ``/v1`` route (401 as
an OpenAI error object without it or with a wrong one; ``/health``, ``/metrics``, ``/version``
open), CORS only for the origins named, and TLS from a certificate and key. Each is checked on a
real aiohttp server bound to a free loopback port, with a plain HTTP client."""
from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import ssl
import subprocess
import threading
import urllib.error
import urllib.request

import pytest
from aiohttp import web

from engine.entrypoints.server.access import api_key_middleware, cors_middleware, ssl_context

KEY = "sk-test-0123456789"


async def _ok(request: web.Request) -> web.Response:
    return web.json_response({"path": request.path})


@contextlib.contextmanager
def serving(middlewares, context: ssl.SSLContext | None = None):
    """An app with /health, /metrics, /version and /v1/models behind ``middlewares``, served from a
    background event loop; yields its base URL."""
    app = web.Application(middlewares=middlewares)
    app.add_routes([web.get(p, _ok) for p in ("/health", "/metrics", "/version", "/v1/models")] +
                   [web.post("/v1/chat/completions", _ok)])
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(app)
    loop.run_until_complete(runner.setup())
    loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", 0, ssl_context=context).start())
    port = runner.addresses[0][1]
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield f"{'https' if context else 'http'}://127.0.0.1:{port}"
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(timeout=30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=30)


def call(url: str, method: str = "GET", headers: dict | None = None, context=None) -> tuple[int, dict, dict]:
    """(status, headers, JSON body or {}) of one request."""
    data = b"{}" if method == "POST" else None
    request = urllib.request.Request(url, data=data, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=30, context=context) as r:
            status, head, raw = r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        status, head, raw = e.code, dict(e.headers), e.read()
    return status, head, json.loads(raw) if raw else {}


def test_every_v1_route_needs_the_key_and_the_open_routes_do_not():
    with serving([api_key_middleware(KEY)]) as url:
        for path, method in (("/v1/models", "GET"), ("/v1/chat/completions", "POST")):
            for headers in ({}, {"Authorization": "Bearer wrong-key"}, {"Authorization": f"Basic {KEY}"},
                            {"Authorization": f"Bearer {KEY}x"}, {"Authorization": "Bearer "}):
                status, head, body = call(url + path, method, headers)
                assert status == 401, (path, headers)
                assert body["error"]["type"] == "invalid_request_error" and body["error"]["code"] == "invalid_api_key"
                assert head.get("WWW-Authenticate") == "Bearer"
            assert call(url + path, method, {"Authorization": f"Bearer {KEY}"})[0] == 200
            assert call(url + path, method, {"Authorization": f"bearer {KEY}"})[0] == 200  # the scheme is case-blind
        for path in ("/health", "/metrics", "/version"):
            assert call(url + path)[0] == 200


def raw_status(url: str, header: bytes) -> int:
    """The status answering a GET /v1/models whose ``Authorization`` header is the raw ``header``."""
    import http.client
    import socket

    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: " + header + b"\r\n\r\n")
        response = http.client.HTTPResponse(sock)
        response.begin()
        return response.status


def test_keys_that_are_not_ascii_are_wrong_keys_never_errors():
    """An ``Authorization`` or ``x-api-key`` header holding bytes that are not ASCII (latin-1,
    UTF-8, invalid UTF-8) is a wrong key: a 401, never an exception in the middleware (a 500);
    ``x-api-key`` with the key passes, as Anthropic's clients send it."""
    with serving([api_key_middleware(KEY)]) as url:
        for header in (b"Bearer caf\xe9", "Bearer café".encode(), b"Bearer \xff\xfe\x80", b"\xe9\xe9 x"):
            assert raw_status(url, header) == 401, header
        assert call(url + "/v1/models", headers={"x-api-key": KEY})[0] == 200
        assert call(url + "/v1/models", headers={"x-api-key": "caf\xe9"})[0] == 401


def test_the_first_key_given_is_the_one_checked():
    """The first non-empty of ``Authorization: Bearer`` and ``x-api-key`` is the key: an empty
    Bearer beside the right ``x-api-key`` passes; a non-empty Bearer is checked whatever
    ``x-api-key`` holds (a wrong one is a 401 beside the right ``x-api-key``)."""
    with serving([api_key_middleware(KEY)]) as url:
        for headers, status in [({"Authorization": "Bearer ", "x-api-key": KEY}, 200),
                                ({"Authorization": "Bearer  ", "x-api-key": KEY}, 200),
                                ({"Authorization": f"Bearer {KEY}", "x-api-key": "wrong-key"}, 200),
                                ({"Authorization": f"Basic {KEY}", "x-api-key": KEY}, 200),
                                ({"Authorization": "Bearer wrong-key", "x-api-key": KEY}, 401),
                                ({"Authorization": "Bearer ", "x-api-key": ""}, 401)]:
            assert call(url + "/v1/models", headers=headers)[0] == status, headers


def test_an_empty_key_is_refused():
    with pytest.raises(ValueError, match="must not be empty"):
        api_key_middleware("")


def test_cors_headers_only_for_the_origins_named():
    allowed = "https://app.example"
    with serving([cors_middleware([allowed])]) as url:
        status, head, _ = call(url + "/v1/models", headers={"Origin": allowed})
        assert status == 200 and head["Access-Control-Allow-Origin"] == allowed
        status, head, _ = call(url + "/v1/models", headers={"Origin": "https://evil.example"})
        assert status == 200 and "Access-Control-Allow-Origin" not in head
        preflight = {"Origin": allowed, "Access-Control-Request-Method": "POST",
                     "Access-Control-Request-Headers": "authorization, content-type"}
        status, head, _ = call(url + "/v1/chat/completions", "OPTIONS", preflight)
        assert status == 204 and head["Access-Control-Allow-Origin"] == allowed
        assert "POST" in head["Access-Control-Allow-Methods"]
        assert "Authorization" in head["Access-Control-Allow-Headers"]
        status, head, _ = call(url + "/v1/chat/completions", "OPTIONS", {**preflight, "Origin": "https://evil.example"})
        assert status == 403 and "Access-Control-Allow-Origin" not in head
    with serving([cors_middleware(["*"])]) as url:
        _, head, _ = call(url + "/v1/models", headers={"Origin": "https://any.example"})
        assert head["Access-Control-Allow-Origin"] == "*"


def test_a_preflight_passes_the_key_check_and_the_answer_still_needs_the_key():
    """Browsers send preflights without credentials: CORS answers them before the key is asked for."""
    with serving([cors_middleware(["*"]), api_key_middleware(KEY)]) as url:
        preflight = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST"}
        assert call(url + "/v1/chat/completions", "OPTIONS", preflight)[0] == 204
        status, head, _ = call(url + "/v1/models", headers={"Origin": "https://app.example"})
        assert status == 401 and head["Access-Control-Allow-Origin"] == "*"


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command to make a certificate")
def test_tls_serves_with_the_certificate_given(tmp_path):
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    with serving([], ssl_context(str(cert), str(key))) as url:
        assert url.startswith("https://")
        trusting = ssl.create_default_context(cafile=str(cert))
        assert call(url + "/health", context=trusting)[0] == 200
        with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
            call(url + "/health", context=ssl.create_default_context())  # not a certificate the system trusts
