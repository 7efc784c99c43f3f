"""The OpenAI protocol: request bodies parsed and validated into engine requests, and the response
objects (JSON, SSE chunks, logprobs, usage, errors).

Every field is checked here, where the request enters, with vLLM's semantics where OpenAI is
silent: a request the engine could not run is a 400 naming the field, never a failure inside a
step. Fields this server does not know are ignored with a warning in the log (as vLLM does);
fields that would change the answer if honoured (``echo``, a non-empty ``logit_bias``, ...) are
refused.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
import uuid
from dataclasses import dataclass
from typing import Any

from engine.sequence import MAX_LOGPROBS, MAX_SEED, SamplingParams

log = logging.getLogger(__name__)

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_N = 16  # choices per prompt
MAX_BODY_BYTES = 32 << 20
COMMON_FIELDS = {"model", "max_tokens", "temperature", "top_p", "top_k", "n", "best_of", "stop", "stop_token_ids",
                 "stream", "stream_options", "seed", "ignore_eos", "min_tokens", "presence_penalty",
                 "frequency_penalty", "repetition_penalty", "logprobs", "user"}
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "echo", "suffix", "logit_bias"}
CHAT_FIELDS = COMMON_FIELDS | {"messages", "max_completion_tokens", "top_logprobs", "logit_bias", "tools",
                               "tool_choice", "response_format"}
# fields whose non-default value would change the answer: refused rather than ignored
UNSUPPORTED = {"echo": (False, None), "suffix": (None, ""), "logit_bias": (None, {}), "tools": (None, []),
               "tool_choice": (None, "none"), "response_format": (None, {"type": "text"})}
_warned: set[str] = set()


class APIError(Exception):
    """An error answered as an OpenAI error object."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


def parse_json(raw: bytes) -> dict:
    """The request body as a JSON object; NaN and Infinity (not JSON) are refused."""
    def refuse(constant: str):
        raise ValueError(f"{constant} is not a JSON number")

    try:
        body = json.loads(raw, parse_constant=refuse)
    except (ValueError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    return body


_TYPE_NAMES = {int: "an integer", float: "a number", bool: "a boolean", str: "a string", list: "an array",
               dict: "an object"}


def field(body: dict, name: str, kind: type, default: Any = None) -> Any:
    """``body[name]`` checked to be a ``kind`` (a float may be given as an int; a bool is never a
    number); ``default`` when absent or null; else a 400 naming the field."""
    value = body.get(name)
    if value is None:
        return default
    types = (int, float) if kind is float else kind
    if not isinstance(value, types) or (kind is not bool and isinstance(value, bool)):
        raise APIError(400, f"'{name}' must be {_TYPE_NAMES[kind]}, got {json.dumps(value)[:50]}", param=name)
    return value


def _bounded_int(body: dict, name: str, low: int, high: int, default: int | None) -> int | None:
    value = field(body, name, int, default)
    if value is not None and not low <= value <= high:
        raise APIError(400, f"'{name}' must be an integer in [{low}, {high}], got {value}", param=name)
    return value


@dataclass
class Choice:
    """One engine request of an HTTP request: the choice ``index`` of prompt ``prompt_index``."""

    index: int
    prompt_index: int
    prompt_token_ids: list[int]
    params: SamplingParams


@dataclass
class GenerationRequest:
    """A parsed /v1/completions or /v1/chat/completions request."""

    choices: list[Choice]
    num_prompt_tokens: int   # every prompt counted once, whatever n
    stream: bool
    include_usage: bool
    chat: bool
    logprobs: bool           # return logprobs (chat: with top_logprobs alternatives)


class OpenAIProtocol:
    """Parses requests against one model: its ``tokenizer`` (for text prompts, chat templates and
    token strings), ``model_name``, ``max_model_len`` and ``vocab_size``."""

    def __init__(self, tokenizer, model_name: str, max_model_len: int, vocab_size: int):
        self.tokenizer, self.model_name = tokenizer, model_name
        self.max_model_len, self.vocab_size = max_model_len, vocab_size
        self._token_text: dict[int, str] = {}

    # ---- requests ----------------------------------------------------------------------------

    def completion(self, body: dict) -> GenerationRequest:
        self._check_fields(body, COMPLETION_FIELDS)
        logprobs = _bounded_int(body, "logprobs", 0, MAX_LOGPROBS, None)
        prompts = self._completion_prompts(body.get("prompt"))
        max_tokens = _bounded_int(body, "max_tokens", 1, MAX_SEED, None)
        return self._request(body, prompts, max_tokens, COMPLETION_DEFAULT_MAX_TOKENS, logprobs, chat=False)

    def chat(self, body: dict) -> GenerationRequest:
        self._check_fields(body, CHAT_FIELDS)
        logprobs = None
        if field(body, "logprobs", bool, False):
            logprobs = _bounded_int(body, "top_logprobs", 0, MAX_LOGPROBS, 0)
        elif body.get("top_logprobs") is not None:
            raise APIError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
        max_tokens = _bounded_int(body, "max_completion_tokens", 1, MAX_SEED,
                                  _bounded_int(body, "max_tokens", 1, MAX_SEED, None))
        prompt = self._encode(self._render_chat(body.get("messages")), "messages")
        return self._request(body, [prompt], max_tokens, None, logprobs, chat=True)

    def _request(self, body: dict, prompts: list[list[int]], max_tokens: int | None, default_max: int | None,
                 logprobs: int | None, chat: bool) -> GenerationRequest:
        self._check_model(body)
        n = _bounded_int(body, "n", 1, MAX_N, 1)
        best_of = _bounded_int(body, "best_of", 1, MAX_N, n)
        if best_of != n:
            raise APIError(400, f"'best_of' must equal 'n' ({n}) here, got {best_of}", param="best_of")
        params = self._sampling_params(body, logprobs)
        choices = []
        for p_index, prompt in enumerate(prompts):
            fitted = self._fit(prompt, params, max_tokens, default_max, "messages" if chat else "prompt")
            for j in range(n):
                seed = None if params.seed is None else (params.seed + j) % (MAX_SEED + 1)
                choices.append(Choice(p_index * n + j, p_index, prompt, dataclasses.replace(fitted, seed=seed)))
        stream = field(body, "stream", bool, False)
        include_usage = field(field(body, "stream_options", dict, {}), "include_usage", bool, False)
        return GenerationRequest(choices, sum(map(len, prompts)), stream, include_usage, chat, logprobs is not None)

    def _check_fields(self, body: dict, known: set[str]) -> None:
        for name, value in body.items():
            if name in UNSUPPORTED and value not in UNSUPPORTED[name]:
                raise APIError(400, f"'{name}' is not supported by this server", param=name)
            if name not in known and name not in _warned:
                _warned.add(name)
                log.warning("ignoring the request field %r, which this server does not know", name)

    def _check_model(self, body: dict) -> None:
        model = field(body, "model", str)
        if model is not None and model != self.model_name:
            raise APIError(404, f"the model {model!r} does not exist; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")

    def _sampling_params(self, body: dict, logprobs: int | None) -> SamplingParams:
        """The request's sampling fields as SamplingParams (max_tokens set per prompt later); a 400
        naming the field for a wrong type or value."""
        stop = [] if body.get("stop") is None else body["stop"]
        if not (isinstance(stop, str) or isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
            raise APIError(400, "'stop' must be a string or an array of strings", param="stop")
        stop_ids = field(body, "stop_token_ids", list, [])
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < self.vocab_size for t in stop_ids):
            raise APIError(400, f"'stop_token_ids' must hold token ids in [0, {self.vocab_size})",
                           param="stop_token_ids")
        try:
            return SamplingParams(
                temperature=field(body, "temperature", float, 1.0), top_p=field(body, "top_p", float, 1.0),
                top_k=field(body, "top_k", int, 0), stop=stop, stop_token_ids=stop_ids,
                ignore_eos=field(body, "ignore_eos", bool, False), seed=field(body, "seed", int),
                min_tokens=field(body, "min_tokens", int, 0),
                presence_penalty=field(body, "presence_penalty", float, 0.0),
                frequency_penalty=field(body, "frequency_penalty", float, 0.0),
                repetition_penalty=field(body, "repetition_penalty", float, 1.0), logprobs=logprobs,
                max_tokens=MAX_SEED)  # a placeholder bound: _fit sets each prompt's own
        except ValueError as e:  # "SamplingParams.<field> must be ..."
            name = str(e).removeprefix("SamplingParams.").split(" ", 1)[0]
            raise APIError(400, str(e).removeprefix("SamplingParams."), param=name) from None

    def _completion_prompts(self, prompt: Any) -> list[list[int]]:
        """A string, an array of strings, token ids or an array of token-id arrays -> token-id prompts."""
        def is_ids(p):
            return isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p)

        if isinstance(prompt, str) or is_ids(prompt):
            prompt = [prompt]
        elif not (isinstance(prompt, list) and prompt and all(isinstance(p, str) or is_ids(p) for p in prompt)):
            raise APIError(400, "'prompt' must be a string, an array of strings, an array of token ids or an "
                                "array of token-id arrays", param="prompt")
        for p in prompt:
            if not isinstance(p, str) and not all(0 <= t < self.vocab_size for t in p):
                raise APIError(400, f"prompt token ids must be in [0, {self.vocab_size})", param="prompt")
        return [self._encode(p, "prompt") if isinstance(p, str) else p for p in prompt]

    def _render_chat(self, messages: Any) -> str:
        """``messages`` through the tokenizer's chat template, with the assistant turn opened."""
        if not isinstance(messages, list) or not messages:
            raise APIError(400, "'messages' must be a non-empty array", param="messages")
        rendered = []
        for m in messages:
            content = m.get("content") if isinstance(m, dict) else None
            if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                                 and isinstance(p.get("text"), str) for p in content):
                content = "".join(p["text"] for p in content)
            if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(content, str)):
                raise APIError(400, "each message must be an object with a string 'role' and a 'content' string "
                                    "(or an array of text parts)", param="messages")
            rendered.append({"role": m["role"], "content": content})
        if not self.tokenizer.chat_template:
            raise APIError(400, "this model's tokenizer has no chat template; use /v1/completions",
                           param="messages", code="no_chat_template")
        try:
            return self.tokenizer.apply_chat_template(rendered, add_generation_prompt=True, tokenize=False)
        except Exception as e:  # jinja2 errors, e.g. a template's raise_exception for a role order
            raise APIError(400, f"the chat template failed: {e}", param="messages") from None

    def _encode(self, text: str, param: str) -> list[int]:
        token_ids = self.tokenizer.encode(text, add_special_tokens=False)  # as LLMEngine.add_request(str)
        if not token_ids:
            raise APIError(400, "the prompt encodes to no tokens", param=param)
        return token_ids

    def _fit(self, prompt: list[int], params: SamplingParams, max_tokens: int | None, default: int | None,
             param: str) -> SamplingParams:
        """``params`` whose max_tokens fits max_model_len after ``prompt``: the requested one if it
        fits (else a 400), or ``default`` (None: all the room) capped by the room left."""
        n, limit = len(prompt), self.max_model_len
        room = limit - n
        if room < 1:
            raise APIError(400, f"the prompt has {n} tokens; this model's maximum context length is {limit} "
                                f"tokens (max_model_len) for prompt and completion together",
                           param=param, code="context_length_exceeded")
        if max_tokens is not None and max_tokens > room:
            raise APIError(400, f"max_tokens={max_tokens} with a prompt of {n} tokens exceeds this model's maximum "
                                f"context length of {limit} tokens (max_model_len); at most {room} new tokens fit",
                           param="max_tokens", code="context_length_exceeded")
        fitted = max_tokens or min(default or room, room)
        if params.min_tokens > fitted:
            raise APIError(400, f"'min_tokens' ({params.min_tokens}) exceeds max_tokens ({fitted})",
                           param="min_tokens")
        return dataclasses.replace(params, max_tokens=fitted)

    # ---- responses ---------------------------------------------------------------------------

    def token_text(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.tokenizer.decode([token_id])
        return text

    def logprobs_object(self, chat: bool, items: list, text_offset: int = 0) -> dict | None:
        """OpenAI's logprobs object for ``items`` ((token id, logprob, [(id, logprob)]) per token):
        chat's ``content`` list, or completions' parallel lists with ``text_offset`` from
        ``text_offset`` on."""
        if chat:
            def entry(token_id, lp):
                text = self.token_text(token_id)
                return {"token": text, "logprob": _finite(lp), "bytes": list(text.encode())}
            return {"content": [{**entry(t, lp), "top_logprobs": [entry(i, v) for i, v in top]}
                                for t, lp, top in items]}
        tokens = [self.token_text(t) for t, _, _ in items]
        offsets, at = [], text_offset
        for text in tokens:
            offsets.append(at)
            at += len(text)
        return {"tokens": tokens, "token_logprobs": [_finite(lp) for _, lp, _ in items],
                "top_logprobs": [{self.token_text(i): _finite(v) for i, v in [(t, lp), *top]}
                                 for t, lp, top in items],
                "text_offset": offsets}

    def choice(self, chat: bool, index: int, text: str, finish_reason: str | None, logprobs: dict | None) -> dict:
        if chat:
            return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                    "finish_reason": finish_reason}
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}

    def delta(self, chat: bool, index: int, text: str, finish_reason: str | None, logprobs: dict | None,
              opening: bool = False) -> dict:
        if not chat:
            return self.choice(chat, index, text, finish_reason, logprobs)
        content = {"role": "assistant", "content": ""} if opening else {"content": text} if text else {}
        return {"index": index, "delta": content, "logprobs": logprobs, "finish_reason": finish_reason}

    def head(self, chat: bool, stream: bool) -> dict:
        kind = ("chat.completion.chunk" if stream else "chat.completion") if chat else "text_completion"
        return {"id": ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex, "object": kind,
                "created": int(time.time()), "model": self.model_name}


def usage(num_prompt_tokens: int, num_completion_tokens: int, num_draft_tokens: int = 0,
          num_accepted_tokens: int = 0) -> dict:
    """OpenAI's usage object; with speculative decoding's drafts, OpenAI's names for them
    (predicted outputs): ``completion_tokens_details.accepted_prediction_tokens`` /
    ``rejected_prediction_tokens``."""
    counts = {"prompt_tokens": num_prompt_tokens, "completion_tokens": num_completion_tokens,
              "total_tokens": num_prompt_tokens + num_completion_tokens}
    if num_draft_tokens:
        counts["completion_tokens_details"] = {"accepted_prediction_tokens": num_accepted_tokens,
                                               "rejected_prediction_tokens": num_draft_tokens - num_accepted_tokens}
    return counts


def _finite(x: float) -> float:
    """JSON has no -Infinity: a token the model gives no probability gets the lowest float."""
    return x if math.isfinite(x) else -3.4028234663852886e38
