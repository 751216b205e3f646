"""The streamed tool-call parser (`gateway.openai.tool_output`) in any chunking, and the `auto` tool grammar:
text or calls, nothing in between."""

from __future__ import annotations

import json

import llguidance
import pytest

from gateway.openai.tool_output import ToolCallStream
from worker.protocol import tool_call_spec
from worker.sample.grammar import grammar_tokenizer
from worker.text.tokenizer import load_tokenizer

CALLS_TEXT = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "a}\\n</b", "days": 2}}\n'
              '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>')


@pytest.mark.parametrize("step", [1, 3, 7, len(CALLS_TEXT)])
def test_tool_call_stream_splits_calls_in_any_chunking(step):
    parser = ToolCallStream()
    deltas: list[dict] = []
    for i in range(0, len(CALLS_TEXT), step):
        text, calls = parser.feed(CALLS_TEXT[i:i + step])
        assert text == ""
        deltas += calls
    assert parser.finish() == ("", [])
    assert [c.name for c in parser.calls] == ["get_weather", "get_time"]
    assert json.loads(parser.calls[0].arguments) == {"city": "a}\n</b", "days": 2}
    heads = [d for d in deltas if "id" in d]
    assert [d["index"] for d in heads] == [0, 1] and heads[0]["function"]["name"] == "get_weather"
    joined = "".join(d["function"]["arguments"] for d in deltas if d["index"] == 1)
    assert joined == '{"tz": "UTC"}'


def test_tool_call_stream_text_and_cut_calls():
    parser = ToolCallStream()
    assert parser.feed("<tool") == ("", [])  # might still open a call: held back
    assert parser.feed("s are fun") == ("<tools are fun", []) and parser.mode == "text"
    cut = ToolCallStream()
    cut.feed('<tool_call>\n{"name": "f", "arguments": {"a": 1')
    _, tail = cut.finish()
    assert cut.calls[0].arguments == '{"a": 1' and "".join(d["function"]["arguments"] for d in tail)


def test_auto_grammar_allows_text_or_calls_only():
    from worker.protocol.grammar_spec import grammar_text

    spec = tool_call_spec([{"name": "f", "parameters": {"type": "object"}}], auto=True)
    grammar = grammar_text(spec)
    tok = load_tokenizer("default")
    lt = grammar_tokenizer(tok)
    for text, ok in [("plain words", True),
                     ('<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>', True),
                     ("<tool_call>oops", False), ("  <tool_call>oops", False),
                     ('<tool_call>\n{"name": "g"', False)]:
        m = llguidance.LLMatcher(lt, grammar, log_level=0)
        assert all(m.consume_token(t) for t in tok.encode(text, add_special_tokens=False)) == ok, text
    assert spec != tool_call_spec([{"name": "f", "parameters": {"type": "object"}}])


def test_a_seeded_parser_names_its_calls_the_same_each_time():
    def ids(parser: ToolCallStream) -> list[str]:
        parser.feed(CALLS_TEXT)
        return [c.id for c in parser.calls]

    first, again = ids(ToolCallStream("resp_1:0")), ids(ToolCallStream("resp_1:0"))
    assert first == again and len(set(first)) == 2 and all(len(i) == 29 for i in first)  # call_ + 24 hex
    assert ids(ToolCallStream("resp_1:1")) != first and ids(ToolCallStream()) != ids(ToolCallStream())
