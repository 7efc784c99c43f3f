"""The one path from a parsed request to the engine and back, shared by every API the server
speaks (chat completions and completions, the Responses API, Anthropic's Messages API): each
route parses its own request shape into a ``GenerationRequest`` and writes its own response
shape from what a ``Generation`` gives.

A ``Generation`` submits one stream per choice to the engine loop, gives their progress as it
comes (``updates``: the choice's position and a ``RequestOutput`` delta: new tokens, text,
logprobs, the finish) or whole (``outputs``), and aborts whatever still runs when it is closed
(the client gone, an error, the answer written). A choice that failed in the engine raises its
``APIError`` where its last update would be: rejected by the engine 400, failed in a step 500,
aborted (the server shutting down) 503. A stream that must show its client it is alive while no
token comes (queued, or prefilling a long prompt: agents' clients give up on a silent stream)
asks ``updates`` for a tick every so many idle seconds and writes its API's keep-alive on each.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from aiohttp import web

from engine.core.engine_client import EngineClient, Stream
from engine.core.output_processor import RequestOutput
from engine.entrypoints.server.protocol import GenerationRequest, usage
from engine.entrypoints.server.request_body import APIError


@dataclass
class ChoiceOutput:
    """A finished choice, whole: its text, logprobs items, output token count and last update."""
    text: str = ""
    logprobs: list = field(default_factory=list)
    num_tokens: int = 0
    final: RequestOutput | None = None


def client_of(request: web.Request) -> str:
    """Who sent ``request``, as fair sharing tells clients apart (the engine's admission, the grammar
    compile queue): its peer address."""
    return request.remote or ""


class Generation:
    """``gen``'s choices, sent by ``client`` (``client_of``: the engine admits waiting
    requests round robin over clients), running on ``engine_client``; ``close()`` aborts what still
    runs."""

    def __init__(self, engine_client: EngineClient, gen: GenerationRequest, client: str):
        self.engine_client, self.gen = engine_client, gen
        self.bell = asyncio.Event()
        self.streams = [Stream(c.prompt_token_ids, c.params, c.index, self.bell, client) for c in gen.choices]
        self.finals: list[RequestOutput | None] = [None] * len(self.streams)
        try:
            for s in self.streams:
                engine_client.submit(s)
        except RuntimeError as e:  # draining or stopped
            self.close()
            raise APIError(503, str(e)) from None

    def close(self) -> None:
        for s in self.streams:
            self.engine_client.abort(s)

    async def updates(self, tick: float | None = None) -> AsyncIterator[tuple[int, RequestOutput] | None]:
        """``(position, delta)`` of each choice's progress until every choice has finished; a
        failed choice raises its error instead of its last delta. With ``tick`` (seconds), None
        each time that long has passed without an update (a stream's keep-alive)."""
        while not all(self.finals):
            if not await self._rung(tick):
                yield None
                continue
            self.bell.clear()
            for i, s in enumerate(self.streams):
                update = s.take() if self.finals[i] is None else None
                if update is None:
                    continue
                if update.finished:
                    self.finals[i] = update
                    raise_if_failed(update)
                yield i, update

    async def _rung(self, timeout: float | None) -> bool:
        """Whether the bell rang within ``timeout`` seconds (None: it is waited for)."""
        try:
            async with asyncio.timeout(timeout):
                await self.bell.wait()
        except TimeoutError:
            return False
        return True

    async def outputs(self) -> list[ChoiceOutput]:
        """Every choice, whole, once all have finished."""
        outputs = [ChoiceOutput() for _ in self.streams]
        async for i, update in self.updates():
            out = outputs[i]
            out.text += update.text
            out.logprobs += update.logprobs or []
            out.num_tokens += len(update.token_ids)
            if update.finished:
                out.final = update
        return outputs

    def usage(self, num_completion_tokens: int) -> dict:
        """OpenAI's usage object of the finished request: each prompt counted once, its cached
        tokens its first choice's."""
        gen, finals = self.gen, self.finals
        cached: dict[int, int] = {}
        for choice, final in zip(gen.choices, finals):
            cached.setdefault(choice.prompt_index, final.num_cached_tokens)
        return usage(gen.num_prompt_tokens, num_completion_tokens, sum(f.num_draft_tokens for f in finals),
                     sum(f.num_accepted_tokens for f in finals), sum(cached.values()))


def raise_if_failed(update: RequestOutput) -> None:
    """The error of a choice that ended without finishing normally."""
    if update.finish_reason == "rejected":
        raise APIError(400, f"the engine rejected the request: {update.reject_reason}", code="rejected")
    if update.finish_reason == "error":
        raise APIError(500, update.error or "the engine failed on this request")
    if update.finish_reason == "abort":
        raise APIError(503, update.error or "the request was aborted")


async def sse_response(request: web.Request) -> web.StreamResponse:
    """A prepared Server-Sent Events response."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    return response
