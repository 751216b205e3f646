"""The official `openai` SDK against a real gateway + worker + Redis (the shared test stack)."""

from __future__ import annotations

import openai
import pytest

from gateway.flow.detokenize import token_byte_table
from worker.text.tokenizer import load_tokenizer

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def client(stack) -> openai.OpenAI:
    return openai.OpenAI(api_key=stack.key, base_url=stack.base_url + "/v1", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("default")


def test_models_list(client):
    assert [m.id for m in client.models.list()] == ["SmolLM2-135M-Instruct"]


def test_chat_non_streaming_paris(client, tok):
    resp = client.chat.completions.create(model="default", messages=QUESTION, temperature=0, max_tokens=20)
    assert "Paris" in resp.choices[0].message.content
    assert resp.choices[0].finish_reason in ("stop", "length")
    assert resp.usage.prompt_tokens == len(tok.apply_chat_template(QUESTION))
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens
    assert resp.usage.prompt_tokens_details.cached_tokens == 0


def test_chat_streaming_with_usage(client, tok):
    stream = client.chat.completions.create(model="default", messages=QUESTION, temperature=0, max_tokens=20,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "Paris" in text
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert last.usage.prompt_tokens == len(tok.apply_chat_template(QUESTION))
    n_content_tokens = last.usage.completion_tokens
    assert 0 < n_content_tokens <= 20


def test_completions_non_streaming_and_streaming(client, tok):
    prompt = "The capital of France is"
    resp = client.completions.create(model="default", prompt=prompt, max_tokens=4, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert resp.object == "text_completion"
    assert resp.usage.prompt_tokens == len(tok.encode(prompt)) and resp.usage.completion_tokens == 4
    assert resp.choices[0].finish_reason == "length"
    stream = client.completions.create(model="default", prompt=prompt, max_tokens=4, temperature=0,
                                       stream=True, stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == resp.choices[0].text
    assert chunks[-1].usage.completion_tokens == 4


def test_sdk_error_types(stack, client):
    bad = openai.OpenAI(api_key="sy-wrong", base_url=stack.base_url + "/v1", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.chat.completions.create(model="default", messages=QUESTION)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=QUESTION)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="default", messages=QUESTION, n=9)
    assert info.value.body["param"] == "n"
    limited = openai.OpenAI(api_key=stack.limited_key, base_url=stack.base_url + "/v1", max_retries=0)
    with pytest.raises(openai.PermissionDeniedError):
        limited.chat.completions.create(model="default", messages=QUESTION)


def test_chat_top_logprobs_and_logit_bias(client, tok):
    resp = client.chat.completions.create(model="default", messages=QUESTION, temperature=0, max_tokens=3,
                                          logprobs=True, top_logprobs=5)
    content = resp.choices[0].logprobs.content
    assert len(content) == resp.usage.completion_tokens
    for tok_lp in content:
        tops = tok_lp.top_logprobs
        assert len(tops) == 5 and tops[0].logprob == pytest.approx(tok_lp.logprob, abs=1e-4)  # greedy
        assert [t.logprob for t in tops] == sorted((t.logprob for t in tops), reverse=True)
    first = token_byte_table(tok.hf, tok.vocab_size).index(bytes(content[0].bytes))
    banned = client.chat.completions.create(model="default", messages=QUESTION, temperature=0, max_tokens=3,
                                            logprobs=True, logit_bias={str(first): -100})
    assert banned.choices[0].logprobs.content[0].token != content[0].token


def test_completion_logprobs_alternatives(client):
    resp = client.completions.create(model="default", prompt="The capital of France is", max_tokens=2,
                                     temperature=0, logprobs=3, extra_body={"ignore_eos": True})
    lp = resp.choices[0].logprobs
    assert len(lp.top_logprobs) == 2 and all(len(d) <= 3 for d in lp.top_logprobs)
    assert max(lp.top_logprobs[0].values()) == pytest.approx(lp.token_logprobs[0], abs=1e-4)


def test_unknown_and_unsupported_fields_are_400(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="default", messages=QUESTION, extra_body={"bogus": 1})
    assert err.value.body["param"] == "bogus"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="default", messages=QUESTION,
                                       functions=[{"name": "f"}])  # the deprecated form of tools
    assert err.value.body["param"] == "functions"
