"""Strict request parsing: each bad or unknown field gives a 400 naming it."""

from __future__ import annotations

import pytest

from common.priorities import Priority
from gateway.openai.schemas import parse_chat, parse_completion
from gateway.web.api_errors import ApiError

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
COMP = {"model": "m", "prompt": "hi"}


def _error(parse, body) -> ApiError:
    with pytest.raises(ApiError) as info:
        parse(body)
    assert info.value.status == 400
    assert info.value.type == "invalid_request_error"
    return info.value


def test_minimal_chat_and_defaults():
    req = parse_chat({**CHAT, "metadata": {"x": "1"}, "store": False, "service_tier": "auto",
                      "parallel_tool_calls": True, "tools": None})
    assert req.tools is None and req.n == 1 and req.grammar is None
    assert req.kind == "chat" and req.messages == [{"role": "user", "content": "hi"}]
    assert req.max_tokens is None and req.temperature == 1.0 and req.stop == () and not req.stream


def test_chat_fields_parsed():
    req = parse_chat({**CHAT, "max_completion_tokens": 7, "max_tokens": 99, "temperature": 0, "top_p": 0.5,
                      "seed": 3, "stop": "END", "stream": True, "stream_options": {"include_usage": True},
                      "logprobs": True, "top_logprobs": 1, "top_k": 5, "ignore_eos": True,
                      "priority": "batch", "n": 1, "user": "u1"})
    assert req.max_tokens == 7 and req.temperature == 0.0 and req.top_p == 0.5 and req.seed == 3
    assert req.stop == ("END",) and req.stream and req.include_usage and req.logprobs
    assert req.top_k == 5 and req.ignore_eos and req.priority == Priority.BATCH and req.user == "u1"


def test_text_parts_and_developer_role():
    req = parse_chat({"model": "m", "messages": [
        {"role": "developer", "content": "sys"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None}]})
    assert req.messages == [{"role": "system", "content": "sys"}, {"role": "user", "content": "ab"},
                            {"role": "assistant", "content": ""}]


@pytest.mark.parametrize("patch,param", [
    ({"model": 5}, "model"),
    ({"model": ""}, "model"),
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
    ({"messages": [{"role": "function", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "c"}]}]},
     "messages[0].tool_calls[0]"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages[0].content[0]"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": "10"}, "max_tokens"),
    ({"max_tokens": 1.5}, "max_tokens"),
    ({"max_completion_tokens": -1}, "max_completion_tokens"),
    ({"temperature": 2.5}, "temperature"),
    ({"temperature": True}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.1}, "top_p"),
    ({"seed": "1"}, "seed"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"stop": [""]}, "stop"),
    ({"stop": 3}, "stop"),
    ({"stream": "yes"}, "stream"),
    ({"stream_options": {"include_usage": 1}}, "include_usage"),
    ({"n": 9}, "n"),
    ({"n": 0}, "n"),
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "sometimes"}, "tool_choice"),
    ({"top_logprobs": 21}, "top_logprobs"),
    ({"priority": "urgent"}, "priority"),
    ({"top_k": 1.5}, "top_k"),
])
def test_chat_bad_fields(patch, param):
    err = _error(parse_chat, {**CHAT, **patch})
    assert err.param == param


def test_n_error_names_the_bound():
    assert "between 1 and 8" in _error(parse_chat, {**CHAT, "n": 9}).message
    assert parse_chat({**CHAT, "n": 8}).n == 8


def test_body_must_be_object():
    _error(parse_chat, ["not", "an", "object"])


def test_completion_prompt_forms():
    assert parse_completion(COMP).prompt == "hi"
    assert parse_completion({**COMP, "prompt": [1, 2, 3]}).prompt == [1, 2, 3]
    assert parse_completion({**COMP, "prompt": ["one"]}).prompt == "one"
    batch = parse_completion({**COMP, "prompt": ["a", [1, 2]]})
    assert batch.prompts == ["a", [1, 2]] and batch.prompt == "a"
    assert parse_completion({**COMP, "logprobs": 1}).logprobs


@pytest.mark.parametrize("prompt", ["", [], [1, "x"], [1, True], None, 7])
def test_completion_bad_prompt(prompt):
    assert _error(parse_completion, {**COMP, "prompt": prompt}).param == "prompt"


def test_completion_logprobs_over_one_rejected():
    assert _error(parse_completion, {**COMP, "logprobs": 6}).param == "logprobs"


@pytest.mark.parametrize("field,value", [
    ("unknown_field", {"x": 1}), ("suffix", "x"),
    ("audio", {}), ("functions", [])])
def test_unknown_and_unsupported_fields_are_400(field, value):
    assert _error(parse_chat, {**CHAT, field: value}).param == field
    assert _error(parse_completion, {**COMP, field: value}).param == field


def test_completion_only_and_chat_only_fields():
    assert _error(parse_chat, {**CHAT, "echo": False}).param == "echo"
    assert _error(parse_completion, {**COMP, "top_logprobs": 1}).param == "top_logprobs"
    assert _error(parse_completion, {**COMP, "best_of": 2}).param == "best_of"
    assert _error(parse_completion, {**COMP, "tools": []}).param == "tools"
    assert parse_completion({**COMP, "n": 2}).n == 2
    assert parse_completion({**COMP, "best_of": 1}).kind == "completion"


def test_prompt_cache_key():
    assert parse_chat({**CHAT, "prompt_cache_key": "conv-1"}).prompt_cache_key == "conv-1"
    assert _error(parse_chat, {**CHAT, "prompt_cache_key": ""}).param == "prompt_cache_key"
    assert _error(parse_chat, {**CHAT, "prompt_cache_key": 5}).param == "prompt_cache_key"


def test_sampling_controls_parsed_and_bounded():
    req = parse_chat({**CHAT, "presence_penalty": 0.5, "frequency_penalty": -1, "repetition_penalty": 1.2,
                      "min_tokens": 2, "logit_bias": {"12": -100, "7": 3.5}, "top_logprobs": 20})
    assert (req.presence_penalty, req.frequency_penalty, req.repetition_penalty) == (0.5, -1.0, 1.2)
    assert req.min_tokens == 2 and req.logit_bias == ((12, -100.0), (7, 3.5))
    assert req.top_logprobs == 20 and req.logprobs
    assert parse_completion({**COMP, "logprobs": 5}).top_logprobs == 5
    for patch, param in [({"logit_bias": {"x": 1}}, "logit_bias"), ({"logit_bias": {"1": 101}}, "logit_bias"),
                         ({"logit_bias": {"\u00b2": 1}}, "logit_bias"),
                         ({"logit_bias": {"\u0663": 1}}, "logit_bias"),
                         ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
                         ({"top_logprobs": 21}, "top_logprobs"),
                         ({"presence_penalty": 2.5}, "presence_penalty"),
                         ({"repetition_penalty": 0}, "repetition_penalty"),
                         ({"min_tokens": 5, "max_tokens": 4}, "min_tokens")]:
        assert _error(parse_chat, {**CHAT, **patch}).param == param
    assert _error(parse_completion, {**COMP, "logprobs": 6}).param == "logprobs"


def test_tools_over_the_size_limit_are_refused_before_any_schema_compiles(monkeypatch):
    """Each schema used to be compiled before the combined 64 KB limit was checked (work before a charge)."""
    from gateway.openai import tools as tools_mod

    compiled = []
    monkeypatch.setattr(tools_mod, "tool_call_spec", lambda *a, **k: compiled.append(a))
    big = {"type": "object",
           "properties": {f"p{i}": {"type": "string", "description": "x" * 40} for i in range(60)}}
    tools = [{"type": "function", "function": {"name": f"f{i}", "parameters": big}} for i in range(20)]
    assert _error(parse_chat, {**CHAT, "tools": tools}).param == "tools"
    assert compiled == []


def test_messages_are_capped():
    from gateway.openai.schemas import MAX_MESSAGES

    many = [{"role": "user", "content": "hi"}] * (MAX_MESSAGES + 1)
    assert _error(parse_chat, {**CHAT, "messages": many}).param == "messages"
    assert parse_chat({**CHAT, "messages": many[:MAX_MESSAGES]}).messages is not None
