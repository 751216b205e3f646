"""Rate-limit headers in OpenAI's format, and the HTTP mapping of admission errors."""

from __future__ import annotations

from admission.capacity import Overloaded
from admission.gate import error_response
from admission.headers import format_duration, rate_limit_headers
from admission.results import ADMITTED, DENIED, NEVER_FITS, ReserveResult, error_for
from tenancy.tenancy_errors import QuotaServiceUnavailable


def result(status: int, **kw) -> ReserveResult:
    base = dict(limit_name=None, limit_tokens=1000, remaining_tokens=250, reset_tokens_ms=45_000,
                limit_requests=60, remaining_requests=59, reset_requests_ms=1000, limit_concurrent=4,
                active_concurrent=1, retry_after_ms=0, used=0, requested=0)
    base.update(kw)
    return ReserveResult(status, **base)


def test_format_duration():
    assert [format_duration(ms) for ms in (0, 17, 999, 1000, 1500, 59_999, 60_000, 360_000, 90_250)] == [
        "0s", "17ms", "999ms", "1s", "1.5s", "59.999s", "1m0s", "6m0s", "1m30.25s"]


def test_headers_on_success_and_denial():
    ok = rate_limit_headers(result(ADMITTED))
    assert ok == {"x-ratelimit-limit-requests": "60", "x-ratelimit-remaining-requests": "59",
                  "x-ratelimit-reset-requests": "1s", "x-ratelimit-limit-tokens": "1000",
                  "x-ratelimit-remaining-tokens": "250", "x-ratelimit-reset-tokens": "45s"}
    denied = rate_limit_headers(result(DENIED, limit_name="tokens", retry_after_ms=2001, used=750,
                                       requested=400))
    assert denied["retry-after"] == "3" and denied["retry-after-ms"] == "2001"
    unlimited = rate_limit_headers(result(ADMITTED, limit_tokens=0, limit_requests=0))
    assert unlimited == {}


def test_error_mapping():
    r = result(DENIED, limit_name="requests", retry_after_ms=500, used=60, requested=1)
    spec = error_response(error_for(r, "acme"))
    assert (spec.status, spec.type, spec.code) == (429, "requests", "rate_limit_exceeded")
    assert "requests per minute" in spec.message and "limit 60, used 60, requested 1" in spec.message
    assert spec.headers["retry-after"] == "1"
    spec = error_response(error_for(result(NEVER_FITS, requested=5000), "acme"))
    assert spec.status == 400 and "can never" in spec.message
    spec = error_response(Overloaded(2.5, "busy"))
    assert (spec.status, spec.code, spec.headers["retry-after"]) == (503, "server_overloaded", "3")
    spec = error_response(QuotaServiceUnavailable("down"))
    assert (spec.status, spec.code) == (503, "quota_service_unavailable")
    assert error_response(ValueError("x")) is None
