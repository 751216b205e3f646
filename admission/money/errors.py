"""The refusal of a dollar budget: which level, its limit, what is used and when the period resets."""

from __future__ import annotations

import time

from admission.money.keys import micro_to_usd


class BudgetExceeded(Exception):
    """429 `insufficient_quota`: a level's dollar budget cannot hold this request's maximum cost."""

    def __init__(self, level: str, budget_micro: int, used_micro: int, cost_micro: int, reset_at: int,
                 never_fits: bool, rolling: bool = False) -> None:
        self.level = level
        self.budget_micro = budget_micro
        self.used_micro = used_micro
        self.cost_micro = cost_micro
        self.reset_at = reset_at  # epoch seconds when the budget's period ends
        self.never_fits = never_fits
        self.rolling = rolling  # a rolling window's budget: `reset_at` is when its oldest bucket leaves it
        super().__init__(self.message())

    def message(self) -> str:
        head = (f"The {self.level} budget of ${micro_to_usd(self.budget_micro)} "
                f"(${micro_to_usd(self.used_micro)} used or held) cannot cover this request's maximum cost "
                f"of ${micro_to_usd(self.cost_micro)}.")
        reset = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.reset_at))
        if self.never_fits:
            return head + " Reduce max_tokens or the prompt; it exceeds the whole budget."
        if self.rolling:
            return head + f" The budget is a rolling window; its oldest spend starts leaving it at {reset}."
        return head + f" The budget resets at {reset}."

    def headers(self, now: float | None = None) -> dict[str, str]:
        """`retry-after` only for a daily budget (waiting helps); the reset time always."""
        now = time.time() if now is None else now
        out = {"x-budget-reset": str(self.reset_at), "x-budget-level": self.level}
        wait = self.reset_at - now
        if not self.never_fits and 0 < wait <= 86_400:
            out["retry-after"] = str(int(wait) + 1)
        return out

    @property
    def code(self) -> str:
        return "insufficient_quota"

    @property
    def status(self) -> int:
        return 429


class LevelRateLimited(Exception):
    """A level's `tpm`, `rpm` or `max_concurrent` refuses the request: 429 `rate_limit_exceeded` with
    `retry-after`, or 400 when the request alone needs more tokens than the level's tpm (`never_fits`)."""

    def __init__(self, level: str, kind: str, limit: int, used: int, requested: int, retry_ms: int,
                 never_fits: bool) -> None:
        self.level = level
        self.kind = kind  # "tpm", "rpm" or "concurrency"
        self.limit = limit
        self.used = used
        self.requested = requested
        self.retry_ms = retry_ms
        self.never_fits = never_fits
        super().__init__(self.message())

    def message(self) -> str:
        if self.never_fits:
            return (f"This request needs {self.requested} tokens (prompt + max_tokens), more than the "
                    f"{self.level} tokens-per-minute limit of {self.limit}, so it can never be admitted. "
                    "Reduce max_tokens or the prompt.")
        what = {"tpm": "tokens per minute", "rpm": "requests per minute",
                "concurrency": "concurrent requests"}[self.kind]
        return (f"Rate limit reached for {self.level} {what}: limit {self.limit}, used {self.used}, "
                f"requested {self.requested}. Please try again in {self.retry_ms / 1000:.3g}s.")

    def headers(self) -> dict[str, str]:
        """The refusing level, and `retry-after` (seconds, ceil) and `retry-after-ms` where waiting helps."""
        if self.never_fits:
            return {"x-ratelimit-level": self.level}
        ms = max(0, self.retry_ms)
        return {"x-ratelimit-level": self.level, "retry-after": str(max(1, -(-ms // 1000))),
                "retry-after-ms": str(ms)}

    @property
    def error_type(self) -> str:
        """OpenAI's error type, as the flat tenant limits answer it."""
        if self.never_fits:
            return "invalid_request_error"
        return "tokens" if self.kind == "tpm" else "requests"

    @property
    def code(self) -> str:
        return "request_too_large" if self.never_fits else "rate_limit_exceeded"

    @property
    def status(self) -> int:
        return 400 if self.never_fits else 429
