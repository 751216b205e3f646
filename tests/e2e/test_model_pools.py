"""Two real models served at once behind one gateway with model pools (`--model-pools`), through the `openai`
SDK: the default model as version v1 and the tiny random model as version v2, in the Redis worker registry,
with a weighted alias between them. Each request reaches the model its version header names (same greedy
output as asking that version directly), weights hold within tolerance, choices stick, an alias edit applies
within a second, and a version taken away drains its streams and the alias falls back to the other."""

from __future__ import annotations

import signal
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import redis

from config.local_stack.launcher import GatewayProc, WorkerProc
from router import ALIASES_KEY, encode_alias
from tenancy import tenant_with_new_key

V1 = "SmolLM2-135M-Instruct@v1"
V2 = "tiny-random@v2"
HEADER = "x-switchyard-model-version"


@pytest.fixture(scope="module")
def fleet(redis_server) -> Iterator[dict]:  # noqa: ANN001
    url = redis_server.url
    r = redis.Redis.from_url(url)
    r.hset(ALIASES_KEY, "canary", encode_alias({V1: 50, V2: 50}))
    logs = Path(tempfile.mkdtemp(prefix="sy-pools-"))
    common = ["--dtype", "float32", "--drain-handoff", "-1", "--drain-timeout", "30"]
    workers = [WorkerProc(logs, model="default", redis_url=url, worker_id="pool-v1",
                          extra=[*common, "--model-version", "v1"]),
               WorkerProc(logs, model="tiny-random", redis_url=url, worker_id="pool-v2",
                          extra=[*common, "--model-version", "v2"])]
    gw = GatewayProc.spawn(logs, ["--redis-url", url, "--model-pools", "--worker-timeout", "10"])
    gw2 = GatewayProc.spawn(logs, ["--redis-url", url, "--model-pools", "--worker-timeout", "10"])
    try:
        key = tenant_with_new_key(url, "pools", max_concurrent=64)
        c = openai.OpenAI(api_key=key, base_url=gw.base_url + "/v1", max_retries=0, timeout=60)
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            if any(p.proc.poll() is not None for p in (gw, gw2, *workers)):
                raise RuntimeError(f"a process exited during start-up; logs in {logs}")
            try:
                if {V1, V2} <= {m.id for m in c.models.list()} and gw2.ready():
                    break
            except openai.APIError:
                pass
            time.sleep(0.5)
        else:
            raise TimeoutError(f"both versions not live after 180 s; logs in {logs}")
        c2 = openai.OpenAI(api_key=key, base_url=gw2.base_url + "/v1", max_retries=0, timeout=60)
        yield {"client": c, "client2": c2, "redis": r, "workers": workers, "logs": logs, "url": url,
               "gateway": gw}
    finally:
        gw.kill()
        gw2.kill()
        for w in workers:
            w.stop()
        r.delete(ALIASES_KEY)
        r.close()


def _complete(client: openai.OpenAI, model: str, prompt: str, max_tokens: int = 4) -> tuple[str, str, str]:
    raw = client.completions.with_raw_response.create(model=model, prompt=prompt, max_tokens=max_tokens,
                                                      temperature=0)
    resp = raw.parse()
    return raw.headers[HEADER], resp.model, resp.choices[0].text


def test_models_lists_versions_model_names_and_aliases(fleet) -> None:  # noqa: ANN001
    ids = {m.id for m in fleet["client"].models.list()}
    assert {V1, V2, "canary", "default", "SmolLM2-135M-Instruct", "tiny-random"} <= ids
    with pytest.raises(openai.NotFoundError) as info:
        _complete(fleet["client"], "no-such-model", "x")
    assert info.value.code == "model_not_found"


def test_each_request_reaches_the_version_its_header_names(fleet) -> None:  # noqa: ANN001
    c = fleet["client"]
    prompts = [f"Fact number {i}: the sun" for i in range(24)]
    direct = {v: {p: _complete(c, v, p)[2] for p in prompts[:4]} for v in (V1, V2)}
    assert direct[V1] != direct[V2]  # the two models answer differently
    seen = []
    for p in prompts:
        version, model, text = _complete(c, "canary", p)
        assert model == version
        if p in direct[version]:
            assert text == direct[version][p]
        seen.append(version)
        assert _complete(c, "canary", p)[0] == version  # sticky: the same prompt head keeps its version
    assert 0.2 <= seen.count(V2) / len(seen) <= 0.8  # 50/50 within tolerance for 24 keys


def test_the_allow_list_and_per_version_metrics(fleet) -> None:  # noqa: ANN001
    key = tenant_with_new_key(fleet["url"], "tiny-only", allowed_models="tiny-random")
    c = openai.OpenAI(api_key=key, base_url=fleet["gateway"].base_url + "/v1", max_retries=0, timeout=60)
    assert {m.id for m in c.models.list()} == {V2, "tiny-random"}
    assert _complete(c, V2, "hello")[0] == V2
    with pytest.raises(openai.PermissionDeniedError) as info:
        _complete(c, V1, "hello")
    assert info.value.code == "model_not_allowed"
    with urllib.request.urlopen(fleet["gateway"].base_url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    for version in (V1, V2):
        assert f'switchyard_version_requests_total{{outcome="ok",version="{version}"}}' in text
        assert f'switchyard_version_tokens_total{{kind="completion",version="{version}"}}' in text


def test_an_alias_edit_applies_on_every_gateway_within_a_second(fleet) -> None:  # noqa: ANN001
    before = [_complete(fleet["client2"], "canary", f"edit {i}")[0] for i in range(6)]
    # replicas agree
    assert before == [_complete(fleet["client"], "canary", f"edit {i}")[0] for i in range(6)]
    fleet["redis"].hset(ALIASES_KEY, "canary", encode_alias({V1: 0, V2: 100}))
    time.sleep(1.0)
    for client in (fleet["client"], fleet["client2"]):
        assert {_complete(client, "canary", f"edit {i}")[0] for i in range(6)} == {V2}
    fleet["redis"].hset(ALIASES_KEY, "canary", "{broken")  # malformed: the last good record stays
    time.sleep(1.0)
    assert {_complete(fleet["client"], "canary", f"edit {i}")[0] for i in range(6)} == {V2}


def test_a_version_taken_away_drains_its_streams_and_the_alias_falls_back(fleet) -> None:  # noqa: ANN001
    c = fleet["client"]
    stream = c.completions.create(model=V2, prompt="Count:", max_tokens=600, temperature=0, stream=True,
                                  extra_body={"ignore_eos": True})
    chunks = iter(stream)
    first = next(chunks)
    fleet["workers"][1].signal(signal.SIGTERM)
    rest = list(chunks)
    finish = [ch.choices[0].finish_reason for ch in [first, *rest] if ch.choices]
    assert finish[-1] == "length"
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and V2 in {m.id for m in c.models.list()}:
        time.sleep(0.2)
    # v2 has weight 100 but is gone
    assert {_complete(c, "canary", f"after {i}")[0] for i in range(4)} == {V1}
