"""OpenAI-style `x-ratelimit-*` and `retry-after` response headers from a `ReserveResult`."""

from __future__ import annotations

from admission.results import DENIED, ReserveResult


def format_duration(ms: int) -> str:
    """OpenAI's reset format: "0s", "250ms", "1.5s", "6m0s"."""
    if ms <= 0:
        return "0s"
    if ms < 1000:
        return f"{ms}ms"
    minutes, rest_ms = divmod(ms, 60_000)
    seconds = f"{rest_ms / 1000:.3f}".rstrip("0").rstrip(".")
    return f"{minutes}m{seconds}s" if minutes else f"{seconds}s"


def rate_limit_headers(result: ReserveResult) -> dict[str, str]:
    headers: dict[str, str] = {}
    if result.limit_requests > 0:
        headers["x-ratelimit-limit-requests"] = str(result.limit_requests)
        headers["x-ratelimit-remaining-requests"] = str(result.remaining_requests)
        headers["x-ratelimit-reset-requests"] = format_duration(result.reset_requests_ms)
    if result.limit_tokens > 0:
        headers["x-ratelimit-limit-tokens"] = str(result.limit_tokens)
        headers["x-ratelimit-remaining-tokens"] = str(result.remaining_tokens)
        headers["x-ratelimit-reset-tokens"] = format_duration(result.reset_tokens_ms)
    if result.status == DENIED:
        headers.update(retry_headers(result.retry_after_ms))
    return headers


def retry_headers(retry_after_ms: int) -> dict[str, str]:
    """`retry-after` (seconds, ceil, at least 1) and `retry-after-ms`."""
    ms = max(0, int(retry_after_ms))
    return {"retry-after": str(max(1, -(-ms // 1000))), "retry-after-ms": str(ms)}
