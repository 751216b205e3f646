"""The unknown-key gate in front of the gateway app: missing, malformed and unknown keys get the app's 401
(OpenAI error body, `www-authenticate`, a request id, counted) without reaching the app; known keys, a key
directory that fails and a draining gateway go on to the app. A small unread body is drained so the connection
stays usable."""

from __future__ import annotations

from types import SimpleNamespace

from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from gateway.telemetry import gateway_metrics
from gateway.web.auth_gate import UnknownKeyGate
from tenancy.apikeys import digest

KNOWN = "sy-" + "k" * 40
UNKNOWN = "sy-" + "u" * 40


class Keys:
    def __init__(self) -> None:
        self.fail = False
        self.lookups = 0

    async def key_owner(self, d: str) -> str | None:
        self.lookups += 1
        if self.fail:
            raise ConnectionError("redis down")
        return "acme" if d == digest(KNOWN) else None


def gated() -> tuple[TestClient, list[str], Keys]:
    reached: list[str] = []

    async def completions(request):  # noqa: ANN001, ANN202
        reached.append(request.headers.get("authorization", ""))
        return JSONResponse({"ok": True})

    app = Starlette(routes=[Route("/v1/completions", completions, methods=["POST"])])
    keys = Keys()
    app.state.service = SimpleNamespace(tenants=keys)
    app.state.drain = SimpleNamespace(draining=False)
    return TestClient(UnknownKeyGate(app)), reached, keys


def post(client: TestClient, key: str | None, body: bytes = b'{"model": "m"}'):  # noqa: ANN201
    headers = {"content-type": "application/json", "x-request-id": "req-test-1"}
    if key is not None:
        headers["authorization"] = f"Bearer {key}"
    return client.post("/v1/completions", content=body, headers=headers)


def test_missing_malformed_and_unknown_keys_are_refused_in_front_of_the_app() -> None:
    client, reached, keys = gated()
    before = gateway_metrics.current().requests.labels("401")._value.get()
    for key, words in ((None, "Missing API key"), ("not-a-key", "Invalid"), (UNKNOWN, "Invalid")):
        resp = post(client, key)
        assert resp.status_code == 401 and words in resp.json()["error"]["message"]
        assert (resp.json()["error"]["code"] == "invalid_api_key"
                and resp.json()["error"]["type"] == "invalid_request_error")
        assert resp.headers["www-authenticate"] == "Bearer" and resp.headers["x-request-id"] == "req-test-1"
        assert "connection" not in resp.headers  # the small body was drained: keep-alive holds
    assert reached == [] and keys.lookups == 1  # only the well-formed key needed a look-up
    assert gateway_metrics.current().requests.labels("401")._value.get() == before + 3


def test_known_keys_failures_and_draining_go_on_to_the_app() -> None:
    client, reached, keys = gated()
    assert post(client, KNOWN).status_code == 200
    keys.fail = True
    assert post(client, UNKNOWN).status_code == 200  # the app decides (it answers 503 when Redis is down)
    keys.fail = False
    client.app.state.drain.draining = True
    assert post(client, UNKNOWN).status_code == 200  # the app's drain gate answers while draining
    assert reached == [f"Bearer {KNOWN}", f"Bearer {UNKNOWN}", f"Bearer {UNKNOWN}"]


def test_a_large_unread_body_closes_the_connection() -> None:
    client, reached, _ = gated()
    resp = post(client, UNKNOWN, b'{"prompt": "' + b"x" * (80 * 1024) + b'"}')
    assert resp.status_code == 401 and resp.headers["connection"] == "close" and reached == []
