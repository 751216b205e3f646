"""The Fleet: one shared Membership, split by model version into pools, each with its own Router (ring, shared
view, loads) created when a worker of a new version first appears.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from router.dispatch import Router
from router.links.membership import Membership, StatsEvent, StatsListener
from router.pools.served import PoolView, Served

log = logging.getLogger(__name__)

MAX_VERSIONS = 64  # model versions a gateway tracks at once; workers of further versions are ignored (logged)

RouterFactory = Callable[[PoolView, Served], Router]


class Fleet:
    """Model version -> (Served, PoolView, Router), kept in step with the Membership's joins, leaves and
    stats."""

    def __init__(self, membership: Membership, make_router: RouterFactory, *,
                 default: Served | None = None) -> None:
        self.membership = membership
        self.default = default  # what a static endpoint (no registration) serves
        self._make_router = make_router
        self._served: dict[str, Served] = {}
        self._views: dict[str, PoolView] = {}
        self._routers: dict[str, Router] = {}
        self._where: dict[str, str] = {}  # member id -> version key
        self._on_version: list[Callable[[str], None]] = []
        membership.on_join(self._joined)
        membership.on_leave(self._left)
        membership.on_stats(self._observed)
        for mid in membership.member_ids():
            self._joined(mid)

    async def start(self) -> None:
        await self.membership.start()

    async def close(self) -> None:
        await self.membership.close()

    def on_version(self, listener: Callable[[str], None]) -> None:
        """Call `listener(key)` when a model version is first seen (its Router exists from then on)."""
        self._on_version.append(listener)

    def on_stats(self, listener: StatsListener) -> None:
        self.membership.on_stats(listener)

    # ------------------------------------------------------------ membership events

    def served_by(self, mid: str) -> Served | None:
        member = self.membership.member(mid)
        if member is None:
            return None
        return Served.of(member.registration) if member.registration is not None else self.default

    def _joined(self, mid: str) -> None:
        served = self.served_by(mid)
        if served is None:
            log.warning("worker %s announces no model and this gateway has no default: not routed to", mid)
            return
        view = self._view(served)
        if view is None:
            return
        self._where[mid] = served.key
        view.join(mid)

    def _left(self, mid: str) -> None:
        key = self._where.pop(mid, None)
        if key is not None:
            self._views[key].leave(mid)

    def _observed(self, event: StatsEvent) -> None:
        key = self._where.get(event.member_id)
        if key is not None:
            self._views[key].observed(event)

    def _view(self, served: Served) -> PoolView | None:
        key = served.key
        view = self._views.get(key)
        if view is not None:
            if served.tokenizer and served.tokenizer != self._served[key].tokenizer:
                log.warning("model version %s announced with two tokenizer fingerprints; keeping the first",
                            key)
            return view
        if len(self._views) >= MAX_VERSIONS and not self._drop_idle_version():
            log.warning("over %d model versions: ignoring %s", MAX_VERSIONS, key)
            return None
        view = PoolView(self.membership, key)
        self._served[key] = served
        self._views[key] = view
        self._routers[key] = self._make_router(view, served)
        log.info("model version %s discovered", key)
        for listener in self._on_version:
            listener(key)
        return view

    def _drop_idle_version(self) -> bool:
        """Forget one version with no workers and nothing in flight (room for a new one); False if none is."""
        for key, view in self._views.items():
            if not view.member_ids() and not self._routers[key].loads.loads():
                del self._views[key], self._routers[key], self._served[key]
                log.info("model version %s forgotten (no workers)", key)
                return True
        return False

    # ------------------------------------------------------------ queries

    def pool(self, served: Served) -> Router | None:
        """The Router of `served`'s version, created now if it is new (None past MAX_VERSIONS)."""
        return self._routers.get(served.key) if self._view(served) is not None else None

    def router(self, key: str) -> Router | None:
        return self._routers.get(key)

    def served(self, key: str) -> Served | None:
        return self._served.get(key)

    def versions(self) -> list[str]:
        """Every model version seen (live or not), sorted."""
        return sorted(self._served)

    def live_versions(self) -> list[str]:
        """Model versions with at least one worker that takes new requests now, sorted."""
        routers = list(self._routers.items())  # one copy: a large body is prepared on a thread
        return sorted(key for key, router in routers if router.live())

    def versions_of(self, name: str) -> list[str]:
        """The versions seen of model `name` (by name), sorted."""
        return [key for key, s in sorted(self._served.items()) if s.name == name]
