"""A project's API keys as OpenAI's `organization.project.api_key` objects (digests and prefixes only)."""

from __future__ import annotations

import re

import redis.asyncio as aredis

from gateway.admin.admin_scope import AdminScope
from gateway.admin.project_admin import project_fields, project_object
from gateway.web.api_errors import ApiError
from tenancy import api_key_key, parse_expiry, tenant_keys_key

_DIGEST = re.compile(r"[0-9a-f]{64}")


def key_not_found(key_id: str) -> ApiError:
    return ApiError(404, f"No API key with id '{key_id[:80]}' found in this project.", param="api_key_id",
                    code="not_found")


def _text(v: str | bytes | None) -> str:
    return v.decode() if isinstance(v, bytes) else (v or "")


def key_object(key_digest: str, fields: dict, project: dict) -> dict:
    """One key: its id is its SHA-256 digest (the ledger's `api_key_id`); the value shows its prefix only."""
    f = {_text(k): _text(v) for k, v in fields.items()}
    created = int(float(f.get("created_at") or 0))
    prefix = f.get("prefix", "")
    expires = parse_expiry(f.get("expires_at"))
    owner = {"id": project["id"], "name": project["name"], "created_at": project["created_at"],
             "role": "member"}
    return {"object": "organization.project.api_key", "id": key_digest, "name": f.get("name") or prefix,
            "redacted_value": prefix + "...", "created_at": created, "last_used_at": None,
            "expires_at": None if expires is None else int(expires),
            "owner": {"type": "service_account", "service_account": owner, "user": None},
            "owner_project_access": "active" if project["status"] == "active" else "inactive"}


async def _key_fields(client: aredis.Redis, project_id: str, key_id: str) -> dict:
    if not _DIGEST.fullmatch(key_id) or not await client.sismember(tenant_keys_key(project_id), key_id):
        raise key_not_found(key_id)
    fields = await client.hgetall(api_key_key(key_id))
    if _text(fields.get(b"tenant", fields.get("tenant"))) != project_id:
        raise key_not_found(key_id)
    return fields


async def list_keys(client: aredis.Redis, scope: AdminScope, project_id: str) -> list[dict]:
    """The project's keys, oldest first (404 for a project the caller does not see)."""
    project = project_object(project_id, await project_fields(client, scope, project_id))
    digests = sorted(_text(d) for d in await client.smembers(tenant_keys_key(project_id)))
    out = []
    for d in digests:
        fields = await client.hgetall(api_key_key(d))
        if _text(fields.get(b"tenant", fields.get("tenant"))) == project_id:
            out.append((float(_text(fields.get(b"created_at")) or 0), d, key_object(d, fields, project)))
    return [key for *_, key in sorted(out, key=lambda t: t[:2])]


async def get_key(client: aredis.Redis, scope: AdminScope, project_id: str, key_id: str) -> dict:
    project = project_object(project_id, await project_fields(client, scope, project_id))
    return key_object(key_id, await _key_fields(client, project_id, key_id), project)


async def delete_key(client: aredis.Redis, scope: AdminScope, project_id: str, key_id: str) -> dict:
    """Revoke the key (every gateway refuses it within 1 s)."""
    await project_fields(client, scope, project_id)
    await _key_fields(client, project_id, key_id)
    await client.delete(api_key_key(key_id))
    await client.srem(tenant_keys_key(project_id), key_id)
    return {"object": "organization.project.api_key.deleted", "id": key_id, "deleted": True}
