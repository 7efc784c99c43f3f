"""Helpers of the phase-14 parser tests: deterministic id sources, splitting an output into
deltas, the OpenAI SDK's own assembly of a chat stream (``ChatCompletionStreamState``, what
``client.chat.completions.stream`` uses) as the truth for what a client sees, a chat choice
read whole and streamed (``engine.entrypoints.server.chat_output.ChatParsing``) in one comparable
shape, and a hang guard for the linear-cost tests (``finishes``)."""
from __future__ import annotations

import itertools
import multiprocessing

import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletionChunk


def counting_ids(prefix: str = "call_"):
    """An id source giving call_0, call_1, ...: two sources from here give the same ids."""
    counter = itertools.count()
    return lambda: f"{prefix}{next(counter)}"


def pieces(text: str, cuts) -> list[str]:
    """``text`` cut at the (sorted, deduplicated) positions ``cuts``."""
    bounds = [0, *sorted(set(cuts)), len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


def run_stream(stream, deltas: list[str]) -> list[dict]:
    """Every delta object the stream gives for these text deltas, then its finish."""
    return [d for piece in deltas for d in stream.feed(piece)] + stream.finish()


def sdk_message(deltas: list[dict], finish_reason: str = "stop"):
    """The message the OpenAI SDK assembles from chunks carrying these deltas (one chunk each,
    after a role chunk, before a finish chunk)."""
    state = ChatCompletionStreamState()
    for delta, reason in [({"role": "assistant"}, None), *((d, None) for d in deltas), ({}, finish_reason)]:
        chunk = ChatCompletionChunk.model_validate({
            "id": "chatcmpl-test", "object": "chat.completion.chunk", "created": 0, "model": "m",
            "choices": [{"index": 0, "delta": delta, "finish_reason": reason}]})
        list(state.handle_chunk(chunk))
    return state.get_final_completion().choices[0].message


def chat_whole(parsing, text: str, finish_reason: str = "stop"):
    """``(content, [(name, arguments)], finish_reason)`` of the whole message ``parsing`` makes of
    ``text`` (ids are random: not compared)."""
    message, reason = parsing.message(text, finish_reason)
    return (message["content"], [(c["function"]["name"], c["function"]["arguments"])
                                 for c in message.get("tool_calls", [])], reason)


def chat_streamed(parsing, deltas: list[str], finish_reason: str = "stop"):
    """The same from ``parsing``'s stream fed ``deltas``, as the OpenAI SDK assembles it (its final
    chunk says ``stop``: the SDK refuses to assemble a ``length`` one), with the finish reason the
    stream gives; every call's id is a fresh ``call_`` id."""
    stream = parsing.stream()
    sent = [d for piece in deltas for d in stream.feed(piece)]
    more, reason = stream.finish(finish_reason)
    message = sdk_message(sent + more)
    calls = message.tool_calls or []
    assert len({c.id for c in calls}) == len(calls) and all(c.id.startswith("call_") for c in calls)
    return message.content, [(c.function.name, c.function.arguments) for c in calls], reason


def finishes(run, seconds: float = 60.0):
    """``run()``'s result, computed in a forked process given ``seconds``: a hang guard (no timing
    is asserted) that a parser whose cost grows with the square of the text runs into; the process
    is then killed, so no quadratic parse goes on burning a core after the test."""
    context = multiprocessing.get_context("fork")
    receive, send = context.Pipe(duplex=False)
    process = context.Process(target=lambda: send.send(run()), daemon=True)
    process.start()
    send.close()
    try:
        assert receive.poll(seconds), f"still parsing after {seconds:g} s: the cost grows with the square of the text"
        try:
            return receive.recv()
        except EOFError:
            pytest.fail("the parse raised (its traceback is in the captured stderr)")
    finally:
        process.kill()
        process.join()
