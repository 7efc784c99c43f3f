"""Agent requests where they enter (``engine.entrypoints.server.protocol``): tools rendered by the chat template
with a history of calls and results, ``tool_choice`` forcing one call through a ``tool_call``
structured spec of the function's parameters, ``response_format`` / ``structured_outputs`` read into
a spec, ``chat_template_kwargs`` reaching the template, every field honoured or refused by name,
and sampling defaults from ``generation_config.json``. The demo model's tokenizer; no engine."""
from __future__ import annotations

import json

import pytest

from agent_cases import HISTORY, TOOLS, TOOLS_TEMPLATE
from engine.core.engine_config import DEFAULT_MODEL_DIR
from engine.core.sampling_defaults import OPENAI, sampling_defaults
from engine.core.tokenizer import load_tokenizer
from engine.entrypoints.server.openai_types import ChatRequest, CompletionRequest, TokenizeRequest
from engine.entrypoints.server.protocol import OpenAIProtocol
from engine.entrypoints.server.request_body import APIError
from engine.entrypoints.server.request_model import validated


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(DEFAULT_MODEL_DIR)


class BodyProtocol(OpenAIProtocol):
    """The protocol given request bodies as the server gives them: typed by the API's model first."""

    def chat(self, body):
        return super().chat(validated(ChatRequest, body, self.limits))

    def completion(self, body):
        return super().completion(validated(CompletionRequest, body, self.limits))

    def tokenize(self, body):
        return super().tokenize(validated(TokenizeRequest, body, self.limits))


def protocol(tokenizer, **options) -> OpenAIProtocol:
    return BodyProtocol(tokenizer, "m", 1024, 8192, chat_template=TOOLS_TEMPLATE, **options)


def refused(proto: OpenAIProtocol, body: dict, chat: bool = True) -> APIError:
    with pytest.raises(APIError) as e:
        (proto.chat if chat else proto.completion)(body)
    assert e.value.status == 400
    return e.value


def test_tools_and_a_history_of_calls_render_through_the_template(tokenizer):
    proto = protocol(tokenizer, tool_call_parser="hermes")
    request = proto.chat({"messages": HISTORY, "tools": TOOLS})
    prompt = tokenizer.decode(request.choices[0].prompt_token_ids)
    assert '"name": "get_weather"' in prompt and '"name": "add"' in prompt  # both signatures
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompt
    assert '<tool_response>\n{"temp": 21}\n</tool_response>' in prompt
    assert prompt.endswith("<|im_start|>assistant\n")
    assert request.parsing.tools == "hermes" and request.structured is None  # auto: read, not forced


def test_a_forced_call_becomes_a_tool_call_spec_of_the_parameters(tokenizer):
    proto = protocol(tokenizer, tool_call_parser="hermes")
    named = proto.chat({"messages": HISTORY[:1], "tools": TOOLS,
                        "tool_choice": {"type": "function", "function": {"name": "add"}}})
    assert named.structured.kind == "tool_call"
    call = json.loads(named.structured.value)
    assert (call["prefix"], call["suffix"]) == ("<tool_call>\n", "\n</tool_call>")
    assert call["schema"]["properties"]["name"] == {"const": "add"}
    assert set(call["schema"]["$defs"]) == {"add"}
    required = protocol(tokenizer, tool_call_parser="llama3_json").chat(
        {"messages": HISTORY[:1], "tools": TOOLS, "tool_choice": "required"})
    call = json.loads(required.structured.value)
    assert (call["prefix"], call["suffix"]) == ("", "") and len(call["schema"]["anyOf"]) == 2
    assert all("parameters" in c["properties"] for c in call["schema"]["anyOf"])
    assert required.parsing.tools == "llama3_json"


def test_tool_choice_none_renders_the_tools_and_reads_no_calls(tokenizer):
    request = protocol(tokenizer, tool_call_parser="hermes").chat(
        {"messages": HISTORY[:1], "tools": TOOLS, "tool_choice": "none"})
    assert request.parsing.tools is None and request.structured is None
    assert '"name": "add"' in tokenizer.decode(request.choices[0].prompt_token_ids)


def test_tool_errors_name_the_field(tokenizer):
    proto = protocol(tokenizer, tool_call_parser="hermes")
    cases = {
        "tools[0].function.parameters": {"tools": [{"type": "function", "function": {
            "name": "f", "parameters": {"type": "object", "properties": {"a": {"type": 3}}}}}]},
        "tool_choice": {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        "messages[2].tool_call_id": {"messages": [HISTORY[0], HISTORY[1], {"role": "tool", "content": "x"}],
                                     "tools": TOOLS},
    }
    for param, body in cases.items():
        assert refused(proto, {"messages": HISTORY[:1], **body}).param == param
    for messages, param in ((None, "messages"), ("x", "messages"), ([], "messages"), (["x"], "messages[0]")):
        assert refused(proto, {"messages": messages, "tools": TOOLS}).param == param
    both = refused(proto, {"messages": HISTORY[:1], "tools": TOOLS, "tool_choice": "required",
                           "response_format": {"type": "json_object"}})
    assert both.param == "tool_choice"
    without_parser = refused(protocol(tokenizer), {"messages": HISTORY[:1], "tools": TOOLS})
    assert without_parser.param == "tools" and "--tool-call-parser" in without_parser.message


def test_response_format_and_structured_outputs_become_specs(tokenizer):
    proto = protocol(tokenizer)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    chat = proto.chat({"messages": HISTORY[:1], "response_format": {
        "type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}})
    assert chat.structured.kind == "json_schema" and json.loads(chat.structured.value) == schema
    completion = proto.completion({"prompt": "x", "structured_outputs": {"choice": ["yes", "no"]}})
    assert completion.structured.kind == "choice"
    bad = refused(proto, {"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {
        "name": "a", "schema": {"type": "object", "properties": {"a": {"type": "integer", "minimum": "zero"}}}}}},
        chat=False)
    assert bad.param == "response_format.json_schema.schema"


def test_chat_template_kwargs_reach_the_template(tokenizer):
    proto = protocol(tokenizer)
    off = proto.chat({"messages": HISTORY[:1], "chat_template_kwargs": {"enable_thinking": False}})
    on = proto.chat({"messages": HISTORY[:1]})
    assert tokenizer.decode(off.choices[0].prompt_token_ids).endswith("<think>\n\n</think>\n\n")
    assert "<think>" not in tokenizer.decode(on.choices[0].prompt_token_ids)
    assert refused(proto, {"messages": HISTORY[:1], "chat_template_kwargs": {"tools": []}}).param == \
        "chat_template_kwargs"
    assert refused(proto, {"messages": HISTORY[:1], "chat_template_kwargs": "x"}).param == "chat_template_kwargs"


def test_every_field_is_known_ignored_or_refused_by_name(tokenizer):
    proto = protocol(tokenizer)
    ignored = {"user": "u", "metadata": {"k": "v"}, "store": False, "service_tier": "auto"}
    assert proto.chat({"messages": HISTORY[:1], **ignored}).choices
    assert proto.completion({"prompt": "x", **ignored}).choices
    assert refused(proto, {"messages": HISTORY[:1], "frobnicate": 1}).message == "unknown field 'frobnicate'"
    assert refused(proto, {"prompt": "x", "tools": []}, chat=False).param == "tools"  # chat only
    assert proto.completion({"prompt": "x", "echo": False, "logit_bias": {}}).choices  # asks for nothing


def test_a_prompt_list_mixing_text_and_token_ids_is_refused(tokenizer):
    proto = protocol(tokenizer)
    assert refused(proto, {"prompt": ["a", [1, 2]]}, chat=False).param == "prompt"
    assert len(proto.completion({"prompt": ["a", "b"]}).choices) == 2
    assert len(proto.completion({"prompt": [[1, 2], [3]]}).choices) == 2


def test_sampling_defaults_come_from_generation_config_then_openai(tokenizer):
    assert sampling_defaults({}, OPENAI) == {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0,
                                             "repetition_penalty": 1.0}
    qwen3 = {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20}
    proto = protocol(tokenizer, generation_config=qwen3)
    params = proto.chat({"messages": HISTORY[:1]}).choices[0].params
    assert (params.temperature, params.top_p, params.top_k) == (0.6, 0.95, 20)
    params = proto.chat({"messages": HISTORY[:1], "temperature": 0, "top_k": 0}).choices[0].params
    assert (params.temperature, params.top_p, params.top_k) == (0.0, 0.95, 0)  # the request wins


def test_add_special_tokens_encodes_a_completion_prompt_with_them():
    """Completions' add_special_tokens encodes text prompts as the tokenizer does with its special
    tokens (here a post-processor that puts <|endoftext|> first); without it, as it does without."""
    from tokenizers.processors import TemplateProcessing

    tokenizer = load_tokenizer(DEFAULT_MODEL_DIR)
    special = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    tokenizer.backend_tokenizer.post_processor = TemplateProcessing(
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", special)])
    proto = protocol(tokenizer)
    text = "the weather in Paris"
    plain = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.encode(text, add_special_tokens=True) == [special, *plain]
    assert proto.completion({"prompt": text, "add_special_tokens": True}).choices[0].prompt_token_ids == [special,
                                                                                                         *plain]
    assert proto.completion({"prompt": text}).choices[0].prompt_token_ids == plain
    assert proto.tokenize({"prompt": text, "add_special_tokens": True}) == [special, *plain]
    assert refused(proto, {"messages": HISTORY[:1], "add_special_tokens": True}).param == "add_special_tokens"


def test_sampling_extensions_reach_sampling_params(tokenizer):
    """logit_bias keys become token ids, bad words are banned as they tokenise alone and after a
    space (vLLM's rule), the constraint of response_format rides in SamplingParams.structured."""
    proto = protocol(tokenizer)
    params = proto.completion({"prompt": "x", "logit_bias": {"17": -100, "5": 2.5}, "allowed_token_ids": [5, 17],
                               "bad_words": ["hello", " hello world"], "min_p": 0.2,
                               "include_stop_str_in_output": True, "skip_special_tokens": False}).choices[0].params
    assert params.logit_bias == ((5, 2.5), (17, -100.0)) and params.allowed_token_ids == (5, 17)
    expected = []
    for text in ("hello", " hello", "hello world", " hello world"):
        ids = tuple(tokenizer.encode(text, add_special_tokens=False))
        expected += [ids] if ids not in expected else []
    assert params.bad_words_token_ids == tuple(expected) and len(expected) == 4
    assert (params.min_p, params.include_stop_str_in_output, params.skip_special_tokens) == (0.2, True, False)
    chat = proto.chat({"messages": HISTORY[:1], "response_format": {"type": "json_object"}})
    assert chat.choices[0].params.structured == chat.structured and chat.structured.kind == "json_object"


def test_the_tool_call_parser_defaults_to_the_architectures(tokenizer):
    """No parser named: a tools request is read by the architecture's (Qwen: hermes, Llama:
    llama3_json); an architecture without one refuses tools, naming the field."""
    def default(architecture):
        return BodyProtocol(tokenizer, "m", 1024, 8192, chat_template=TOOLS_TEMPLATE, tool_call_parser=None,
                            architecture=architecture)

    for architecture, name in (("Qwen3ForCausalLM", "hermes"), ("LlamaForCausalLM", "llama3_json")):
        assert default(architecture).chat({"messages": HISTORY[:1], "tools": TOOLS}).parsing.tools == name
    assert refused(default("MistralForCausalLM"), {"messages": HISTORY[:1], "tools": TOOLS}).param == "tools"
    assert default("MistralForCausalLM").chat({"messages": HISTORY[:1]}).parsing is None  # no tools: plain


def test_schemas_too_deep_or_with_pattern_properties_are_400s(tokenizer):
    """A schema nested past MAX_SCHEMA_DEPTH (given as an object, or as JSON text nested past the
    recursion limit) is a 400 before anything recurses into it; patternProperties (whose keys the
    grammar cannot keep unique) is a 400 naming it; a property merely named so is fine."""
    from engine.scheduling.structured.spec import MAX_SCHEMA_DEPTH

    proto = protocol(tokenizer)
    deep: dict = {"type": "string"}
    for _ in range(MAX_SCHEMA_DEPTH):
        deep = {"type": "object", "properties": {"a": deep}}
    messages = HISTORY[:1]
    bad = refused(proto, {"messages": messages, "response_format": {
        "type": "json_schema", "json_schema": {"name": "deep", "schema": deep}}})
    assert bad.param == "response_format.json_schema.schema" and "deeper" in bad.message
    text = '{"type": "object", "properties": {"a": ' * 5000 + '{}' + "}}" * 5000
    assert "deeper" in refused(proto, {"messages": messages, "structured_outputs": {"json": text}}).message
    pattern = {"type": "object", "patternProperties": {"^x[0-9]$": {"type": "integer"}}}
    bad = refused(proto, {"messages": messages, "structured_outputs": {"json": pattern}})
    assert bad.param == "structured_outputs.json" and "patternProperties" in bad.message
    named = {"type": "object", "properties": {"patternProperties": {"type": "string"}}}
    assert proto.chat({"messages": messages, "structured_outputs": {"json": named}}).structured is not None
