"""Which gateway owns each running request, and when each gateway was last heard.

Engine request ids are minted here, so two gateways may use the same request id without colliding.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field


@dataclass(slots=True)
class InFlight:
    engine_rid: str
    ident: bytes  # gateway's ZeroMQ identity
    rid: str  # the gateway's request id
    deadline: float  # unix seconds; 0.0 = none
    client_aborted: bool = False  # abort asked by the gateway: forward the final "abort" item


@dataclass(slots=True)
class Gateway:
    ident: bytes
    last_seen: float  # time.monotonic()
    engine_rids: set[str] = field(default_factory=set)


class InFlightTable:
    def __init__(self) -> None:
        self._by_engine: dict[str, InFlight] = {}
        self._by_key: dict[tuple[bytes, str], str] = {}
        self.gateways: dict[bytes, Gateway] = {}
        self._seq = 0

    def __len__(self) -> int:
        return len(self._by_engine)

    def __iter__(self) -> Iterator[InFlight]:
        return iter(list(self._by_engine.values()))

    def seen(self, ident: bytes, now: float) -> bool:
        """Record traffic from a gateway; True when it is new (or came back after expiring)."""
        gw = self.gateways.get(ident)
        if gw is None:
            self.gateways[ident] = Gateway(ident, now)
            return True
        gw.last_seen = now
        return False

    def find(self, ident: bytes, rid: str) -> InFlight | None:
        engine_rid = self._by_key.get((ident, rid))
        return None if engine_rid is None else self._by_engine[engine_rid]

    def get(self, engine_rid: str) -> InFlight | None:
        return self._by_engine.get(engine_rid)

    def add(self, ident: bytes, rid: str, deadline: float, now: float) -> InFlight:
        self._seq += 1
        entry = InFlight(str(self._seq), ident, rid, deadline)
        self._by_engine[entry.engine_rid] = entry
        self._by_key[(ident, rid)] = entry.engine_rid
        gw = self.gateways.get(ident)
        if gw is None:
            gw = self.gateways[ident] = Gateway(ident, now)
        gw.engine_rids.add(entry.engine_rid)
        return entry

    def remove(self, engine_rid: str) -> InFlight | None:
        entry = self._by_engine.pop(engine_rid, None)
        if entry is not None:
            self._by_key.pop((entry.ident, entry.rid), None)
            gw = self.gateways.get(entry.ident)
            if gw is not None:
                gw.engine_rids.discard(engine_rid)
        return entry

    def expired_gateways(self, now: float, timeout: float) -> list[Gateway]:
        """Forget gateways silent for `timeout` s and return them (their requests are still in the table)."""
        gone = [gw for gw in self.gateways.values() if now - gw.last_seen > timeout]
        for gw in gone:
            del self.gateways[gw.ident]
        return gone

    def live_gateways(self) -> list[bytes]:
        return list(self.gateways)

    def past_deadline(self, wall_now: float) -> list[InFlight]:
        return [e for e in self._by_engine.values() if 0.0 < e.deadline < wall_now]
