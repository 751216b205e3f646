"""Budget reserve/settle against a real Redis: arithmetic, refunds, denials, leases, retry-after."""

from __future__ import annotations

import asyncio
import time

import pytest

from admission.budget import Budget
from admission.headers import rate_limit_headers
from admission.hold import BudgetGuard
from admission.results import QuotaExceeded, RequestTooLarge, TenantRejected
from common.priorities import Priority
from tenancy import tenant_admin as store
from tenancy.redis_client import async_client
from tenancy.schema import bucket_key, config_key, leases_key, usage_key

pytestmark = pytest.mark.timeout(60)
WINDOW_US = 60_000_000


@pytest.fixture()
async def budget(redis_url):
    client = async_client(redis_url)
    yield Budget(client, lease_ttl_s=60)
    await client.aclose()


def bucket(r, name: str) -> tuple[float, float, int]:
    tok, req, ts = r.hmget(bucket_key(name), "tok", "req", "ts")
    return float(tok), float(req), int(ts)


async def test_refund_leaves_unused_tokens_in_bucket(r, budget):
    t = store.create_tenant(r, "acme", tpm=6000, rpm=100)
    res = await budget.reserve(t, prompt_tokens=20, max_tokens=500)
    assert res.result.admitted and res.result.remaining_tokens == 6000 - 520
    tok1, req1, ts1 = bucket(r, "acme")
    assert tok1 == 6000 - 520 and req1 == 99
    res.record(completion_tokens=10, cached_tokens=4)
    assert await budget.settle(res) is True
    tok2, _, ts2 = bucket(r, "acme")
    refill = (ts2 - ts1) * 6000 / WINDOW_US
    assert tok2 == pytest.approx(tok1 + refill + 490, abs=1e-5)  # exactly 490 back, plus the refill
    assert await budget.settle(res) is False                    # idempotent: no double refund
    assert r.zcard(leases_key("acme")) == 0
    day = time.strftime("%Y%m%d", time.gmtime())
    usage = {k.decode(): int(v) for k, v in r.hgetall(usage_key("acme", day)).items()}
    assert usage == {"requests": 1, "prompt_tokens": 20, "cached_tokens": 4, "completion_tokens": 10}
    assert 0 < r.ttl(usage_key("acme", day)) <= 400 * 86400


async def test_rejected_request_charges_nothing(r, budget):
    t = store.create_tenant(r, "acme", tpm=1000, rpm=100, max_concurrent=5)
    await budget.reserve(t, 100, 800)
    state = r.hgetall(bucket_key("acme"))
    leases = r.zrange(leases_key("acme"), 0, -1)
    with pytest.raises(QuotaExceeded) as exc:
        await budget.reserve(t, 100, 200)
    res = exc.value.result
    assert res.limit_name == "tokens" and res.requested == 300 and res.used == 900
    assert ("tokens per minute" in str(exc.value) and "used 900" in str(exc.value)
            and "requested 300" in str(exc.value))
    # (300 - 100 - refill) / (1000/60 s) ≈ 12 s
    assert 11_000 <= res.retry_after_ms <= 12_010
    assert r.hgetall(bucket_key("acme")) == state and r.zrange(leases_key("acme"), 0, -1) == leases
    h = rate_limit_headers(res)
    assert (h["retry-after"] == str(-(-res.retry_after_ms // 1000))
            and int(h["retry-after-ms"]) == res.retry_after_ms)
    assert h["x-ratelimit-limit-tokens"] == "1000" and h["x-ratelimit-remaining-tokens"] == "100"
    assert h["x-ratelimit-limit-requests"] == "100" and h["x-ratelimit-remaining-requests"] == "99"
    assert h["x-ratelimit-reset-tokens"].endswith("s")


async def test_never_fits_is_distinct(r, budget):
    t = store.create_tenant(r, "acme", tpm=1000)
    with pytest.raises(RequestTooLarge, match="can never"):
        await budget.reserve(t, 600, 500)
    assert not r.exists(bucket_key("acme"))


async def test_disabled_or_deleted_tenant_rejected_at_reserve(r, budget):
    t = store.create_tenant(r, "acme")
    r.hset(config_key("acme"), "status", "disabled")
    with pytest.raises(TenantRejected, match="disabled"):
        await budget.reserve(t, 1, 1)
    r.delete(config_key("acme"))
    with pytest.raises(TenantRejected, match="does not exist"):
        await budget.reserve(t, 1, 1)


async def test_requests_per_minute_and_live_edit(r, budget):
    t = store.create_tenant(r, "acme", rpm=2, tpm=0)
    await budget.reserve(t, 1, 1)
    await budget.reserve(t, 1, 1)
    with pytest.raises(QuotaExceeded) as exc:
        await budget.reserve(t, 1, 1)
    assert exc.value.result.limit_name == "requests" and 29_000 < exc.value.result.retry_after_ms <= 30_002
    r.hset(config_key("acme"), "rpm", "0")  # live edit: unlimited from the next call
    await budget.reserve(t, 1, 1)


async def test_concurrency_leases_cap_and_expire(r, redis_url):
    t = store.create_tenant(r, "acme", max_concurrent=3, tpm=0, rpm=0)
    client = async_client(redis_url)
    short = Budget(client, lease_ttl_s=0.6)
    try:
        results = await asyncio.gather(*(short.reserve(t, 1, 1) for _ in range(10)), return_exceptions=True)
        admitted = [x for x in results if not isinstance(x, BaseException)]
        denied = [x for x in results if isinstance(x, QuotaExceeded)]
        assert len(admitted) == 3 and len(denied) == 7
        assert all(d.result.limit_name == "concurrency" and d.result.used == 3 for d in denied)
        assert r.zcard(leases_key("acme")) == 3
        # never settled (a crashed gateway): the leases expire after their TTL and slots come back
        await asyncio.sleep(0.7)
        again = await asyncio.gather(*(short.reserve(t, 1, 1) for _ in range(3)))
        assert len(again) == 3 and r.zcard(leases_key("acme")) == 3
        # renewal keeps leases alive past the TTL
        assert (await short.renew("acme", [x.lease_id for x in again])).renewed == 3
        lost = await short.renew("acme", [admitted[0].lease_id])  # expired and swept; all 3 slots taken
        assert (lost.renewed, lost.retaken, lost.lost) == (0, (), (admitted[0].lease_id,))
    finally:
        await client.aclose()


async def test_retry_after_is_honoured(r, budget):
    t = store.create_tenant(r, "acme", tpm=6000, rpm=0)  # 100 tokens/s
    await budget.reserve(t, 5000, 900)
    with pytest.raises(QuotaExceeded) as exc:
        await budget.reserve(t, 100, 100)
    wait_ms = exc.value.result.retry_after_ms
    assert 900 <= wait_ms <= 2100
    await asyncio.sleep(wait_ms * 0.9 / 1000)
    with pytest.raises(QuotaExceeded):  # too early by 10 %: still denied
        await budget.reserve(t, 100, 100)
    await asyncio.sleep(wait_ms * 0.1 / 1000 + 0.005)
    res = await budget.reserve(t, 100, 100)
    assert res.result.admitted


async def test_guard_settles_on_error_and_cancellation(r, redis_url):
    t = store.create_tenant(r, "acme", tpm=10_000, max_concurrent=2)
    client = async_client(redis_url)
    guard = BudgetGuard(Budget(client))
    try:
        with pytest.raises(RuntimeError):
            async with guard.hold(t, 10, 100) as res:
                res.record(5)
                raise RuntimeError("worker died")
        assert r.zcard(leases_key("acme")) == 0

        started = asyncio.Event()

        async def stream() -> None:
            async with guard.hold(t, 10, 100):
                started.set()
                await asyncio.sleep(30)

        task = asyncio.create_task(stream())
        await started.wait()
        assert r.zcard(leases_key("acme")) == 1
        task.cancel()  # client disconnect
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0.05)
        assert r.zcard(leases_key("acme")) == 0 and guard.in_flight == 0

        tok0, req0, _ = bucket(r, "acme")
        async with guard.hold(t, 10, 100) as res:  # shed after reserving: nothing charged
            res.unserved()
        tok, req, _ = bucket(r, "acme")
        assert tok >= tok0 and req >= req0
        day = time.strftime("%Y%m%d", time.gmtime())
        assert int(r.hget(usage_key("acme", day), "requests")) == 2
    finally:
        await guard.aclose()
        await client.aclose()


async def test_guard_renews_long_streams(r, redis_url):
    t = store.create_tenant(r, "acme")
    client = async_client(redis_url)
    guard = BudgetGuard(Budget(client, lease_ttl_s=0.6))  # renewer runs every 0.2 s
    try:
        async with guard.hold(t, 1, 1):
            await asyncio.sleep(1.0)
            assert r.zcard(leases_key("acme")) == 1  # outlived its TTL thanks to renewals
        assert r.zcard(leases_key("acme")) == 0
    finally:
        await guard.aclose()
        await client.aclose()


async def test_admission_facade_sheds_without_charging(r, redis_url):
    from admission.capacity import CapacityGate, Overloaded, WorkerCapacity
    from admission.gate import Admission, error_response

    t = store.create_tenant(r, "acme", tpm=10_000, rpm=100)
    client = async_client(redis_url)
    gate = CapacityGate(lambda: [WorkerCapacity("w0", 1000, 1000)], admission_wait_ms=50,
                        interactive_reserve=0.2)
    admission = Admission(BudgetGuard(Budget(client)), gate)
    try:
        async with admission.admit(t, 100, 300, Priority.INTERACTIVE) as ticket:
            assert ticket.headers["x-ratelimit-remaining-tokens"] == str(10_000 - 400)
            ticket.record_usage(100, 20, 50)
        tok0, req0, _ = bucket(r, "acme")
        with pytest.raises(Overloaded) as exc:
            async with admission.admit(t, 100, 800, Priority.BATCH):
                pass  # 900 > 1000 - 20 % reserve: shed
        spec = error_response(exc.value)
        assert (spec.status == 503 and spec.code == "server_overloaded"
                and int(spec.headers["retry-after"]) >= 1)
        tok1, req1, _ = bucket(r, "acme")
        assert tok1 >= tok0 and req1 >= req0  # the shed request was refunded in full
        day = time.strftime("%Y%m%d", time.gmtime())
        assert r.hgetall(usage_key("acme", day))[b"requests"] == b"1"
        with pytest.raises(QuotaExceeded) as exc2:
            async with admission.admit(t, 100, 9800, Priority.INTERACTIVE):
                pass
        spec = error_response(exc2.value)
        assert spec.status == 429 and spec.code == "rate_limit_exceeded" and "retry-after-ms" in spec.headers
    finally:
        await admission.aclose()
        await client.aclose()


async def test_read_only_or_full_redis_is_quota_service_unavailable(r, redis_url):
    """After a failover the old primary answers READONLY; a full one OOM: both are 503s, never 500s."""
    from redis.exceptions import ResponseError

    from admission.gate import error_response
    from admission.lua.scripts import is_unavailable_reply
    from tenancy.tenancy_errors import QuotaServiceUnavailable
    from tests.conftest import free_port

    t = store.create_tenant(r, "acme", tpm=10_000, max_concurrent=5)
    client = async_client(redis_url)
    guard = BudgetGuard(Budget(client, lease_ttl_s=60))
    try:
        held = await guard.acquire(t, 10, 10)
        r.replicaof("127.0.0.1", free_port())  # this server is a replica now: writes answer READONLY
        with pytest.raises(QuotaServiceUnavailable) as exc:
            await guard.acquire(t, 10, 10)
        spec = error_response(exc.value)
        assert spec is not None and (spec.status, spec.code) == (503, "quota_service_unavailable")
        assert await guard.renew_due(0.0) == 0  # renewal fails quietly; the lease is kept for the next try
    finally:
        r.replicaof("no", "one")
        await guard.release(held)
        await guard.aclose()
        await client.aclose()
    assert r.zcard(leases_key("acme")) == 0
    # the other "cannot write now" replies map the same way; a bug in a call still raises
    assert is_unavailable_reply(
        ResponseError("OOM command not allowed when used memory > 'maxmemory'. script: x"))
    assert is_unavailable_reply(ResponseError("MISCONF Redis is configured to save RDB snapshots, but ..."))
    assert not is_unavailable_reply(ResponseError("ERR wrong number of arguments for 'hget' command"))


async def test_renewal_retakes_expired_leases_only_within_max_concurrent(r, redis_url):
    """Leases that expired during an outage: taken again while the tenant has room, else marked lost."""
    t = store.create_tenant(r, "acme", max_concurrent=2, tpm=0, rpm=0)
    client = async_client(redis_url)
    guard = BudgetGuard(Budget(client, lease_ttl_s=60))
    other = Budget(client, lease_ttl_s=60)  # another gateway
    try:
        a = await guard.acquire(t, 1, 1)
        b = await guard.acquire(t, 1, 1)
        r.delete(leases_key("acme"))  # both expired while Redis was unreachable (or it lost them)
        c = await other.reserve(t, 1, 1)  # meanwhile another gateway took one of the two slots
        assert await guard.renew_due(0.0) == 1
        assert [a.lease_lost, b.lease_lost] == [False, True]
        assert r.zcard(leases_key("acme")) == 2  # never more than max_concurrent
        assert r.zscore(leases_key("acme"), a.lease_id) is not None
        assert await guard.renew_due(0.0) == 1  # a is renewed as usual; b is not taken again
        await guard.release(b)
        await guard.release(a)
        await other.settle(c)
        assert r.zcard(leases_key("acme")) == 0
    finally:
        await guard.aclose()
        await client.aclose()


async def test_renewal_racing_a_settle_leaves_no_lease(r, redis_url):
    class LateRenewals(Budget):
        async def renew(self, tenant_name, lease_ids):
            await settled.wait()
            return await super().renew(tenant_name, lease_ids)

    settled = asyncio.Event()
    t = store.create_tenant(r, "acme", max_concurrent=2, tpm=0, rpm=0)
    client = async_client(redis_url)
    guard = BudgetGuard(LateRenewals(client, lease_ttl_s=60))
    try:
        res = await guard.acquire(t, 1, 1)
        renewal = asyncio.ensure_future(guard.renew_due(0.0))
        await asyncio.sleep(0)  # the renewal has picked the lease
        await guard.release(res)  # and the settle's ZREM reaches Redis first
        settled.set()
        assert await renewal == 1  # it found the lease gone and took it back...
        assert r.zcard(leases_key("acme")) == 0
    finally:
        await guard.aclose()
        await client.aclose()


async def test_charge_invalid_takes_one_request_and_says_when_one_is_back(r, budget):
    t = store.create_tenant(r, "sloppy", tpm=1000, rpm=2, max_concurrent=5)
    assert await budget.charge_invalid(t) == 0  # one of two left
    retry_ms = await budget.charge_invalid(t)
    assert 29_000 <= retry_ms <= 30_002  # none left: one request per 30 s comes back
    assert await budget.charge_invalid(t) > 0
    tok, req = (float(v) for v in r.hmget(bucket_key("sloppy"), "tok", "req"))
    assert tok == pytest.approx(1000) and 0 <= req < 0.01  # never below zero, and no token charged
    assert await budget.charge_invalid(store.Tenant(name="nobody")) == 0  # unknown tenant: nothing written
    assert not r.exists(bucket_key("nobody"))
    unlimited = store.create_tenant(r, "unlimited", tpm=1000, rpm=0)
    assert await budget.charge_invalid(unlimited) == 0 and not r.exists(bucket_key("unlimited"))


async def test_a_reserve_that_timed_out_after_running_is_undone(r, budget, monkeypatch):
    """The script charged and took a lease, but the reply was lost (a timeout): the gateway settles the
    unknown lease as never served, so the tenant's concurrency slot and tokens come back within a second, not
    after the TTL."""
    from admission import budget as budget_module
    from tenancy.tenancy_errors import QuotaServiceUnavailable

    t = store.create_tenant(r, "late", tpm=6000, rpm=100, max_concurrent=1)
    real = budget._reserve_shielded

    async def ran_then_timed_out(name: str, cost: int, lease_id: str):
        await real(name, cost, lease_id)
        raise QuotaServiceUnavailable("timed out reading the reply")

    monkeypatch.setattr(budget, "_reserve_shielded", ran_then_timed_out)
    monkeypatch.setattr(budget_module, "UNDO_DELAYS_S", (0.1, 0.3))
    with pytest.raises(QuotaServiceUnavailable):
        await budget.reserve(t, prompt_tokens=20, max_tokens=500)
    assert r.zcard(leases_key("late")) == 1  # the lease the lost reply took
    await asyncio.sleep(0.3)
    assert r.zcard(leases_key("late")) == 0
    tok, req, _ = bucket(r, "late")
    # tokens and request back
    assert tok == pytest.approx(6000, abs=1) and req == pytest.approx(100, abs=0.01)
    monkeypatch.setattr(budget, "_reserve_shielded", real)
    res = await budget.reserve(t, prompt_tokens=1, max_tokens=1)  # the concurrency slot is free again
    assert res.result.admitted
    await budget.settle(res)
