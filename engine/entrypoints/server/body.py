"""A request's body as the server reads it: its raw bytes on the event loop, under the body cap
and within the body deadline (``read_body``), then inflated under the same cap on a request
worker when it came compressed (``inflate``).

aiohttp's own inflating is off (``auto_decompress=False``): it inflates on the event loop as the
bytes arrive, past the cap and before the API key is checked, so 4 MB of gzip (4 GiB of zeros)
took seconds of CPU from every other client. Here a compressed body is read as it was sent, after
the middlewares (the API key) have passed it, and inflated in pieces that never hold more than
the cap: over it is a 413, however small the compressed body. ``Content-Encoding`` may be
``identity`` (or absent), ``gzip`` (``x-gzip``) or ``deflate`` (zlib's format, or raw deflate as
some clients send it); any other (``br``, ``zstd``, several stacked) is a 415 naming those taken.
"""
from __future__ import annotations

import asyncio
import zlib
from typing import NamedTuple

from aiohttp import web

from engine.entrypoints.server.request_body import APIError, shown

GZIP_BITS = 16 + zlib.MAX_WBITS  # zlib's window bits for a gzip header and trailer
CODINGS = {"gzip": "gzip", "x-gzip": "gzip", "deflate": "deflate"}  # a Content-Encoding -> how it is inflated
TAKEN = "identity, gzip or deflate"


class RawBody(NamedTuple):
    """A body as it arrived: its bytes and how they are compressed (None: not at all)."""
    data: bytes
    coding: str | None


def too_large(max_bytes: int) -> APIError:
    """The 413 of a body over ``max_bytes`` (compressed or inflated)."""
    return APIError(413, f"the request body is over {max_bytes >> 20} MiB (serve --max-body-mib)",
                    code="request_entity_too_large")


def content_coding(request: web.Request) -> str | None:
    """How ``request``'s body is compressed: None (no ``Content-Encoding``, or ``identity``),
    "gzip" or "deflate"; any other coding, or several stacked, is a 415 naming those taken."""
    given = ",".join(request.headers.getall("Content-Encoding", []))
    codings = [c for c in (part.strip().lower() for part in given.split(",")) if c and c != "identity"]
    if not codings:
        return None
    if len(codings) == 1 and codings[0] in CODINGS:
        return CODINGS[codings[0]]
    raise APIError(415, f"Content-Encoding {shown(given.strip(), 80)} is not supported: send the body as {TAKEN}",
                   code="unsupported_content_encoding")


async def read_body(request: web.Request, max_bytes: int, timeout: float) -> RawBody:
    """``request``'s body as it was sent (compressed or not), read on the event loop: a 415 for a
    ``Content-Encoding`` not taken, before anything is read; a 413 when it is over ``max_bytes``
    (at once when its ``Content-Length`` says so, else as soon as the bytes read pass it); a 408
    when it has not all arrived within ``timeout`` seconds. Each leaves the rest of the body
    unread: the connection is closed after the answer (``connections``), never drained."""
    coding = content_coding(request)
    if request.content_length is not None and request.content_length > max_bytes:
        raise too_large(max_bytes)
    data = bytearray()
    try:
        async with asyncio.timeout(timeout):
            while chunk := await request.content.readany():
                data += chunk
                if len(data) > max_bytes:
                    raise too_large(max_bytes)
    except TimeoutError:
        raise APIError(408, f"the request body did not arrive within {timeout:g} s (serve --body-timeout)",
                       code="request_timeout") from None
    return RawBody(bytes(data), coding)


def inflate(body: RawBody, max_bytes: int) -> bytes:
    """``body``'s bytes inflated (as they are when not compressed), at most ``max_bytes`` held at
    any time: more is a 413 once the inflated bytes pass it, a stream that is not valid (or ends
    early) a 400. Concatenated gzip members are one body, as gzip reads them. Linear in the bytes
    inflated; runs on a request worker (zlib releases the interpreter lock)."""
    if body.coding is None:
        return body.data
    inflated, rest = bytearray(), body.data
    try:
        while rest:  # a member at a time
            decompressor = zlib.decompressobj(_window_bits(body.coding, rest))
            while rest and not decompressor.eof:
                inflated += decompressor.decompress(rest, max_bytes + 1 - len(inflated))
                if len(inflated) > max_bytes:
                    raise too_large(max_bytes)
                rest = decompressor.unconsumed_tail
            if not decompressor.eof:
                raise APIError(400, f"the request body's {body.coding} stream ends early")
            rest = decompressor.unused_data
    except zlib.error as e:
        raise APIError(400, f"the request body is not valid {body.coding}: {shown(str(e), 120)}") from None
    return bytes(inflated)


def _window_bits(coding: str, data: bytes) -> int:
    """zlib's window bits for a stream of ``coding`` starting with ``data``: gzip's header; for
    deflate zlib's header (RFC 1950, what HTTP names deflate) when ``data`` starts with one, else
    raw deflate."""
    if coding == "gzip":
        return GZIP_BITS
    zlib_header = len(data) >= 2 and data[0] & 0x0F == 8 and (data[0] << 8 | data[1]) % 31 == 0
    return zlib.MAX_WBITS if zlib_header else -zlib.MAX_WBITS
