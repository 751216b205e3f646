"""Streams resumed on another gateway: two real gateways over one `tiny-random` worker (fp32, greedy) and
Redis.

A client reads part of a stream from gateway A, drops its connection and reconnects to gateway B
(`Last-Event-ID` on chat, `starting_after` on responses): the events it missed, then the live tail, give the
text and usage of an undisturbed run, with no event twice. A background run streams from B (raw, and through
the `openai` SDK's `responses.retrieve(stream=True, starting_after=...)`). A SIGKILLed gateway's stream
is carried on by B: the events it logged, then its worker request again after the logged tokens (a body of any
size the gateway accepts: one over 256 KiB too)."""

from __future__ import annotations

import contextlib
import datetime
import json
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
import redis

from tenancy.schema import leases_key, usage_key
from tests.faults.cluster import FaultCluster, gateway_log_records, unattributed_errors

# two gateways and a worker: a long multi-process scenario, `make test-heavy` (its own CI step)
pytestmark = [pytest.mark.timeout(240), pytest.mark.heavy]
CHAT = {"model": "default", "messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": 120,
        "ignore_eos": True, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
RESP = {"model": "default", "input": "Tell me a story.", "max_output_tokens": 120, "temperature": 0,
        "stream": True}


@pytest.fixture(scope="module")
def cluster() -> Iterator[FaultCluster]:
    c = FaultCluster.start(workers=1, gateways=2, worker_args=("--no-prefix-cache",),
                           gateway_settings={"stream_detach_grace": 30})
    yield c
    c.stop()


@pytest.fixture(scope="module")
def key(cluster: FaultCluster) -> str:
    return cluster.create_tenant("streams")


def sse(lines: list[str]) -> list[tuple[str | None, str | None, str]]:
    """(id, event, data) of each event in these lines."""
    out, eid, kind = [], None, None
    for line in lines:
        if line.startswith("id: "):
            eid = line[4:]
        elif line.startswith("event: "):
            kind = line[7:]
        elif line.startswith("data: "):
            out.append((eid, kind, line[6:]))
            eid = kind = None
    return out


def read(http: httpx.Client, method: str, url: str, key: str, *, body: dict | None = None,
         headers: dict | None = None,
         stop_after: int | None = None) -> list[tuple[str | None, str | None, str]]:
    lines, events = [], 0
    with http.stream(method, url, json=body,
                     headers={"authorization": f"Bearer {key}", **(headers or {})}) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            lines.append(line)
            events += line.startswith("data: ")
            if stop_after is not None and events >= stop_after:
                break  # the client drops its connection
    return sse(lines)


def chat_text(events: list) -> tuple[str, dict | None]:
    text, usage = "", None
    for _, _, data in events:
        if data == "[DONE]":
            continue
        obj = json.loads(data)
        assert "error" not in obj, obj
        text += "".join(c["delta"].get("content") or "" for c in obj["choices"])
        usage = obj.get("usage") or usage
    return text, usage


def response_text(events: list) -> tuple[str, dict]:
    text, final = "", {}
    for _, kind, data in events:
        obj = json.loads(data)
        assert kind != "error", obj
        if kind == "response.output_text.delta":
            text += obj["delta"]
        final = obj
    return text, final


def test_a_chat_stream_resumes_on_another_gateway(cluster: FaultCluster, key: str):
    a, b = (g.base_url for g in cluster.gateways)
    with httpx.Client(timeout=60) as http:
        whole = read(http, "POST", a + "/v1/chat/completions", key, body=CHAT)
        part = read(http, "POST", a + "/v1/chat/completions", key, body=CHAT, stop_after=15)
        last = part[-1][0]
        assert last is not None and last.endswith(":14") and last.startswith(json.loads(part[0][2])["id"])
        rest = read(http, "POST", b + "/v1/chat/completions", key, headers={"last-event-id": last})
    assert [int(e[0].rpartition(":")[2]) for e in part + rest] == list(range(len(part) + len(rest)))
    text, usage = chat_text(part + rest)
    assert (text, usage["completion_tokens"]) == (chat_text(whole)[0],
                                                  chat_text(whole)[1]["completion_tokens"])
    assert rest[-1][2] == "[DONE]"


def test_a_response_stream_resumes_with_starting_after(cluster: FaultCluster, key: str):
    a, b = (g.base_url for g in cluster.gateways)
    with httpx.Client(timeout=60) as http:
        whole = read(http, "POST", a + "/v1/responses", key, body=RESP)
        part = read(http, "POST", a + "/v1/responses", key, body=RESP, stop_after=12)
        rid = json.loads(part[0][2])["response"]["id"]
        rest = read(http, "GET", f"{b}/v1/responses/{rid}?stream=true&starting_after=11", key)
        with pytest.raises(AssertionError, match="404"):  # another tenant's response: not found
            read(http, "GET", f"{b}/v1/responses/{rid}?stream=true", cluster.create_tenant("other"))
    assert [int(e[0]) for e in part + rest] == [json.loads(e[2])["sequence_number"] for e in part + rest] \
        == list(range(len(part) + len(rest)))
    (text, final), (want, done) = response_text(part + rest), response_text(whole)
    # max_output_tokens reached
    assert text == want and final["type"] == done["type"] == "response.incomplete"
    assert final["response"]["usage"]["output_tokens"] == done["response"]["usage"]["output_tokens"]


def test_a_background_run_streams_from_another_gateway(cluster: FaultCluster, key: str):
    a, b = (g.base_url for g in cluster.gateways)
    auth = {"authorization": f"Bearer {key}"}
    with httpx.Client(timeout=60) as http:
        started = http.post(a + "/v1/responses", json={**RESP, "stream": False, "background": True},
                            headers=auth)
        rid = started.json()["id"]
        events = read(http, "GET", f"{b}/v1/responses/{rid}?stream=true", key)
        stored = http.get(f"{b}/v1/responses/{rid}", headers=auth).json()
    text, final = response_text(events)
    assert final["type"] == "response.incomplete" and stored["status"] == "incomplete"
    assert text == stored["output"][0]["content"][0]["text"] and events[0][1] == "response.created"


def test_the_openai_sdk_follows_a_background_run_from_another_gateway(cluster: FaultCluster, key: str):
    a, b = (openai.OpenAI(api_key=key, base_url=g.base_url + "/v1", max_retries=0, timeout=60)
            for g in cluster.gateways)
    started = a.responses.create(model="default", input="Tell me a story.", max_output_tokens=40,
                                 temperature=0, background=True)
    events = list(b.responses.retrieve(started.id, stream=True, starting_after=2))
    assert [e.sequence_number for e in events] == list(range(3, 3 + len(events)))
    done = b.responses.retrieve(started.id)
    assert events[-1].type == f"response.{done.status}" and events[-1].response.id == started.id
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == done.output_text
    chunks = list(a.chat.completions.create(model="default", messages=CHAT["messages"], max_tokens=8,
                                            stream=True, extra_body={"ignore_eos": True}))
    assert len(chunks) >= 8  # the SDK reads streams whose events carry ids (8 tokens, eos ignored)


def test_reconnects_that_cannot_be_served_name_their_field(cluster: FaultCluster, key: str):
    a, b = (g.base_url for g in cluster.gateways)
    with httpx.Client(timeout=60) as http:
        part = read(http, "POST", a + "/v1/chat/completions", key, body={**CHAT, "max_tokens": 4})
        other = {"authorization": f"Bearer {cluster.create_tenant('other')}", "last-event-id": part[0][0]}
        cases = [(b + "/v1/chat/completions", other, 404, "Last-Event-ID"),  # another tenant's stream
                 (b + "/v1/completions", {**other, "authorization": f"Bearer {key}"}, 400, "Last-Event-ID"),
                 (b + "/v1/responses", {"authorization": f"Bearer {key}", "last-event-id": "3"}, 400,
                  "Last-Event-ID")]
        for url, headers, status, param in cases:
            resp = http.post(url, json={}, headers=headers)
            assert (resp.status_code, resp.json()["error"]["param"]) == (status, param), resp.text


def usage_today(cluster: FaultCluster, tenant: str) -> dict[str, int]:
    day = datetime.datetime.now(datetime.UTC).strftime("%Y%m%d")
    with redis.Redis.from_url(cluster.redis.url) as r:
        return {k.decode(): int(v) for k, v in r.hgetall(usage_key(tenant, day)).items()}


def output_text(response: dict) -> str:
    return "".join(c["text"] for item in response["output"] for c in item.get("content") or [])


def read_until_cut(it: Iterator[str], lines: list[str]) -> None:
    """The rest of a stream whose gateway is killed: its lines until the connection breaks."""
    with contextlib.suppress(httpx.HTTPError):
        for line in it:
            lines.append(line)


def test_a_killed_gateway_s_streams_are_carried_on_by_another(cluster: FaultCluster):  # last: it kills A
    a, b = cluster.gateways
    key = cluster.create_tenant("carried")
    auth = {"authorization": f"Bearer {key}"}
    with httpx.Client(timeout=60) as http:
        whole_chat = chat_text(read(http, "POST", b.base_url + "/v1/chat/completions", key, body=CHAT))
        whole_resp = response_text(read(http, "POST", b.base_url + "/v1/responses", key, body=RESP))
        long_run = {**RESP, "max_output_tokens": 1500, "stream": False}
        whole_run = http.post(b.base_url + "/v1/responses", json=long_run, headers=auth).json()
        before = usage_today(cluster, "carried")
        run = http.post(a.base_url + "/v1/responses", json={**long_run, "background": True},
                        headers=auth).json()
        with contextlib.ExitStack() as stack:
            # the third: the chat request in a body of 300 KB (JSON whitespace), kept whole for carrying on
            big = json.dumps(CHAT).encode() + b" " * 300_000
            bodies = [("/v1/chat/completions", json.dumps(CHAT).encode()),
                      ("/v1/responses", json.dumps(RESP).encode()), ("/v1/chat/completions", big)]
            streams = [stack.enter_context(http.stream("POST", a.base_url + path, content=body,
                                                       headers={**auth, "content-type": "application/json"}))
                       for path, body in bodies]
            lines: list[list[str]] = [[], [], []]
            its = [resp.iter_lines() for resp in streams]
            for it, seen in zip(its, lines, strict=True):
                while sum(x.startswith("data: ") for x in seen) < 12:
                    seen.append(next(it))
            a.kill()
            for it, seen in zip(its, lines, strict=True):
                read_until_cut(it, seen)
        chat_part, resp_part, big_part = sse(lines[0]), sse(lines[1]), sse(lines[2])
        chat_rest = read(http, "POST", b.base_url + "/v1/chat/completions", key,
                         headers={"last-event-id": chat_part[-1][0]})
        big_rest = read(http, "POST", b.base_url + "/v1/chat/completions", key,
                        headers={"last-event-id": big_part[-1][0]})
        rid = json.loads(resp_part[0][2])["response"]["id"]
        resp_rest = read(http, "GET", f"{b.base_url}/v1/responses/{rid}?stream=true"
                         f"&starting_after={resp_part[-1][0]}", key)
        deadline = time.monotonic() + 60  # nobody reads the background run: a sweeper carries it on
        while (done := http.get(f"{b.base_url}/v1/responses/{run['id']}", headers=auth).json())["status"] \
                in ("queued", "in_progress"):
            assert time.monotonic() < deadline, done
            time.sleep(0.2)
    assert (done["status"], output_text(done), done["usage"]) == (
        whole_run["status"], output_text(whole_run), whole_run["usage"])
    assert [int(e[0].rpartition(":")[2]) for e in chat_part + chat_rest[:-1]] == list(
        range(len(chat_part) + len(chat_rest) - 1))
    assert chat_text(chat_part + chat_rest) == whole_chat  # the text and usage of an undisturbed run
    assert chat_text(big_part + big_rest) == whole_chat
    text, final = response_text(resp_part + resp_rest)
    assert [int(e[0]) for e in resp_part + resp_rest] == list(range(len(resp_part) + len(resp_rest)))
    assert (text, final["response"]["usage"]) == (whole_resp[0], whole_resp[1]["response"]["usage"])
    after = usage_today(cluster, "carried")
    want = 2 * whole_chat[1]["completion_tokens"] + whole_resp[1]["response"]["usage"]["output_tokens"]
    metered = {k: after[k] - before.get(k, 0) for k in ("requests", "completion_tokens")}
    want += whole_run["usage"]["output_tokens"]
    assert metered == {"requests": 4, "completion_tokens": want}  # once, by the gateway that carried them on
    with redis.Redis.from_url(cluster.redis.url) as r:
        assert r.zcard(leases_key("carried")) == 0  # the lost gateway's leases are settled
    carried = [r["msg"] for r in gateway_log_records(b)[0] if "carrying on stream" in r.get("msg", "")]
    assert len(carried) == 4, carried  # B carried them on (they had not ended when A died)
    assert not unattributed_errors(b)
