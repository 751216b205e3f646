"""The refusal of a dollar budget: which level, its limit, what is used and when the period resets."""

from __future__ import annotations

import time

from admission.money.keys import micro_to_usd


class BudgetExceeded(Exception):
    """429 `insufficient_quota`: a level's dollar budget cannot hold this request's maximum cost."""

    def __init__(self, level: str, budget_micro: int, used_micro: int, cost_micro: int, reset_at: int,
                 never_fits: bool) -> None:
        self.level = level
        self.budget_micro = budget_micro
        self.used_micro = used_micro
        self.cost_micro = cost_micro
        self.reset_at = reset_at  # epoch seconds when the budget's period ends
        self.never_fits = never_fits
        super().__init__(self.message())

    def message(self) -> str:
        head = (f"The {self.level} budget of ${micro_to_usd(self.budget_micro)} "
                f"(${micro_to_usd(self.used_micro)} used or held) cannot cover this request's maximum cost "
                f"of ${micro_to_usd(self.cost_micro)}.")
        reset = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.reset_at))
        if self.never_fits:
            return head + " Reduce max_tokens or the prompt; it exceeds the whole budget."
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
