"""Projects (Switchyard's tenants) as OpenAI's `organization.project` objects, scoped to an admin's org."""

from __future__ import annotations

import time

import redis.asyncio as aredis

from admission import DEFAULT_ORG, ORGS_SET, PROJECT_ORG_KEY
from gateway.admin.admin_scope import AdminScope, project_orgs
from gateway.web.api_errors import ApiError, invalid
from tenancy import ACTIVE, DISABLED, TENANTS_SET, config_key, new_salt, validate_name


def project_not_found(project_id: str) -> ApiError:
    """404 for a project that does not exist or is another organization's (the same answer)."""
    return ApiError(404, f"No project with id '{project_id[:80]}' found.", param="project_id",
                    code="not_found")


def _text(v: str | bytes | None) -> str:
    return v.decode() if isinstance(v, bytes) else (v or "")


def _epoch(raw: str) -> int | None:
    try:
        return int(float(raw)) if raw else None
    except ValueError:
        return None


def project_object(name: str, fields: dict) -> dict:
    """A tenant's config hash as a project: archived while its status is not `active`."""
    f = {_text(k): _text(v) for k, v in fields.items()}
    active = (f.get("status") or ACTIVE) == ACTIVE
    return {"id": name, "object": "organization.project", "name": name,
            "created_at": _epoch(f.get("created_at", "")) or 0,
            "archived_at": None if active else _epoch(f.get("archived_at", "")),
            "status": "active" if active else "archived"}


async def project_fields(client: aredis.Redis, scope: AdminScope, project_id: str) -> dict:
    """The config hash of a project the caller sees; 404 otherwise."""
    try:
        validate_name(project_id)
    except ValueError:
        raise project_not_found(project_id) from None
    org = _text(await client.hget(PROJECT_ORG_KEY, project_id)) or DEFAULT_ORG
    fields = await client.hgetall(config_key(project_id)) if scope.sees(org) else {}
    if not fields:
        raise project_not_found(project_id)
    return fields


async def list_projects(client: aredis.Redis, scope: AdminScope, include_archived: bool) -> list[dict]:
    """The caller's projects, oldest first."""
    names = sorted(_text(n) for n in await client.smembers(TENANTS_SET))
    orgs = await project_orgs(client)
    names = [n for n in names if scope.sees(orgs.get(n, DEFAULT_ORG))]
    found = []
    for name in names:
        fields = await client.hgetall(config_key(name))
        project = project_object(name, fields) if fields else None
        if project is not None and (include_archived or project["status"] == "active"):
            found.append((_created(fields), name, project))
    return [project for *_, project in sorted(found, key=lambda t: t[:2])]


def _created(fields: dict) -> float:
    """Creation time to the millisecond (the object shows whole seconds): the listing's order."""
    try:
        return float(_text(fields.get(b"created_at", fields.get("created_at"))) or 0)
    except ValueError:
        return 0.0


async def get_project(client: aredis.Redis, scope: AdminScope, project_id: str) -> dict:
    return project_object(project_id, await project_fields(client, scope, project_id))


async def create_project(client: aredis.Redis, scope: AdminScope, name: object) -> dict:
    """A new project (a tenant with default quotas) in the caller's organization."""
    if not isinstance(name, str):
        raise invalid("'name' must be a string.", param="name")
    try:
        validate_name(name)
    except ValueError as exc:
        raise invalid(f"Project name: {exc}.", param="name") from None
    if not await client.hsetnx(config_key(name), "salt", new_salt()):
        raise invalid(f"A project named '{name}' exists.", param="name", code="project_exists")
    await client.hset(config_key(name), mapping={"status": ACTIVE, "created_at": f"{time.time():.3f}"})
    await client.sadd(TENANTS_SET, name)
    await client.sadd(ORGS_SET, scope.home)
    await client.hset(PROJECT_ORG_KEY, name, scope.home)
    return await get_project(client, scope, name)


async def archive_project(client: aredis.Redis, scope: AdminScope, project_id: str) -> dict:
    """Disable the project's tenant (its keys stop working within 1 s) and note when."""
    fields = await project_fields(client, scope, project_id)
    if project_object(project_id, fields)["status"] == "active":
        await client.hset(config_key(project_id), mapping={"status": DISABLED,
                                                           "archived_at": str(int(time.time()))})
    return await get_project(client, scope, project_id)
