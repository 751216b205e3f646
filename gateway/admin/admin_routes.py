"""The administration API's HTTP routes (`/v1/organization/...`), each authenticated by an admin key."""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable

import redis.asyncio as aredis
from redis.exceptions import RedisClusterException, RedisError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway.admin import project_admin, project_keys, project_rate_limits
from gateway.admin.admin_query import bool_param, list_object, parse_usage_query, split_params
from gateway.admin.admin_scope import AdminScope, authenticate, scope_orgs, store_unavailable
from gateway.admin.usage_buckets import build_page, read_ledger
from gateway.web.api_errors import ApiError, invalid
from gateway.web.request_io import read_json

ADMIN_PREFIX = "/v1/organization/"
Handler = Callable[[Request, aredis.Redis, AdminScope], Awaitable[dict]]
CREATE_FIELDS = ("name",)
REFUSED_FIELDS = ("external_key_id", "geography", "residency")  # no residency or external keys here


def admin_route(handler: Handler) -> Callable[[Request], Awaitable[Response]]:
    """Authenticate the admin key, run the handler, answer its JSON; Redis failures are a 503."""

    @functools.wraps(handler)
    async def endpoint(request: Request) -> Response:
        client = getattr(request.app.state, "redis", None)
        if client is None:
            raise ApiError(404, "This gateway has no Redis: the administration API is off.", code="not_found")
        try:
            scope = await authenticate(request, client)
            return JSONResponse(await handler(request, client, scope))
        except (RedisError, RedisClusterException, OSError):
            raise store_unavailable() from None

    return endpoint


def _no_params(request: Request) -> None:
    split_params(request.query_params.multi_items(), ())


async def _projects(request: Request, client: aredis.Redis, scope: AdminScope) -> dict:
    if request.method == "POST":
        _no_params(request)
        return await project_admin.create_project(client, scope, (await _create_body(request)).get("name"))
    one, _ = split_params(request.query_params.multi_items(), ("limit", "after", "include_archived"))
    found = await project_admin.list_projects(client, scope, bool_param(one, "include_archived"))
    return list_object(found, one)


async def _create_body(request: Request) -> dict:
    config = request.app.state.config
    body, _ = await read_json(request, config.max_body_bytes, config.body_timeout_s)
    if not isinstance(body, dict):
        raise invalid("The body must be a JSON object.")
    for name in body:
        if name in REFUSED_FIELDS:
            raise invalid(f"'{name}' is not supported: Switchyard has no data residency or external keys.",
                          param=name, code="unsupported_parameter")
        if name not in CREATE_FIELDS:
            raise invalid(f"Unknown parameter '{name[:80]}'.", param=name[:80], code="unknown_parameter")
    if "name" not in body:
        raise invalid("Missing required parameter 'name'.", param="name", code="missing_required_parameter")
    return body


async def _project(request: Request, client: aredis.Redis, scope: AdminScope) -> dict:
    _no_params(request)
    return await project_admin.get_project(client, scope, request.path_params["project_id"])


async def _archive(request: Request, client: aredis.Redis, scope: AdminScope) -> dict:
    _no_params(request)
    return await project_admin.archive_project(client, scope, request.path_params["project_id"])


async def _api_keys(request: Request, client: aredis.Redis, scope: AdminScope) -> dict:
    one, _ = split_params(request.query_params.multi_items(), ("limit", "after", "owner_project_access"))
    access = one.get("owner_project_access", "any")
    if access not in ("active", "inactive", "any"):
        raise invalid("'owner_project_access' must be active, inactive or any.", param="owner_project_access")
    found = await project_keys.list_keys(client, scope, request.path_params["project_id"])
    return list_object([k for k in found if access in ("any", k["owner_project_access"])], one)


async def _api_key(request: Request, client: aredis.Redis, scope: AdminScope) -> dict:
    _no_params(request)
    ids = request.path_params["project_id"], request.path_params["api_key_id"]
    if request.method == "DELETE":
        return await project_keys.delete_key(client, scope, *ids)
    return await project_keys.get_key(client, scope, *ids)


async def _rate_limits(request: Request, client: aredis.Redis, scope: AdminScope) -> dict:
    one, _ = split_params(request.query_params.multi_items(), ("limit", "after"))
    project_id, listing = request.path_params["project_id"], request.app.state.service.pools.listing
    found = await project_rate_limits.list_rate_limits(client, scope, project_id, listing)
    return list_object(found, one)


async def _rate_limit(request: Request, client: aredis.Redis, scope: AdminScope) -> dict:
    _no_params(request)
    config = request.app.state.config
    body, _ = await read_json(request, config.max_body_bytes, config.body_timeout_s)
    if not isinstance(body, dict):
        raise invalid("The body must be a JSON object.")
    ids = request.path_params["project_id"], request.path_params["rate_limit_id"]
    return await project_rate_limits.update_rate_limit(client, scope, *ids, body,
                                                       request.app.state.service.pools.listing)


async def _usage(request: Request, client: aredis.Redis, scope: AdminScope, kind: str) -> dict:
    query = parse_usage_query(request.query_params.multi_items(), kind)
    return build_page(query, await read_ledger(client, await scope_orgs(client, scope), query))


ROUTES = [
    Route(ADMIN_PREFIX + "projects", admin_route(_projects), methods=["GET", "POST"]),
    Route(ADMIN_PREFIX + "projects/{project_id}", admin_route(_project), methods=["GET"]),
    Route(ADMIN_PREFIX + "projects/{project_id}/archive", admin_route(_archive), methods=["POST"]),
    Route(ADMIN_PREFIX + "projects/{project_id}/api_keys", admin_route(_api_keys), methods=["GET"]),
    Route(ADMIN_PREFIX + "projects/{project_id}/api_keys/{api_key_id}", admin_route(_api_key),
          methods=["GET", "DELETE"]),
    Route(ADMIN_PREFIX + "projects/{project_id}/rate_limits", admin_route(_rate_limits), methods=["GET"]),
    Route(ADMIN_PREFIX + "projects/{project_id}/rate_limits/{rate_limit_id}", admin_route(_rate_limit),
          methods=["POST"]),
    Route(ADMIN_PREFIX + "usage/completions",
          admin_route(functools.partial(_usage, kind="completions")), methods=["GET"]),
    Route(ADMIN_PREFIX + "costs", admin_route(functools.partial(_usage, kind="costs")), methods=["GET"]),
]
