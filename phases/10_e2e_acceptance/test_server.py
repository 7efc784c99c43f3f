"""The OpenAI-compatible server on CPU: real HTTP on loopback, the official openai client.

One server (engine thread + aiohttp in a background thread) serves the module; an oracle
LLMEngine on the same checkpoint gives the expected greedy outputs. Every test ends with
the engine idle, every KV block free and every request forgotten.
"""
import asyncio
import json
import tomllib
from pathlib import Path

import pytest

from engine.core.llm_engine import LLMEngine
from engine.core.tokenizer import load_tokenizer
from engine.scheduling.sequence import SamplingParams
from server_cases import (
    HANG_GUARD_S,
    PROMPTS,
    VOCAB,
    assert_error_object,
    held_steps,
    http,
    make_word_checkpoint,
    paused_until,
    posted_text,
    running_server,
    wait_idle,
)

openai = pytest.importorskip("openai")  # a test dependency; absent on the GPU image

MAX_MODEL_LEN = 128
GREEDY = dict(temperature=0, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_word_checkpoint(tmp_path_factory.mktemp("word-model"), seed=3)


@pytest.fixture(scope="module")
def oracle(model_dir):
    """A second engine on the same checkpoint: each request alone, greedy, EOS ignored."""
    engine = LLMEngine(model_dir, block_size=4, max_model_len=MAX_MODEL_LEN)

    def greedy(prompt: str | list[int], max_tokens: int, stop=()) -> tuple[str, list[int]]:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, stop=stop)
        rid = engine.add_request(prompt, params)
        while engine.has_unfinished_requests():
            engine.step()
        out = engine.pop_request(rid)
        return out.text, out.token_ids
    return greedy


@pytest.fixture(scope="module")
def served(model_dir):
    engine = LLMEngine(model_dir, block_size=4, max_num_seqs=32, max_model_len=MAX_MODEL_LEN)
    with running_server(engine) as running:
        yield running


@pytest.fixture
def client(served):
    # reads outlast the engine's hang guard, so a held-back stream fails on what the engine saw
    with openai.OpenAI(base_url=served.url + "/v1", api_key="none", max_retries=0, timeout=2 * HANG_GUARD_S) as c:
        yield c
    wait_idle(served.engine_client)


def test_completions_json_and_health(served, client, oracle):
    """/health and /v1/models answer; /v1/completions takes a string, strings, token ids and
    token-id lists and answers OpenAI-shaped JSON whose greedy text is the engine's own,
    with finish_reason and usage right."""
    assert http(served.url + "/health")[0] == 200
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"]

    prompt = PROMPTS[0]
    text, tokens = oracle(prompt, 6)
    out = client.completions.create(model="tiny", prompt=prompt, max_tokens=6, **GREEDY)
    assert out.object == "text_completion" and out.id and out.model == "tiny" and isinstance(out.created, int)
    assert [(c.index, c.text, c.finish_reason) for c in out.choices] == [(0, text, "length")]
    prompt_ids = served.server.tokenizer.encode(prompt, add_special_tokens=False)
    n_prompt = len(prompt_ids)
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == (n_prompt, 6, n_prompt + 6)

    batch = client.completions.create(model="tiny", prompt=PROMPTS[:3], max_tokens=5, **GREEDY)
    assert [c.text for c in sorted(batch.choices, key=lambda c: c.index)] == [oracle(p, 5)[0] for p in PROMPTS[:3]]
    assert batch.usage.completion_tokens == 15

    ids = client.completions.create(model="tiny", prompt=prompt_ids, max_tokens=6, **GREEDY)
    assert ids.choices[0].text == text
    id_lists = client.completions.create(model="tiny", prompt=[prompt_ids, [5, 6, 7]], max_tokens=4, **GREEDY)
    assert [c.text for c in sorted(id_lists.choices, key=lambda c: c.index)] == [oracle(prompt_ids, 4)[0],
                                                                                 oracle([5, 6, 7], 4)[0]]

    # a stop string ends the text before it, with finish_reason "stop"
    long_text, _ = oracle(prompt, 12)
    words = long_text.split()
    stop = words[len(words) // 2]
    stopped = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, stop=[stop], **GREEDY)
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == long_text[:long_text.index(stop)] == oracle(prompt, 12, stop=(stop,))[0]
    # without max_tokens a completion gets 16 tokens (OpenAI's default)
    assert client.completions.create(model="tiny", prompt=prompt, **GREEDY).usage.completion_tokens == 16


def _choice_text(choice) -> str:
    return choice.text if hasattr(choice, "text") else (choice.delta.content or "")


def _stream_text(chunks) -> tuple[str, list[str], list, object]:
    """(joined text, the non-empty text pieces, each choice chunk's finish_reason, the usage)."""
    texts, finishes, usage = [], [], None
    for chunk in chunks:
        if chunk.usage is not None:
            assert chunk.choices == []
            usage = chunk.usage
        for choice in chunk.choices:
            texts.append(_choice_text(choice))
            finishes.append(choice.finish_reason)
    return "".join(texts), [t for t in texts if t], finishes, usage


def _in_step_with_the_engine(served, create) -> list:
    """The chunks of the streaming request ``create()`` makes, read while the engine is held before
    each step until every character it has posted has reached this client. Each step's text must
    then leave in an event of its own before the next step runs, whatever the machine's load: a
    server that holds text back leaves the engine waiting (the hang guard fails the test). For
    requests without stop strings (their hold-back keeps posted text back by design)."""
    received = [0]
    with held_steps(served.engine_client, lambda: received[0] < posted_text(served.engine_client)) as gave_up:
        chunks = []
        for chunk in create():
            chunks.append(chunk)
            received[0] += sum(len(_choice_text(choice)) for choice in chunk.choices)
    assert not gave_up, f"{gave_up[0]}: text it had posted did not reach the client before the next step"
    return chunks


def test_streaming_matches_non_streaming(served, client, oracle):
    """SSE chunks arrive step by step (each step's text in its own event, the first before the
    end), join to the non-streaming text (stop strings included: nothing that turns into a stop
    string is ever sent), end with a finish_reason, a usage chunk when asked, and data: [DONE]."""
    for prompt, max_tokens in [(PROMPTS[1], 10), (PROMPTS[2], 7)]:
        text, _ = oracle(prompt, max_tokens)
        chunks = _in_step_with_the_engine(served, lambda: client.completions.create(
            model="tiny", prompt=prompt, max_tokens=max_tokens, stream=True, stream_options={"include_usage": True},
            **GREEDY))
        joined, pieces, finishes, usage = _stream_text(chunks)
        assert joined == text
        assert len(pieces) >= max_tokens - 1, f"text came in {len(pieces)} pieces, not one per step"
        first_text = next(i for i, c in enumerate(chunks) if any(_choice_text(choice) for choice in c.choices))
        assert chunks[first_text].choices[0].finish_reason is None, "no text left before the request finished"
        assert finishes[-1] == "length" and not any(finishes[:-1])
        assert usage.completion_tokens == max_tokens and usage.total_tokens == usage.prompt_tokens + max_tokens

    text, _ = oracle(PROMPTS[0], 12)
    stop = " ".join(text.split()[3:5])  # a two-word stop string: its first word must be held back
    plain = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=12, stop=stop, **GREEDY)
    streamed = _stream_text(client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=12, stop=stop,
                                                      stream=True, **GREEDY))
    assert streamed[0] == plain.choices[0].text == text[:text.index(stop)]
    assert streamed[2][-1] == plain.choices[0].finish_reason == "stop"

    status, raw = http(served.url + "/v1/completions", {"model": "tiny", "prompt": PROMPTS[3], "max_tokens": 3,
                                                        "stream": True, "temperature": 0})
    events = raw.decode().split("\n\n")
    assert status == 200 and events[-2:] == ["data: [DONE]", ""]
    assert all(e.startswith("data: ") for e in events[:-1])
    assert json.loads(events[0][6:])["object"] == "text_completion"


def test_streamed_text_leaves_before_the_request_finishes(served, client, oracle):
    """Streamed text leaves before the request finishes and joins to exactly the non-streamed
    text, however the client's reads interleave with the engine's steps: held after each step
    until this client has what it posted, the engine still has the request unfinished when the
    first text arrives (deterministic: it cannot step on before the client says so); read only
    once the engine has finished the request, the same text arrives, ending in the finish."""
    prompt, max_tokens = PROMPTS[5], 12
    text, _ = oracle(prompt, max_tokens)
    received, unfinished_at_first_text = [0], []

    def read(stream) -> list[str]:
        pieces = []
        for chunk in stream:
            piece = "".join(_choice_text(choice) for choice in chunk.choices)
            if piece and not pieces:  # asked before the engine may take another step
                unfinished_at_first_text.append(served.engine_client.call(lambda e: e.has_unfinished_requests()))
            pieces.append(piece)
            received[0] += len(piece)
        return pieces

    with held_steps(served.engine_client, lambda: received[0] < posted_text(served.engine_client)) as gave_up:
        pieces = read(client.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens, stream=True,
                                                **GREEDY))
    assert unfinished_at_first_text == [True], "the first text left with the finish, not before it"
    assert not gave_up, gave_up[0]
    assert "".join(pieces) == text

    late = client.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens, stream=True, **GREEDY)
    wait_idle(served.engine_client)  # the engine finished (and forgot) the request before any read
    joined, _, finishes, _ = _stream_text(late)
    assert joined == text and finishes[-1] == "length" and not any(finishes[:-1])


def test_chat_completions(served, client, oracle):
    """Chat messages go through the tokenizer's chat template (generation prompt added); JSON and
    streaming answers equal the engine's greedy text of the rendered prompt."""
    messages = [{"role": "system", "content": "the garden"}, {"role": "user", "content": "a fox in the city"}]
    rendered = served.server.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert rendered.endswith("assistant said")
    text, _ = oracle(rendered, 8)
    out = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, **GREEDY)
    assert out.object == "chat.completion"
    assert (out.choices[0].message.role, out.choices[0].message.content, out.choices[0].finish_reason) == (
        "assistant", text, "length")
    n_prompt = len(served.server.tokenizer.encode(rendered, add_special_tokens=False))
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (n_prompt, 8)

    chunks = _in_step_with_the_engine(served, lambda: client.chat.completions.create(
        model="tiny", messages=messages, max_completion_tokens=8, stream=True, stream_options={"include_usage": True},
        **GREEDY))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    joined, pieces, finishes, usage = _stream_text(chunks)
    assert joined == text and len(pieces) > 1 and finishes[-1] == "length" and usage.completion_tokens == 8

    # without max_tokens a chat completion may use all the room max_model_len leaves
    room = client.chat.completions.create(model="tiny", messages=messages, **GREEDY)
    assert room.usage.total_tokens == MAX_MODEL_LEN and room.choices[0].finish_reason == "length"


def test_chat_without_template_is_a_400(tmp_path):
    """A tokenizer without a chat template: /v1/chat/completions is a clear 400, completions work."""
    engine = LLMEngine(make_word_checkpoint(tmp_path / "plain", seed=1, chat_template=None), block_size=4,
                       max_model_len=64)
    with running_server(engine, "plain") as running:
        with openai.OpenAI(base_url=running.url + "/v1", api_key="none", max_retries=0) as client:
            with pytest.raises(openai.BadRequestError) as e:
                client.chat.completions.create(model="plain", messages=[{"role": "user", "content": "hi"}])
            assert e.value.code == "no_chat_template" and "chat template" in e.value.message
            done = client.completions.create(model="plain", prompt="the", max_tokens=2, **GREEDY)
            assert done.usage.completion_tokens == 2
        wait_idle(running.engine_client)


def test_concurrent_requests_match_sequential(served, client, oracle):
    """32 concurrent streaming clients each get the greedy text its prompt gets alone, and the
    engine batched them: far fewer steps than tokens generated. The engine waits until all 32 are
    submitted (however slowly the HTTP thread takes them in), so they start together."""
    prompts = [" ".join(PROMPTS[i % len(PROMPTS)].split()[:1 + i % 5] + PROMPTS[(i + 3) % len(PROMPTS)].split())
               for i in range(32)]
    max_tokens = [4 + i % 7 for i in range(32)]
    expected = [oracle(p, n)[0] for p, n in zip(prompts, max_tokens)]

    async def one(aclient, prompt, n):
        stream = await aclient.completions.create(model="tiny", prompt=prompt, max_tokens=n, stream=True, **GREEDY)
        return "".join([c.choices[0].text async for c in stream if c.choices])

    async def all_at_once():
        async with openai.AsyncOpenAI(base_url=served.url + "/v1", api_key="none", max_retries=0) as aclient:
            return await asyncio.gather(*(one(aclient, p, n) for p, n in zip(prompts, max_tokens)))

    steps_before = served.engine_client.call(lambda e: e.num_steps)
    with paused_until(served.engine_client, lambda: served.engine_client.num_streams >= len(prompts)) as gave_up:
        assert asyncio.run(all_at_once()) == expected
    assert not gave_up, gave_up[0]
    steps = served.engine_client.call(lambda e: e.num_steps) - steps_before
    assert steps < sum(max_tokens) // 3, f"{steps} engine steps for {sum(max_tokens)} tokens: not batched"


BAD_REQUESTS = [  # (path, body, status, param, code)
    ("/v1/completions", b'{"model": "tiny", "prompt": "the', 400, None, None),
    ("/v1/completions", b'["the"]', 400, None, None),
    ("/v1/completions", {"model": "tiny"}, 400, "prompt", None),
    ("/v1/completions", {"model": "tiny", "prompt": 5}, 400, "prompt", None),
    ("/v1/completions", {"model": "tiny", "prompt": [1, "the"]}, 400, "prompt", None),
    ("/v1/completions", {"model": "tiny", "prompt": [[3, 99999]]}, 400, "prompt", None),
    ("/v1/completions", {"model": "tiny", "prompt": "the", "max_tokens": "3"}, 400, "max_tokens", None),
    ("/v1/completions", {"model": "tiny", "prompt": "the", "temperature": "hot"}, 400, "temperature", None),
    ("/v1/completions", {"model": "tiny", "prompt": "the", "stream": "yes"}, 400, "stream", None),
    ("/v1/completions", {"model": "tiny", "prompt": "the", "stop": [1]}, 400, "stop", None),
    ("/v1/completions", {"model": "tiny", "prompt": "the", "temperature": -1}, 400, "temperature", None),
    ("/v1/completions", {"model": "tiny", "prompt": "the", "top_p": 0}, 400, "top_p", None),
    ("/v1/completions", {"model": "tiny", "prompt": "the", "max_tokens": 0}, 400, "max_tokens", None),
    ("/v1/completions", {"model": "tiny", "prompt": "the", "n": 10**6}, 400, "n", None),
    ("/v1/completions", {"model": "tiny", "prompt": "the", "n": 2, "best_of": 3}, 400, "best_of", None),
    ("/v1/completions", {"model": "tiny", "prompt": "the", "logprobs": 10**6}, 400, "logprobs", None),
    ("/v1/completions", {"model": "tiny", "prompt": "the", "top_k": 10**20}, 400, "top_k", None),
    ("/v1/completions", b'{"model": "tiny", "prompt": "the", "temperature": Infinity}', 400, None, None),
    ("/v1/completions", b'{"model": "tiny", "prompt": "the", "temperature": NaN}', 400, None, None),
    ("/v1/completions", {"model": "tiny", "prompt": "the", "stop": ["x"] * 1000}, 400, "stop", None),
    ("/v1/completions", {"model": "tiny", "prompt": "the", "stop": ["x" * 10000]}, 400, "stop", None),
    ("/v1/completions", {"model": "tiny", "prompt": "the", "max_tokens": -1}, 400, "max_tokens", None),
    ("/v1/completions", {"model": "tiny", "prompt": "the", "stop_token_ids": [10**9]}, 400, "stop_token_ids", None),
    ("/v1/completions", {"model": "tiny", "prompt": "the", "presence_penalty": 3}, 400, "presence_penalty", None),
    ("/v1/completions", {"model": "tiny", "prompt": "the", "min_tokens": 9, "max_tokens": 3}, 400, "min_tokens",
     None),
    ("/v1/completions", {"model": "tiny", "prompt": "the", "echo": "yes"}, 400, "echo", None),
    ("/v1/completions", {"model": "tiny", "prompt": "the", "prompt_logprobs": 21}, 400, "prompt_logprobs", None),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "a"}], "echo": True},
     400, "echo", None),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "a"}], "prompt_logprobs": 1},
     400, "prompt_logprobs", None),
    ("/v1/completions", {"model": "tiny", "prompt": "the", "seed": -1}, 400, "seed", None),
    ("/v1/completions", {"model": "tiny", "prompt": "the", "lora_path": "adapter"}, 400, "lora_path", None),
    ("/v1/completions", {"model": "tiny", "prompt": "the", "until": 3}, 400, "until", None),
    ("/v1/completions", {"model": "tiny", "prompt": "the", "do_sample": "no"}, 400, "do_sample", None),
    ("/v1/completions", {"model": "tiny", "prompt": [3] * MAX_MODEL_LEN}, 400, "prompt", "context_length_exceeded"),
    ("/v1/completions", {"model": "tiny", "prompt": "the fox", "max_tokens": MAX_MODEL_LEN - 1}, 400, "max_tokens",
     "context_length_exceeded"),
    ("/v1/completions", {"model": "gpt-4", "prompt": "the"}, 404, "model", "model_not_found"),
    ("/v1/chat/completions", {"model": "tiny"}, 400, "messages", None),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user"}]}, 400, "messages[0].content", None),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "root", "content": "a"}]}, 400,
     "messages[0].role", None),
    ("/v1/completions", b'{"model": "tiny", "prompt": "the", "metadata": ' + b"[" * 600 + b"]" * 600 + b"}", 400,
     None, None),
    ("/v1/completions", b'{"model": "tiny", "prompt": "the", "metadata": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
     400, None, None),
    ("/v1/completions", b'{"model": "tiny", "prompt": "the \\ud800 fox"}', 400, None, None),
    ("/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": "user", "content": "\\udfff"}]}', 400, None,
     None),
    ("/tokenize", b'{"model": "tiny", "prompt": "\\ud800"}', 400, None, None),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "a"}], "top_logprobs": 2},
     400, "top_logprobs", None),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "a"}], "logprobs": True,
                              "top_logprobs": 21}, 400, "top_logprobs", None),
    ("/v1/nowhere", {"model": "tiny"}, 404, None, "not_found"),
]


def test_bad_requests_get_error_objects(served, client):
    """Malformed JSON, missing or wrongly typed fields, bad sampling values, over-long prompts,
    unknown models and routes: each its status and an OpenAI error object; the server serves on."""
    for path, body, status, param, code in BAD_REQUESTS:
        got, raw = http(served.url + path, body)
        assert got == status, (path, body, got, raw)
        error = assert_error_object(raw, param, code)
        assert error["type"] == "invalid_request_error"
    error = assert_error_object(http(served.url + "/v1/completions", {"prompt": [3] * 200})[1])
    assert "200 tokens" in error["message"] and str(MAX_MODEL_LEN) in error["message"], "the limit is not named"
    assert http(served.url + "/v1/completions", method="GET")[0] == 405
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model="tiny", prompt="the", temperature=-1)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="the")
    assert client.completions.create(model="tiny", prompt="the", max_tokens=3, **GREEDY).usage.completion_tokens == 3


def test_tokenize_detokenize_and_version(served, client, model_dir):
    """/tokenize encodes a prompt as a completion's (special tokens on request) and messages as a
    chat's, /detokenize decodes, each as the tokenizer does; /version is the package's; bad bodies
    are 400s naming the field."""
    tokenizer = load_tokenizer(model_dir)
    prompt = PROMPTS[2]
    status, raw = http(served.url + "/tokenize", {"prompt": prompt})
    expected = tokenizer.encode(prompt, add_special_tokens=False)
    assert status == 200 and json.loads(raw) == {"tokens": expected, "count": len(expected),
                                                 "max_model_len": MAX_MODEL_LEN}
    messages = [{"role": "user", "content": prompt}]
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    tokens = json.loads(http(served.url + "/tokenize", {"messages": messages})[1])["tokens"]
    assert tokens == tokenizer.encode(rendered, add_special_tokens=False)
    assert client.chat.completions.create(model="tiny", messages=messages, max_tokens=1).usage.prompt_tokens == len(
        tokens)
    status, raw = http(served.url + "/detokenize", {"tokens": expected})
    assert status == 200 and json.loads(raw) == {"prompt": tokenizer.decode(expected)} and tokenizer.decode(
        expected) == prompt
    status, raw = http(served.url + "/version", method="GET")
    declared = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())["project"]["version"]
    assert status == 200 and json.loads(raw) == {"version": declared}
    both = {"prompt": "a", "messages": [{"role": "user", "content": "a"}]}
    for path, body, param in [("/tokenize", {}, "prompt"), ("/tokenize", both, "prompt"),
                              ("/tokenize", {"prompt": 3}, "prompt"), ("/tokenize", {"messages": "x"}, "messages"),
                              ("/tokenize", {"prompt": "a", "frobnicate": 1}, "frobnicate"),
                              ("/detokenize", {"tokens": [VOCAB]}, "tokens"),
                              ("/detokenize", {"tokens": "a"}, "tokens"),
                              ("/detokenize", {"tokens": [1], "model": "other"}, "model")]:
        status, raw = http(served.url + path, body)
        assert status in (400, 404), (path, body, status)
        assert_error_object(raw, param)


def test_client_disconnect_aborts_its_request(served, client, monkeypatch):
    """A client that leaves mid-stream has its request aborted (not run to max_tokens); its KV
    blocks are free once the engine is idle; other requests go on. The engine steps only once
    the client has the text posted so far, so it cannot run ahead of the client (however the
    threads are scheduled): after the client leaves, only the abort lets it go on."""
    engine = served.engine_client.engine
    aborted = []
    real_abort = engine.abort_request
    monkeypatch.setattr(engine, "abort_request", lambda rid: aborted.append(real_abort(rid)) or aborted[-1])
    steps_before = served.engine_client.call(lambda e: e.num_steps)
    received = [0]
    with held_steps(served.engine_client, lambda: received[0] < posted_text(served.engine_client)) as gave_up:
        stream = client.completions.create(model="tiny", prompt=PROMPTS[4], max_tokens=100, stream=True, **GREEDY)
        for _, chunk in zip(range(3), stream):
            assert chunk.choices
            received[0] += len(chunk.choices[0].text)
        stream.close()
        wait_idle(served.engine_client)
    assert not gave_up, gave_up[0]
    assert aborted == [True]
    steps = served.engine_client.call(lambda e: e.num_steps) - steps_before
    assert steps < 50, f"the request ran {steps} steps after its client left"
    assert client.completions.create(model="tiny", prompt="the", max_tokens=2, **GREEDY).usage.completion_tokens == 2


def test_engine_error_fails_only_the_failed_step(served, client, monkeypatch):
    """A forward that raises fails the requests of that step (every running request is in it)
    with a 500 error object naming the error; the engine frees their blocks and keeps serving
    the requests that come after."""
    engine = served.engine_client.engine
    poison = 17
    real_launch = engine.runner.launch

    def launch(batch, previous=None):
        if any(seq.prompt_token_ids[0] == poison for seq in batch.seqs):
            raise RuntimeError("injected forward failure")
        return real_launch(batch, previous)

    monkeypatch.setattr(engine.runner, "launch", launch)
    with pytest.raises(openai.InternalServerError, match="injected forward failure"):
        client.completions.create(model="tiny", prompt=[poison, 3, 4], max_tokens=5)
    assert http(served.url + "/health")[0] == 200
    assert client.completions.create(model="tiny", prompt="the", max_tokens=2, **GREEDY).usage.completion_tokens == 2
    wait_idle(served.engine_client)
    assert served.engine_client.call(lambda e: e.block_manager.num_free_blocks == e.block_manager.num_blocks)


def test_a_failed_step_is_fatal_under_tensor_parallelism():
    """One process: a step that raises fails only its batch (an error message, the loop goes
    on). Under TP it is re-raised: the rank that raised missed its peers' collectives, so only
    stopping every rank is safe (a peer may be spinning in a captured all-reduce)."""
    from types import SimpleNamespace

    from engine.core.lockstep import run_step

    def failing_step():
        raise RuntimeError("boom")

    failed = ["failed-request-output"]  # what the engine pushes for the requests of the failed step
    def engine(ranks):
        return SimpleNamespace(tp=SimpleNamespace(size=ranks), step=failing_step, take_outputs=lambda: failed)

    outputs, error = run_step(engine(1))
    assert outputs == failed and "RuntimeError: boom" in error
    with pytest.raises(RuntimeError, match="boom"):
        run_step(engine(2))
