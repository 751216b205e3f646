"""Who calls the administration API: an admin key's organization (or every one), read from Redis per call."""

from __future__ import annotations

from dataclasses import dataclass

import redis.asyncio as aredis
from redis.exceptions import RedisClusterException, RedisError
from starlette.requests import Request

from admission import (
    DEFAULT_ORG,
    ORGS_SET,
    PROJECT_ORG_KEY,
    admin_key_key,
    admin_key_shape_ok,
    parse_admin_key,
    validate_org,
)
from gateway.web.api_errors import ApiError, unauthorized
from gateway.web.request_io import bearer_key
from tenancy import key_digest

ORG_HEADER = "openai-organization"


@dataclass(slots=True, frozen=True)
class AdminScope:
    """The organizations a caller sees: one, or every one (`org` None: a global key, or the CLI)."""

    org: str | None = None

    @property
    def home(self) -> str:
        """Where a project this caller creates goes."""
        return self.org or DEFAULT_ORG

    def sees(self, org: str) -> bool:
        return self.org is None or self.org == org


def store_unavailable() -> ApiError:
    return ApiError(503, "The administration store (Redis) is unavailable; retry shortly.", "server_error",
                    code="service_unavailable", headers={"retry-after": "1"})


async def authenticate(request: Request, client: aredis.Redis) -> AdminScope:
    """The caller's scope, or 401 for a missing, non-admin (API keys too), unknown or revoked key."""
    key = bearer_key(request.headers.get("authorization"))
    if key is None:
        raise unauthorized("Missing admin key: send 'Authorization: Bearer <admin key>'.")
    if not admin_key_shape_ok(key):
        raise unauthorized("The administration endpoints take an admin key (sy-admin-...); "
                           "API keys are refused.")
    try:
        fields = await client.hgetall(admin_key_key(key_digest(key)))
    except (RedisError, RedisClusterException, OSError):
        raise store_unavailable() from None
    record = parse_admin_key(key_digest(key), fields)
    if record is None:
        raise unauthorized("Invalid or revoked admin key.")
    return _narrowed(AdminScope(record.org), request.headers.get(ORG_HEADER))


def _narrowed(scope: AdminScope, header: str | None) -> AdminScope:
    """`OpenAI-Organization` narrows a global key to one organization; another org's key may not name it."""
    if not header:
        return scope
    try:
        org = validate_org(header.strip())
    except ValueError:
        raise ApiError(400, "The OpenAI-Organization header is not an organization name.",
                       param="OpenAI-Organization") from None
    if not scope.sees(org):
        raise ApiError(403, "This admin key belongs to another organization.", "permission_error",
                       param="OpenAI-Organization", code="insufficient_permissions")
    return AdminScope(org)


def _text(v: str | bytes) -> str:
    return v.decode() if isinstance(v, bytes) else v


async def project_orgs(client: aredis.Redis) -> dict[str, str]:
    """Project -> organization as Redis holds it now (`sy:project_org`)."""
    return {_text(k): _text(v) for k, v in (await client.hgetall(PROJECT_ORG_KEY)).items()}


async def scope_orgs(client: aredis.Redis, scope: AdminScope) -> list[str]:
    """The organizations whose ledgers a caller reads."""
    if scope.org is not None:
        return [scope.org]
    orgs = {_text(o) for o in await client.smembers(ORGS_SET)}
    return sorted(orgs | set((await project_orgs(client)).values()) | {DEFAULT_ORG})
