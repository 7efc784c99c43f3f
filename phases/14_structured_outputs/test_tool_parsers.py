"""Tool-call parsers (engine/entrypoints/server/tool_parsers.py) on outputs shaped like real Qwen3 (hermes) and
Llama 3.x (JSON) tool calls: the whole-output parse against hand-written answers, and the stream,
for every split of each output into deltas, assembled by the OpenAI SDK into the same message.
Then a chat choice read for a request (engine/entrypoints/server/chat_output.py): calls of functions the
request does not offer stay content, parallel_tool_calls false keeps one call, and a forced call
cut off by max_tokens is that call, never content; whole and streamed alike."""
import json
import re

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from engine.entrypoints.server.call_object import compact
from engine.entrypoints.server.chat_output import ChatParsing
from engine.entrypoints.server.json_stream import JsonScanner
from engine.entrypoints.server.tool_parsers import default_tool_parser, random_call_id, tool_parser
from stream_cases import chat_streamed, chat_whole, counting_ids, finishes, pieces, run_stream, sdk_message

WEATHER_PARIS = '{"city":"Paris","unit":"celsius"}'
# (parser, output, content, [(name, arguments)])
CASES = {
    "qwen3-text-then-two-calls": (
        "hermes",
        "I'll check the weather in both cities.\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "東京", "unit": "celsius"}}\n</tool_call>',
        "I'll check the weather in both cities.",
        [("get_weather", WEATHER_PARIS), ("get_weather", '{"city":"東京","unit":"celsius"}')]),
    "qwen3-nested-unicode-escapes": (
        "hermes",
        '<tool_call>\n{"name": "write_file", "arguments": {"path": "notes/café.md", "content": "He said \\"hi\\" '
        '— 👋\\n\\tthen left \\\\ \\u00e9", "meta": {"tags": ["a", "b c"], "size": -1.5e2, "draft": true, '
        '"owner": null, "ratio": 0}}}\n</tool_call>',
        None,
        [("write_file", '{"path":"notes/café.md","content":"He said \\"hi\\" — 👋\\n\\tthen left \\\\ \\u00e9",'
                        '"meta":{"tags":["a","b c"],"size":-1.5e2,"draft":true,"owner":null,"ratio":0}}')]),
    "qwen3-malformed-block-then-call": (
        "hermes",
        'Let me look that up.\n<tool_call>\n{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}\n'
        '</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
        "</tool_call>",
        'Let me look that up.\n<tool_call>\n{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}\n'
        "</tool_call>",
        [("get_weather", WEATHER_PARIS)]),
    "qwen3-python-dict-is-no-call": (
        "hermes",
        "<tool_call>\n{'name': 'get_weather', 'arguments': {'city': 'Paris'}}\n</tool_call>",
        "<tool_call>\n{'name': 'get_weather', 'arguments': {'city': 'Paris'}}\n</tool_call>",
        []),
    "qwen3-calls-without-arguments": (
        "hermes",
        '<tool_call>\n{"name": "get_current_time"}\n</tool_call>\n'
        '<tool_call>\n{"name": "list_files", "arguments": {}}\n</tool_call>',
        None,
        [("get_current_time", "{}"), ("list_files", "{}")]),
    "qwen3-unclosed-last-block": (
        "hermes",
        'Sure.\n\n<tool_call>\n{"name": "search", "arguments": {"query": "agent-infer", "limit": 10}}\n',
        "Sure.",
        [("search", '{"query":"agent-infer","limit":10}')]),
    "qwen3-text-around-a-call": (
        "hermes",
        'First <tool_call>{"name":"a","arguments":{"x":[1,{"y":"}"}]}}</tool_call>\n\nthen more text.',
        "Firstthen more text.",
        [("a", '{"x":[1,{"y":"}"}]}')]),
    "qwen3-tag-like-text": (
        "hermes",
        "Compare a <tool and <tool_cal with <b>bold</b>, then <tool_call> alone.",
        "Compare a <tool and <tool_cal with <b>bold</b>, then <tool_call> alone.",
        []),
    "qwen3-tag-inside-a-broken-block": (
        "hermes",
        '<tool_call>\nnot json <tool_call>{"name": "f", "arguments": {"k": "v"}}</tool_call>',
        "<tool_call>\nnot json",
        [("f", '{"k":"v"}')]),
    "llama3-python-tag": (
        "llama3_json",
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}',
        None,
        [("get_weather", WEATHER_PARIS)]),
    "llama3-bare-json": (
        "llama3_json",
        '{"name": "get_weather", "parameters": {"city": "San Francisco, CA", "days": 3}}',
        None,
        [("get_weather", '{"city":"San Francisco, CA","days":3}')]),
    "llama3-two-calls": (
        "llama3_json",
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
        '{"name": "get_time", "arguments": {"timezone": "Europe/Paris"}}',
        None,
        [("get_weather", '{"city":"Paris"}'), ("get_time", '{"timezone":"Europe/Paris"}')]),
    "llama3-text-answer": (
        "llama3_json",
        "The weather in Paris is 18 °C and sunny.",
        "The weather in Paris is 18 °C and sunny.",
        []),
    "llama3-json-answer-is-no-call": (
        "llama3_json",
        ' {"answer": 42, "name": "deep thought"}',
        ' {"answer": 42, "name": "deep thought"}',
        []),
    "llama3-text-after-a-call": (
        "llama3_json",
        '{"name": "f", "parameters": {"a": 1}} \nI called f.',
        "I called f.",
        [("f", '{"a":1}')]),
    "llama3-bad-second-object": (
        "llama3_json",
        '{"name": "f", "parameters": {"a": 1}}; {"nom": "g"}',
        '; {"nom": "g"}',
        [("f", '{"a":1}')]),
    "none": ("none", '<tool_call>\n{"name": "f"}\n</tool_call>', '<tool_call>\n{"name": "f"}\n</tool_call>', []),
}
# (parser, the request's function names, output, content, [(name, arguments)]): a call object naming
# a function the request does not offer is no call; it stays content like a malformed block
REQUEST_CASES = {
    "qwen3-unknown-function-then-a-known-one": (
        "hermes", {"get_weather"},
        "I'll look.\n"
        '<tool_call>\n{"name": "rm_rf", "arguments": {"path": "/"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>',
        'I\'ll look.\n<tool_call>\n{"name": "rm_rf", "arguments": {"path": "/"}}\n</tool_call>',
        [("get_weather", WEATHER_PARIS)]),
    "qwen3-a-name-extending-a-known-one": (
        "hermes", {"get_weather"},
        '<tool_call>\n{"name": "get_weather_v2", "arguments": {"city": "Paris"}}\n</tool_call>',
        '<tool_call>\n{"name": "get_weather_v2", "arguments": {"city": "Paris"}}\n</tool_call>',
        []),
    "qwen3-unknown-function-without-arguments": (
        "hermes", {"get_current_time"},
        '<tool_call>\n{"name": "delete_everything"}\n</tool_call>\n<tool_call>\n{"name": "get_current_time"}\n'
        "</tool_call>",
        '<tool_call>\n{"name": "delete_everything"}\n</tool_call>',
        [("get_current_time", "{}")]),
    "qwen3-a-known-name-written-with-an-escape": (
        "hermes", {"get_weather"},
        '<tool_call>\n{"name": "get\\u005fweather", "arguments": {}}\n</tool_call>',
        None,
        [("get_weather", "{}")]),
    "qwen3-a-request-without-functions": (
        "hermes", set(),
        'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
        'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
        []),
    "llama3-unknown-function": (
        "llama3_json", {"get_weather"},
        '<|python_tag|>{"name": "exec", "parameters": {"code": "rm -rf /"}}',
        '<|python_tag|>{"name": "exec", "parameters": {"code": "rm -rf /"}}',
        []),
    "llama3-unknown-second-call": (
        "llama3_json", {"f"},
        '{"name": "f", "parameters": {"a": 1}}; {"name": "g", "parameters": {}}',
        '; {"name": "g", "parameters": {}}',
        [("f", '{"a":1}')]),
}
ALL_CASES = {case: (parser, None, *rest) for case, (parser, *rest) in CASES.items()} | REQUEST_CASES


def whole(parser: str, text: str, names=None):
    content, calls = tool_parser(parser, counting_ids(), names).extract(text)
    return content, [(c.id, c.name, c.arguments) for c in calls]


def streamed(parser: str, deltas: list[str], names=None):
    """The stream of the same request (the same ids), as the OpenAI SDK assembles it."""
    message = sdk_message(run_stream(tool_parser(parser, counting_ids(), names).stream(), deltas))
    return message.content, [(c.id, c.function.name, c.function.arguments) for c in message.tool_calls or []]


@pytest.mark.parametrize("case", ALL_CASES)
def test_whole_output_parse_of_recorded_outputs(case):
    parser, names, text, content, calls = ALL_CASES[case]
    assert whole(parser, text, names) == (content, [(f"call_{i}", *c) for i, c in enumerate(calls)])


@pytest.mark.parametrize("case", ALL_CASES)
def test_every_split_streams_the_whole_parse(case):
    """Two deltas cut at every position, and one delta per character."""
    parser, names, text, _, _ = ALL_CASES[case]
    want = whole(parser, text, names)
    for cut in range(len(text) + 1):
        assert streamed(parser, [text[:cut], text[cut:]], names) == want, f"cut at {cut}: {text[:cut]!r}"
    assert streamed(parser, list(text), names) == want


@settings(max_examples=300, deadline=None)
@given(data=st.data(), case=st.sampled_from(sorted(ALL_CASES)))
def test_any_split_streams_the_whole_parse(data, case):
    parser, names, text, _, _ = ALL_CASES[case]
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=12))
    assert streamed(parser, pieces(text, cuts), names) == whole(parser, text, names)


def test_a_call_of_a_function_the_request_does_not_offer_is_never_announced():
    """The name is known before the stream commits to a call: with the name's closing quote the
    held block goes out as content, and no call delta is ever sent."""
    stream = tool_parser("hermes", counting_ids(), {"get_weather"}).stream()
    assert stream.feed('Sure. <tool_call>\n{"name": "rm_r') == [{"content": "Sure."}]
    assert stream.feed('f"') == [{"content": ' <tool_call>\n{"name": "rm_rf"'}]
    assert stream.feed(', "arguments": {}}</tool_call>') == [{"content": ', "arguments": {}}</tool_call>'}]
    assert stream.finish() == []
    stream = tool_parser("llama3_json", counting_ids(), {"f"}).stream()
    assert stream.feed('{"name": "f_') == []
    assert stream.feed('2", "parameters": {}}') == [{"content": '{"name": "f_2", "parameters": {}}'}]


NAME_POOL = ["f", "get_weather", "g"]
call_names = st.sampled_from(NAME_POOL) | st.text(max_size=6)
request_names = st.none() | st.frozensets(st.sampled_from(NAME_POOL))  # None: any name is a call


def hermes_outputs():
    """Text (with tag-like pieces), well-formed blocks and blocks that are no call, in any order."""
    args = st.dictionaries(st.text(max_size=5), st.none() | st.integers() | st.text(max_size=5), max_size=3)
    good = st.builds(lambda name, a, indent, close: "<tool_call>" + json.dumps({"name": name, "arguments": a},
                                                                              indent=indent) + close,
                     call_names, args, st.none() | st.integers(0, 2),
                     st.sampled_from(["</tool_call>", "\n</tool_call>"]))
    no_call = st.sampled_from(['<tool_call>{"name": "f", "arguments": "{}"}</tool_call>', "<tool_call>\n{'name': 'f'}",
                               '<tool_call>{"arguments": {}, "name": "f"}</tool_call>', "<tool_call></tool_call>",
                               '<tool_call>{"name": 1}</tool_call>', "<tool_call>"])
    text = st.text(alphabet="ab <>/_toolcal\n", max_size=12)
    return st.lists(good | no_call | text, max_size=5).map("".join)


@settings(max_examples=300, deadline=None)
@given(text=hermes_outputs(), names=request_names, data=st.data())
def test_generated_hermes_outputs_stream_as_they_parse(text, names, data):
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=8))
    assert streamed("hermes", pieces(text, cuts), names) == whole("hermes", text, names)


def llama3_outputs():
    """Optional python tag, calls separated by ';', then nothing, text, or an object that is no call."""
    values = st.none() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=5)
    args = st.dictionaries(st.text(max_size=5), values, max_size=3)
    call = st.builds(lambda name, key, a, indent: json.dumps({"name": name, key: a}, indent=indent),
                     call_names, st.sampled_from(["parameters", "arguments"]), args,
                     st.none() | st.integers(0, 2))
    calls = st.lists(call, max_size=3).flatmap(lambda cs: st.sampled_from(["; ", ";", " ;\n"]).map(
        lambda sep: sep.join(cs)))
    start = st.sampled_from(["", " ", "<|python_tag|>", "\n<|python_tag|> "])
    end = st.sampled_from(["", " ", "; ", " Done.", '; {"name": 3}', ";{'name': 'f'}", "<|eom_id|>"])
    return st.tuples(start, calls, end).map("".join)


@settings(max_examples=300, deadline=None)
@given(text=llama3_outputs(), names=request_names, data=st.data())
def test_generated_llama3_outputs_stream_as_they_parse(text, names, data):
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=8))
    assert streamed("llama3_json", pieces(text, cuts), names) == whole("llama3_json", text, names)


@settings(max_examples=300, deadline=None)
@given(parser=st.sampled_from(["hermes", "llama3_json"]), data=st.data(),
       parts=st.lists(st.sampled_from(["<tool_call>", "</tool_call>", "<tool_c", '{"name": "f"', ', "arguments": {',
                                       '"a": [1, "x"', "]", "}", ";", " ", "\n", "<|python_tag|>", "z"]), max_size=14))
def test_any_text_streams_the_same_whatever_its_split(parser, data, parts):
    """Also where stream and whole parse may differ (calls broken after their announcement), the
    stream does not depend on how the text is split."""
    text = "".join(parts)
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=8))
    assert streamed(parser, pieces(text, cuts)) == streamed(parser, [text])


def test_stream_deltas_have_the_openai_shape():
    """Per call: one delta with index, id, type and name (arguments ""), then argument fragments
    that carry only index and arguments; indexes count from 0 in order."""
    _, text, _, calls = CASES["qwen3-text-then-two-calls"]
    deltas = run_stream(tool_parser("hermes", counting_ids()).stream(), list(text))
    assert all(len(d) == 1 and set(d) <= {"content", "tool_calls"} for d in deltas)
    call_deltas = [d["tool_calls"] for d in deltas if "tool_calls" in d]
    assert all(len(d) == 1 for d in call_deltas)
    heads = [d[0] for d in call_deltas if "id" in d[0]]
    assert heads == [{"index": i, "id": f"call_{i}", "type": "function", "function": {"name": name, "arguments": ""}}
                     for i, (name, _) in enumerate(calls)]
    fragments = [d[0] for d in call_deltas if "id" not in d[0]]
    assert all(set(f) == {"index", "function"} and set(f["function"]) == {"arguments"} for f in fragments)
    assert [f["index"] for f in fragments] == sorted(f["index"] for f in fragments)
    assert all(f["function"]["arguments"] for f in fragments)


def test_a_possible_tag_is_held_back_and_released_when_it_cannot_be_one():
    stream = tool_parser("hermes").stream()
    assert stream.feed("Let me check <tool_c") == [{"content": "Let me check"}]
    assert stream.feed("alc") == [{"content": " <tool_calc"}]
    assert stream.feed("\n\n<tool_call>\n{\"name\": \"f\", \"argum") == []  # held: it may be a call
    assert stream.feed("ents\": 7}") == [{"content": "\n\n<tool_call>\n{\"name\": \"f\", \"arguments\": 7}"}]
    assert stream.feed(" <") == []
    assert stream.finish() == [{"content": " <"}]


def test_arguments_stream_as_the_model_writes_them():
    """The call is announced once its name is known and its arguments open; each argument
    character is sent with the delta that brings it (string contents included)."""
    stream = tool_parser("hermes", counting_ids()).stream()
    assert stream.feed('<tool_call>\n{"name": "get_weather"') == []
    assert stream.feed(', "arguments": {"ci') == [
        {"tool_calls": [{"index": 0, "id": "call_0", "type": "function",
                         "function": {"name": "get_weather", "arguments": ""}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"ci'}}]}]
    assert stream.feed('ty":  "Par') == [{"tool_calls": [{"index": 0, "function": {"arguments": 'ty":"Par'}}]}]
    assert stream.feed('is"}}\n</tool_call>') == [{"tool_calls": [{"index": 0, "function": {"arguments": 'is"}'}}]}]
    assert stream.finish() == []


def test_llama3_holds_the_python_tag_and_the_first_object_until_it_is_a_call():
    stream = tool_parser("llama3_json", counting_ids()).stream()
    assert stream.feed("<|python_") == []
    assert stream.feed('tag|>{"name": "f", "parameters": ') == []
    assert stream.feed("{") == [
        {"tool_calls": [{"index": 0, "id": "call_0", "type": "function", "function": {"name": "f", "arguments": ""}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": "{"}}]}]
    plain = tool_parser("llama3_json").stream()
    assert plain.feed('{"na') == []
    assert plain.feed('rrative": 1') == [{"content": '{"narrative": 1'}]  # no call: all content from here on
    assert plain.feed("}") == [{"content": "}"}]


def test_a_call_broken_after_it_was_announced_ends_there():
    """The one disagreement the module docstring states: an output cut off inside the arguments
    (max_tokens). The stream has announced the call and sent its arguments so far; the whole
    parse leaves the block in the content."""
    text = '<tool_call>\n{"name": "search", "arguments": {"query": "agent'
    assert whole("hermes", text) == (text, [])
    assert streamed("hermes", [text]) == (None, [("call_0", "search", '{"query":"agent')])
    broken = '<tool_call>\n{"name": "f", "arguments": {"a": 1]}}\n</tool_call> after'  # invalid JSON
    assert whole("hermes", broken) == (broken, [])
    assert streamed("hermes", [broken]) == ("]}}\n</tool_call> after", [("call_0", "f", '{"a":1')])
    broken = '{"name": "f", "parameters": {"a": 1]} trailing'
    assert whole("llama3_json", broken) == (broken, [])
    assert streamed("llama3_json", [broken]) == ("]} trailing", [("call_0", "f", '{"a":1')])


NAMES = frozenset({"get_weather", "get_time", "f"})
# parallel_tool_calls false: (parser, output, content, the one call kept); the same content as with
# parallel calls (the text around the dropped calls stays), the calls after the first dropped
ONE_CALL_CASES = {
    "qwen3-two-calls-with-text-around": (
        "hermes",
        "Checking both.\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>\n'
        "and\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "東京"}}\n</tool_call>\n'
        "Done.",
        "Checking both.andDone.",
        [("get_weather", WEATHER_PARIS)]),
    "qwen3-an-unknown-function-is-no-first-call": (
        "hermes",
        '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time"}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
        '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>',
        [("get_time", "{}")]),
    "llama3-three-calls": (
        "llama3_json",
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", '
        '"parameters": {}}; {"name": "f", "parameters": {"a": [1]}}',
        None,
        [("get_weather", '{"city":"Paris"}')]),
}


@pytest.mark.parametrize("case", ONE_CALL_CASES)
def test_parallel_tool_calls_false_keeps_the_first_call_whole_and_streamed(case):
    parser, text, content, calls = ONE_CALL_CASES[case]
    one = ChatParsing(parser, tool_names=NAMES, parallel_tool_calls=False)
    want = (content, calls, "tool_calls")
    assert chat_whole(one, text) == want
    assert len(chat_whole(ChatParsing(parser, tool_names=NAMES), text)[1]) > 1  # the option is what drops them
    for cut in range(len(text) + 1):
        assert chat_streamed(one, [text[:cut], text[cut:]]) == want, f"cut at {cut}: {text[:cut]!r}"
    assert chat_streamed(one, list(text)) == want
    stream = one.stream()
    sent = stream.feed(text) + stream.finish("stop")[0]
    assert {d["tool_calls"][0]["index"] for d in sent if "tool_calls" in d} == {0}  # nothing of the dropped calls


# forced calls (tool_choice required / named): (parser, output, finish reason, calls, finish reason
# sent); content is always None. An output cut by max_tokens keeps the call once its name is complete.
FORCED_CASES = {
    "qwen3-complete": (
        "hermes",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>',
        "stop", [("get_weather", WEATHER_PARIS)], "tool_calls"),
    "qwen3-cut-in-the-arguments": (
        "hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa', "length",
        [("get_weather", '{"city":"Pa')], "length"),
    "qwen3-cut-after-an-escape": (
        "hermes", '<tool_call>\n{"name": "f", "arguments": {"note": "say \\', "length",
        [("f", '{"note":"say \\')], "length"),
    "qwen3-cut-after-the-name": (
        "hermes", '<tool_call>\n{"name": "get_weather", "argum', "length", [("get_weather", "")], "length"),
    "qwen3-cut-in-the-name": ("hermes", '<tool_call>\n{"name": "get_wea', "length", [], "length"),
    "qwen3-cut-in-the-prefix": ("hermes", "<tool_ca", "length", [], "length"),
    "qwen3-cut-in-the-suffix": (
        "hermes", '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool', "length",
        [("get_time", "{}")], "length"),
    "llama3-cut-in-the-arguments": (
        "llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "cel', "length",
        [("get_weather", '{"city":"Paris","unit":"cel')], "length"),
    "llama3-complete": (
        "llama3_json", '{"name": "f", "parameters": {"a": [1, 2.5e3]}}', "stop", [("f", '{"a":[1,2.5e3]}')],
        "tool_calls"),
}


@pytest.mark.parametrize("case", FORCED_CASES)
def test_a_forced_call_cut_off_is_that_call_whole_and_streamed(case):
    """Never content; the call with its arguments so far once its name is complete; the stream,
    split anywhere, sends no content delta and assembles into the whole message."""
    parser, text, reason, calls, sent_reason = FORCED_CASES[case]
    forced = ChatParsing(parser, tool_names=NAMES, forced=True)
    want = (None, calls, sent_reason)
    assert chat_whole(forced, text, reason) == want
    for cut in range(len(text) + 1):
        assert chat_streamed(forced, [text[:cut], text[cut:]], reason) == want, f"cut at {cut}: {text[:cut]!r}"
    assert chat_streamed(forced, list(text), reason) == want
    stream = forced.stream()
    assert not any("content" in d for ch in text for d in stream.feed(ch))


@settings(max_examples=300, deadline=None)
@given(parser=st.sampled_from(["hermes", "llama3_json"]), name=st.sampled_from(sorted(NAMES)),
       arguments=st.dictionaries(st.text(max_size=5), st.none() | st.integers() | st.text(max_size=5), max_size=3),
       indent=st.none() | st.integers(0, 2), data=st.data())
def test_a_forced_call_cut_anywhere_streams_as_it_reads_whole(parser, name, arguments, indent, data):
    """What the grammar makes the model write (prefix, call object, suffix), cut anywhere: the call
    is there iff the cut is past its name, its arguments a prefix of the whole call's, and the
    stream, split anywhere, is the same."""
    p = tool_parser(parser)
    text = p.call_prefix + json.dumps({"name": name, p.arguments_key: arguments}, indent=indent) + p.call_suffix
    cut = data.draw(st.integers(0, len(text)))
    reason = "stop" if cut == len(text) else "length"
    forced = ChatParsing(parser, tool_names=NAMES, forced=True)
    content, calls, sent_reason = chat_whole(forced, text[:cut], reason)
    past_name = text.index(json.dumps(name)) + len(json.dumps(name))
    assert content is None and len(calls) == (cut >= past_name)
    assert all(c == name and json.dumps(arguments, separators=(",", ":")).startswith(a) for c, a in calls)
    if reason == "stop":
        assert calls == [(name, json.dumps(arguments, separators=(",", ":")))] and sent_reason == "tool_calls"
    cuts = data.draw(st.lists(st.integers(0, cut), max_size=8))
    assert chat_streamed(forced, pieces(text[:cut], cuts), reason) == (content, calls, sent_reason)


@settings(max_examples=300, deadline=None)
@given(outputs=st.sampled_from([("hermes", hermes_outputs()), ("llama3_json", llama3_outputs())]).flatmap(
    lambda p: st.tuples(st.just(p[0]), p[1])), names=st.frozensets(st.sampled_from(NAME_POOL)),
       parallel=st.booleans(), data=st.data())
def test_generated_outputs_read_for_a_request_stream_as_they_read_whole(outputs, names, parallel, data):
    """Through ChatParsing, with the request's names and parallel_tool_calls: stream == whole for
    any split; without parallel calls, the content of the parallel reading and its first call."""
    parser, text = outputs
    parsing = ChatParsing(parser, tool_names=names, parallel_tool_calls=parallel)
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=8))
    got = chat_whole(parsing, text)
    assert chat_streamed(parsing, pieces(text, cuts)) == got
    content, calls, reason = chat_whole(ChatParsing(parser, tool_names=names), text)
    assert got == (content, calls if parallel else calls[:1], reason)
    assert all(name in names for name, _ in calls)


def test_call_ids():
    ids = {random_call_id() for _ in range(1000)}
    assert len(ids) == 1000 and all(re.fullmatch(r"call_[A-Za-z0-9]{24}", i) for i in ids)
    _, text, _, _ = CASES["qwen3-text-then-two-calls"]
    parser = tool_parser("hermes")  # the default id source: fresh ids for every call
    first, second = parser.extract(text)[1], parser.extract(text)[1]
    assert len({c.id for c in first + second}) == 4
    assert first[0].to_openai() == {"id": first[0].id, "type": "function",
                                    "function": {"name": "get_weather", "arguments": WEATHER_PARIS}}


def test_parser_names_and_the_default_per_architecture():
    assert {name: type(tool_parser(name)).__name__ for name in ("hermes", "llama3_json", "none")} == {
        "hermes": "HermesToolParser", "llama3_json": "Llama3JsonToolParser", "none": "NoToolParser"}
    with pytest.raises(ValueError, match="--tool-call-parser: unknown parser 'mistral'; choose one of hermes"):
        tool_parser("mistral")
    with pytest.raises(ValueError, match="--tool-call-parser none reads no calls, so it cannot read a forced one"):
        tool_parser("none", forced=True)
    defaults = {arch: default_tool_parser(arch) for arch in (
        "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM", "LlamaForCausalLM",
        "MistralForCausalLM", "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")}
    assert defaults == {"Qwen2ForCausalLM": "hermes", "Qwen3ForCausalLM": "hermes", "Qwen3MoeForCausalLM": "hermes",
                        "Qwen2MoeForCausalLM": "hermes", "LlamaForCausalLM": "llama3_json",
                        "MistralForCausalLM": "none", "DeepseekV2ForCausalLM": "none", "DeepseekV3ForCausalLM": "none"}


def json_values(max_leaves=20):
    scalars = st.none() | st.booleans() | st.integers(-10**30, 10**30) | \
        st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=8)
    return st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) |
                        st.dictionaries(st.text(max_size=6), inner, max_size=4), max_leaves=max_leaves)


def scan(text: str) -> str | None:
    """The scanner's compact form of ``text`` (an object, whitespace around it allowed), or None
    when it refuses it."""
    scanner, kept = JsonScanner("{"), []
    for i, ch in enumerate(text):
        if scanner.done:
            return "".join(kept) if not text[i:].strip(" \t\n\r") else None
        out = scanner.push(ch)
        if out is None:
            return None
        kept.append(out)
    return "".join(kept) if scanner.done else None


def loads(text: str):
    def refuse(constant):
        raise ValueError(constant)
    return json.loads(text, parse_int=str, parse_float=str, parse_constant=refuse)


@settings(max_examples=300, deadline=None)
@given(value=st.dictionaries(st.text(max_size=6), json_values(), max_size=5), indent=st.none() | st.integers(0, 3),
       ascii_only=st.booleans())
def test_json_scanner_takes_json_objects_and_compacts_them(value, indent, ascii_only):
    text = json.dumps(value, indent=indent, ensure_ascii=ascii_only)
    assert scan(text) == json.dumps(value, separators=(",", ":"), ensure_ascii=ascii_only) == compact(text)


@settings(max_examples=400, deadline=None)
@example(value={"a": 0}, edits=[(9, 0, "1")])  # {"a": 01}: a digit after a leading zero, always tried
@given(value=st.dictionaries(st.text(alphabet='ab"\\/u0é', max_size=4), json_values(8), min_size=1, max_size=3),
       edits=st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 2),
                                st.sampled_from(list('{}[]:,"\\ ue0-.+1tn\x01'))), min_size=1, max_size=3))
def test_json_scanner_refuses_exactly_what_json_refuses(value, edits):
    """Valid objects with characters inserted, deleted or replaced: the scanner takes the text iff
    ``json.loads`` does and gives an object (NaN and Infinity refused by both)."""
    text = json.dumps(value, indent=1)
    for pos, kind, ch in edits:
        pos %= len(text) + 1
        text = text[:pos] + (ch if kind != 1 else "") + text[pos + (kind != 0):]
    try:
        ok = isinstance(loads(text), dict)
    except ValueError:
        ok = False
    assert (scan(text) is not None) == ok, text


LONG = 200_000  # characters: a quadratic parser takes minutes on this much, a linear one well under a second


def tokens_of(text: str, size: int = 51) -> list[str]:
    """``text`` in deltas of ``size`` characters (the issue's attack: a 51-space token)."""
    return [text[i:i + size] for i in range(0, len(text), size)]


def joined(deltas: list[dict]) -> tuple[str | None, list[tuple[str, str]]]:
    """Stream deltas joined (as the SDK joins them, without its per-chunk cost): content and calls."""
    content, calls = [], {}
    for delta in deltas:
        content.append(delta.get("content") or "")
        for call in delta.get("tool_calls") or []:
            entry = calls.setdefault(call["index"], [call["function"].get("name"), []])
            entry[1].append(call["function"]["arguments"])
    return "".join(content) or None, [(name, "".join(parts)) for name, parts in calls.values()]


def test_parsers_are_linear_in_whitespace_names_and_arguments():
    """Issue 57: whitespace held back (it may precede a tag or a call), a long call name and long
    arguments, streamed a token at a time and parsed whole (one delta, as ``whole_blocks`` reads
    a whole answer): each of LONG characters, and the result is the whole parse's. The parsers that
    re-sliced and stripped the held text per character (and grew strings a character at a time)
    took minutes here."""
    spaces, name = " " * LONG, "f" * LONG
    call = '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
    unknown = f'<tool_call>{{"name": "{name}"}}</tool_call>'  # a function the request does not offer
    cases = [  # (parser, names, text, content, calls)
        ("hermes", None, spaces + call, None, [("f", '{"a":1}')]),
        ("hermes", None, "x" + spaces + call + spaces + "y", "xy", [("f", '{"a":1}')]),
        ("hermes", None, spaces + "<tool_c" + spaces, spaces + "<tool_c" + spaces, []),
        ("hermes", None, f'<tool_call>{{"name": "{name}", "arguments": {{"a": "{name}"}}}}</tool_call>', None,
         [(name, f'{{"a":"{name}"}}')]),
        ("hermes", {"f"}, unknown, unknown, []),
        ("llama3_json", None, spaces + "<|python_tag|>" + spaces + '{"name": "f", "parameters": {"a": 1}}' + spaces,
         None, [("f", '{"a":1}')]),
        ("llama3_json", None, spaces + "x", spaces + "x", []),
        ("llama3_json", {"f"}, f'{{"name": "{name}", "parameters": {{}}}}', f'{{"name": "{name}", "parameters": {{}}}}',
         []),
    ]

    def run():
        got = []
        for parser, names, text, _, _ in cases:
            streams = [tool_parser(parser, counting_ids(), names).stream() for _ in range(2)]
            got.append((joined(run_stream(streams[0], tokens_of(text))), joined(run_stream(streams[1], [text])),
                        whole(parser, text, names)))
        forced = tool_parser("hermes", counting_ids(), {"f"}, forced=True)
        text = f'<tool_call>\n{{"name": "f", "arguments": {{"a": "{name}"}}}}\n</tool_call>'
        calls = forced.extract(text)[1]
        got.append(([(c.name, c.arguments) for c in calls], joined(run_stream(forced.stream(), tokens_of(text))),
                    joined(run_stream(forced.stream(), [text]))))
        return got

    got = finishes(run)
    for (parser, names, text, content, calls), (by_token, at_once, parsed) in zip(cases, got):
        want = (content, [(f"call_{i}", *c) for i, c in enumerate(calls)])
        assert parsed == want and by_token == at_once == (content, calls), (parser, names, text[:40])
    forced_call = [("f", f'{{"a":"{name}"}}')]
    assert got[-1] == (forced_call, (None, forced_call), (None, forced_call))
