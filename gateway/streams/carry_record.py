"""What another gateway needs to carry a stream on: the request as the client sent it, its ids, and the
reservations it holds (one typed record in Redis under `event_log.carry_key`: its fields as one JSON line,
then the body's bytes as the client sent them, never encoded again)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from admission import ADMITTED, MoneyHold, MoneyPath, Price, Reservation, ReserveResult
from tenancy import Tenant

VERSION = 2  # 1: the body inside the JSON (a gateway of either version carries on only its own version's)
APIS = ("chat", "completions", "responses")


@dataclass(slots=True)
class Lease:
    """The token reservation the stream's first gateway took (`admission.budget.Reservation`)."""

    lease_id: str
    prompt_tokens: int
    max_tokens: int

    def reservation(self, tenant: Tenant) -> Reservation:
        result = ReserveResult(ADMITTED, None, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)
        # renewed_at 0: the next renewal round extends it (its first gateway renewed it last)
        return Reservation(tenant, self.lease_id, self.prompt_tokens, self.max_tokens, result, renewed_at=0.0)


@dataclass(slots=True)
class CarryRecord:
    api: str  # chat | completions | responses
    body: bytes  # the request body as the client sent it (JSON; up to the gateway's max_body_bytes)
    tenant: str
    key_digest: str
    stream_id: str  # the response id (chatcmpl-..., cmpl-..., resp_...)
    created: int
    request_id: str
    first_cached: int  # the cached prompt tokens the stream reported
    lease: Lease | None = None
    money: dict[str, Any] | None = None  # `MoneyHold` as a dict
    run_deadline: float = 0.0  # a background run's stored deadline (0: a streamed request)
    grouped: bool = False  # served by `gateway.flow.choices` (choices, tool calls, echo): its steps logged

    def encode(self) -> bytes:
        """One JSON line of the fields, then the body's bytes: a body of megabytes costs a copy, not an
        encode, on the event loop."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "body"}
        if self.lease is not None:
            fields["lease"] = dataclasses.asdict(self.lease)
        if not self.grouped:  # a gateway that cannot carry a group on refuses a grouped one: an unknown field
            del fields["grouped"]
        return json.dumps({"v": VERSION, **fields}, separators=(",", ":")).encode() + b"\n" + self.body

    @classmethod
    def decode(cls, raw: bytes) -> CarryRecord | None:
        """The record, or None when it is not one this gateway reads (another version, damaged)."""
        head, sep, body = raw.partition(b"\n")
        try:
            data = json.loads(head)
            if not sep or data.pop("v", None) != VERSION or data.get("api") not in APIS:
                return None
            lease = data.pop("lease", None)
            return cls(**data, body=body, lease=Lease(**lease) if lease else None)
        except (ValueError, TypeError):
            return None

    def money_hold(self) -> MoneyHold | None:
        if self.money is None:
            return None
        fields = dict(self.money)
        return MoneyHold(**{**fields, "path": MoneyPath(**fields["path"]), "price": Price(**fields["price"])})


def money_dict(hold: MoneyHold | None) -> dict[str, Any] | None:
    return None if hold is None else dataclasses.asdict(hold)


def carry_record(prepared: Any, gen: Any, run_deadline: float = 0.0) -> CarryRecord | None:
    """The record of a stream (a `Generation`, or a `GenerationGroup` of several choices, chat tool calls or
    echo) that another gateway can carry on; None when it cannot be (no body as sent: `raw_body` None)."""
    body, req = prepared.raw_body, prepared.req
    if body is None:
        return None
    api = "responses" if req.api == "responses" else "chat" if req.kind == "chat" else "completions"
    res = gen.ticket.reservation if gen.ticket is not None else None
    local = res is None or res.result.local
    lease = None if local else Lease(res.lease_id, res.prompt_tokens, res.max_tokens)
    return CarryRecord(api, body, prepared.tenant.name, prepared.key_digest, prepared.shape.id,
                       prepared.shape.created, prepared.request_id, gen.usage.cached_tokens, lease,
                       money_dict(prepared.money_hold), run_deadline, prepared.grouped)
