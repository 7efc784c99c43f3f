"""Anthropic's Messages API request body as a typed model (``MessagesRequest``; a count_tokens body
is the same without ``max_tokens``), as the anthropic SDK and Claude Code send it; ``anthropic``
reads it as the chat request it amounts to.

Content blocks are told apart by ``type``; keys of a block other than those read
(``cache_control``, ``citations`` ...) are ignored, as are the fields of a request that mean
nothing to this server (``metadata``, ``context_management`` ...). A tool's other documented
fields are accepted and ignored. A turn's ``role`` may be ``system`` anywhere in ``messages``
(Claude Code's beta ``mid-conversation-system-2026-04-07``): its content is text.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import Field, Tag

from engine.entrypoints.server.request_model import (
    Ignored,
    LenientModel,
    RequestModel,
    capped,
    refused,
    tagged_kind,
)
from engine.scheduling.sequence import MAX_SEED

EFFORTS = {"low": "low", "medium": "medium", "high": "high", "xhigh": "xhigh", "max": "xhigh"}  # -> reasoning_effort


class TextBlock(LenientModel):
    type: Literal["text"]
    text: str


Text = Annotated[Union[str, list[TextBlock]], capped("content_parts")]


class ToolUseBlock(LenientModel):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any] = {}


class ToolResultBlock(LenientModel):
    type: Literal["tool_result"]
    tool_use_id: str
    content: Text = ""
    is_error: bool | None = None


class ThinkingBlock(LenientModel):
    """Sent back by clients (``thinking``, ``redacted_thinking``); dropped, as templates drop past reasoning."""

    type: Literal["thinking", "redacted_thinking"]


BLOCK_KINDS = ("text", "tool_use", "tool_result", "thinking", "redacted_thinking")


def _block_kind(block: Any) -> str | None:
    kind = block.get("type") if isinstance(block, dict) else None
    return "thinking" if kind == "redacted_thinking" else kind


Block = Annotated[Union[Annotated[TextBlock, Tag("text")], Annotated[ToolUseBlock, Tag("tool_use")],
                        Annotated[ToolResultBlock, Tag("tool_result")], Annotated[ThinkingBlock, Tag("thinking")]],
                  tagged_kind(_block_kind, BLOCK_KINDS)]


class Message(LenientModel):
    role: Literal["user", "assistant", "system"]
    content: Annotated[Union[str, list[Block]], capped("content_parts")]


class Tool(RequestModel):
    name: str
    description: str | None = None
    input_schema: dict[str, Any] = {"type": "object"}
    type: Literal["custom"] | None = None  # server tools (web search ...) are not run here
    strict: bool | None = None
    cache_control: Ignored = None
    defer_loading: Ignored = None
    eager_input_streaming: Ignored = None
    input_examples: Ignored = None
    allowed_callers: Ignored = None


class ToolChoice(RequestModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Thinking(LenientModel):
    type: Literal["enabled", "adaptive", "between_tools", "disabled"]
    budget_tokens: int | None = None


class JsonSchemaFormat(RequestModel):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(LenientModel):
    effort: Literal[tuple(EFFORTS)] | None = None
    format: JsonSchemaFormat | None = None


class MessagesRequest(RequestModel):
    model: str | None = None
    messages: Annotated[list[Message], capped("messages"), Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1, le=MAX_SEED)] | None = None  # required by /v1/messages
    system: Text | None = None
    stop_sequences: list[str] | None = None
    stream: bool | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    tools: Annotated[list[Tool], capped("tools")] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    output_format: JsonSchemaFormat | None = None
    metadata: Ignored = None
    service_tier: Ignored = None
    context_management: Ignored = None
    cache_control: Ignored = None
    diagnostics: Ignored = None
    inference_geo: Ignored = None
    speed: Ignored = None
    user_profile_id: Ignored = None
    workspace_id: Ignored = None
    mcp_servers: refused([]) = None
    container: refused() = None
