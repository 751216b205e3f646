"""A project's per-model limits as OpenAI's `project.rate_limit` objects (`.../projects/{id}/rate_limits`)."""

from __future__ import annotations

from collections.abc import Callable

import redis.asyncio as aredis

from admission import DEFAULT_ORG, PROJECT_ORG_KEY, level_config_key, model_family, model_ident
from gateway.admin.admin_scope import AdminScope
from gateway.admin.project_admin import project_fields
from gateway.web.api_errors import ApiError, invalid
from tenancy import Tenant, parse_tenant

Listing = Callable[[Tenant], list[str]]  # the gateway's `pools.listing`: the models a tenant may use
ID_PREFIX = "rl-"
# OpenAI's fields -> the level config's; 0 is no limit
FIELDS = {"max_requests_per_1_minute": "rpm", "max_tokens_per_1_minute": "tpm"}
# OpenAI's other fields: images, audio and daily request counts have no meaning or no counter here
UNSUPPORTED = ("max_images_per_1_minute", "max_audio_megabytes_per_1_minute", "max_requests_per_1_day",
               "batch_1_day_max_input_tokens")


def _text(v: str | bytes | None) -> str:
    return v.decode() if isinstance(v, bytes) else (v or "")


async def _families(client: aredis.Redis, scope: AdminScope, project_id: str, listing: Listing) -> set[str]:
    """The model families the caller's project may use (versions `name@v` share `name`); 404 for a project the
    caller does not see."""
    fields = await project_fields(client, scope, project_id)
    return {model_family(m) for m in listing(parse_tenant(project_id, fields))}


async def _org(client: aredis.Redis, project_id: str) -> str:
    return _text(await client.hget(PROJECT_ORG_KEY, project_id)) or DEFAULT_ORG


def _config_key(org: str, project_id: str, model: str) -> str:
    return level_config_key(org, "project_model", model_ident(project_id, model))


async def _object(client: aredis.Redis, org: str, project_id: str, model: str) -> dict:
    raw = await client.hmget(_config_key(org, project_id, model), *FIELDS.values())
    out: dict = {"object": "project.rate_limit", "id": ID_PREFIX + model, "model": model}
    for name, value in zip(FIELDS, raw, strict=True):
        out[name] = int(_text(value) or 0)
    return out


async def list_rate_limits(client: aredis.Redis, scope: AdminScope, project_id: str,
                           listing: Listing) -> list[dict]:
    """One object per model family the project may use, by name."""
    models = await _families(client, scope, project_id, listing)
    org = await _org(client, project_id)
    return [await _object(client, org, project_id, m) for m in sorted(models)]


async def update_rate_limit(client: aredis.Redis, scope: AdminScope, project_id: str, rate_limit_id: str,
                            body: dict, listing: Listing) -> dict:
    """Set the model's `max_requests_per_1_minute` / `max_tokens_per_1_minute` (0: none); applied at once."""
    models = await _families(client, scope, project_id, listing)
    model = rate_limit_id.removeprefix(ID_PREFIX)
    if not rate_limit_id.startswith(ID_PREFIX) or model not in models:
        raise ApiError(404, f"No rate limit with id '{rate_limit_id[:80]}' found for project "
                       f"'{project_id[:80]}'.", param="rate_limit_id", code="not_found")
    values = {}
    for name, value in body.items():
        if name in UNSUPPORTED:
            raise invalid(f"'{name}' is not supported: Switchyard limits tokens and requests per minute.",
                          param=name, code="unsupported_parameter")
        if name not in FIELDS:
            raise invalid(f"Unknown parameter '{name[:80]}'.", param=name[:80], code="unknown_parameter")
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise invalid(f"'{name}' must be a non-negative integer (0: no limit).", param=name)
        values[FIELDS[name]] = value
    org = await _org(client, project_id)
    if values:
        await client.hset(_config_key(org, project_id, model), mapping=values)
    return await _object(client, org, project_id, model)
