"""What a worker serves (`Served`: model name, version, tokenizer, pool label) and `PoolView`, the members of
one model version shown to that version's Router as if they were the whole Membership.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from common.worker_registry import Registration
from router.links.membership import Member, MemberEvents, Membership, StatsEvent
from router.placement.policy import FALLBACK_DEAD

VERSION_SEP = "@"


@dataclass(slots=True, frozen=True)
class Served:
    """A model version as workers announce it; `key`
    (`<name>@<version>`, or the name alone) names its pool."""

    name: str
    version: str = ""
    tokenizer: str = ""  # fingerprint: a gateway tokenizes with a tokenizer of this version only
    spec: str = ""  # what the gateway loads the tokenizer from ("" = the gateway's own model)

    @property
    def key(self) -> str:
        return f"{self.name}{VERSION_SEP}{self.version}" if self.version else self.name

    @classmethod
    def of(cls, reg: Registration) -> Served:
        return cls(reg.model, reg.model_version, reg.tokenizer, reg.spec)


class PoolView(MemberEvents):
    """The members of one model version: the Membership interface a Router uses, fed by the Fleet."""

    def __init__(self, membership: Membership, key: str) -> None:
        super().__init__()
        self.key = key
        self.clock: Callable[[], float] = membership.clock
        self._m = membership
        self._ids: set[str] = set()

    async def start(self) -> None:
        """Nothing: the Fleet starts the shared Membership."""

    async def close(self) -> None:
        """Nothing: the Fleet closes the shared Membership."""

    # ------------------------------------------------------------ fed by the Fleet

    def join(self, mid: str) -> None:
        if mid not in self._ids:
            self._ids.add(mid)
            for listener in self._on_join:
                listener(mid)

    def leave(self, mid: str) -> None:
        if mid in self._ids:
            self._ids.discard(mid)
            for listener in self._on_leave:
                listener(mid)

    def observed(self, event: StatsEvent) -> None:
        if event.member_id in self._ids:
            for listener in self._on_stats:
                listener(event)

    # ------------------------------------------------------------ queries (Membership's)

    def client(self, mid: str):  # noqa: ANN201 - a WorkerClient (or a bench's stand-in)
        return self._m.client(mid)

    def member(self, mid: str) -> Member | None:
        return self._m.member(mid) if mid in self._ids else None

    def member_ids(self) -> list[str]:
        return sorted(self._ids)

    def status(self, mid: str) -> str | None:
        return self._m.status(mid) if mid in self._ids else FALLBACK_DEAD

    def pool_of(self, mid: str) -> str:
        return self._m.pool_of(mid)

    def live(self) -> list[str]:
        return [mid for mid in sorted(self._ids) if self._m.status(mid) is None]

    def reporting(self) -> list[Member]:
        out = []
        for mid in sorted(self._ids):
            member = self._m.member(mid)
            if member is not None and self._m.status(mid) != FALLBACK_DEAD:
                out.append(member)
        return out
