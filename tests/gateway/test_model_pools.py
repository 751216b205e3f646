"""Model pools in the gateway: a request's `model` (version, model name or alias) resolved to a live version's
Target, the errors (404 unknown, 403 not allowed, 503 none live, with retry-after), the tokenizer cache and
the model listing, over simulated workers."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from types import SimpleNamespace

import pytest

from bench.fleet import SimMembership
from gateway.flow.versions import FleetPools, TokenizerCache, sticky_prefix
from gateway.openai.schemas import parse_chat, parse_completion
from gateway.web.api_errors import ApiError
from router import AliasTable, Fleet, Router, Served, encode_alias, sticky_key
from tenancy import Tenant

OWN = SimpleNamespace(model_id="own", version="tok-own")
MODELS = {"spec-m": SimpleNamespace(model_id="m", version="tok-m")}


def _pools(aliases: AliasTable | None = None) -> tuple[FleetPools, SimMembership]:
    m = SimMembership()
    fleet = Fleet(m, lambda view, served: Router(view, secret=b"s"),  # type: ignore[arg-type]
                  default=Served("own"))
    m.add("a", "own", tokenizer="tok-own")
    m.add("b", "m", "v1", spec="spec-m", tokenizer="tok-m")
    m.add("c", "m", "v2", spec="spec-m", tokenizer="tok-m")
    m.add("d", "x", spec="spec-x", tokenizer="tok-x")  # a tokenizer this gateway cannot load
    loads: list[str] = []

    def load(spec: str) -> SimpleNamespace:
        loads.append(spec)
        return MODELS[spec]

    pools = FleetPools(fleet, TokenizerCache(OWN, "default", load), aliases)  # type: ignore[arg-type]
    pools.loads = loads  # type: ignore[attr-defined]
    return pools, m


def _error(f, *args) -> ApiError:  # noqa: ANN001
    with pytest.raises(ApiError) as info:
        f(*args)
    return info.value


def test_a_request_names_a_version_a_model_or_the_default_alias() -> None:
    pools, _ = _pools()
    t = Tenant("t")
    target = pools.resolve("m@v1", t, "p")
    assert (target.key, target.response_model, target.model) == ("m@v1", "m@v1", MODELS["spec-m"])
    assert {pools.resolve("m", t, f"p{i}").key for i in range(40)} == {"m@v1", "m@v2"}
    assert pools.resolve("default", t, "p").key == "own"
    assert pools.resolve("own", t, "p").model is OWN
    assert pools.loads == ["spec-m"]  # loaded once, then cached


def test_unknown_forbidden_and_unavailable_models_get_openai_errors() -> None:
    pools, m = _pools()
    err = _error(pools.resolve, "nope", Tenant("t"), "")
    assert (err.status, err.code, err.param) == (404, "model_not_found", "model")
    err = _error(pools.resolve, "own", Tenant("t", allowed_models=("m",)), "")
    assert (err.status, err.code) == (403, "model_not_allowed")
    assert pools.resolve("m@v2", Tenant("t", allowed_models=("m",)), "").key == "m@v2"
    err = _error(pools.resolve, "x", Tenant("t"), "")
    assert (err.status, err.code) == (503, "model_unavailable")  # no tokenizer for it here
    m.kill("b")
    m.kill("c")
    err = _error(pools.resolve, "m", Tenant("t"), "")
    assert (err.status, err.code, err.headers["retry-after"]) == (503, "model_unavailable", "1")


def test_aliases_route_by_weight_fall_back_and_are_listed() -> None:
    async def main() -> None:
        class R:
            async def hgetall(self, key: str) -> dict:
                return {b"canary": encode_alias({"m@v1": 90, "m@v2": 10}).encode(),
                        b"broken": encode_alias({"gone@v0": 1}).encode()}

        table = AliasTable(R())
        await table.start()
        pools, m = _pools(table)
        await asyncio.to_thread(pools.tokenizers.get, pools.fleet.served("m@v1"))  # as the fleet preloads it
        t = Tenant("t")
        picks = [pools.resolve("canary", t, f"conv-{i}").key for i in range(1000)]
        assert 0.06 < picks.count("m@v2") / len(picks) < 0.14
        assert all(pools.resolve("canary", t, f"conv-{i}").key == k for i, k in enumerate(picks[:50]))
        m.kill("b")
        assert {pools.resolve("canary", t, f"conv-{i}").key for i in range(50)} == {"m@v2"}
        err = _error(pools.resolve, "broken", t, "")
        assert (err.status, err.code) == (503, "model_unavailable")
        assert pools.listing(t) == ["canary", "default", "m", "m@v2", "own", "x"]
        assert pools.listing(Tenant("t", allowed_models=("canary",))) == ["canary"]
        await table.close()

    asyncio.run(main())


def test_operator_alias_mistakes_are_not_the_clients() -> None:
    """A malformed alias record (no last good one) is a 503, not a charged 404; an alias picks only among the
    versions a tenant may use (never an intermittent 403); an alias named like a model does not carry that
    model's permission to other models."""
    async def main() -> None:
        class R:
            async def hgetall(self, key: str) -> dict:
                return {b"typo": b"{not json", b"canary": encode_alias({"m@v1": 10, "m@v2": 90}).encode(),
                        b"own": encode_alias({"m@v1": 1}).encode()}

        table = AliasTable(R())
        await table.start()
        pools, _ = _pools(table)
        await asyncio.to_thread(pools.tokenizers.get, pools.fleet.served("m@v1"))
        err = _error(pools.resolve, "typo", Tenant("t"), "")
        assert (err.status, err.code) == (503, "model_unavailable") and "malformed" in str(err)
        only_v1 = Tenant("t", allowed_models=("m@v1",))
        assert {pools.resolve("canary", only_v1, f"conv-{i}").key for i in range(200)} == {"m@v1"}
        err = _error(pools.resolve, "canary", Tenant("t", allowed_models=("x",)), "")
        assert (err.status, err.code) == (403, "model_not_allowed")
        # the model's name, not m's
        err = _error(pools.resolve, "own", Tenant("t", allowed_models=("own",)), "")
        assert (err.status, err.code) == (403, "model_not_allowed")
        assert pools.resolve("canary", Tenant("t", allowed_models=("canary",)), "p").key in ("m@v1", "m@v2")
        await table.close()

    asyncio.run(main())


def test_a_tokenizer_load_never_blocks_the_event_loop() -> None:
    """On the loop, a version whose tokenizer is not loaded gets a retryable 503 at once while a thread loads
    it (once, however many requests ask); the next request after the load is served."""
    pools, _ = _pools()
    release = threading.Event()
    slow = pools.tokenizers._load

    def load(spec: str):  # noqa: ANN202
        release.wait(10)
        return slow(spec)

    pools.tokenizers._load = load

    async def main() -> None:
        t0 = time.monotonic()
        for _ in range(3):
            err = _error(pools.resolve, "m@v1", Tenant("t"), "p")
            assert (err.status, err.code, err.headers["retry-after"]) == (503, "model_unavailable", "1")
        assert time.monotonic() - t0 < 0.5  # nothing waited for the load
        release.set()
        for _ in range(100):
            with contextlib.suppress(ApiError):
                return pools.resolve("m@v1", Tenant("t"), "p")
            await asyncio.sleep(0.05)

    target = asyncio.run(main())
    assert target is not None and target.model is MODELS["spec-m"] and pools.loads == ["spec-m"]


def test_sticky_prefix_is_the_same_on_every_turn_of_a_conversation() -> None:
    first = [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}]
    later = [*first, {"role": "assistant", "content": "hello"}, {"role": "user", "content": "more"}]
    a = sticky_prefix(parse_chat({"model": "m", "messages": first}))
    assert a == sticky_prefix(parse_chat({"model": "m", "messages": later}))
    assert a != sticky_prefix(parse_chat({"model": "m", "messages": [{"role": "user", "content": "other"}]}))
    keyed = parse_chat({"model": "m", "messages": first, "prompt_cache_key": "k"})
    assert sticky_prefix(keyed) == "k:k"
    assert sticky_prefix(parse_completion({"model": "m", "prompt": "x" * 5000})) == "p:" + "x" * 1024


def test_capacity_is_admitted_per_version_and_per_traffic_class_pool() -> None:
    from common.priorities import Priority

    m = SimMembership()
    fleet = Fleet(m, lambda view, served: Router(view, secret=b"s"),  # type: ignore[arg-type]
                  default=Served("own"))
    m.add("i", "m", "v1", pool="interactive")
    m.add("b", "m", "v1", pool="batch")
    m.add("c", "m", "v2")
    made: list[tuple[str, str | None]] = []

    def make_gate(router: Router, pool: str | None) -> object:
        made.append((router.live()[0], pool))
        return object()

    pools = FleetPools(fleet, TokenizerCache(OWN, "default"), None, make_gate,  # type: ignore[arg-type]
                       {Priority.BATCH: "batch", Priority.INTERACTIVE: "interactive"})
    t = Tenant("t")
    batch = pools.resolve("m@v1", t, "", Priority.BATCH).capacity
    assert pools.resolve("m@v1", t, "x", Priority.BATCH).capacity is batch  # one gate per (version, pool)
    assert pools.resolve("m@v1", t, "", Priority.INTERACTIVE).capacity is not batch
    pools.resolve("m@v2", t, "", Priority.BATCH)  # no pool labels in v2: one gate over every worker
    assert made == [("b", "batch"), ("b", "interactive"), ("c", None)]


def test_router_capacity_counts_only_its_pool() -> None:
    from gateway.flow.capacity_view import RouterCapacity

    m = SimMembership()
    router = Router(m, secret=b"s")  # type: ignore[arg-type]
    m.add("i", "m", pool="interactive", kv_total=100)
    m.add("b", "m", pool="batch", kv_total=300)
    assert [v.worker_id for v in RouterCapacity(router, "batch")()] == ["b"]
    assert sorted(v.worker_id for v in RouterCapacity(router)()) == ["b", "i"]


def test_a_tenant_cannot_aim_all_its_load_at_a_canary() -> None:
    """Sticky keys chosen to land on a 10% canary: at most twice its share of the tenant's picks stay there,
    the rest go to the stable version; another tenant's picks follow the weights as before."""
    async def main() -> None:
        class R:
            async def hgetall(self, key: str) -> dict:
                return {b"canary": encode_alias({"m@v1": 90, "m@v2": 10}).encode()}

        table = AliasTable(R())
        await table.start()
        pools, _ = _pools(table)
        await asyncio.to_thread(pools.tokenizers.get, pools.fleet.served("m@v1"))
        alias = table.get("canary")
        aimed = [f"conv-{i}" for i in range(5000)
                 if alias.pick({"m@v1", "m@v2"}, sticky_key("greedy", "canary", f"conv-{i}")) == "m@v2"][:300]
        picks = [pools.resolve("canary", Tenant("greedy"), p).key for p in aimed]
        assert picks.count("m@v2") / len(picks) <= 0.3 and picks.count("m@v1") > 200
        fair = [pools.resolve("canary", Tenant("other"), f"c-{i}").key for i in range(500)]
        assert 0.06 < fair.count("m@v2") / len(fair) < 0.14
        await table.close()

    asyncio.run(main())
