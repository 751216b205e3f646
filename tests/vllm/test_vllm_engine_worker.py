"""A vLLM-engine worker (vLLM's CPU build, the default model as an HF folder) behind a real gateway and
Redis, driven with the `openai` SDK: the OpenAI features the end-to-end tests cover,
tenant-salted caching, aborts."""

from __future__ import annotations

import io
import json
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from config.local_stack.launcher import Stack, StackConfig, free_port

pytestmark = pytest.mark.vllm

# ~400 tokens of natural text (several of vLLM's 128-token CPU blocks)
LONG_TEXT = (Path(__file__).resolve().parents[2] / "README.md").read_text()[:1800]
QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("hf") / "SmolLM2-135M-Instruct"
    subprocess.run([sys.executable, "-m", "worker.vllm_engine.hf_folder", "default", str(out)], check=True,
                   timeout=600, capture_output=True)
    return out


@pytest.fixture(scope="module")
def vllm_stack(hf_model: Path, vllm_env: None) -> Iterator[tuple[Stack, int]]:
    metrics_port = free_port()
    logs = Path(tempfile.mkdtemp(prefix="sy-vllm-test-"))
    stack = Stack(StackConfig(
        port=free_port(), log_dir=logs, ready_timeout=900.0, model=str(hf_model),
        worker_args=["--engine", "vllm", "--engine-args", "--max-model-len 2048",
                     "--metrics-port", str(metrics_port), "--metrics-host", "127.0.0.1"],
        gateway_args=["--worker-timeout", "60", "--stream-detach-grace", "0",
                      "--files-dir", str(logs / "files")]))
    try:
        stack.start()
        yield stack, metrics_port
    finally:
        stack.stop()


def _client(stack: Stack, tenant: str) -> openai.OpenAI:
    key = stack.create_tenant(tenant, max_concurrent=64)
    return openai.OpenAI(api_key=key, base_url=stack.base_url + "/v1", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def client(vllm_stack: tuple[Stack, int]) -> openai.OpenAI:
    return _client(vllm_stack[0], "vllm-a")


def test_the_registry_names_the_engine_and_the_folder(vllm_stack: tuple[Stack, int], hf_model: Path):
    from common.worker_registry import REGISTRY_SET_KEY, parse_registration, registration_key
    from tenancy.redis_client import sync_client

    r = sync_client(vllm_stack[0].redis_url)
    try:
        ids = [w.decode() for w in r.zrange(REGISTRY_SET_KEY, 0, -1)]
        regs = [parse_registration(r.get(registration_key(w))) for w in ids]
    finally:
        r.close()
    assert [(reg.engine, reg.spec, reg.model) for reg in regs] == [("vllm", str(hf_model), hf_model.name)]


def test_greedy_chat_streams_what_it_answers_whole(client: openai.OpenAI):
    whole = client.chat.completions.create(model="default", messages=QUESTION, max_tokens=24, temperature=0)
    text = whole.choices[0].message.content
    assert "Paris" in text
    assert whole.choices[0].finish_reason == "stop" and "<|im_end|>" not in text  # the stop token is not text
    assert whole.usage.completion_tokens >= 1 and whole.usage.prompt_tokens > 10
    stream = client.chat.completions.create(model="default", messages=QUESTION, max_tokens=24, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_length_logprobs_and_n(client: openai.OpenAI):
    resp = client.completions.create(model="default", prompt="The capital of France is", max_tokens=8,
                                     temperature=0, logprobs=3)
    choice = resp.choices[0]
    assert choice.finish_reason == "length" and resp.usage.completion_tokens == 8
    lp = choice.logprobs
    assert len(lp.tokens) == 8 and all(len(top) == 3 for top in lp.top_logprobs)
    for chosen, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert max(top.values()) == pytest.approx(logprob, abs=1e-4) and chosen in top  # greedy: the top one
    many = client.completions.create(model="default", prompt="Once upon a time", max_tokens=6, n=3,
                                     temperature=1.0, seed=11)
    assert len(many.choices) == 3 and sorted(c.index for c in many.choices) == [0, 1, 2]
    assert many.usage.completion_tokens == 18


def test_logit_bias_and_stop_sequences(client: openai.OpenAI):
    resp = client.completions.create(model="default", prompt="Hello", max_tokens=5, temperature=0,
                                     logit_bias={"28": 100})  # token 28 is ","
    assert resp.usage.completion_tokens == 5 and resp.choices[0].text == ",,,,,"
    stop = client.chat.completions.create(model="default", messages=QUESTION, max_tokens=24, temperature=0,
                                          stop=["aris"])
    assert stop.choices[0].finish_reason == "stop" and "aris" not in stop.choices[0].message.content


def test_structured_output_and_tool_calls(client: openai.OpenAI):
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "population": {"type": "integer"}},
              "required": ["city", "population"], "additionalProperties": False}
    resp = client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": "Name a big city as JSON."}], max_tokens=60,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": schema}})
    value = json.loads(resp.choices[0].message.content)
    assert set(value) == {"city", "population"} and isinstance(value["population"], int)
    tools = [{"type": "function", "function": {
        "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                              "required": ["city"]}}}]
    call = client.chat.completions.create(model="default", max_tokens=200, temperature=0, tools=tools,
                                          tool_choice="required",
                                          messages=[{"role": "user", "content": "Weather in Paris?"}])
    calls = call.choices[0].message.tool_calls
    assert call.choices[0].finish_reason == "tool_calls", call.choices[0]
    assert calls[0].function.name == "get_weather"
    assert "city" in json.loads(calls[0].function.arguments)


def test_responses_api_whole_streamed_and_chained(client: openai.OpenAI):
    question = QUESTION[0]["content"]
    first = client.responses.create(model="default", input=question, temperature=0, max_output_tokens=20)
    assert first.status in ("completed", "incomplete") and "Paris" in first.output_text
    events = list(client.responses.create(model="default", input=question, temperature=0,
                                          max_output_tokens=20, stream=True))
    assert events[-1].type == "response.completed" and events[-1].response.output_text == first.output_text
    follow = client.responses.create(model="default", input="And of Germany?", temperature=0,
                                     max_output_tokens=20, previous_response_id=first.id)
    assert follow.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens


def test_a_batch_runs_at_batch_priority_to_completion(client: openai.OpenAI):
    lines = [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": "default", "messages": QUESTION, "max_tokens": 8, "temperature": 0}}
             for i in range(3)]
    data = b"".join(json.dumps(line).encode() + b"\n" for line in lines)
    fid = client.files.create(file=("b.jsonl", io.BytesIO(data)), purpose="batch").id
    batch = client.batches.create(input_file_id=fid, endpoint="/v1/chat/completions", completion_window="24h")
    deadline = time.monotonic() + 120
    while (batch := client.batches.retrieve(batch.id)).status not in ("completed", "failed"):
        assert time.monotonic() < deadline, f"batch still {batch.status}"
        time.sleep(0.2)
    assert batch.status == "completed" and batch.request_counts.completed == 3
    out = [json.loads(x) for x in client.files.content(batch.output_file_id).content.splitlines()]
    assert sorted(x["custom_id"] for x in out) == ["r0", "r1", "r2"]
    assert all("Paris" in x["response"]["body"]["choices"][0]["message"]["content"] for x in out)


def test_tenants_never_share_cached_blocks(vllm_stack: tuple[Stack, int], client: openai.OpenAI):
    other = _client(vllm_stack[0], "vllm-b")

    def cached(c: openai.OpenAI) -> int:
        resp = c.completions.create(model="default", prompt=LONG_TEXT, max_tokens=2, temperature=0)
        assert resp.usage.prompt_tokens > 300
        return resp.usage.prompt_tokens_details.cached_tokens

    assert cached(client) == 0
    assert cached(client) >= 128  # vLLM's whole blocks (128 tokens on CPU), salted with this tenant
    assert cached(other) == 0  # the same text under another tenant's salt
    assert cached(other) >= 128


def test_a_closed_stream_frees_its_request(vllm_stack: tuple[Stack, int], client: openai.OpenAI):
    stream = client.completions.create(model="default", prompt="Count: 1, 2, 3,", max_tokens=400,
                                       temperature=0, stream=True)
    for i, _ in enumerate(stream):
        if i == 2:
            break
    stream.close()
    deadline = time.monotonic() + 30
    while _gauge(vllm_stack[1], "switchyard_worker_running_requests") != 0.0:
        assert time.monotonic() < deadline, "the aborted request still runs"
        time.sleep(0.2)
    again = client.completions.create(model="default", prompt="Hi", max_tokens=2, temperature=0)
    assert again.usage.completion_tokens == 2


def test_bad_input_gets_a_400_naming_the_field(client: openai.OpenAI):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="default", prompt="Hi", max_tokens=5000)
    assert err.value.body["param"] == "max_tokens"


def _gauge(port: int, name: str) -> float | None:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    return None


def test_sigterm_drains_running_streams_to_their_end(vllm_stack: tuple[Stack, int], client: openai.OpenAI):
    """Last in this module: the worker stops. A lone worker finishes its streams in place (no hand-over)."""
    stream = client.completions.create(model="default", prompt="Count: 1, 2, 3,", max_tokens=120,
                                       temperature=0, stream=True, extra_body={"ignore_eos": True},
                                       stream_options={"include_usage": True})
    chunks = []
    for chunk in stream:
        chunks.append(chunk)
        if len(chunks) == 3:
            vllm_stack[0].procs["worker"].send_signal(signal.SIGTERM)
    assert chunks[-1].usage.completion_tokens == 120
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert vllm_stack[0].procs["worker"].wait(timeout=60) == 0
