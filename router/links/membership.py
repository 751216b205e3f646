"""The known workers (Redis registry and/or static endpoints), one WorkerClient each, and their liveness.

The registry only discovers workers; liveness is decided in `status` alone, from the direct link (the
workers' ~100 ms stats), so Redis being down or empty drops nobody. Listeners hear joins, leaves and stats.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from common.redis_url import async_redis
from common.worker_registry import REGISTRY_KEY_PREFIX, REGISTRY_SET_KEY, Registration, parse_registration
from router.links.client import WorkerClient
from router.placement.policy import FALLBACK_DEAD, FALLBACK_DRAINING
from worker.protocol import PROTOCOL_VERSION, WorkerStats

log = logging.getLogger(__name__)

DEFAULT_POLL_INTERVAL_S = 0.5
DEFAULT_DEAD_AFTER_S = 0.5  # 3 stats intervals of 100 ms plus slack for a busy host
DEFAULT_STALL_AFTER_S = 10.0  # stats silence allowed while the worker's link still answers pings
REDIS_TIMEOUT_S = 1.0

ClientFactory = Callable[..., WorkerClient]

# KEYS: registry set. ARGV: record key prefix. Sweeps expired entries, then MGETs the live ones' records.
_READ_REGISTRY = """
local t = redis.call('TIME')
local now_ms = string.format('%d', tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000))
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now_ms)
local ids = redis.call('ZRANGEBYSCORE', KEYS[1], '(' .. now_ms, '+inf')
if #ids == 0 then return {} end
local keys = {}
for i, id in ipairs(ids) do keys[i] = ARGV[1] .. id end
return redis.call('MGET', unpack(keys))
"""


@dataclass(slots=True, frozen=True)
class StatsEvent:
    """A stats frame, as recorded: `at` on the membership clock; `came_back`: dead (or new) and now live."""

    member_id: str
    stats: WorkerStats
    at: float
    came_back: bool = False


StatsListener = Callable[[StatsEvent], None]
MemberListener = Callable[[str], None]


@dataclass(slots=True)
class Member:
    member_id: str
    endpoint: str
    client: WorkerClient
    static: bool = False
    started_at: float = 0.0
    joined_at: float = 0.0  # membership clock
    stats: WorkerStats | None = None
    stats_at: float | None = None  # membership clock
    registration: Registration | None = None  # what it announced (None: a static endpoint)


@dataclass(slots=True)
class _Wanted:
    endpoint: str
    static: bool
    started_at: float
    registration: Registration | None = None


class MemberEvents:
    """Subscribers to member joins, leaves and recorded stats frames (a Membership, or one pool's view of
    it)."""

    def __init__(self) -> None:
        self._on_join: list[MemberListener] = []
        self._on_leave: list[MemberListener] = []
        self._on_stats: list[StatsListener] = []

    def on_join(self, listener: MemberListener) -> None:
        """Call `listener(member_id)` after each member joins."""
        self._on_join.append(listener)

    def on_leave(self, listener: MemberListener) -> None:
        """Call `listener(member_id)` after each member leaves."""
        self._on_leave.append(listener)

    def on_stats(self, listener: StatsListener) -> None:
        """Call `listener(event)` after each stats frame is recorded, in subscription order."""
        self._on_stats.append(listener)


class Membership(MemberEvents):
    """Known workers, their clients and liveness; listeners hear every join, leave and recorded stats
    frame."""

    def __init__(
        self,
        *,
        gateway_id: str,
        redis_url: str | None = None,
        static_endpoints: Iterable[str] = (),
        model: str | None = None,
        poll_interval: float = DEFAULT_POLL_INTERVAL_S,
        dead_after: float = DEFAULT_DEAD_AFTER_S,
        stall_after: float = DEFAULT_STALL_AFTER_S,
        clock: Callable[[], float] = time.monotonic,
        client_factory: ClientFactory = WorkerClient,
    ) -> None:
        super().__init__()
        self.gateway_id = gateway_id
        self.redis_url = redis_url
        self.static_endpoints = list(dict.fromkeys(static_endpoints))
        if redis_url is None and not self.static_endpoints:
            raise ValueError("membership needs a redis_url, static endpoints, or both")
        self.model = model
        self.poll_interval = poll_interval
        self.dead_after = dead_after
        self.stall_after = stall_after
        self.clock = clock
        self._client_factory = client_factory
        self._members: dict[str, Member] = {}
        self._registry: dict[str, _Wanted] = {}  # last good registry view, kept across Redis errors
        self._redis = None
        self._read_script = None
        self._task: asyncio.Task[None] | None = None
        self._redis_ok = True
        self._changed = asyncio.Event()
        self._stop = asyncio.Event()

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        if self.redis_url is not None:
            self._redis = async_redis(  # one server, or a cluster (the registry keys share one slot)
                self.redis_url, socket_timeout=REDIS_TIMEOUT_S, socket_connect_timeout=REDIS_TIMEOUT_S
            )
            self._read_script = self._redis.register_script(_READ_REGISTRY)  # reloads itself on NOSCRIPT
        await self.refresh()
        self._task = asyncio.create_task(self._poll_loop(), name="sy-membership")

    async def close(self) -> None:
        if self._task is not None:
            # A stop flag, not only cancel(): a cancel landing inside WorkerClient.close() is swallowed there.
            self._stop.set()
            try:
                await asyncio.wait_for(asyncio.shield(self._task),
                                       self.poll_interval + 2 * REDIS_TIMEOUT_S + 1)
            except TimeoutError:
                self._task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self._task
            self._task = None
        for mid in list(self._members):
            await self._remove(mid)
        if self._redis is not None:
            await self._redis.aclose()
            self._redis = None

    async def _poll_loop(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), self.poll_interval)
            if self._stop.is_set():
                return
            try:
                await self.refresh()
            except Exception:  # never let one bad poll end the watch
                log.exception("membership refresh failed")

    # ------------------------------------------------------------ registry

    async def refresh(self) -> None:
        """One poll: read the registry, then add/remove members to match it and the static list."""
        if self._redis is not None:
            registry = await self._read_registry()
            if registry is not None:
                self._registry = registry
        await self._reconcile(self._wanted())

    async def _read_registry(self) -> dict[str, _Wanted] | None:
        try:
            values = await self._read_script(keys=[REGISTRY_SET_KEY], args=[REGISTRY_KEY_PREFIX])
        except Exception as exc:
            if self._redis_ok:
                log.warning("worker registry unreadable, keeping the last view: %s", exc)
            self._redis_ok = False
            return None
        self._redis_ok = True
        found: dict[str, _Wanted] = {}
        by_endpoint: dict[str, str] = {}
        for raw in values:
            if raw is None:  # the record expired before its set entry
                continue
            try:
                reg = parse_registration(raw)
            except ValueError as exc:
                log.warning("ignoring malformed worker registration: %s", exc)
                continue
            if reg.version != PROTOCOL_VERSION or (self.model is not None and reg.model != self.model):
                continue
            other = by_endpoint.get(reg.endpoint)
            if other is not None:
                if found[other].started_at >= reg.started_at:
                    continue
                del found[other]
            by_endpoint[reg.endpoint] = reg.worker_id
            found[reg.worker_id] = _Wanted(reg.endpoint, False, float(reg.started_at), reg)
        return found

    def _wanted(self) -> dict[str, _Wanted]:
        """The registry's workers, those it no longer lists whose link still answers (unless another worker
        registered their endpoint since), and the static endpoints no registered worker covers."""
        wanted = dict(self._registry)
        claimed = {w.endpoint for w in wanted.values()}
        for mid, member in self._members.items():
            if (mid not in wanted and not member.static and member.endpoint not in claimed
                    and not self._gone(member)):
                wanted[mid] = _Wanted(member.endpoint, False, member.started_at, member.registration)
                claimed.add(member.endpoint)
        for ep in self.static_endpoints:
            if ep not in claimed:
                wanted[ep] = _Wanted(ep, True, 0.0)
        return wanted

    async def _reconcile(self, wanted: dict[str, _Wanted]) -> None:
        for mid, member in list(self._members.items()):
            want = wanted.get(mid)
            if want is None or want.endpoint != member.endpoint:
                await self._remove(mid)
        for mid, want in wanted.items():
            if mid not in self._members:
                await self._add(mid, want)

    async def _add(self, mid: str, want: _Wanted) -> None:
        client = self._client_factory(want.endpoint, gateway_id=self.gateway_id,
                                      worker_timeout=self.dead_after, stall_timeout=self.stall_after,
                                      on_stats=self._stats_callback(mid))
        try:
            await client.start()
        except Exception as exc:  # e.g. a malformed endpoint: skip this worker, keep the others
            log.warning("cannot connect to worker %s at %r: %s", mid, want.endpoint, exc)
            await client.close()
            return
        self._members[mid] = Member(mid, want.endpoint, client, want.static, want.started_at, self.clock(),
                                    registration=want.registration)
        for listener in self._on_join:
            listener(mid)
        log.info("worker %s joined at %s", mid, want.endpoint)
        self._changed.set()

    async def _remove(self, mid: str) -> None:
        member = self._members.pop(mid)
        for listener in self._on_leave:
            listener(mid)
        await member.client.close()
        log.info("worker %s left (%s)", mid, member.endpoint)
        self._changed.set()

    # ------------------------------------------------------------ stats and liveness

    def _stats_callback(self, mid: str) -> Callable[[WorkerClient, WorkerStats], None]:
        def on_stats(client: WorkerClient, stats: WorkerStats) -> None:
            member = self._members.get(mid)
            if member is not None and member.client is client:
                self.observe(mid, stats)

        return on_stats

    def observe(self, mid: str, stats: WorkerStats) -> None:
        """Record a stats frame from member `mid` (called by its client's receive task)."""
        member = self._members.get(mid)
        if member is None:
            return
        now = self.clock()
        was = self.status(mid)
        member.stats = stats
        member.stats_at = now
        now_status = self.status(mid)
        if was != now_status:
            self._changed.set()
        event = StatsEvent(mid, stats, now, came_back=was == FALLBACK_DEAD and now_status is None)
        for listener in self._on_stats:
            listener(event)

    def status(self, mid: str) -> str | None:
        """None if `mid` may take new requests, else why not (a routing fallback reason): the one liveness
        rule."""
        member = self._members.get(mid)
        if member is None or member.stats is None or member.stats_at is None:
            return FALLBACK_DEAD
        if self._gone(member):
            return FALLBACK_DEAD
        stats = member.stats
        if stats.version != PROTOCOL_VERSION or (self.model is not None and stats.model != self.model):
            return FALLBACK_DEAD
        if stats.draining:
            return FALLBACK_DRAINING
        return None

    def _gone(self, member: Member) -> bool:
        """Its connection dropped (a dead process closes it at once) or it has been silent past its limit."""
        return member.client.link_closed or self._silence(member) > member.client.silence_limit

    def _silence(self, member: Member) -> float:
        """How long `member` has been silent: the time since its last stats (or its join, before any), but
        no longer than its link has been observed silent after draining its socket, so that a stall of
        this process's event loop (frames waiting unread) is not taken for the worker's silence."""
        if member.stats_at is None:
            return self.clock() - member.joined_at
        return min(self.clock() - member.stats_at, member.client.silent_for())

    # ------------------------------------------------------------ queries

    def client(self, mid: str) -> WorkerClient:
        return self._members[mid].client

    def member(self, mid: str) -> Member | None:
        return self._members.get(mid)

    def member_ids(self) -> list[str]:
        return sorted(self._members)

    def pool_of(self, mid: str) -> str:
        """The traffic-class pool label `mid` announced ("" for none, or a static endpoint)."""
        member = self._members.get(mid)
        reg = member.registration if member is not None else None
        return reg.pool if reg is not None else ""

    def live(self) -> list[str]:
        """Members that may take new requests now."""
        return [mid for mid in sorted(self._members) if self.status(mid) is None]

    def reporting(self) -> list[Member]:
        """Members with current, compatible stats: the live ones and the draining ones."""
        return [m for mid, m in sorted(self._members.items()) if self.status(mid) != FALLBACK_DEAD]

    async def wait_until(self, predicate: Callable[[Membership], bool], timeout: float) -> None:
        """Wait until `predicate(self)` holds, rechecked on changes and every 50 ms; TimeoutError after
        `timeout`."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not predicate(self):
            left = deadline - loop.time()
            if left <= 0:
                raise TimeoutError(f"membership condition not met within {timeout}s")
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), min(0.05, left))
