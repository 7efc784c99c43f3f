"""Reasoning parsers (engine/entrypoints/server/reasoning.py) on Qwen3- and DeepSeek-R1-shaped outputs: the
whole-output split against hand-written answers, each rule of the two parsers, and the stream,
for every split, assembled by the OpenAI SDK into the same reasoning_content and content."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.entrypoints.server.reasoning import reasoning_parser
from engine.entrypoints.server.tool_parsers import tool_parser
from stream_cases import counting_ids, finishes, pieces, run_stream, sdk_message

QWEN3_THINKING_PROMPT = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n"
QWEN3_PROMPT = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
NO_THINKING_PROMPT = QWEN3_PROMPT + "<think>\n\n</think>\n\n"
# (parser, prompt, output, reasoning, content)
CASES = {
    "qwen3-think-block": (
        "qwen3", QWEN3_PROMPT,
        "<think>\nThe user greets me. I should answer briefly.\n</think>\n\nHello! How can I help you today?",
        "The user greets me. I should answer briefly.", "Hello! How can I help you today?"),
    "qwen3-empty-think-block": (
        "qwen3", QWEN3_PROMPT, "<think>\n\n</think>\n\nHello!", None, "Hello!"),
    "qwen3-no-think-block": (
        "qwen3", NO_THINKING_PROMPT, "Hello! 2 < 3 and </think> is only text here.", None,
        "Hello! 2 < 3 and </think> is only text here."),
    "qwen3-block-opened-by-the-prompt": (
        "qwen3", QWEN3_THINKING_PROMPT, "Okay, 2 + 2 = 4.\n</think>\n\nThe answer is 4.", "Okay, 2 + 2 = 4.",
        "The answer is 4."),
    "qwen3-cut-off-while-thinking": (
        "qwen3", QWEN3_PROMPT, "<think>\nFirst, list the files. Then <thi", "First, list the files. Then <thi", None),
    "qwen3-tags-after-the-block-are-content": (
        "qwen3", QWEN3_PROMPT, "<think>a < b</think>Use <think> and </think> tags.", "a < b",
        "Use <think> and </think> tags."),
    "qwen3-text-before-a-tag-is-no-reasoning": (
        "qwen3", QWEN3_PROMPT, "Sure. <think>x</think> y", None, "Sure. <think>x</think> y"),
    "deepseek-r1-opened-by-the-prompt": (
        "deepseek_r1", "", "Let me compute 17 * 3 = 51.\n</think>\n\n**51**", "Let me compute 17 * 3 = 51.", "**51**"),
    "deepseek-r1-with-its-own-tag": (
        "deepseek_r1", "", "  <think>\nhmm\n</think>ok", "hmm", "ok"),
    "deepseek-r1-cut-off": ("deepseek_r1", "", "I need to think about </thin", "I need to think about </thin", None),
    "deepseek-r1-empty-output": ("deepseek_r1", "", "", None, None),
    "qwen3-only-whitespace": ("qwen3", QWEN3_PROMPT, " \n", None, " \n"),
}


def whole(parser: str, prompt: str, text: str):
    return reasoning_parser(parser, prompt).extract(text)


def streamed(parser: str, prompt: str, deltas: list[str]):
    message = sdk_message(run_stream(reasoning_parser(parser, prompt).stream(), deltas))
    return getattr(message, "reasoning_content", None), message.content


@pytest.mark.parametrize("case", CASES)
def test_whole_output_split_of_recorded_outputs(case):
    parser, prompt, text, reasoning, content = CASES[case]
    assert whole(parser, prompt, text) == (reasoning, content)


@pytest.mark.parametrize("case", CASES)
def test_every_split_streams_the_whole_split(case):
    parser, prompt, text, _, _ = CASES[case]
    want = whole(parser, prompt, text)
    for cut in range(len(text) + 1):
        assert streamed(parser, prompt, [text[:cut], text[cut:]]) == want, f"cut at {cut}: {text[:cut]!r}"
    assert streamed(parser, prompt, list(text)) == want


@settings(max_examples=300, deadline=None)
@given(data=st.data(), case=st.sampled_from(sorted(CASES)))
def test_any_split_streams_the_whole_split(data, case):
    parser, prompt, text, _, _ = CASES[case]
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=10))
    assert streamed(parser, prompt, pieces(text, cuts)) == whole(parser, prompt, text)


@settings(max_examples=500, deadline=None)
@given(parser=st.sampled_from(["qwen3", "deepseek_r1"]), opened=st.booleans(), data=st.data(),
       parts=st.lists(st.sampled_from(["<think>", "</think>", "<thi", "</", " ", "\n", "a", "<", "b c"]), max_size=12))
def test_tag_soup_streams_the_whole_split(parser, opened, data, parts):
    """Outputs made of tags, tag prefixes, whitespace and text, in any order and split anywhere."""
    text, prompt = "".join(parts), QWEN3_THINKING_PROMPT if opened else QWEN3_PROMPT
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=8))
    assert streamed(parser, prompt, pieces(text, cuts)) == whole(parser, prompt, text)


def test_the_stream_holds_back_a_possible_tag():
    stream = reasoning_parser("qwen3").stream()
    assert stream.feed("<thi") == []
    assert stream.feed("nk>\nStep one.\n</thi") == [{"reasoning_content": "Step one."}]
    assert stream.feed("nk>\n\nDone") == [{"content": "Done"}]
    stream = reasoning_parser("qwen3").stream()
    assert stream.feed(" <thx") == [{"content": " <thx"}]
    stream = reasoning_parser("deepseek_r1").stream()
    assert stream.feed("a </th") == [{"reasoning_content": "a"}]
    assert stream.finish() == [{"reasoning_content": " </th"}]


def test_where_qwen3_starts_inside_the_block():
    """Only a prompt that ends with an open <think> (whitespace after it allowed) starts the
    output inside the reasoning; deepseek_r1 always does."""
    assert reasoning_parser("qwen3", QWEN3_THINKING_PROMPT).starts_inside
    assert not reasoning_parser("qwen3", QWEN3_PROMPT).starts_inside
    assert not reasoning_parser("qwen3", NO_THINKING_PROMPT).starts_inside
    assert reasoning_parser("deepseek_r1").starts_inside
    with pytest.raises(ValueError, match="--reasoning-parser: unknown parser 'r2'; choose one of qwen3, deepseek_r1"):
        reasoning_parser("r2")


def test_reasoning_then_tool_calls_compose():
    """A Qwen3 turn that thinks, says a sentence and calls a tool: the reasoning stream's content
    deltas fed to the hermes stream give what the two whole parses give, for every split."""
    text = ('<think>\nThe user wants the weather; call get_weather.\n</think>\n\nChecking now.\n'
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')
    reasoning, content = reasoning_parser("qwen3").extract(text)
    rest, calls = tool_parser("hermes", counting_ids()).extract(content)
    want = (reasoning, rest, [(c.id, c.name, c.arguments) for c in calls])
    assert want == ("The user wants the weather; call get_weather.", "Checking now.",
                    [("call_0", "get_weather", '{"city":"Paris"}')])
    for cut in range(len(text) + 1):
        thinking, tools, deltas = reasoning_parser("qwen3").stream(), tool_parser("hermes", counting_ids()).stream(), []
        for d in run_stream(thinking, [text[:cut], text[cut:]]):
            deltas += tools.feed(d["content"]) if "content" in d else [d]
        message = sdk_message(deltas + tools.finish(), finish_reason="tool_calls")
        got = (message.reasoning_content, message.content,
               [(c.id, c.function.name, c.function.arguments) for c in message.tool_calls])
        assert got == want, f"cut at {cut}"


LONG = 200_000  # characters: a quadratic parser takes minutes on this much, a linear one well under a second


def test_reasoning_streams_and_blocks_are_linear_in_whitespace():
    """Issue 57: LONG spaces held back (they may precede <think> at the start, </think> in the
    reasoning), streamed 51 characters at a time (the issue's 51-space token) and in one delta;
    the answer's blocks (``whole_blocks``, the Responses and Anthropic answers) through the
    reasoning and hermes parsers, whole and fed a token at a time. Each equals the whole split;
    the parsers that re-sliced and stripped the held text per character took minutes here."""
    from engine.entrypoints.server.chat_output import ChatParsing
    from engine.entrypoints.server.output_blocks import BlockStream, whole_blocks

    spaces = " " * LONG
    cases = [  # (parser, prompt, text, reasoning, content)
        ("qwen3", QWEN3_PROMPT, spaces + "x", None, spaces + "x"),
        ("qwen3", QWEN3_PROMPT, spaces + "<think>" + spaces + "a" + spaces + "</think>" + spaces + "b", "a", "b"),
        ("qwen3", QWEN3_THINKING_PROMPT, "a" + spaces + "</thi" + spaces, "a" + spaces + "</thi" + spaces, None),
        ("deepseek_r1", "", spaces + "a" + spaces + "</think>" + spaces, "a", None),
    ]
    call = '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
    answer = spaces + "<think>" + spaces + "a" + spaces + "</think>" + spaces + "b" + spaces + call + spaces
    parsing = ChatParsing("hermes", "qwen3", tool_names=frozenset({"f"}))

    def joined(deltas):
        return tuple("".join(d.get(key, "") for d in deltas) or None for key in ("reasoning_content", "content"))

    def run():
        got = []
        for parser, prompt, text, _, _ in cases:
            by_token = run_stream(reasoning_parser(parser, prompt).stream(), [text[i:i + 51]
                                                                             for i in range(0, len(text), 51)])
            got.append((joined(by_token), joined(run_stream(reasoning_parser(parser, prompt).stream(), [text])),
                        whole(parser, prompt, text)))
        chat, blocks = parsing.stream(), BlockStream()
        for i in range(0, len(answer), 51):
            blocks.feed(chat.feed(answer[i:i + 51]))
        blocks.feed(chat.finish("stop")[0])
        blocks.finish()
        return got, whole_blocks(parsing, answer, "stop"), blocks.blocks

    got, (whole_answer, reason), streamed_answer = finishes(run)
    for (parser, prompt, text, reasoning, content), split in zip(cases, got):
        assert split == ((reasoning, content),) * 3, (parser, prompt, text[:40])
    want = [("reasoning", "a", ""), ("text", "b", ""), ("tool_call", '{"a":1}', "f")]
    assert [(b.kind, b.text, b.name) for b in whole_answer] == want and reason == "tool_calls"
    assert [(b.kind, b.text, b.name) for b in streamed_answer] == want
