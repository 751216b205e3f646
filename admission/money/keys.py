"""Where money lives in Redis: every key one admission touches carries its organization's hash tag."""

from __future__ import annotations

import hashlib
import re
from decimal import Decimal, InvalidOperation

from tenancy.schema import validate_name

DEFAULT_ORG = "default"
LEVELS = ("organization", "project", "key", "user")
PERIODS = ("day", "month", "24h", "30d")  # calendar UTC day or month; rolling 24 hours or 30 days
PRICES_KEY = "sy:prices"            # hash "<model>:input|cached|output" -> USD per million tokens
PROJECT_ORG_KEY = "sy:project_org"  # hash project (today's tenant) -> organization
ORGS_SET = "sy:orgs"
SPEND_TTL_S = 400 * 86_400          # the per-day spend hashes are kept this long
_PLAIN_USER = re.compile(r"^[A-Za-z0-9_.@+:=-]{1,64}$")  # other `user` ids go by their SHA-256
_PLAIN_MODEL = re.compile(r"^[A-Za-z0-9_.@+:=/-]{1,128}$")  # and other model names


def org_tag(org: str) -> str:
    return "{o:" + org + "}"


def config_key(org: str, level: str, ident: str) -> str:
    """Hash of one level's limits: `budget_micro`, `period` (a project also has `user_budget_micro`...)."""
    return f"{org_tag(org)}:cfg:{level}:{ident}"


def balance_key(org: str, level: str, ident: str) -> str:
    """Hash `{p, spent, held}`: the current period's id, its settled spend and the holds in flight."""
    return f"{org_tag(org)}:bal:{level}:{ident}"


def holds_key(org: str) -> str:
    return org_tag(org) + ":holds"


def hold_key(org: str, hold_id: str) -> str:
    return f"{org_tag(org)}:hold:{hold_id}"


def spend_key(org: str, day: str) -> str:
    """Per-UTC-day spend hash; `day` is `YYYYMMDD`; fields `<dimension>|<counter>`."""
    return f"{org_tag(org)}:spend:{day}"


def user_ident(project: str, user: str) -> str:
    """The end user's id inside its project; an id longer than 64 characters or with other characters than
    letters, digits and `_.@+:=-` goes by its digest (key names stay short and free of spaces)."""
    return f"{project}/{_plain(user, _PLAIN_USER)}"


def _plain(name: str, plain: re.Pattern[str]) -> str:
    return name if plain.match(name) else "sha256:" + hashlib.sha256(name.encode()).hexdigest()


def model_family(model: str) -> str:
    """The name whose per-model limits a model obeys: every version `name@v` of a model shares `name`'s."""
    return model.split("@", 1)[0]


def model_ident(owner: str, model: str) -> str:
    """An organization's or project's limits for one model (config and balance under level `org_model` or
    `project_model`)."""
    return f"{owner}/{_plain(model, _PLAIN_MODEL)}"


def validate_org(name: str) -> str:
    return validate_name(name)


def usd_to_micro(text: str | float | int, what: str = "amount") -> int:
    """A non-negative USD decimal as integer micro-dollars (rounded half up); ValueError otherwise."""
    try:
        value = Decimal(str(text))
    except InvalidOperation:
        raise ValueError(f"{what} {text!r} is not a decimal number of dollars") from None
    if not value.is_finite() or value < 0:
        raise ValueError(f"{what} {text!r} must be a finite, non-negative number of dollars")
    return int((value * 1_000_000).to_integral_value(rounding="ROUND_HALF_UP"))


def micro_to_usd(micro: int) -> str:
    """Integer micro-dollars as an exact decimal string (`1.500000`)."""
    sign = "-" if micro < 0 else ""
    whole, frac = divmod(abs(int(micro)), 1_000_000)
    return f"{sign}{whole}.{frac:06d}"
