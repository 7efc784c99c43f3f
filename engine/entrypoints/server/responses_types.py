"""The Responses API's request body as a typed model (``ResponsesRequest``), as the openai SDK and
the OpenAI Agents SDK send it; ``responses`` reads it as the chat request it amounts to.

Input items are told apart by ``type`` (a message when absent); keys of an item other than those
read (``id``, ``status`` ...) are ignored, as clients send back what they were given. Nothing is
stored: ``store`` is ignored, and the fields that need stored state are refused.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import Field, Tag

from engine.entrypoints.server.openai_types import REASONING_EFFORTS, FunctionName
from engine.entrypoints.server.request_model import (
    Ignored,
    LenientModel,
    RequestModel,
    capped,
    refused,
    tagged_kind,
)
from engine.scheduling.sequence import MAX_SEED

STATELESS = ": this server stores no responses"


class TextPart(LenientModel):
    type: Literal["input_text", "output_text", "text"]
    text: str


Text = Annotated[Union[str, list[TextPart]], capped("content_parts")]


class MessageItem(LenientModel):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Text


class FunctionCallItem(LenientModel):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(LenientModel):
    type: Literal["function_call_output"]
    call_id: str
    output: Text


class ReasoningItem(LenientModel):
    """Sent back by clients; dropped (chat templates drop past reasoning too)."""

    type: Literal["reasoning"]


ITEM_KINDS = ("message", "function_call", "function_call_output", "reasoning")


def _item_kind(item: Any) -> str | None:
    return item.get("type", "message") if isinstance(item, dict) else None


InputItem = Annotated[Union[Annotated[MessageItem, Tag("message")], Annotated[FunctionCallItem, Tag("function_call")],
                            Annotated[FunctionCallOutputItem, Tag("function_call_output")],
                            Annotated[ReasoningItem, Tag("reasoning")]],
                      tagged_kind(_item_kind, ITEM_KINDS)]


class FunctionTool(RequestModel):
    type: Literal["function"]
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(RequestModel):
    type: Literal["function"]
    name: str


class TextConfig(LenientModel):
    format: dict[str, Any] | None = None  # text / json_object / json_schema: read as chat's response_format


class ReasoningConfig(LenientModel):
    effort: Literal[REASONING_EFFORTS] | None = None


class ResponsesRequest(RequestModel):
    model: str | None = None
    input: Union[str, Annotated[list[InputItem], capped("messages"), Field(min_length=1)]]
    instructions: str | None = None
    max_output_tokens: Annotated[int, Field(ge=1, le=MAX_SEED)] | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: Annotated[list[FunctionTool], capped("tools")] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    stream: bool | None = None
    store: Ignored = None
    metadata: Ignored = None
    user: Ignored = None
    safety_identifier: Ignored = None
    prompt_cache_key: Ignored = None
    prompt_cache_retention: Ignored = None
    service_tier: Ignored = None
    include: Ignored = None
    truncation: Ignored = None
    stream_options: Ignored = None
    max_tool_calls: Ignored = None
    previous_response_id: refused(why=STATELESS) = None
    conversation: refused(why=STATELESS) = None
    prompt: refused(why=STATELESS) = None
    background: refused(False, why=STATELESS) = None
    top_logprobs: refused(0, why=STATELESS) = None
