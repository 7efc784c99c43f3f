"""The OpenAI protocol: request bodies parsed and validated into engine requests, and the response
objects (JSON, SSE chunks, logprobs, usage, errors).

A request arrives typed (``openai_types``: every field's type, the lists' caps and the field
policy checked before this module reads it); what needs the model is checked here, where the
request enters (on a request worker thread, never the event loop), with vLLM's semantics where
OpenAI is silent: a request the engine could not run is a 400 naming the field, never a failure
inside a step. Every check is linear and no error echoes a large input back. A request's cost is
bounded before it is paid: a chat's messages and tools are counted against the longest prompt
the context can hold before any schema is checked or the template rendered, and the work stops
between its stages once its client has gone (``request_body.stop_if_client_gone``).
``reasoning_effort`` reaches the chat template (``"none"`` turns thinking off where the template
reads ``enable_thinking``). One request runs at most ``RequestLimits.sequences_per_request``
sequences (prompts x n).

Completions take ``echo`` (the prompt's text, its token ids decoded, before each choice's text;
with ``logprobs: N`` the choice's logprobs cover the prompt tokens first, the first one with a
null logprob and no alternatives, as OpenAI's legacy completions give them) and vLLM's
``prompt_logprobs: N`` (a ``prompt_logprobs`` list on each choice: per prompt token null for the
first, else ``{"token id": {"logprob", "rank", "decoded_token"}}`` for the token and the N most
likely ones; ranks count from 1 among the N, the token's own rank is null when it is not among
them). ``max_tokens: 0`` with ``echo`` (lm-eval's loglikelihood) answers the prompt alone: the
engine runs one token, which the answer drops (text, logprobs and usage).

vLLM's sampling extensions are honoured: ``min_p``, ``logit_bias`` (OpenAI's ``{"token id": bias}``,
ids in [0, vocab), biases in [-100, 100]), ``allowed_token_ids``, ``bad_words`` (each word banned
as it tokenises with and without a leading space), ``include_stop_str_in_output``,
``skip_special_tokens`` and, for completions, ``add_special_tokens`` (the prompt encoded with the
tokenizer's special tokens).

Chat requests may carry ``tools`` (rendered by the chat template, the output read by the
server's tool-call parser; ``tool_choice`` ``"required"`` or a named function forces one call
through the structured-output machinery, so its arguments always follow the function's
``parameters``), assistant ``tool_calls`` and ``tool`` messages in their history, and
``chat_template_kwargs`` for the template (``enable_thinking``). Any request may constrain its
output (``response_format``, ``structured_outputs``: ``engine.scheduling.structured``). Sampling fields a
request leaves out take the checkpoint's ``generation_config.json`` values, then OpenAI's.
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

from engine.core.sampling_defaults import OPENAI, sampling_defaults
from engine.entrypoints.server.chat_output import ChatParsing
from engine.entrypoints.server.openai_types import (
    ChatMessage,
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    SamplingFields,
    TokenizeRequest,
)
from engine.entrypoints.server.request_body import APIError, RequestLimits, shown, stop_if_client_gone
from engine.entrypoints.server.tool_parsers import default_tool_parser, tool_parser
from engine.entrypoints.server.tools import ToolRequest, call_schema, messages_for_template, validate_tools
from engine.scheduling.sequence import MAX_SEED, SamplingParams
from engine.scheduling.structured.spec import StructuredOutputError, StructuredSpec, spec_from_request, tool_call_spec

log = logging.getLogger(__name__)

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
# chat_template_kwargs the server sets itself
RESERVED_TEMPLATE_KWARGS = {"conversation", "messages", "tools", "add_generation_prompt", "tokenize",
                            "continue_final_message", "return_dict", "chat_template"}


class ContextLengthExceeded(APIError):
    """A prompt, or a prompt with the output asked for, that the context cannot hold (400,
    ``context_length_exceeded``), with its numbers, so an API can word it as its clients read it
    (Anthropic's "prompt is too long: N tokens > M maximum", on which Claude Code compacts):
    ``prompt_tokens`` (for a prompt refused by its characters before it was tokenized, the fewest
    tokens those characters can encode to), ``max_tokens`` (the output asked for; None: the prompt
    alone does not fit) and ``max_model_len``."""

    def __init__(self, message: str, param: str, prompt_tokens: int, max_tokens: int | None, max_model_len: int):
        super().__init__(400, message, param=param, code="context_length_exceeded")
        self.prompt_tokens, self.max_tokens, self.max_model_len = prompt_tokens, max_tokens, max_model_len


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
    structured: StructuredSpec | None = None   # what the output must match (compiled before it runs)
    parsing: ChatParsing | None = None         # chat: how the output is read (None: as generated)
    echo: bool = False       # completions: the prompt (and its logprobs) before each choice's output
    num_logprobs: int = 0    # completions: the alternatives per logprobs token
    prompt_logprobs: int | None = None         # completions: vLLM's prompt_logprobs list, N alternatives
    drop_output: bool = False                  # max_tokens 0 (only with echo): the one token run is dropped


class OpenAIProtocol:
    """Reads typed requests against one model: its ``tokenizer`` (for text prompts, chat templates
    and token strings), ``model_name``, ``max_model_len`` and ``vocab_size``. ``tool_call_parser``
    (``engine.entrypoints.server.tool_parsers``; "none": tools are refused; None: the default of the
    checkpoint's ``architecture``, read when a request first uses tools) reads tool calls,
    ``reasoning_parser`` (None: none) splits reasoning off; ``chat_template`` replaces the
    tokenizer's; ``generation_config`` is the checkpoint's (its sampling values are the defaults,
    ``engine.core.sampling_defaults``); ``limits`` caps what a request may hold (its
    ``sequences_per_request`` resolved).

    Its methods are called from any thread (the server's request workers): they keep no state
    but a cache of token texts. A prompt longer than ``max_prompt_chars`` characters
    (``max_model_len`` times the longest token's characters: it cannot fit, whatever it encodes
    to) is refused before it is encoded, and a chat's messages and tools before they are checked
    or rendered."""

    def __init__(self, tokenizer, model_name: str, max_model_len: int, vocab_size: int, *,
                 tool_call_parser: str | None = "none", reasoning_parser: str | None = None,
                 chat_template: str | None = None, generation_config: dict | None = None, architecture: str = "",
                 limits: RequestLimits = RequestLimits(sequences_per_request=1024)):
        self.tokenizer, self.model_name = tokenizer, model_name
        self.max_model_len, self.vocab_size = max_model_len, vocab_size
        self.tool_call_parser, self.reasoning_parser = tool_call_parser, reasoning_parser
        self.architecture = architecture
        self.chat_template = chat_template
        self.defaults = sampling_defaults(generation_config or {}, OPENAI)
        if limits.sequences_per_request is None:
            raise ValueError("limits.sequences_per_request must be resolved (a number)")
        self.limits = limits
        self.max_prompt_chars = max_model_len * max(map(len, tokenizer.get_vocab()), default=1)
        self._token_text: dict[int, str] = {}

    # ---- requests ----------------------------------------------------------------------------

    def completion(self, req: CompletionRequest) -> GenerationRequest:
        echo = bool(req.echo)
        if req.max_tokens == 0 and not echo:
            raise APIError(400, "'max_tokens' must be at least 1 (0 only with 'echo')", param="max_tokens")
        prompts = self._completion_prompts(req.prompt, bool(req.add_special_tokens))
        structured = self._structured(req) if req.constrained else None
        max_tokens = req.max_tokens
        gen = self._request(req, prompts, 1 if max_tokens == 0 else max_tokens, COMPLETION_DEFAULT_MAX_TOKENS,
                            req.logprobs, chat=False, structured=structured)
        asked = [n for n in (req.prompt_logprobs, req.logprobs if echo else None) if n is not None]
        for choice in gen.choices:  # the engine computes the most alternatives either asks
            choice.params = dataclasses.replace(choice.params, prompt_logprobs=max(asked) if asked else None)
        return dataclasses.replace(gen, echo=echo, num_logprobs=req.logprobs or 0,
                                   prompt_logprobs=req.prompt_logprobs, drop_output=max_tokens == 0)

    def chat(self, req: ChatRequest) -> GenerationRequest:
        logprobs = None
        if req.logprobs:
            logprobs = req.top_logprobs or 0
        elif req.top_logprobs is not None:
            raise APIError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
        max_param = "max_tokens" if req.max_completion_tokens is None else "max_completion_tokens"
        max_tokens = getattr(req, max_param)
        self._check_size(req)
        if self.reasoning_parser is not None or req.uses_agent_features:
            rendered, structured, parsing = self._agent_chat(req)
        else:
            rendered, structured, parsing = self._render_chat(req.messages), None, None
        return self._request(req, [self._encode(rendered, "messages")], max_tokens, None, logprobs, chat=True,
                             structured=structured, parsing=parsing, max_param=max_param)

    def _check_size(self, req: ChatRequest) -> None:
        """The messages' text and the tools' JSON, which the template writes into the prompt, fit
        ``max_prompt_chars``: else a 400 before anything is checked or rendered (context_length_exceeded)."""
        chars = sum(map(_chars, req.messages))
        tools = len(json.dumps([t.model_dump(exclude_none=True) for t in req.tools])) if req.tools else 0
        if chars + tools > self.max_prompt_chars:
            what = "messages and tools hold" if tools else "messages hold"
            raise self._too_many_chars(f"the {what} {chars + tools} characters", chars + tools,
                                       "tools" if tools > chars else "messages")

    def _agent_chat(self, req: ChatRequest) -> tuple[str, StructuredSpec | None, ChatParsing]:
        """A chat request with tools, a tool history, a constraint or template arguments (or any
        chat request on a server with a reasoning parser): its rendered prompt, what its output
        must match (a forced tool call's spec, or the request's own), and how its output is read."""
        stop_if_client_gone()
        tools = self._tool_request(req)
        messages = messages_for_template([m.model_dump(exclude_none=True) for m in req.messages])
        rendered = self._render_chat(messages, tools.tools, self._template_kwargs(req))
        structured = self._structured(req) if req.constrained else None
        if tools.tool_choice == "required":
            if structured is not None:
                raise APIError(400, "a forced tool call ('tool_choice') and 'response_format' / "
                                    "'structured_outputs' cannot constrain one output together", param="tool_choice")
            parser = tool_parser(self._tool_call_parser())
            structured = tool_call_spec(parser.call_prefix, call_schema(tools, parser.arguments_key),
                                        parser.call_suffix)
        reads_tools = bool(tools.tools) and tools.tool_choice != "none"
        return rendered, structured, ChatParsing(self._tool_call_parser() if reads_tools else None,
                                                 self.reasoning_parser, rendered, tool_names=tools.names,
                                                 forced=tools.tool_choice == "required",
                                                 parallel_tool_calls=tools.parallel_tool_calls)

    def _template_kwargs(self, req: ChatRequest) -> dict:
        """The chat template's arguments: ``chat_template_kwargs``, with ``reasoning_effort`` (as
        templates such as gpt-oss's read it) and, for ``"none"``, ``enable_thinking: false`` where
        the template reads that (Qwen3's); what ``chat_template_kwargs`` sets wins."""
        kwargs = dict(req.chat_template_kwargs or {})
        effort = req.reasoning_effort
        if effort is None:
            return kwargs
        template = self.chat_template or self.tokenizer.chat_template
        if effort == "none" and isinstance(template, str) and "enable_thinking" in template:
            kwargs.setdefault("enable_thinking", False)
        return {"reasoning_effort": effort, **kwargs}

    def _tool_call_parser(self) -> str:
        """The tool-call parser's name: the one given, else the architecture's default."""
        return default_tool_parser(self.architecture) if self.tool_call_parser is None else self.tool_call_parser

    def _tool_request(self, req: ChatRequest) -> ToolRequest:
        """The request's tool fields, checked; tools to read need a tool-call parser."""
        tools = validate_tools(req)
        if tools.tools and tools.tool_choice != "none" and self._tool_call_parser() == "none":
            raise APIError(400, "this server reads no tool calls from the model's output: start it with "
                                "--tool-call-parser (hermes for Qwen, llama3_json for Llama), or send "
                                "tool_choice 'none'", param="tools")
        return tools

    @staticmethod
    def _structured(req: SamplingFields) -> StructuredSpec | None:
        """The request's ``response_format`` / ``structured_outputs`` as a spec (a 400 naming the field)."""
        try:
            return spec_from_request({"response_format": req.response_format,
                                      "structured_outputs": req.structured_outputs})
        except StructuredOutputError as e:
            raise APIError(400, str(e), param=e.param) from None

    def _request(self, req: SamplingFields, prompts: list[list[int]], max_tokens: int | None,
                 default_max: int | None, logprobs: int | None, chat: bool, structured: StructuredSpec | None = None,
                 parsing: ChatParsing | None = None, max_param: str = "max_tokens") -> GenerationRequest:
        """The engine requests of ``prompts``: ``n`` choices each, their sampling parameters with
        ``max_tokens`` (the request's field ``max_param``; None: ``default_max``) fitted to the context."""
        self._check_model(req.model)
        n = req.n or 1
        best_of = req.best_of or n
        if best_of != n:
            raise APIError(400, f"'best_of' must equal 'n' ({n}) here, got {best_of}", param="best_of")
        cap = self.limits.sequences_per_request
        if len(prompts) * n > cap:
            raise APIError(400, f"the request asks for {len(prompts) * n} sequences ({len(prompts)} prompts x n={n}); "
                                f"this server takes at most {cap} (serve --max-sequences-per-request)",
                           param="n" if n > 1 else "prompt", code="too_many_items")
        params = dataclasses.replace(self._sampling_params(req, logprobs), structured=structured)
        choices = []
        for p_index, prompt in enumerate(prompts):
            fitted = self._fit(prompt, params, max_tokens, default_max, "messages" if chat else "prompt", max_param)
            for j in range(n):
                seed = None if params.seed is None else (params.seed + j) % (MAX_SEED + 1)
                choices.append(Choice(p_index * n + j, p_index, prompt, dataclasses.replace(fitted, seed=seed)))
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return GenerationRequest(choices, sum(map(len, prompts)), bool(req.stream), include_usage, chat,
                                 logprobs is not None, structured, parsing)

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"the model {shown(model)} does not exist; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")

    def _sampling_params(self, req: SamplingFields, logprobs: int | None) -> SamplingParams:
        """The request's sampling fields as SamplingParams (max_tokens set per prompt later); a 400
        naming the field for a value the engine refuses."""
        stop: dict[str, None] = {}  # in order, each once
        for value in (req.stop, req.until):
            stop.update(dict.fromkeys([] if value is None else [value] if isinstance(value, str) else value))
        stop_ids = req.stop_token_ids or []
        if not all(0 <= t < self.vocab_size for t in stop_ids):
            raise APIError(400, f"'stop_token_ids' must hold token ids in [0, {self.vocab_size})",
                           param="stop_token_ids")
        defaults = self.defaults

        def given(value, default):
            return default if value is None else value

        try:
            return SamplingParams(
                min_p=given(req.min_p, 0.0), logit_bias=self._logit_bias(req),
                allowed_token_ids=self._allowed_token_ids(req), bad_words_token_ids=self._bad_words(req),
                include_stop_str_in_output=bool(req.include_stop_str_in_output),
                skip_special_tokens=given(req.skip_special_tokens, True),
                temperature=(0.0 if req.do_sample is False  # HF-style greedy
                             else given(req.temperature, defaults["temperature"])),
                top_p=given(req.top_p, defaults["top_p"]), top_k=given(req.top_k, defaults["top_k"]),
                stop=list(stop), stop_token_ids=list(stop_ids), ignore_eos=bool(req.ignore_eos), seed=req.seed,
                min_tokens=given(req.min_tokens, 0), presence_penalty=given(req.presence_penalty, 0.0),
                frequency_penalty=given(req.frequency_penalty, 0.0),
                repetition_penalty=given(req.repetition_penalty, defaults["repetition_penalty"]),
                logprobs=logprobs,
                max_tokens=MAX_SEED)  # a placeholder bound: _fit sets each prompt's own
        except ValueError as e:  # "SamplingParams.<field> must be ..."
            name = str(e).removeprefix("SamplingParams.").split(" ", 1)[0]
            name = {"bad_words_token_ids": "bad_words"}.get(name, name)
            raise APIError(400, str(e).removeprefix("SamplingParams."), param=name) from None

    def _token_id(self, value: Any) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < self.vocab_size

    def _logit_bias(self, req: SamplingFields) -> tuple[tuple[int, float], ...]:
        """OpenAI's ``{"token id": bias}``: ids (decimal strings) in [0, vocab)."""
        pairs = []
        for key, bias in (req.logit_bias or {}).items():
            token_id = int(key) if key.isascii() and key.isdigit() else None
            if not self._token_id(token_id):
                raise APIError(400, f"'logit_bias' keys must be token ids in [0, {self.vocab_size}), got "
                                    f"{shown(key)}", param="logit_bias")
            pairs.append((token_id, float(bias)))
        return tuple(pairs)

    def _allowed_token_ids(self, req: SamplingFields) -> tuple[int, ...] | None:
        allowed = req.allowed_token_ids
        if allowed is not None and not all(map(self._token_id, allowed)):
            raise APIError(400, f"'allowed_token_ids' must hold token ids in [0, {self.vocab_size})",
                           param="allowed_token_ids")
        return None if allowed is None else tuple(allowed)

    def _bad_words(self, req: SamplingFields) -> tuple[tuple[int, ...], ...]:
        """Each bad word's token ids as it tokenises alone and after a space (vLLM's rule: banned at
        the start of the text and inside it); a word that tokenises to nothing is a 400."""
        sequences: dict[tuple[int, ...], None] = {}  # in order, each once
        for word in req.bad_words or []:
            for text in (word.lstrip(), " " + word.lstrip()):
                ids = tuple(self.tokenizer.encode(text, add_special_tokens=False))
                if not ids:
                    raise APIError(400, f"the bad word {shown(word)} tokenises to nothing", param="bad_words")
                sequences[ids] = None
        return tuple(sequences)

    def _completion_prompts(self, prompt: str | list, add_special_tokens: bool = False) -> list[list[int]]:
        """A string, an array of strings, token ids or an array of token-id arrays -> token-id prompts
        (strings encoded with the tokenizer's special tokens when ``add_special_tokens``)."""
        prompts = [prompt] if isinstance(prompt, str) or isinstance(prompt[0], int) else prompt
        for p in prompts:
            if not isinstance(p, str) and not all(0 <= t < self.vocab_size for t in p):
                raise APIError(400, f"prompt token ids must be in [0, {self.vocab_size})", param="prompt")
        return [self._encode(p, "prompt", add_special_tokens) if isinstance(p, str) else p for p in prompts]

    def _render_chat(self, messages: list[ChatMessage] | list[dict], tools: list[dict] | None = None,
                     template_kwargs: dict | None = None) -> str:
        """``messages`` (and ``tools``) through the chat template, with the assistant turn opened;
        ``template_kwargs`` go to the template (``enable_thinking``, ...). Roles are OpenAI's
        (``developer`` is rendered as ``system``); content is a string or an array of text parts
        (null for an assistant message with tool_calls)."""
        stop_if_client_gone()
        rendered = []
        for i, m in enumerate(messages):
            m = m.model_dump(exclude_none=True) if isinstance(m, ChatMessage) else m
            content = m.get("content")
            if isinstance(content, list):
                content = "".join(p["text"] for p in content)
            if not (isinstance(content, str) or content is None and m["role"] == "assistant" and m.get("tool_calls")):
                raise APIError(400, f"'messages[{i}].content' must be a string or an array of text parts (null for "
                                    "an assistant message with tool_calls)", param=f"messages[{i}].content")
            role = "system" if m["role"] == "developer" else m["role"]
            rendered.append({**m, "role": role, "content": content})
        template_kwargs = template_kwargs or {}
        bad = sorted(set(template_kwargs) & RESERVED_TEMPLATE_KWARGS)
        if bad:
            raise APIError(400, f"'chat_template_kwargs.{bad[0]}' is set by the server", param="chat_template_kwargs")
        if not (self.chat_template or self.tokenizer.chat_template):
            raise APIError(400, "this model's tokenizer has no chat template; use /v1/completions",
                           param="messages", code="no_chat_template")
        try:
            return self.tokenizer.apply_chat_template(rendered, tools=tools or None, chat_template=self.chat_template,
                                                      add_generation_prompt=True, tokenize=False, **template_kwargs)
        except Exception as e:  # jinja2 errors, e.g. a template's raise_exception for a role order
            raise APIError(400, f"the chat template failed: {shown(str(e), 300)}", param="messages") from None

    def _encode(self, text: str, param: str, add_special_tokens: bool = False) -> list[int]:
        """``text`` as token ids (a 400 when it cannot fit or encodes to nothing)."""
        if len(text) > self.max_prompt_chars:
            raise self._too_many_chars(f"the prompt has {len(text)} characters", len(text), param)
        stop_if_client_gone()
        token_ids = self.tokenizer.encode(text, add_special_tokens=add_special_tokens)  # as LLMEngine.add_request(str)
        if not token_ids:
            raise APIError(400, "the prompt encodes to no tokens", param=param)
        return token_ids

    def _too_many_chars(self, what: str, chars: int, param: str) -> ContextLengthExceeded:
        """The error of a prompt of ``chars`` characters, more than ``max_prompt_chars``: it
        encodes to at least ``chars`` / the longest token's characters tokens, more than fit."""
        longest = self.max_prompt_chars // self.max_model_len
        return ContextLengthExceeded(f"{what}: more than this model's maximum context length of "
                                     f"{self.max_model_len} tokens (max_model_len) can hold", param,
                                     -(-chars // longest), None, self.max_model_len)

    def _fit(self, prompt: list[int], params: SamplingParams, max_tokens: int | None, default: int | None,
             param: str, max_param: str) -> SamplingParams:
        """``params`` whose max_tokens fits max_model_len after ``prompt`` (the field ``param``): the
        requested one (the field ``max_param``) if it fits (else a 400), or ``default`` (None: all
        the room) capped by the room left."""
        n, limit = len(prompt), self.max_model_len
        room = limit - n
        if room < 1:
            raise ContextLengthExceeded(f"the prompt has {n} tokens; this model's maximum context length is {limit} "
                                        f"tokens (max_model_len) for prompt and completion together", param, n, None,
                                        limit)
        if max_tokens is not None and max_tokens > room:
            raise ContextLengthExceeded(f"'{max_param}' {max_tokens} with a prompt of {n} tokens exceeds this "
                                        f"model's maximum context length of {limit} tokens (max_model_len); at most "
                                        f"{room} new tokens fit", max_param, n, max_tokens, limit)
        fitted = max_tokens or min(default or room, room)
        if params.min_tokens > fitted:
            raise APIError(400, f"'min_tokens' ({params.min_tokens}) exceeds max_tokens ({fitted})",
                           param="min_tokens")
        return dataclasses.replace(params, max_tokens=fitted)

    def tokenize(self, req: TokenizeRequest) -> list[int]:
        """A /tokenize request, ``{"prompt": text}`` (encoded as a completion's prompt; with
        ``add_special_tokens``) or ``{"messages": [...]}`` (rendered as a chat's), as token ids."""
        self._check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give either 'prompt' or 'messages'", param="prompt")
        if req.messages is not None:
            return self._encode(self._render_chat(req.messages), "messages")
        return self._encode(req.prompt, "prompt", bool(req.add_special_tokens))

    def detokenize(self, req: DetokenizeRequest) -> str:
        """A /detokenize request, ``{"tokens": [ids]}``, as text."""
        self._check_model(req.model)
        if not all(map(self._token_id, req.tokens)):
            raise APIError(400, f"'tokens' must be an array of token ids in [0, {self.vocab_size})", param="tokens")
        return self.tokenizer.decode(req.tokens)

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
        return {"tokens": tokens, "token_logprobs": [None if lp is None else _finite(lp) for _, lp, _ in items],
                "top_logprobs": [None if lp is None else {self.token_text(i): _finite(v) for i, v in [(t, lp), *top]}
                                 for t, lp, top in items],
                "text_offset": offsets}

    def echoed_logprobs(self, prompt_token_ids: list[int], prompt_logprobs: list, n: int) -> list:
        """The prompt's tokens as logprobs items for an echo: the first with a None logprob (no
        alternatives), the others with their ``n`` most likely tokens."""
        return [(prompt_token_ids[0], None, [])] + [(t, lp, top[:n]) for t, lp, top in prompt_logprobs[1:]]

    def prompt_logprobs_object(self, prompt_logprobs: list, n: int) -> list:
        """vLLM's ``prompt_logprobs``: per prompt token None (the first), else {token id string:
        {"logprob", "rank", "decoded_token"}} for the token and its ``n`` most likely tokens (rank:
        1-based among those; the token's own rank is None when it is not among them)."""
        def entry(token_id, lp, rank):
            return {"logprob": _finite(lp), "rank": rank, "decoded_token": self.token_text(token_id)}

        out = [None]
        for t, lp, top in prompt_logprobs[1:]:
            ranks = {i: r for r, (i, _) in enumerate(top[:n], 1)}
            out.append({str(t): entry(t, lp, ranks.get(t)),
                        **{str(i): entry(i, v, ranks[i]) for i, v in top[:n] if i != t}})
        return out

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
          num_accepted_tokens: int = 0, num_cached_tokens: int = 0) -> dict:
    """OpenAI's usage object, with the prompt tokens found in the prefix cache
    (``prompt_tokens_details.cached_tokens``); with speculative decoding's drafts, OpenAI's names
    for them (predicted outputs): ``completion_tokens_details.accepted_prediction_tokens`` /
    ``rejected_prediction_tokens``."""
    counts = {"prompt_tokens": num_prompt_tokens, "completion_tokens": num_completion_tokens,
              "total_tokens": num_prompt_tokens + num_completion_tokens,
              "prompt_tokens_details": {"cached_tokens": num_cached_tokens}}
    if num_draft_tokens:
        counts["completion_tokens_details"] = {"accepted_prediction_tokens": num_accepted_tokens,
                                               "rejected_prediction_tokens": num_draft_tokens - num_accepted_tokens}
    return counts


def _chars(message: ChatMessage) -> int:
    """The characters of a message's text and tool-call arguments (what its rendering writes at least)."""
    content = message.content
    chars = len(content) if isinstance(content, str) else sum(len(p.text) for p in content or [])
    return chars + sum(len(call.function.arguments) for call in message.tool_calls or [])


def _finite(x: float) -> float:
    """JSON has no -Infinity: a token the model gives no probability gets the lowest float."""
    return x if math.isfinite(x) else -3.4028234663852886e38
