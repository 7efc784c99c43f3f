"""Deadlines and caps on the server's connections, so that no client can hold them open for free.

- The header deadline (``--header-timeout``, 60 s, nginx's ``client_header_timeout``): a new
  connection must finish its TLS handshake (with ``--ssl-certfile``) within it, then its first
  request's line and headers within it; a later request its headers within it of its first byte;
  else the connection is closed, after a 408 when part of a request had come: a client sending a
  header byte every few seconds (slowloris) holds it no longer.
- The body deadline (``--body-timeout``, 60 s): a request's whole body must arrive within it once
  its handler reads it (``body.read_body``), else a 408 and the connection is closed.
- The keep-alive timeout (``--keep-alive-timeout``, 75 s, nginx's ``keepalive_timeout``): a
  connection idle between requests (no byte of the next one) is closed (aiohttp's
  ``keepalive_timeout``).
- Caps on open connections, a connection past one refused as it is accepted (a minimal response,
  then closed before the next accept; over TLS closed without one, as it cannot be read before a
  handshake) while those already open keep being served. Per client address, a 429
  (``--max-connections-per-client``, 1024: benchmark clients at an unbounded request rate, vLLM's
  and SGLang's defaults, open a connection per request in flight, 1,000 in their usual runs; 0
  for none, as behind a proxy every client has the proxy's address). In all, a 503
  (``--max-connections``; by default, and at most, what the process's file descriptors leave
  room for: the soft ``RLIMIT_NOFILE`` raised to the hard one, less the descriptors open at
  start and ``FD_RESERVE`` for the engine's own files), so the server never runs out of
  descriptors (EMFILE) however many clients connect. A connection counts from its accept, its TLS
  handshake included, and a refused one holds its descriptor for no loop iteration: refused
  through an asyncio transport, it closed three iterations on, each of which could accept a
  burst of ``BACKLOG`` more, and a flood outran any fixed reserve.
- A response that leaves part of its request's body unread (a 401 before the key is checked, a 413
  by ``Content-Length``, a 415, a 408) says ``Connection: close`` and the connection closes once it
  is sent: the rest of the upload is never read (aiohttp's lingering drain is off).
- A request aiohttp cannot parse (a malformed request line or header) is one log line naming the
  peer and the fault, never a traceback (``handler_options``' logger).

``Connections`` is the listener: it accepts each connection itself (``loop.add_reader`` on the
listening sockets), admits or refuses it there, and serves an admitted one through a thin
protocol (``loop.connect_accepted_socket``) that runs its header deadline and hands everything
else to the aiohttp ``RequestHandler`` (``runner.server()``) serving it; its ``middleware`` tells
the connection when a request's headers are complete and its handler is done.
"""
from __future__ import annotations

import argparse
import asyncio
import errno
import json
import logging
import os
import resource
import socket
import ssl
from collections import Counter
from dataclasses import dataclass, fields
from typing import Callable

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from engine.entrypoints.server.request_body import APIError, clipped

log = logging.getLogger("engine.entrypoints.server.connections")

BACKLOG = 128      # the listen queue, and the most connections accepted before the event loop's other work
FD_RESERVE = 64    # descriptors kept for the engine's own files besides the connections
# accept() failing for want of descriptors or memory (another process's, as the budget keeps ours): a pause, then again
OUT_OF_RESOURCES = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
ACCEPT_PAUSE_S = 1.0


@dataclass(frozen=True)
class ConnectionLimits:
    """The deadlines (seconds) and caps of the server's connections; each is a ``serve`` flag."""

    header_timeout: float = 60.0      # a request's line and headers, from the connection's start or its first byte
    body_timeout: float = 60.0        # a request's whole body, once its handler reads it
    keep_alive_timeout: float = 75.0  # idle between two requests
    max_connections_per_client: int = 1024  # open connections of one client address (0: no cap)
    max_connections: int = 0          # open connections in all (0: as many as the file descriptors allow)

    HELP = {"header_timeout": "seconds a new connection's TLS handshake, then a request's line and headers, may "
                              "take (from the connection's start or the request's first byte); then the "
                              "connection is closed",
            "body_timeout": "seconds a request's whole body may take to arrive; then a 408 and the connection "
                            "is closed",
            "keep_alive_timeout": "seconds a connection may idle between requests before it is closed",
            "max_connections_per_client": "open connections of one client address, more are refused with a 429; "
                                          "0: no cap (behind a proxy every client has the proxy's address)",
            "max_connections": "open connections in all, more are refused with a 503 (0: as many as the "
                               "process's file descriptors leave room for, which also caps any larger value)"}

    @classmethod
    def add_cli_args(cls, group: argparse._ArgumentGroup) -> None:
        for f in fields(cls):
            group.add_argument(f"--{f.name.replace('_', '-')}", type=type(f.default), default=f.default,
                               metavar="S" if isinstance(f.default, float) else "N",
                               help=f"{cls.HELP[f.name]} (default {f.default:g})")

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> ConnectionLimits:
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})


def fd_budget() -> int:
    """How many connections the process's file descriptors leave room for: the soft
    ``RLIMIT_NOFILE``, first raised to the hard limit, less the descriptors open now, one for a
    connection being refused and ``FD_RESERVE``."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):  # an unlimited hard limit the kernel does not take as a soft one
            pass
    return soft - len(os.listdir("/dev/fd")) - 1 - FD_RESERVE


def _refusal(status: int, reason: str, error: APIError) -> bytes:
    """A whole HTTP response of ``error`` that closes its connection."""
    body = json.dumps(error.body()).encode()
    return (f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            "Connection: close\r\n\r\n").encode() + body


class _ClientFaultLog(logging.LoggerAdapter):
    """aiohttp's request handlers' logger: a request it cannot parse (an ``HttpProcessingError``:
    a malformed request line or header) is one line naming the peer and the fault, at most INFO,
    never a traceback; everything else passes through as aiohttp logs it."""

    def log(self, level, msg, *args, exc_info=None, **kwargs):
        if isinstance(exc_info, HttpProcessingError):
            fault = clipped(" ".join(str(exc_info.message).split()), 200)
            self.logger.log(min(level, logging.INFO), "%s: %d %s", msg % args if args else msg, exc_info.code, fault)
        else:
            self.logger.log(level, msg, *args, exc_info=exc_info, **kwargs)


class Connections:
    """The server's open connections under ``limits`` (see the module): ``listen`` accepts and
    serves them until ``close``, ``middleware`` (outermost in the app) marks each request's start
    and end on its connection."""

    def __init__(self, limits: ConnectionLimits):
        self.limits = limits
        self.capacity = 0  # set by listen
        self.make_handler: Callable[[], asyncio.Protocol] | None = None
        self._ssl_context: ssl.SSLContext | None = None
        self._listening: list[socket.socket] = []
        self._starting: set[asyncio.Task] = set()  # the admitted being handed to a transport (a TLS handshake)
        self._open = 0  # admitted and not yet closed, from their accept (a TLS handshake included)
        self.serving: dict[asyncio.BaseTransport, _Connection] = {}  # the admitted with a transport (past TLS), by it
        self._per_client: Counter[str] = Counter()
        self._refusing: set[str] = set()  # the client addresses ("" for all) at their cap, logged once
        self._busy = _refusal(503, "Service Unavailable", APIError(
            503, "the server is at its connection cap: retry once a connection has closed",
            code="too_many_connections"))
        self.headers_late = _refusal(408, "Request Timeout", APIError(
            408, f"the request's headers did not arrive within {limits.header_timeout:g} s (serve --header-timeout)",
            code="request_timeout"))
        self._too_many = _refusal(429, "Too Many Requests", APIError(
            429, f"this client has {limits.max_connections_per_client} connections open: reuse them "
                 "(serve --max-connections-per-client)", code="too_many_connections"))

    def handler_options(self) -> dict:
        """The options of aiohttp's request handlers (``web.AppRunner``'s keywords) these limits need."""
        return {"keepalive_timeout": self.limits.keep_alive_timeout, "lingering_time": 0,
                "logger": _ClientFaultLog(logging.getLogger("aiohttp.server"))}

    async def listen(self, make_handler: Callable[[], asyncio.Protocol], host: str, port: int,
                     ssl_context: ssl.SSLContext | None) -> int:
        """Listen on every address of ``host`` (``""``: every interface) at ``port`` (TLS with
        ``ssl_context``, its handshake within the header deadline), each connection admitted served
        by a ``make_handler()`` (``runner.server``); returns the port of the first address (``port``
        0: one the system chose). An address family the kernel lacks is skipped, as asyncio does."""
        budget = fd_budget()
        self.capacity = min(self.limits.max_connections or budget, budget)
        if self.capacity < self.limits.max_connections:
            log.warning("--max-connections %d: the file descriptor limit leaves room for %d",
                        self.limits.max_connections, self.capacity)
        if self.capacity < 1:
            raise SystemExit(f"serve: the file descriptor limit (ulimit -n) leaves no room for connections "
                             f"({budget}); raise it")
        self.make_handler, self._ssl_context = make_handler, ssl_context
        log.info("connections: at most %d open, %s per client; deadlines: headers %g s, body %g s, keep-alive %g s",
                 self.capacity, self.limits.max_connections_per_client or "any number",
                 self.limits.header_timeout, self.limits.body_timeout, self.limits.keep_alive_timeout)
        loop = asyncio.get_running_loop()
        addresses = await loop.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        try:
            for family, address in dict.fromkeys((family, address) for family, *_, address in addresses):
                try:
                    self._listening.append(socket.create_server(address, family=family, backlog=BACKLOG))
                except OSError as error:
                    if error.errno != errno.EAFNOSUPPORT:  # a family the kernel lacks (IPv6) is skipped
                        raise
            if not self._listening:
                raise OSError(errno.EAFNOSUPPORT, f"no address of {host!r} can be listened on here")
        except OSError:  # an address taken: none is kept
            self.close()
            raise
        for listening in self._listening:
            listening.setblocking(False)
            loop.add_reader(listening, self._accept, listening)
        return self._listening[0].getsockname()[1]

    def close(self) -> None:
        """Stop listening (the connections open are served on)."""
        loop = asyncio.get_running_loop()
        for listening in self._listening:
            loop.remove_reader(listening)
            listening.close()
        self._listening.clear()

    def _accept(self, listening: socket.socket) -> None:
        """Accept the connections waiting on ``listening`` (at most ``BACKLOG``: the loop's other
        work goes on), each admitted and served, or refused and closed before the next accept."""
        for _ in range(BACKLOG):
            try:
                sock, peer = listening.accept()
            except (BlockingIOError, InterruptedError, ConnectionAbortedError):
                return
            except OSError as error:
                if error.errno not in OUT_OF_RESOURCES:
                    raise
                log.warning("accepting connections: %s; pausing %g s", error, ACCEPT_PAUSE_S)
                loop = asyncio.get_running_loop()
                loop.remove_reader(listening)
                loop.call_later(ACCEPT_PAUSE_S, self._resume_accepting, listening)
                return
            sock.setblocking(False)
            client = peer[0] if isinstance(peer, tuple) else ""
            refusal = self.admit(client)
            if refusal is None:
                task = asyncio.get_running_loop().create_task(self._serve(sock, _Connection(self, client)))
                self._starting.add(task)
                task.add_done_callback(self._starting.discard)
                continue
            if self._ssl_context is None:
                try:
                    sock.send(refusal)  # a few hundred bytes into an empty send buffer
                except OSError:
                    pass
            sock.close()

    def _resume_accepting(self, listening: socket.socket) -> None:
        if listening in self._listening:  # not closed meanwhile
            asyncio.get_running_loop().add_reader(listening, self._accept, listening)

    async def _serve(self, sock: socket.socket, connection: _Connection) -> None:
        """Serve ``sock`` (admitted) by ``connection``: its TLS handshake first, within the header deadline."""
        try:
            await asyncio.get_running_loop().connect_accepted_socket(
                lambda: connection, sock, ssl=self._ssl_context,
                ssl_handshake_timeout=self.limits.header_timeout if self._ssl_context else None)
        except OSError as error:  # a handshake failed or too slow: asyncio has closed the socket
            log.debug("a connection of %s closed before it was served: %s", connection.client, error)
        finally:
            if connection.transport is None:  # never served: no connection_lost releases it
                self.release(connection)

    @web.middleware
    async def middleware(self, request: web.Request, handler):
        """Marks the request's headers complete (its connection's header deadline ends) and its
        handler done (the connection idles: the keep-alive timeout); a response leaving part of the
        body unread closes the connection instead of draining it."""
        connection = self.serving.get(request.transport)
        if connection is not None:
            connection.request_started()
        try:
            response = await handler(request)
        finally:
            if connection is not None:
                connection.request_done()
        if not request.content.is_eof():
            response.force_close()
        return response

    def admit(self, client: str) -> bytes | None:
        """Count a new connection of ``client`` (its address) open, or the refusal it gets (over a cap)."""
        per_client = self.limits.max_connections_per_client
        if self._open >= self.capacity:
            return self._refuse("", self._busy, "at its cap of %d open connections: refusing new ones",
                                self.capacity)
        if per_client and self._per_client[client] >= per_client:
            return self._refuse(client, self._too_many, "client %s has %d connections open: refusing "
                                "its new ones", client, per_client)
        self._open += 1
        self._per_client[client] += 1
        return None

    def _refuse(self, who: str, refusal: bytes, message: str, *args) -> bytes:
        if who not in self._refusing:
            self._refusing.add(who)
            log.warning(message, *args)
        return refusal

    def release(self, connection: _Connection) -> None:
        """``connection`` (admitted) has closed: its place is free for the next one."""
        self._open -= 1
        self.serving.pop(connection.transport, None)
        self._per_client[connection.client] -= 1
        if not self._per_client[connection.client]:
            del self._per_client[connection.client]
        self._refusing.discard(connection.client)
        self._refusing.discard("")


class _Connection(asyncio.Protocol):
    """One admitted connection of ``client`` (its address), served by an aiohttp request handler,
    to which it hands every event, under the header deadline: armed at the start (after a TLS
    handshake) and at the first byte after a response, ended when the middleware sees the
    request's headers complete."""

    def __init__(self, connections: Connections, client: str):
        self._connections = connections
        self.transport: asyncio.BaseTransport | None = None
        self.client = client
        self._handler: asyncio.Protocol | None = None
        self._deadline: asyncio.TimerHandle | None = None
        self._idle = False  # between a handler's end and the next request's first byte
        self._heard = False  # a byte came since the header deadline was armed

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        self._connections.serving[transport] = self
        self._handler = self._connections.make_handler()
        self._handler.connection_made(transport)
        self._await_headers()

    def data_received(self, data: bytes) -> None:
        if self._idle:
            self._idle = False
            self._await_headers()
        self._heard = True
        self._handler.data_received(data)

    def eof_received(self) -> bool | None:
        return self._handler.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_deadline()
        self._connections.release(self)
        self._handler.connection_lost(exc)

    def pause_writing(self) -> None:
        self._handler.pause_writing()

    def resume_writing(self) -> None:
        self._handler.resume_writing()

    def request_started(self) -> None:
        self._cancel_deadline()

    def request_done(self) -> None:
        self._idle = True

    def _await_headers(self) -> None:
        self._cancel_deadline()
        self._heard = False
        self._deadline = asyncio.get_running_loop().call_later(self._connections.limits.header_timeout,
                                                               self._headers_late)

    def _headers_late(self) -> None:
        log.debug("closing a connection of %s: no request headers within %g s", self.client,
                  self._connections.limits.header_timeout)
        if self._heard:
            self.transport.write(self._connections.headers_late)
        self.transport.close()

    def _cancel_deadline(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
