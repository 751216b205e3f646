"""`n`, batches of prompts, `echo` and GET /v1/models/{id} through the official `openai` SDK against a real
gateway, Redis and worker (tiny random model, prefix cache): `n` siblings prefill the prompt's pages once."""

from __future__ import annotations

import re
import time
import urllib.request

import openai
import pytest

pytestmark = pytest.mark.timeout(240)  # the first test also starts the tools_stack
BLOCK = 16  # the worker's page size (EngineConfig.block_size)


def _prefilled(port: int) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return float(re.search(r"^switchyard_worker_prefill_tokens_computed_total (\S+)$", text, re.M).group(1))


def _settled(port: int) -> float:
    time.sleep(0.4)  # the worker refreshes its counters with every stats frame (every 0.1 s)
    return _prefilled(port)


@pytest.mark.parametrize("stream", [False, True])
def test_n_siblings_prefill_the_prompt_once(tools_stack, tools_client, stream):
    port = tools_stack[1]
    # a prompt that shares no page with any earlier request (a chat prompt would share the system turn's)
    prompt_text = f"{'Streamed' if stream else 'Whole'} " + " ".join(f"word{i}" for i in range(60))
    kw = {"model": "default", "prompt": prompt_text, "n": 4, "max_tokens": 6, "temperature": 1.0, "seed": 7,
          "extra_body": {"ignore_eos": True}}
    before = _settled(port)
    if stream:
        chunks = list(tools_client.completions.create(stream=True, stream_options={"include_usage": True},
                                                      **kw))
        texts, finishes = {}, {}
        for ch in chunks:
            for c in ch.choices:
                texts[c.index] = texts.get(c.index, "") + c.text
                finishes[c.index] = c.finish_reason or finishes.get(c.index)
        usage = chunks[-1].usage
        assert sorted(texts) == [0, 1, 2, 3] and set(finishes.values()) == {"length"}
    else:
        resp = tools_client.completions.create(**kw)
        usage = resp.usage
        assert [c.index for c in resp.choices] == [0, 1, 2, 3]
        assert {c.finish_reason for c in resp.choices} == {"length"}
        texts = {c.index: c.text for c in resp.choices}
    assert usage.completion_tokens == 4 * 6  # every choice counts; the prompt once
    assert len(set(texts.values())) > 1  # distinct seeds per choice
    prompt = usage.prompt_tokens
    tail = prompt - (prompt - 1) // BLOCK * BLOCK  # the last, partial page each sibling computes itself
    computed = _settled(port) - before
    assert computed == prompt + 3 * tail, (computed, prompt, tail)
    assert computed < 2 * prompt  # without sharing it would be 4 x prompt


def test_prompt_batch_with_n_and_echo(tools_client):
    prompts = ["The cat sat on", "One two three"]
    resp = tools_client.completions.create(model="default", prompt=prompts, n=2, max_tokens=4, temperature=0,
                                           echo=True, extra_body={"ignore_eos": True})
    assert [c.index for c in resp.choices] == [0, 1, 2, 3]
    for c in resp.choices:
        assert c.text.startswith(prompts[c.index // 2]) and len(c.text) > len(prompts[c.index // 2])
    assert resp.choices[0].text == resp.choices[1].text  # greedy siblings of one prompt agree
    one = tools_client.completions.create(model="default", prompt=prompts[1], max_tokens=4, temperature=0,
                                          extra_body={"ignore_eos": True})
    assert resp.choices[2].text == prompts[1] + one.choices[0].text
    other = tools_client.completions.create(model="default", prompt=prompts[0], max_tokens=1)
    assert resp.usage.prompt_tokens == one.usage.prompt_tokens + other.usage.prompt_tokens  # each prompt once
    assert resp.usage.completion_tokens == 4 * 4
    streamed: dict[int, str] = {}
    for ch in tools_client.completions.create(model="default", prompt=[[1, 2, 3], "Hello"], max_tokens=3,
                                              stream=True, echo=True, temperature=0,
                                              extra_body={"ignore_eos": True}):
        for c in ch.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert sorted(streamed) == [0, 1] and streamed[1].startswith("Hello")


def test_models_retrieve(tools_client):
    assert tools_client.models.retrieve("default").id == "default"
    with pytest.raises(openai.NotFoundError) as err:
        tools_client.models.retrieve("no-such-model")
    assert err.value.body["param"] == "model"
