"""The administration API on a real redis-server and a real gateway app (uvicorn, behind the unknown-key
gate), called through the `openai` SDK's admin resources: admin-key scoping, digests only, usage and costs
equal to the ledger, live edits, 400s naming the parameter, and the CLI's same answers."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace

import httpx
import openai
import pytest
import uvicorn

from admission.money import LevelRateLimited, MoneyLedger, MoneyPath, PriceBook
from admission.money.admin_keys import admin_key_key
from admission.money.hierarchy import assign_project, read_spend
from admission.money.keys import PROJECT_ORG_KEY, spend_key
from admission.money.prices import set_price
from config.cli import main
from config.local_stack.launcher import free_port, wait_for_port
from gateway.app import create_app
from gateway.web.auth_gate import UnknownKeyGate
from tenancy import config_key, key_digest
from tenancy import tenant_admin as store
from tenancy.directory import TenantDirectory
from tenancy.redis_client import async_client

pytestmark = pytest.mark.timeout(90)
DAY = 86_400


@pytest.fixture()
def gateway(redis_url: str) -> Iterator[str]:
    """A gateway app (no worker: the admin routes need only Redis) served on a free port."""
    client = async_client(redis_url)

    async def make_service() -> SimpleNamespace:
        async def close() -> None:
            return None
        served = ("m1", "m2")  # what `pools.listing` gives: the models a tenant may use
        pools = SimpleNamespace(listing=lambda tenant: [m for m in served if tenant.allows_model(m)])
        return SimpleNamespace(tenants=TenantDirectory(client), pools=pools, close=close)

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(UnknownKeyGate(create_app(make_service, redis=client)),
                                           host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_for_port(port)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=10)


def cli(capsys, redis_url: str, *argv: str) -> object:
    assert main(["money", *argv, "--redis-url", redis_url, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def admin_key(capsys, redis_url: str, org: str | None) -> str:
    scope = ["--org", org] if org else ["--global"]
    return cli(capsys, redis_url, "admin-key", "create", *scope)["key"]


def sdk(base: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(api_key="unused", admin_api_key=key, base_url=base + "/v1", max_retries=0,
                         timeout=10)


@pytest.fixture()
def world(r, redis_url: str) -> SimpleNamespace:
    """Org acme: projects shop and lab; org beta: project far; each with a key; prices; spend of today."""
    keys = {}
    for project, org in (("shop", "acme"), ("lab", "acme"), ("far", "beta")):
        store.create_tenant(r, project)
        assign_project(r, project, org)
        keys[project] = store.issue_key(r, project)
        time.sleep(0.01)                    # projects list in creation order (to the millisecond)
    set_price(r, "m1", "1.5", "0.5", "6")
    set_price(r, "m2", "0.25", None, "2")
    paths = [(MoneyPath("acme", "shop", key_digest(keys["shop"]), "m1", "u1"), 1000, 200, 300),
             (MoneyPath("acme", "shop", key_digest(keys["shop"]), "m2", None), 777, 0, 51),
             (MoneyPath("acme", "lab", key_digest(keys["lab"]), "m1", "u2"), 10, 3, 7),
             (MoneyPath("beta", "far", key_digest(keys["far"]), "m1", None), 5000, 0, 5000)]
    costs: dict[str, int] = {}

    async def spend() -> None:
        client = async_client(redis_url)
        ledger = MoneyLedger(client, PriceBook(client))
        for path, inp, cached, out in paths:
            hold = await ledger.reserve(path, inp, out)
            await ledger.settle(hold, inp, cached, out)
            costs[path.org] = costs.get(path.org, 0) + hold.cost_micro
        await client.aclose()

    asyncio.run(spend())
    return SimpleNamespace(keys=keys, costs=costs, today=int(time.time()) // DAY * DAY)


def test_admin_keys_are_digests_scoped_to_their_organization(capsys, r, redis_url, gateway, world):
    acme, beta = admin_key(capsys, redis_url, "acme"), admin_key(capsys, redis_url, "beta")
    root = admin_key(capsys, redis_url, None)
    for key in r.scan_iter(count=1000):     # no admin key's plaintext anywhere in Redis
        kind = r.type(key)
        dump = (repr(r.hgetall(key)) if kind == b"hash" else repr(r.smembers(key)) if kind == b"set"
                else repr(r.get(key)) if kind == b"string" else "")
        for plain in (acme, beta, root):
            assert plain[9:] not in dump and plain[9:].encode() not in key
    assert r.exists(admin_key_key(key_digest(acme)))
    a = sdk(gateway, acme)
    assert [p.id for p in a.admin.organization.projects.list()] == ["shop", "lab"]
    assert a.admin.organization.projects.retrieve("shop").object == "organization.project"
    with pytest.raises(openai.NotFoundError):
        a.admin.organization.projects.retrieve("far")          # beta's project: not found for acme
    with pytest.raises(openai.NotFoundError):
        a.admin.organization.projects.api_keys.list("far")
    assert [p.id for p in sdk(gateway, beta).admin.organization.projects.list()] == ["far"]
    assert {p.id for p in sdk(gateway, root).admin.organization.projects.list()} == {"shop", "lab", "far"}
    beta_only = {"OpenAI-Organization": "beta"}
    narrowed = sdk(gateway, root).admin.organization.projects.list(extra_headers=beta_only)
    assert [p.id for p in narrowed] == ["far"]
    with pytest.raises(openai.PermissionDeniedError):
        a.admin.organization.projects.list(extra_headers=beta_only)
    (listed,) = a.admin.organization.projects.api_keys.list("shop").data
    assert listed.id == key_digest(world.keys["shop"]) and listed.object == "organization.project.api_key"
    assert listed.redacted_value == world.keys["shop"][:10] + "..." and world.keys["shop"] not in listed.name
    with pytest.raises(openai.AuthenticationError) as tenant_key:   # an API key on the admin routes
        sdk(gateway, world.keys["shop"]).admin.organization.projects.list()
    assert tenant_key.value.status_code == 401 and "admin key" in tenant_key.value.message
    chat = httpx.post(gateway + "/v1/chat/completions", headers={"authorization": f"Bearer {acme}"},
                      json={"model": "m1", "messages": [{"role": "user", "content": "hi"}]})
    assert chat.status_code == 401 and chat.json()["error"]["code"] == "invalid_api_key"


def test_usage_buckets_and_costs_equal_the_ledger(capsys, redis_url, r, gateway, world):
    a = sdk(gateway, admin_key(capsys, redis_url, "acme"))
    start = world.today - 2 * DAY
    page = a.admin.organization.usage.completions(start_time=start, bucket_width="1d")
    assert page.object == "page" and [b.start_time for b in page.data] == [start, start + DAY, world.today]
    assert page.data[0].results == [] and not page.has_more and page.next_page is None
    (total,) = page.data[2].results
    (day,) = read_spend(r, "acme", 1).values()
    assert total.object == "organization.usage.completions.result"
    assert (total.input_tokens, total.output_tokens, total.input_cached_tokens, total.num_model_requests) == (
        day["org|input_tokens"], day["org|output_tokens"], day["org|cached_tokens"], day["org|requests"])
    grouped = a.admin.organization.usage.completions(start_time=world.today, group_by=["project_id", "model"])
    rows = {(x.project_id, x.model): x for x in grouped.data[0].results}
    assert set(rows) == {("lab", "m1"), ("shop", "m1"), ("shop", "m2")}
    assert rows["shop", "m2"].input_tokens == 777 and rows["shop", "m2"].output_tokens == 51
    assert sum(x.input_tokens for x in rows.values()) == day["org|input_tokens"]
    users = a.admin.organization.usage.completions(start_time=world.today, group_by=["user_id"],
                                                   user_ids=["u1"])
    (u1,) = users.data[0].results
    assert u1.user_id == "u1" and u1.input_tokens == 1000 and u1.project_id is None
    costs = a.admin.organization.usage.costs(start_time=world.today, group_by=["line_item"])
    micro = {x.line_item: round(x.amount.value * 1_000_000) for x in costs.data[0].results}
    assert costs.data[0].results[0].object == "organization.costs.result"
    assert costs.data[0].results[0].amount.currency == "usd"
    assert sum(micro.values()) == world.costs["acme"] == day["org|cost_micro"]  # beta's spend not in it
    assert micro["m2"] == -(-(777 * 250_000 + 51 * 2_000_000) // 1_000_000)
    paged = a.admin.organization.usage.costs(start_time=start, limit=2)
    assert paged.has_more and len(paged.data) == 2
    rest = a.admin.organization.usage.costs(start_time=start, limit=2, page=paged.next_page)
    assert [b.start_time for b in rest.data] == [world.today] and not rest.has_more


def test_unknown_and_unsupported_parameters_are_a_400_naming_them(capsys, redis_url, gateway, world):
    a = sdk(gateway, admin_key(capsys, redis_url, "acme"))
    usage = a.admin.organization.usage
    cases = [(lambda: usage.completions(start_time=world.today, bucket_width="1h"), "bucket_width"),
             (lambda: usage.completions(start_time=world.today, extra_query={"foo": "1"}), "foo"),
             (lambda: usage.completions(start_time=world.today, group_by=["batch"]), "group_by"),
             (lambda: usage.completions(start_time=world.today, batch=True), "batch"),
             (lambda: usage.completions(start_time=world.today, limit=0), "limit"),
             (lambda: usage.costs(start_time=world.today, extra_query={"models[]": "m1"}),
              "models[]"),
             (lambda: usage.costs(start_time=world.today, group_by=["api_source"]), "group_by"),
             (lambda: usage.completions(start_time=world.today, page="page_7"), "page"),
             (lambda: a.admin.organization.projects.list(extra_query={"order": "asc"}), "order"),
             (lambda: a.admin.organization.projects.create(name="x", extra_body={"geography": "eu"}),
              "geography"),
             (lambda: usage.completions(start_time=None), "start_time")]  # type: ignore[arg-type]
    for call, param in cases:
        with pytest.raises(openai.BadRequestError) as exc:
            call()
        assert exc.value.status_code == 400 and exc.value.param == param, (param, exc.value.body)


def test_records_edited_in_redis_apply_within_a_second(capsys, r, redis_url, gateway, world):
    key = admin_key(capsys, redis_url, "acme")
    a = sdk(gateway, key)
    assert a.admin.organization.projects.retrieve("lab").status == "active"
    r.hset(config_key("lab"), "status", "disabled")   # as `redis-cli HSET {t:lab}:config status disabled`
    r.hset(PROJECT_ORG_KEY, "shop", "beta")           # as `redis-cli HSET sy:project_org shop beta`
    t0 = time.monotonic()
    assert a.admin.organization.projects.retrieve("lab").status == "archived"
    with pytest.raises(openai.NotFoundError):
        a.admin.organization.projects.retrieve("shop")
    assert [p.id for p in a.admin.organization.projects.list(include_archived=True)] == ["lab"]
    r.delete(admin_key_key(key_digest(key)))
    with pytest.raises(openai.AuthenticationError):
        a.admin.organization.projects.list()
    assert time.monotonic() - t0 < 1.0


def test_projects_and_keys_are_created_archived_paged_and_revoked(capsys, r, redis_url, gateway, world):
    a = sdk(gateway, admin_key(capsys, redis_url, "acme"))
    made = a.admin.organization.projects.create(name="new")
    assert (made.id, made.status, made.archived_at) == ("new", "active", None)
    assert r.hget(PROJECT_ORG_KEY, "new") == b"acme"
    first = a.admin.organization.projects.list(limit=2)
    assert [p.id for p in first.data] == ["shop", "lab"] and first.has_more
    assert [p.id for p in a.admin.organization.projects.list(limit=2, after="lab").data] == ["new"]
    assert [p.id for p in a.admin.organization.projects.list()] == ["shop", "lab", "new"]  # auto-paging
    archived = a.admin.organization.projects.archive("new")
    assert archived.status == "archived" and archived.archived_at
    assert r.hget(config_key("new"), "status") == b"disabled"
    keys = a.admin.organization.projects.api_keys
    digest = key_digest(world.keys["lab"])
    assert keys.retrieve(digest, project_id="lab").owner_project_access == "active"
    with pytest.raises(openai.NotFoundError):
        keys.retrieve(digest, project_id="shop")                     # another project's key
    gone = keys.delete(digest, project_id="lab")
    assert (gone.id, gone.deleted, gone.object) == (digest, True, "organization.project.api_key.deleted")
    assert not r.exists(f"sy:key:{digest}") and keys.list("lab").data == []


def test_cli_verbs_answer_as_the_routes_do(capsys, r, redis_url, gateway, world):
    a = sdk(gateway, admin_key(capsys, redis_url, "acme"))
    got = cli(capsys, redis_url, "usage", "--org", "acme", "--start-time", str(world.today),
              "--group-by", "project_id")
    assert got == a.admin.organization.usage.completions(start_time=world.today, group_by=["project_id"],
                                                         end_time=got_end(got)).to_dict(mode="json")
    costs = cli(capsys, redis_url, "costs", "--start-time", str(world.today))   # every organization
    assert round(costs["data"][0]["results"][0]["amount"]["value"] * 1e6) == sum(world.costs.values())
    listed = cli(capsys, redis_url, "projects", "list", "--org", "beta")
    assert [p["id"] for p in listed["data"]] == ["far"]
    assert cli(capsys, redis_url, "projects", "archive", "far")["status"] == "archived"
    (k,) = cli(capsys, redis_url, "api-keys", "list", "far")["data"]
    assert cli(capsys, redis_url, "api-keys", "revoke", "far", k["id"])["deleted"] is True
    assert main(["money", "usage", "--bucket-width", "1h", "--redis-url", redis_url]) == 1
    assert "bucket_width" in capsys.readouterr().err
    keys = cli(capsys, redis_url, "admin-key", "list")
    assert {k["org"] for k in keys} == {"acme"} and all("key" not in k for k in keys)
    assert cli(capsys, redis_url, "admin-key", "revoke", keys[0]["digest"])["org"] == "acme"
    assert r.scard("sy:admin_keys") == 0 and not r.exists(spend_key("acme", "19700101"))


def got_end(page: dict) -> int:
    return page["data"][-1]["end_time"]


def test_project_rate_limits_per_model_through_the_sdk(capsys, r, redis_url, gateway, world):
    limits = sdk(gateway, admin_key(capsys, redis_url, "acme")).admin.organization.projects.rate_limits
    listed = limits.list_rate_limits("shop")
    assert [x.id for x in listed] == ["rl-m1", "rl-m2"] and listed.data[0].object == "project.rate_limit"
    assert (listed.data[0].max_tokens_per_1_minute, listed.data[0].max_requests_per_1_minute) == (0, 0)
    got = limits.update_rate_limit("rl-m1", project_id="shop", max_tokens_per_1_minute=900,
                                   max_requests_per_1_minute=2)
    assert (got.id, got.model) == ("rl-m1", "m1")
    assert (got.max_tokens_per_1_minute, got.max_requests_per_1_minute) == (900, 2)
    assert limits.list_rate_limits("shop").data[1].max_requests_per_1_minute == 0  # m2 untouched

    async def requests() -> list[str]:
        client = async_client(redis_url)
        ledger, out = MoneyLedger(client, PriceBook(client)), []
        for model in ("m1", "m1", "m1", "m2"):
            try:
                await ledger.refund(await ledger.reserve(MoneyPath("acme", "shop", "k" * 64, model), 1, 1))
                out.append("ok")
            except LevelRateLimited as exc:
                out.append(exc.level)
        await client.aclose()
        return out

    assert asyncio.run(requests()) == ["ok", "ok", "project (model m1)", "ok"]  # applied at once
    with pytest.raises(openai.BadRequestError) as exc:
        limits.update_rate_limit("rl-m1", project_id="shop", max_images_per_1_minute=5)
    assert exc.value.param == "max_images_per_1_minute" and exc.value.code == "unsupported_parameter"
    with pytest.raises(openai.BadRequestError) as exc:
        limits.update_rate_limit("rl-m1", project_id="shop", max_tokens_per_1_minute=-1)
    assert exc.value.param == "max_tokens_per_1_minute"
    with pytest.raises(openai.NotFoundError):
        limits.update_rate_limit("rl-m9", project_id="shop", max_tokens_per_1_minute=1)
    with pytest.raises(openai.NotFoundError):
        limits.list_rate_limits("far")                                  # beta's project
