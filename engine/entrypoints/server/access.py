"""Who may call the server: an API key, cross-origin browsers, TLS.

``api_key_middleware(key)``: every route (``/v1/*``, ``/tokenize``, ``/detokenize``) answers 401
unless the request carries ``Authorization: Bearer <key>`` or, as Anthropic's clients send it,
``x-api-key: <key>`` (the first of the two that is not empty is the key given; compared in
constant time, as bytes: a header that is not ASCII is just a wrong key); the error is an OpenAI
error object, or Anthropic's on ``ANTHROPIC_ROUTES``.
``OPEN_ROUTES`` (``/health``, ``/metrics``, ``/version``) stay open, as do ``OPTIONS`` preflights.
``cors_middleware(origins)``: answers a browser's preflight and adds ``Access-Control-Allow-*``
headers for the listed origins (``*`` for any); without it (the default) no CORS header is sent
and browsers on other origins are refused by their own same-origin rule.
``ssl_context(certfile, keyfile)``: the server's TLS context (``--ssl-certfile`` /
``--ssl-keyfile``).
"""
from __future__ import annotations

import hmac
import ssl

from aiohttp import web

OPEN_ROUTES = frozenset({"/health", "/metrics", "/version"})
ANTHROPIC_ROUTES = "/v1/messages"  # the prefix of Anthropic's routes
CORS_METHODS = "GET, POST, OPTIONS"
CORS_HEADERS = "Authorization, Content-Type, x-api-key, anthropic-version, anthropic-beta"


def anthropic_error(status: int, message: str) -> dict:
    """Anthropic's error object for an HTTP ``status``."""
    kinds = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
             404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}
    return {"type": "error", "error": {"type": kinds.get(status, "api_error" if status >= 500 else
                                                           "invalid_request_error"), "message": message}}


def _unauthorized(request: web.Request, message: str) -> web.Response:
    if request.path.startswith(ANTHROPIC_ROUTES):
        body = anthropic_error(401, message)
    else:
        body = {"error": {"message": message, "type": "invalid_request_error", "param": None,
                          "code": "invalid_api_key"}}
    return web.json_response(body, status=401, headers={"WWW-Authenticate": "Bearer"})


def _credential(request: web.Request) -> str:
    """The key ``request`` gives: the first non-empty of its ``Authorization: Bearer <key>`` and its
    ``x-api-key`` ("" when neither holds one). An empty Bearer beside an ``x-api-key`` is no key
    at all; a non-empty one is the key, right or wrong, whatever ``x-api-key`` holds (one
    credential per request: a client cannot try a second key in the same request)."""
    scheme, _, bearer = request.headers.get("Authorization", "").partition(" ")
    bearer = bearer.strip() if scheme.lower() == "bearer" else ""
    return bearer or request.headers.get("x-api-key", "").strip()


def api_key_middleware(key: str):
    """A middleware refusing requests (but to ``OPEN_ROUTES``) without ``Authorization: Bearer key``
    or ``x-api-key: key`` (401)."""
    if not key:
        raise ValueError("the API key must not be empty")
    expected = key.encode()

    @web.middleware
    async def check_api_key(request: web.Request, handler):
        if request.method == "OPTIONS" or request.path in OPEN_ROUTES:
            return await handler(request)
        given = _credential(request)
        if not given:
            return _unauthorized(request, "missing API key: send the header 'Authorization: Bearer <key>' "
                                          "(or 'x-api-key: <key>')")
        # header bytes that are not UTF-8 arrive as surrogates: as bytes they are a wrong key
        if not hmac.compare_digest(given.encode("utf-8", "surrogatepass"), expected):
            return _unauthorized(request, "incorrect API key")
        return await handler(request)

    return check_api_key


def cors_middleware(origins: list[str]):
    """A middleware answering preflights and labelling responses for ``origins`` (``["*"]``: any)."""
    allowed = frozenset(origins)

    def headers_for(origin: str | None) -> dict[str, str]:
        if origin is None or not ("*" in allowed or origin in allowed):
            return {}
        return {"Access-Control-Allow-Origin": "*" if "*" in allowed else origin, "Vary": "Origin",
                "Access-Control-Allow-Methods": CORS_METHODS, "Access-Control-Allow-Headers": CORS_HEADERS}

    @web.middleware
    async def cors(request: web.Request, handler):
        headers = headers_for(request.headers.get("Origin"))
        if request.method == "OPTIONS" and "Access-Control-Request-Method" in request.headers:
            return web.Response(status=204 if headers else 403, headers=headers)
        response = await handler(request)
        response.headers.update(headers)
        return response

    return cors


def ssl_context(certfile: str, keyfile: str) -> ssl.SSLContext:
    """A server TLS context from a PEM certificate chain and its private key."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(certfile, keyfile)
    return context
