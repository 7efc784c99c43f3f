"""The server in production conditions (CPU, loopback): bad requests beside good ones, logprobs
against transformers, n choices sharing one prefill, penalties, /metrics and logs, a bounded load
of mixed and misbehaving clients, a client that never reads."""
import asyncio
import json
import logging
import random
import socket

import pytest
import torch

from engine.core.llm_engine import LLMEngine
from engine.entrypoints.server.metrics import ServerMetrics
from engine.scheduling.sequence import SamplingParams
from server_cases import PROMPTS, assert_error_object, http, make_word_checkpoint, metrics, running_server, wait_idle

aiohttp = pytest.importorskip("aiohttp")
openai = pytest.importorskip("openai")

MAX_MODEL_LEN = 96
GREEDY = dict(temperature=0, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_word_checkpoint(tmp_path_factory.mktemp("word-model"), seed=5)


@pytest.fixture(scope="module")
def oracle(model_dir):
    """An engine of its own on the same checkpoint: each request alone."""
    engine = LLMEngine(model_dir, block_size=4, max_model_len=MAX_MODEL_LEN)

    def run(prompt, params: SamplingParams):
        rid = engine.add_request(prompt, params)
        while engine.has_unfinished_requests():
            engine.step()
        return engine.pop_request(rid)
    return run


@pytest.fixture(scope="module")
def served(model_dir):
    engine = LLMEngine(model_dir, block_size=4, max_num_seqs=16, max_model_len=MAX_MODEL_LEN)
    with running_server(engine, metrics=ServerMetrics(stats_interval_s=0.0)) as running:
        yield running


@pytest.fixture
def client(served):
    with openai.OpenAI(base_url=served.url + "/v1", api_key="none", max_retries=0, timeout=60) as c:
        yield c
    wait_idle(served.engine_client)


async def post_all(url: str, bodies: list, concurrency: int = 16) -> list[tuple[int, bytes]]:
    """POST every body (a dict or raw bytes) to ``url`` at once, ``concurrency`` at a time."""
    gate = asyncio.Semaphore(concurrency)

    async def one(session, body):
        async with gate:
            data = body if isinstance(body, bytes) else json.dumps(body).encode()
            async with session.post(url, data=data, headers={"Content-Type": "application/json"}) as r:
                return r.status, await r.read()

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
        return await asyncio.gather(*(one(session, b) for b in bodies))


POISON = [  # (body fields, param named in the 400)
    ({"temperature": 0.5, "top_k": 10**20}, "top_k"),
    (b'"temperature": Infinity', None),
    (b'"temperature": NaN', None),
    ({"stop": [f"s{i}" for i in range(1000)]}, "stop"),
    ({"n": 10**6}, "n"),
    ({"logprobs": 10**6}, "logprobs"),
    ({"max_tokens": -1}, "max_tokens"),
]


def test_poisoned_requests_fail_alone(served, client, oracle):
    """Each bad request sent beside well-formed ones at once: the bad one is a 400 naming its field,
    every well-formed one completes with exactly the tokens it gets alone (greedy)."""
    good = [{"model": "tiny", "prompt": p, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
            for p in PROMPTS[:4]]
    expected = [oracle(p, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)).text for p in PROMPTS[:4]]
    for fields, param in POISON:
        if isinstance(fields, bytes):
            bad = b'{"model": "tiny", "prompt": "the", "max_tokens": 4, ' + fields + b"}"
        else:
            bad = {"model": "tiny", "prompt": "the", "max_tokens": 4, **fields}
        answers = asyncio.run(post_all(served.url + "/v1/completions", [good[0], bad, *good[1:]]))
        status, raw = answers[1]
        assert status == 400, (fields, raw)
        assert_error_object(raw, param)
        for (status, raw), text in zip(answers[:1] + answers[2:], expected):
            assert status == 200, raw
            assert json.loads(raw)["choices"][0]["text"] == text
    assert http(served.url + "/health")[0] == 200


def test_logprobs_equal_the_models_log_softmax(served, client, model_dir):
    """Completions (JSON and streamed) and chat logprobs: each token's logprob and its top-N
    alternatives equal transformers' log-softmax at that position (float32), keyed by token text."""
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    tokenizer = served.server.tokenizer
    prompt = PROMPTS[2]
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)

    def expected(tokens: list[int], i: int) -> torch.Tensor:
        with torch.no_grad():
            return hf(torch.tensor([prompt_ids + tokens[:i]])).logits[0, -1].double().log_softmax(-1)

    out = client.completions.create(model="tiny", prompt=prompt, max_tokens=5, logprobs=3, **GREEDY)
    lp = out.choices[0].logprobs
    tokens = [tokenizer.convert_tokens_to_ids(t) for t in tokenizer.tokenize(out.choices[0].text)]
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5 and len(tokens) == 5
    for i, token in enumerate(tokens):
        reference = expected(tokens, i)
        assert lp.token_logprobs[i] == pytest.approx(float(reference[token]), abs=1e-4)
        values, ids = reference.topk(3)
        top = {tokenizer.decode([t]): float(v) for t, v in zip(ids.tolist(), values)}
        assert {k: pytest.approx(v, abs=1e-4) for k, v in top.items()} == {
            k: v for k, v in lp.top_logprobs[i].items() if k in top}
    streamed = client.completions.create(model="tiny", prompt=prompt, max_tokens=5, logprobs=3, stream=True,
                                         **GREEDY)
    chunks = [c.choices[0].logprobs for c in streamed if c.choices and c.choices[0].logprobs]
    assert [x for c in chunks for x in c.token_logprobs] == pytest.approx(lp.token_logprobs, abs=1e-6)

    messages = [{"role": "user", "content": "the fox"}]
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=4, logprobs=True,
                                          top_logprobs=2, **GREEDY)
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    prompt_ids = tokenizer.encode(rendered, add_special_tokens=False)
    content = chat.choices[0].logprobs.content
    tokens = [tokenizer.convert_tokens_to_ids(tokenizer.tokenize(c.token)[0]) for c in content]
    for i, (token, entry) in enumerate(zip(tokens, content)):
        reference = expected(tokens, i)
        assert entry.logprob == pytest.approx(float(reference[token]), abs=1e-4) and len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob == pytest.approx(float(reference.max()), abs=1e-4)


def test_n_choices_share_one_prefill(served, client):
    """n = 4 choices of one prompt: the prompt's full blocks are computed once and the other three
    choices hit them (prefix-cache hits in /metrics); seeded choices differ, each reproducible."""
    prompt = " ".join(PROMPTS[2:5])  # several full 4-token blocks
    n_tokens = len(served.server.tokenizer.encode(prompt, add_special_tokens=False))
    before = metrics(served.url)
    out = client.completions.create(model="tiny", prompt=prompt, n=4, max_tokens=6, temperature=1.0, seed=7,
                                    extra_body={"ignore_eos": True})
    after = metrics(served.url)
    assert sorted(c.index for c in out.choices) == [0, 1, 2, 3]
    assert out.usage.prompt_tokens == n_tokens and out.usage.completion_tokens == 24
    shared = (n_tokens - 1) // 4 * 4  # every full block but the last prompt token's
    hits = after["agent_infer:prefix_cache_hits_total"] - before["agent_infer:prefix_cache_hits_total"]
    assert hits >= 3 * shared, f"{hits} prompt tokens hit, expected the 3 later choices to share {shared} each"
    assert len({c.text for c in out.choices}) > 1
    again = client.completions.create(model="tiny", prompt=prompt, n=4, max_tokens=6, temperature=1.0, seed=7,
                                      extra_body={"ignore_eos": True})
    assert sorted((c.index, c.text) for c in again.choices) == sorted((c.index, c.text) for c in out.choices)


def test_penalties_and_min_tokens_reach_the_engine(served, client, oracle):
    """presence / frequency / repetition penalties, min_tokens and stop_token_ids given over HTTP
    give the engine's own answer for the same SamplingParams (their math: phase 09)."""
    fields = dict(presence_penalty=0.5, frequency_penalty=0.7, repetition_penalty=1.4, min_tokens=3)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, **fields)
    expected = oracle(PROMPTS[1], params)
    out = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=10, temperature=0,
                                    presence_penalty=0.5, frequency_penalty=0.7,
                                    extra_body={"ignore_eos": True, "repetition_penalty": 1.4, "min_tokens": 3})
    assert out.choices[0].text == expected.text
    plain = oracle(PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)).text
    assert expected.text != plain


def test_metrics_and_logs(served, client, caplog):
    """/metrics names running / waiting requests, KV usage, prefix-cache queries and hits, prompt
    and generation tokens and the TTFT / ITL / E2E histograms; a finished request logs one line
    with its token counts and finish reason, and a busy loop logs stats lines."""
    before = metrics(served.url)
    with caplog.at_level(logging.INFO, logger="engine"):  # the client's request lines, the server's stats
        out = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=7, **GREEDY)
        wait_idle(served.engine_client)
    after = metrics(served.url)
    for name in ("agent_infer:num_requests_running", "agent_infer:num_requests_waiting",
                 "agent_infer:kv_cache_usage_perc", "agent_infer:prefix_cache_queries_total",
                 "agent_infer:prefix_cache_hits_total"):
        assert name in after, name
    assert after["agent_infer:generation_tokens_total"] - before.get("agent_infer:generation_tokens_total", 0) == 7
    assert after["agent_infer:prompt_tokens_total"] - before.get("agent_infer:prompt_tokens_total", 0) == \
        out.usage.prompt_tokens
    for histogram, count in (("time_to_first_token_seconds", 1), ("inter_token_latency_seconds", 6),
                             ("e2e_request_latency_seconds", 1)):
        name = f"agent_infer:{histogram}_count"
        assert after[name] - before.get(name, 0) == count, histogram
    assert after["agent_infer:num_requests_running"] == 0 and after["agent_infer:kv_cache_usage_perc"] == 0
    lines = [r.getMessage() for r in caplog.records]
    assert any("output 7 tokens, finished (length)" in line for line in lines), lines
    assert any(line.startswith("running ") and "generation" in line for line in lines), lines


def load_bodies(rng: random.Random, count: int) -> list[tuple[str, dict | bytes, bool]]:
    """``count`` mixed requests: (kind, body, stream)."""
    bodies = []
    for i in range(count):
        prompt = rng.choice(PROMPTS)
        base = {"model": "tiny", "prompt": prompt, "max_tokens": rng.randint(1, 8), "temperature": 0,
                "ignore_eos": True}
        kind = ["malformed", "too-long", "n", "logprobs", "stream", "dropped", "stream", "plain", "plain",
                "dropped"][i % 10]
        if kind == "malformed":
            bodies.append((kind, b'{"prompt": "the', False))
        elif kind == "too-long":
            bodies.append((kind, {**base, "prompt": [3] * (MAX_MODEL_LEN + 5)}, False))
        elif kind == "n":
            bodies.append((kind, {**base, "n": 3, "temperature": 0.8, "seed": i}, False))
        elif kind == "logprobs":
            bodies.append((kind, {**base, "logprobs": 2}, False))
        else:
            bodies.append((kind, {**base, "max_tokens": rng.randint(4, 12)} if kind == "dropped" else base,
                           kind in ("stream", "dropped")))
    return bodies


async def load(url: str, bodies, concurrency: int) -> list[tuple[str, int, str | None]]:
    """Send every request, ``concurrency`` at a time; a "dropped" stream is closed after its first
    chunk. (kind, status, the first choice's text for completed non-streams)."""
    gate = asyncio.Semaphore(concurrency)

    async def one(session, kind, body, stream):
        async with gate:
            data = body if isinstance(body, bytes) else json.dumps({**body, "stream": stream}).encode()
            async with session.post(url + "/v1/completions", data=data,
                                    headers={"Content-Type": "application/json"}) as r:
                if kind == "dropped":
                    await r.content.readline()
                    r.close()
                    return kind, r.status, None
                raw = await r.read()
                text = json.loads(raw)["choices"][0]["text"] if r.status == 200 and not stream else None
                return kind, r.status, text

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        return await asyncio.gather(*(one(session, *b) for b in bodies))


def test_bounded_load_leaves_the_engine_idle_and_unchanged(served, client):
    """1,000 mixed requests at 64 concurrent (streamed and not, a third of the streams dropped by
    the client, malformed bodies, over-long prompts, n > 1, logprobs): every one gets its status;
    afterwards the engine is idle with every KV block free (read from /metrics) and a fixed
    greedy request gives the same text as before the load."""
    fixed = dict(model="tiny", prompt=PROMPTS[6], max_tokens=10, **GREEDY)
    before = client.completions.create(**fixed).choices[0].text
    results = asyncio.run(load(served.url, load_bodies(random.Random(0), 1000), concurrency=64))
    expected = {"malformed": 400, "too-long": 400}
    for kind, status, _ in results:
        assert status == expected.get(kind, 200), (kind, status)
    wait_idle(served.engine_client)
    after = metrics(served.url)
    assert after["agent_infer:num_requests_running"] == after["agent_infer:num_requests_waiting"] == 0
    assert after["agent_infer:kv_cache_usage_perc"] == 0
    assert client.completions.create(**fixed).choices[0].text == before


def test_a_client_that_never_reads_does_not_stall_the_others(served, client, oracle):
    """A streaming client that sends its request and never reads holds nothing up: the others
    complete meanwhile; once it goes away its request ends and every block is free."""
    body = json.dumps({"model": "tiny", "prompt": PROMPTS[0], "max_tokens": MAX_MODEL_LEN - 8, "stream": True,
                       "temperature": 0, "ignore_eos": True}).encode()
    host, port = served.url.removeprefix("http://").split(":")
    silent = socket.create_connection((host, int(port)))
    silent.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
    silent.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                   b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    try:
        expected = [oracle(p, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)).text
                    for p in PROMPTS[1:5]]
        bodies = [{"model": "tiny", "prompt": p, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
                  for p in PROMPTS[1:5]]
        answers = asyncio.run(post_all(served.url + "/v1/completions", bodies * 3))
        assert [json.loads(raw)["choices"][0]["text"] for _, raw in answers] == expected * 3
    finally:
        silent.close()
    wait_idle(served.engine_client)


def test_benchmark_and_eval_client_payloads_work_unchanged(served, client, model_dir):
    """The bodies vLLM's and SGLang's serving benchmarks and lm-eval's local-completions send, as
    they send them: answered (vLLM's streamed, with a usage chunk); lm-eval's loglikelihood bodies
    (echo, logprobs 1, max_tokens 1 or 0) answer the prompt's text and its tokens' logprobs, equal
    to transformers' log-softmax of the prompt (max_tokens 0: the prompt alone)."""
    import transformers

    vllm = {"model": "tiny", "prompt": PROMPTS[0], "temperature": 0.0, "repetition_penalty": 1.0, "max_tokens": 5,
            "logprobs": None, "best_of": 1, "stream": True, "stream_options": {"include_usage": True},
            "ignore_eos": True}
    sglang = {"model": "tiny", "prompt": PROMPTS[1], "temperature": 0.0, "best_of": 1, "max_tokens": 5,
              "stream": False, "ignore_eos": True, "lora_path": None}
    lm_eval = {"prompt": [PROMPTS[2], PROMPTS[3]], "model": "tiny", "max_tokens": 5, "temperature": 0,
               "stop": ["\n\n"], "seed": 1234, "until": ["\n\n"], "do_sample": False}
    status, raw = http(served.url + "/v1/completions", vllm)
    events = [json.loads(e[6:]) for e in raw.decode().split("\n\n") if e.startswith("data: {")]
    assert status == 200 and events[-1]["usage"]["completion_tokens"] == 5
    for body in (sglang, lm_eval):
        status, raw = http(served.url + "/v1/completions", body)
        assert status == 200, raw
        answer = json.loads(raw)
        assert len(answer["choices"]) == (len(body["prompt"]) if isinstance(body["prompt"], list) else 1)
        assert all(c["text"] for c in answer["choices"])
    tokenizer = served.engine_client.engine.tokenizer
    prompt = tokenizer.encode(PROMPTS[0], add_special_tokens=False)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        expected = hf(torch.tensor([prompt])).logits[0].double().log_softmax(-1)
    for max_tokens in (1, 0):
        loglikelihood = {"model": "tiny", "prompt": PROMPTS[0], "temperature": 0, "max_tokens": max_tokens,
                         "logprobs": 1, "seed": 1234, "echo": True}
        status, raw = http(served.url + "/v1/completions", loglikelihood)
        assert status == 200, raw
        answer = json.loads(raw)
        choice, lp = answer["choices"][0], answer["choices"][0]["logprobs"]
        assert choice["text"].startswith(tokenizer.decode(prompt))
        assert len(lp["tokens"]) == len(prompt) + max_tokens and lp["token_logprobs"][0] is None
        assert lp["top_logprobs"][0] is None and lp["text_offset"][0] == 0
        for t in range(1, len(prompt)):
            assert lp["token_logprobs"][t] == pytest.approx(float(expected[t - 1, prompt[t]]), abs=1e-4)
            best = int(expected[t - 1].argmax())
            assert lp["top_logprobs"][t][tokenizer.decode([best])] == pytest.approx(float(expected[t - 1, best]),
                                                                                     abs=1e-4)
        assert answer["usage"]["completion_tokens"] == max_tokens
        if max_tokens == 0:
            assert choice["text"] == tokenizer.decode(prompt)


def test_echo_streams_the_prompt_first_and_prompt_logprobs_follow_vllm(served, model_dir):
    """A streamed echo sends the prompt's text (and its logprobs) in the first chunk and the same
    text and logprobs as the answer (max_tokens 0: the prompt alone, no completion token);
    ``prompt_logprobs: 2`` gives vLLM's list: None, then per token {id: {logprob, rank,
    decoded_token}} for the token and its 2 most likely tokens, equal to transformers'
    log-softmax of the prompt."""
    import transformers

    tokenizer = served.engine_client.engine.tokenizer
    prompt = tokenizer.encode(PROMPTS[1], add_special_tokens=False)
    body = {"model": "tiny", "prompt": PROMPTS[1], "temperature": 0, "max_tokens": 3, "logprobs": 0, "echo": True,
            "prompt_logprobs": 2, "ignore_eos": True}
    status, raw = http(served.url + "/v1/completions", body)
    assert status == 200, raw
    choice = json.loads(raw)["choices"][0]
    status, raw = http(served.url + "/v1/completions", {**body, "stream": True})
    chunks = [json.loads(e[6:])["choices"][0] for e in raw.decode().split("\n\n") if e.startswith("data: {")]
    assert chunks[0]["text"].startswith(tokenizer.decode(prompt))
    assert "".join(c["text"] for c in chunks) == choice["text"]
    streamed = [c["logprobs"] for c in chunks if c["logprobs"]]
    assert sum((lp["token_logprobs"] for lp in streamed), []) == choice["logprobs"]["token_logprobs"]
    offsets = choice["logprobs"]["text_offset"]
    assert offsets[len(prompt)] == len(tokenizer.decode(prompt))  # the output's first token follows the prompt
    assert streamed[0]["text_offset"][:len(prompt) + 1] == offsets[:len(prompt) + 1]
    assert chunks[0]["prompt_logprobs"] == choice["prompt_logprobs"]
    status, raw = http(served.url + "/v1/completions", {**body, "stream": True, "max_tokens": 0,
                                                         "stream_options": {"include_usage": True}})
    events = [json.loads(e[6:]) for e in raw.decode().split("\n\n") if e.startswith("data: {")]
    assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == tokenizer.decode(prompt)
    assert events[-1]["usage"]["completion_tokens"] == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        expected = hf(torch.tensor([prompt])).logits[0].double().log_softmax(-1)
    got = choice["prompt_logprobs"]
    assert len(got) == len(prompt) and got[0] is None
    for t in range(1, len(prompt)):
        values, best = expected[t - 1].topk(2)
        assert {str(i) for i in best.tolist()} <= set(got[t]) and str(prompt[t]) in got[t]
        assert got[t][str(prompt[t])]["logprob"] == pytest.approx(float(expected[t - 1, prompt[t]]), abs=1e-4)
        for rank, (i, v) in enumerate(zip(best.tolist(), values.tolist()), 1):
            assert got[t][str(i)] == {"logprob": pytest.approx(v, abs=1e-4), "rank": rank,
                                      "decoded_token": tokenizer.decode([i])}
