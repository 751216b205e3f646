"""/metrics on the gateway's public port: loopback clients, or a bearer metrics token; anyone else gets a 404
(it once answered all, showing worker ids and per-tenant volumes). Worker metrics bind loopback by default."""

from __future__ import annotations

from starlette.applications import Starlette
from starlette.routing import Route
from starlette.testclient import TestClient

from config.settings import WorkerSettings
from gateway.telemetry.gateway_metrics import guarded_endpoint


def _client(token: str | None, host: str) -> TestClient:
    app = Starlette(routes=[Route("/metrics", guarded_endpoint(token), methods=["GET"])])
    return TestClient(app, client=(host, 50000))


def test_off_loopback_needs_the_token():
    assert _client(None, "10.1.2.3").get("/metrics").status_code == 404
    client = _client("s3cret", "10.1.2.3")
    assert client.get("/metrics").status_code == 404
    assert client.get("/metrics", headers={"authorization": "Bearer wrong"}).status_code == 404
    ok = client.get("/metrics", headers={"authorization": "Bearer s3cret"})
    assert ok.status_code == 200 and "# TYPE" in ok.text


def test_loopback_is_served_without_a_token():
    for host in ("127.0.0.1", "::1"):
        assert _client(None, host).get("/metrics").status_code == 200


def test_a_set_token_is_needed_from_loopback_too():
    """A proxy on the same host makes every client loopback: with a token set, nobody is served without it."""
    client = _client("s3cret", "127.0.0.1")
    assert client.get("/metrics").status_code == 404
    assert client.get("/metrics", headers={"authorization": "Bearer s3cret"}).status_code == 200


def test_loopback_through_an_http_proxy_is_not_loopback():
    for header in ("forwarded", "x-forwarded-for", "x-real-ip"):
        assert _client(None, "127.0.0.1").get("/metrics", headers={header: "203.0.113.9"}).status_code == 404


def test_worker_metrics_bind_loopback_unless_told():
    assert WorkerSettings().metrics_host == "127.0.0.1"


def test_unauthenticated_access_lines_are_capped_per_second(caplog):
    """An unknown-key flood logs at most `per_second` access lines a second, and one line summing the rest."""
    from gateway.telemetry.gateway_metrics import UnauthenticatedLines

    lines = UnauthenticatedLines(per_second=10)
    with caplog.at_level("INFO", logger="switchyard.gateway.access"):
        admitted = [lines.admit(100.0 + i / 100) for i in range(25)]  # 25 in one second
        assert admitted == [True] * 10 + [False] * 15 and not caplog.records
        assert lines.admit(101.2)  # the next second starts: the summary first, then room again
    (summary,) = caplog.records
    assert summary.suppressed == 15 and "15 more unauthenticated" in summary.getMessage()
    assert lines.logged == 1 and lines.suppressed == 0
