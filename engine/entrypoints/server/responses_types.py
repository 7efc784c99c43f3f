"""The Responses API's request body as a typed model (``ResponsesRequest``), as the openai SDK,
the OpenAI Agents SDK and the Codex CLI send it; ``responses`` reads it as the chat request it
amounts to.

Input items are told apart by ``type`` (a message when absent); keys of an item other than those
read (``id``, ``status`` ...) are ignored, as clients send back what they were given. Nothing is
stored: ``store`` is ignored, and the fields that need stored state are refused. Tools are told
apart by ``type`` too: ``function``; ``namespace`` (functions grouped under a name, as Codex
sends its sub-agent tools); and the tools whose calls this server cannot make (``HOSTED_TOOLS``:
run by OpenAI's servers, or built-in client tools whose calls are not function calls), which are
accepted and dropped beside function tools (``responses``).
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
    namespace: str | None = None  # a call of a namespace's function


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


# tools whose calls are not function calls: OpenAI's hosted tools and its built-in client tools
HOSTED_TOOLS = ("web_search", "web_search_2025_08_26", "web_search_preview", "web_search_preview_2025_03_11",
                "file_search", "code_interpreter", "computer", "computer_use", "computer_use_preview",
                "image_generation", "mcp", "tool_search", "programmatic_tool_calling", "local_shell", "shell",
                "apply_patch", "custom")


class HostedTool(LenientModel):
    """A tool whose calls this server cannot make (its settings ignored): dropped."""

    type: Literal[HOSTED_TOOLS]


def _tool_kind(tool: Any) -> str | None:
    """A tool's tag: as sent (a dict), or as typed (a model, as the answer's echo dumps it)."""
    kind = tool.get("type") if isinstance(tool, dict) else getattr(tool, "type", None)
    return "hosted" if kind in HOSTED_TOOLS else kind


NamespaceMember = Annotated[Union[Annotated[FunctionTool, Tag("function")], Annotated[HostedTool, Tag("hosted")]],
                            tagged_kind(_tool_kind, ("function", *HOSTED_TOOLS))]


class NamespaceTool(RequestModel):
    """Functions grouped under ``name``: offered as functions of their own (``responses``)."""

    type: Literal["namespace"]
    name: FunctionName
    description: str = ""
    tools: Annotated[list[NamespaceMember], capped("tools")]


Tool = Annotated[Union[Annotated[FunctionTool, Tag("function")], Annotated[NamespaceTool, Tag("namespace")],
                       Annotated[HostedTool, Tag("hosted")]],
                 tagged_kind(_tool_kind, ("function", "namespace", *HOSTED_TOOLS))]


class NamedFunction(RequestModel):
    type: Literal["function"]
    name: str


class HostedToolChoice(LenientModel):
    """A ``tool_choice`` forcing a hosted tool: refused (``responses``)."""

    type: Literal[HOSTED_TOOLS]


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
    tools: Annotated[list[Tool], capped("tools")] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | HostedToolChoice | None = None
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
    client_metadata: Ignored = None
    previous_response_id: refused(why=STATELESS) = None
    conversation: refused(why=STATELESS) = None
    prompt: refused(why=STATELESS) = None
    background: refused(False, why=STATELESS) = None
    top_logprobs: refused(0, why=STATELESS) = None
