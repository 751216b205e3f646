"""OpenAI's prompt_cache_retention: parsed, checked (a 400 naming it), carried to the worker in sampling."""

from __future__ import annotations

import pytest

from gateway.openai.schemas import parse_chat, parse_completion
from gateway.web.api_errors import ApiError
from worker.protocol import SamplingParams

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("value", ["in_memory", "24h"])
def test_accepted_values_pass_through(value):
    assert parse_chat({**CHAT, "prompt_cache_retention": value}).prompt_cache_retention == value
    assert (parse_completion({"model": "m", "prompt": "x", "prompt_cache_retention": value})
            .prompt_cache_retention == value)
    sp = SamplingParams(cache_retention=value)
    assert SamplingParams.from_dict(sp.to_dict()).cache_retention == value


def test_absent_or_null_is_the_default_and_not_sent():
    assert parse_chat(CHAT).prompt_cache_retention == ""
    assert parse_chat({**CHAT, "prompt_cache_retention": None}).prompt_cache_retention == ""
    assert "cache_retention" not in SamplingParams().to_dict()  # an older worker sees the map it knows


@pytest.mark.parametrize("value", ["1h", "forever", "", 24, True])
def test_other_values_are_a_400_naming_it(value):
    with pytest.raises(ApiError) as info:
        parse_chat({**CHAT, "prompt_cache_retention": value})
    assert info.value.status == 400 and info.value.param == "prompt_cache_retention"


def test_the_worker_refuses_a_bad_value_too():
    with pytest.raises(Exception) as info:
        SamplingParams(cache_retention="1h").validate(100)
    assert getattr(info.value, "param", None) == "prompt_cache_retention"
