"""The OpenAI API's request bodies as typed models: ``/v1/completions`` (``CompletionRequest``),
``/v1/chat/completions`` (``ChatRequest``), ``/tokenize`` and ``/detokenize``.

Each model checks every field's type, the lists' caps and the bounds that need no model (n,
logprobs, max_tokens ...); what needs the model or the tokenizer (token ids in the vocabulary,
sampling values, the context length, tool semantics) is the protocol's (``OpenAIProtocol``).
The field policy (docs/agents.md, "Fields"): OpenAI's fields that mean nothing to a server like
this one are ``Ignored``, as OpenAI-compatible servers do; fields this server knows and does not
implement are ``refused`` unless they ask for nothing (``suffix``, a ``priority`` other than 0,
chat's ``echo`` ...); any other field is a 400 naming it (a typo is caught).
"""
from __future__ import annotations

import re
from typing import Annotated, Any, Literal, Union

from pydantic import AfterValidator, BeforeValidator, ConfigDict, Field, WrapValidator
from pydantic_core import PydanticCustomError

from engine.entrypoints.server.request_model import Ignored, LenientModel, RequestModel, at_most, capped, refused
from engine.scheduling.sequence import MAX_BAD_WORDS, MAX_LOGPROBS, MAX_SEED, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS

MAX_N = 16  # choices per prompt
MAX_BAD_WORD_CHARS = 256
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")  # OpenAI's values
NAME_RULE = "1 to 64 letters, digits, '_' or '-'"


def _matching(pattern: str, rule: str) -> AfterValidator:
    """A string that ``pattern`` matches whole; else "must be ``rule``"."""
    compiled = re.compile(pattern)

    def check(text: str) -> str:
        if not compiled.fullmatch(text):
            raise PydanticCustomError("string_rule", "must be " + rule)
        return text

    return AfterValidator(check)


# names and ids as chat templates write them into the prompt ("name": "{{ name }}"): one holding quotes or a
# template's special tokens would write turns of its own
FunctionName = Annotated[str, _matching(r"[a-zA-Z0-9_-]{1,64}", NAME_RULE)]
CallId = Annotated[str, _matching(r"[a-zA-Z0-9_.:-]{1,256}", "1 to 256 letters, digits, '_', '-', '.' or ':'")]
TokenIds = Annotated[list[int], Field(min_length=1, fail_fast=True)]  # ids in the vocabulary: the protocol's check
Stop = Annotated[Union[str, list[str]], at_most(MAX_STOP_STRINGS, "stop strings")]
Count = Annotated[int, Field(ge=0, le=MAX_LOGPROBS)]


class StreamOptions(LenientModel):
    include_usage: bool | None = None


class SamplingFields(RequestModel):
    """The sampling fields completions and chat share (vLLM's extensions included)."""

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] | None = None
    best_of: Annotated[int, Field(ge=1, le=MAX_N)] | None = None
    stop: Stop | None = None
    until: Stop | None = None  # lm-eval's harness sends its stop strings as ``until``
    stop_token_ids: Annotated[list[int], Field(fail_fast=True), at_most(MAX_STOP_TOKEN_IDS, "token ids")] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    seed: int | None = None
    ignore_eos: bool | None = None
    min_tokens: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    do_sample: bool | None = None  # HF-style: false is greedy
    logit_bias: Annotated[dict[str, Annotated[float, Field(ge=-100, le=100)]], capped("logit_bias")] | None = None
    allowed_token_ids: Annotated[list[int], Field(min_length=1, fail_fast=True),
                                 capped("allowed_token_ids")] | None = None
    bad_words: Annotated[list[Annotated[str, Field(max_length=MAX_BAD_WORD_CHARS)]],
                         at_most(MAX_BAD_WORDS, "strings")] | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    response_format: dict[str, Any] | None = None     # read by the structured-output spec
    structured_outputs: dict[str, Any] | None = None
    user: Ignored = None
    metadata: Ignored = None
    store: Ignored = None
    service_tier: Ignored = None
    safety_identifier: Ignored = None
    prompt_cache_key: Ignored = None
    prompt_cache_retention: Ignored = None
    verbosity: Ignored = None
    prediction: Ignored = None
    priority: refused(0) = None
    lora_path: refused() = None
    audio: refused() = None
    web_search_options: refused() = None
    functions: refused() = None
    function_call: refused() = None
    suffix: refused("") = None

    @property
    def constrained(self) -> bool:
        """The request asks to constrain its output (``response_format`` other than text, ``structured_outputs``)."""
        return self.structured_outputs is not None or self.response_format not in (None, {"type": "text"})


PROMPT_RULE = ("must be a string, an array of strings, an array of token ids or an array of token-id arrays "
               "(not a mix of strings and token ids)")


def _prompt(value: Any, handler, info) -> Any:
    """A completion's prompt: its shape checked as one (the alternatives named together), an
    array of prompts capped by ``RequestLimits.prompts`` before any is read."""
    prompts = isinstance(value, list) and value and not all(isinstance(t, int) for t in value)
    if prompts and len(value) > info.context["limits"].prompts:
        raise PydanticCustomError("too_many_items", "holds {count} items; this server takes at most {cap} "
                                                    "(serve --max-prompts)",
                                  {"count": len(value), "cap": info.context["limits"].prompts})
    try:
        return handler(value)
    except ValueError:
        raise PydanticCustomError("prompt_shape", PROMPT_RULE) from None


Prompt = Annotated[Union[str, Annotated[list[str], Field(min_length=1)], TokenIds,
                         Annotated[list[TokenIds], Field(min_length=1)]], WrapValidator(_prompt)]


class CompletionRequest(SamplingFields):
    prompt: Prompt
    max_tokens: Annotated[int, Field(ge=0, le=MAX_SEED)] | None = None  # 0 only with echo
    logprobs: Count | None = None
    echo: bool | None = None
    prompt_logprobs: Count | None = None
    add_special_tokens: bool | None = None


class TextPart(LenientModel):
    type: Literal["text"]
    text: str


class CalledFunction(LenientModel):
    name: FunctionName
    arguments: str  # a JSON object: the tool checks'


class MessageToolCall(LenientModel):
    id: CallId
    type: Literal["function"] = "function"
    function: CalledFunction


def _history_calls(calls: Any, info) -> Any:
    """A message's tool calls, counted with those of the messages before it (in the validation
    context): past ``RequestLimits.history_tool_calls`` in all, a 400 before they are read."""
    if isinstance(calls, list):
        count = info.context["history_tool_calls"] = info.context.get("history_tool_calls", 0) + len(calls)
        cap = info.context["limits"].history_tool_calls
        if count > cap:
            raise PydanticCustomError("too_many_items", "the messages hold more than {cap} tool calls in all "
                                                        "(serve --max-history-tool-calls)", {"cap": cap})
    return calls


class ChatMessage(LenientModel):
    """A chat message; keys other than these go to the chat template as they are."""

    model_config = ConfigDict(extra="allow", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]  # developer is rendered as system
    content: Annotated[Union[str, list[TextPart]], capped("content_parts")] | None = None
    tool_calls: Annotated[list[MessageToolCall], BeforeValidator(_history_calls)] | None = None
    tool_call_id: str | None = None
    name: str | None = None


class FunctionDefinition(RequestModel):
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None   # a JSON schema of type object: the tool checks'
    strict: bool | None = None


class Tool(RequestModel):
    type: Literal["function"]
    function: FunctionDefinition


class ToolChoiceFunction(RequestModel):
    name: str


class NamedToolChoice(RequestModel):
    type: Literal["function"]
    function: ToolChoiceFunction


Messages = Annotated[list[ChatMessage], capped("messages"), Field(min_length=1)]


class ChatRequest(SamplingFields):
    messages: Messages
    max_tokens: Annotated[int, Field(ge=1, le=MAX_SEED)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1, le=MAX_SEED)] | None = None
    logprobs: bool | None = None
    top_logprobs: Count | None = None
    tools: Annotated[list[Tool], capped("tools")] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: Literal[REASONING_EFFORTS] | None = None
    modalities: list[Literal["text"]] | None = None  # this server writes text only
    echo: refused(False) = None
    add_special_tokens: refused(False) = None
    prompt_logprobs: refused() = None

    @property
    def uses_agent_features(self) -> bool:
        """Tools, a tool history, a constraint, template arguments or a reasoning effort."""
        history = any(m.role == "tool" or m.tool_calls for m in self.messages)
        return history or any(getattr(self, name) is not None for name in (
            "tools", "tool_choice", "parallel_tool_calls", "chat_template_kwargs", "response_format",
            "structured_outputs", "reasoning_effort"))


class TokenizeRequest(RequestModel):
    """``{"prompt"}`` (a completion's prompt text) or ``{"messages"}`` (a chat's)."""

    model: str | None = None
    prompt: str | None = None
    messages: Messages | None = None
    add_special_tokens: bool | None = None


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: Annotated[list[int], Field(fail_fast=True)]
