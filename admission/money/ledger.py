"""Hold a request's maximum cost at every level of its path; settle its exact cost once, refund the rest."""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass

import redis.asyncio as aredis

from admission.lua.scripts import LuaScript
from admission.money.errors import BudgetExceeded, LevelRateLimited
from admission.money.keys import (
    SPEND_TTL_S,
    balance_key,
    config_key,
    hold_key,
    holds_key,
    micro_to_usd,
    model_family,
    model_ident,
    spend_key,
    user_ident,
)
from admission.money.prices import Price, PriceBook

MONEY_RESERVE = LuaScript("money_reserve")
MONEY_SETTLE = LuaScript("money_settle")
ADMITTED, DENIED, NEVER_FITS = 0, 1, 2


@dataclass(slots=True, frozen=True)
class Level:
    """One level of a request's path: its label in refusals, config and balance hashes, config field prefix;
    an `optional` level (a model's) is passed over while its config is empty."""

    label: str
    config: str
    balance: str
    prefix: str = ""
    optional: bool = False


@dataclass(slots=True, frozen=True)
class MoneyPath:
    """Where a request's money goes: its organization, project (today's tenant), key digest, model, user."""

    org: str
    project: str
    key_digest: str
    model: str
    user: str | None = None

    def levels(self) -> list[Level]:
        """The path's levels, widest first; the organization and the project also have a level for the
        request's model family (`name` of `name@version`)."""
        o, p, m = self.org, self.project, model_family(self.model)
        om, pm, k = model_ident(o, m), model_ident(p, m), self.key_digest
        out = [Level("organization", config_key(o, "organization", o), balance_key(o, "organization", o)),
               Level(f"organization (model {m})", config_key(o, "org_model", om),
                     balance_key(o, "org_model", om), optional=True),
               Level("project", config_key(o, "project", p), balance_key(o, "project", p)),
               Level(f"project (model {m})", config_key(o, "project_model", pm),
                     balance_key(o, "project_model", pm), optional=True),
               Level("key", config_key(o, "key", k), balance_key(o, "key", k))]
        if self.user:
            uid = user_ident(p, self.user)
            out.append(Level("user", config_key(o, "project", p), balance_key(o, "user", uid), "user_"))
        return out

    def dimensions(self) -> list[str]:
        """The spend record's field prefixes: each level and model alone, and their combination."""
        dims = ["org", f"project:{self.project}", f"key:{self.key_digest}", f"model:{self.model}"]
        combo = f"p:{self.project}|k:{self.key_digest}|m:{self.model}"
        if self.user:
            uid = user_ident(self.project, self.user)
            dims.append(f"user:{uid}")
            combo += f"|u:{uid}"
        return [*dims, combo]


@dataclass(slots=True)
class MoneyHold:
    """An admitted request's hold on every level's budget, at the prices of its admission."""

    path: MoneyPath
    hold_id: str
    price: Price
    reserved_micro: int
    cost_micro: int = 0
    settled: bool = False
    narrowest: str = ""        # the narrowest level with a budget ("" if none has one)
    remaining_micro: int = 0   # its budget left after this hold
    reset_at: int = 0          # when its period ends (epoch seconds)
    tokens: int = 0            # prompt + max_tokens held at the levels' tpm buckets
    batch: bool = False        # a Batch API request: it pays the price's batch fraction

    def headers(self) -> dict[str, str]:
        """The narrowest budgeted level's remaining money, for the response."""
        if not self.narrowest:
            return {}
        remaining = micro_to_usd(self.remaining_micro)
        return {"x-budget-level": self.narrowest, "x-budget-remaining-usd": remaining,
                "x-budget-reset": str(self.reset_at)}


class MoneyLedger:
    """Dollar-budget admission of one gateway process against Redis (one script call per step)."""

    def __init__(self, client: aredis.Redis, prices: PriceBook, hold_ttl_s: float = 900.0) -> None:
        self.redis = client
        self.prices = prices
        self.hold_ttl_ms = int(hold_ttl_s * 1000)

    async def reserve(self, path: MoneyPath, prompt_tokens: int, max_tokens: int,
                      batch: bool = False) -> MoneyHold:
        """Hold the request's maximum cost and tokens at every level, or raise `BudgetExceeded` (a dollar
        budget) or `LevelRateLimited` (a tpm, rpm or max_concurrent) naming the level."""
        price = await self.prices.get(path.model)
        cost = price.max_cost(prompt_tokens, max_tokens, batch)
        tokens = prompt_tokens + max_tokens
        hold = MoneyHold(path, secrets.token_hex(12), price, cost, tokens=tokens, batch=batch)
        levels = path.levels()
        keys = [holds_key(path.org), hold_key(path.org, hold.hold_id)]
        args: list[object] = [cost, self.hold_ttl_ms, len(levels), tokens]
        for level in levels:
            keys += [level.config, level.balance]
            args += [level.label, level.prefix, "1" if level.optional else "0"]
        status, level, limit, amount, reset_s, kind, retry_ms = await MONEY_RESERVE(self.redis, keys, args)
        kind = _text(kind)
        if int(status) != ADMITTED and kind not in ("budget", "rolling"):
            requested = tokens if kind == "tpm" else 1
            raise LevelRateLimited(_text(level), kind, int(limit), int(amount), requested, int(retry_ms),
                                   never_fits=int(status) == NEVER_FITS)
        if int(status) != ADMITTED:
            raise BudgetExceeded(_text(level), int(limit), int(amount), cost, int(reset_s),
                                 never_fits=int(status) == NEVER_FITS, rolling=kind == "rolling")
        hold.narrowest, hold.remaining_micro, hold.reset_at = _text(level), int(amount), int(reset_s)
        return hold

    async def settle(self, hold: MoneyHold, input_tokens: int = 0, cached_tokens: int = 0,
                     output_tokens: int = 0) -> bool:
        """Charge the exact cost of the tokens served (0 for none: a full refund); True the first time."""
        if hold.settled:
            return False
        cost = hold.price.cost(input_tokens, cached_tokens, output_tokens, hold.batch)
        day = time.strftime("%Y%m%d", time.gmtime())
        org = hold.path.org
        keys = [holds_key(org), hold_key(org, hold.hold_id), spend_key(org, day)]
        served = input_tokens or output_tokens
        dims = hold.path.dimensions() if served else []
        args = [cost, SPEND_TTL_S, input_tokens, min(cached_tokens, input_tokens), output_tokens,
                input_tokens + output_tokens, *dims]
        done = int(await MONEY_SETTLE(self.redis, keys, args)) == 1
        hold.settled, hold.cost_micro = True, cost
        return done

    async def refund(self, hold: MoneyHold) -> bool:
        """The request never ran: give back everything, record nothing."""
        return await self.settle(hold)


def _text(v: str | bytes) -> str:
    return v.decode() if isinstance(v, bytes) else v
