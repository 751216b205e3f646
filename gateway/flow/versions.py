"""Which model version serves a request: the requested name (a version, a model name or an alias) resolved
over the live pools to a `Target` (that version's tokenizer, Router and capacity gate), and the model listing.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import threading
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from admission import CapacityGate
from common.priorities import Priority
from gateway.flow.served_model import DEFAULT_ALIAS, ServedModel
from gateway.openai.schemas import GenerationRequest
from gateway.web import api_errors
from router import Alias, AliasTable, Fleet, Router, Served, sticky_key, weighted_pick
from tenancy import Tenant

log = logging.getLogger("switchyard.gateway")

# tokenizers (ServedModels) kept at once, least recently used dropped (a fleet's versions fit)
MAX_TOKENIZERS = 32
STICKY_PROMPT_CHARS = 1024  # a completion's version sticks to this much of its prompt
VERSION_HEADER = "x-switchyard-model-version"


@dataclass(slots=True)
class Target:
    """The model version a request goes to."""

    key: str  # version key (`<name>@<version>` or the name): the header's value
    model: ServedModel
    router: Router
    capacity: CapacityGate | None = None  # None: the Admission's own gate
    response_model: str = ""  # the response's `model` field
    ns_model: str = ""  # the model id in the cache namespace


class ModelPools(Protocol):
    def resolve(self, name: str, tenant: Tenant, prefix: str, priority: Priority | None = None) -> Target: ...
    def listing(self, tenant: Tenant) -> list[str]: ...
    def ready(self) -> bool: ...
    async def close(self) -> None: ...


def sticky_prefix(req: GenerationRequest) -> str:
    """The request's prefix key for version stickiness: its prompt_cache_key, else the conversation's opening
    (system messages and the first user turn, the same on every later turn), else the prompt's head."""
    if req.prompt_cache_key is not None:
        return "k:" + req.prompt_cache_key
    if req.messages is not None:
        head: list[object] = []
        for m in req.messages:
            head.append([m.get("role"), m.get("content")])
            if m.get("role") == "user":
                break
        return "c:" + json.dumps(head, ensure_ascii=False, default=str)
    prompt = req.prompt
    if isinstance(prompt, str):
        return "p:" + prompt[:STICKY_PROMPT_CHARS]
    return "t:" + ",".join(map(str, (prompt or [])[:256]))


class SinglePool:
    """One model and one Router (the gateway without model pools): `model` must name it or an alias of it."""

    def __init__(self, model: ServedModel, router: Router) -> None:
        self.model = model
        self.router = router

    def resolve(self, name: str, tenant: Tenant, prefix: str, priority: Priority | None = None) -> Target:
        m = self.model
        if name not in m.names:
            raise api_errors.model_not_found(name)
        if not (tenant.allows_model(name) or tenant.allows_model(m.model_id)):
            raise api_errors.model_not_allowed(name)
        return Target(m.model_id, m, self.router, None, name, m.model_id)

    def listing(self, tenant: Tenant) -> list[str]:
        return [self.model.model_id] if tenant.allows_model(self.model.model_id) else []

    def ready(self) -> bool:
        return bool(self.router.live())

    async def close(self) -> None:
        await self.router.close()


class TokenizerCache:
    """ServedModels by (spec, fingerprint), at most MAX_TOKENIZERS; the gateway's own model is always there.

    A load (0.2-0.4 s; seconds for a first GGUF conversion) never runs on the event loop and never holds the
    lock other lookups take: on the loop, a tokenizer not loaded yet starts loading on a thread and the
    request gets a retryable 503; off the loop (threads, the fleet's preload of each new version), the caller
    loads it, and concurrent callers for the same key wait for that one load."""

    def __init__(self, default: ServedModel, default_spec: str,
                 load: Callable[[str], ServedModel] = ServedModel.load, size: int = MAX_TOKENIZERS) -> None:
        self.default = default
        self.default_spec = default_spec
        self._load = load
        self._size = size
        self._models: OrderedDict[tuple[str, str], ServedModel | str] = OrderedDict()  # str: why it failed
        self._loading: dict[tuple[str, str], threading.Event] = {}
        self._lock = threading.Lock()  # the dicts only: never held across a load

    def get(self, served: Served) -> ServedModel | str:
        """The tokenizer of `served`, or why there is none (a load error or a fingerprint mismatch); on an
        event loop, a 503 `model_unavailable` while it loads (the loop's cheap path: a dict lookup)."""
        if not served.spec or served.tokenizer == self.default.version or (
                served.spec == self.default_spec and not served.tokenizer):
            return self.default
        key = (served.spec, served.tokenizer)
        with self._lock:
            found = self._models.get(key)
            if found is not None:
                self._models.move_to_end(key)
                return found
            loading = self._loading.get(key)
            mine = loading is None
            if mine:
                loading = self._loading[key] = threading.Event()
        if _on_event_loop():
            if mine:
                threading.Thread(target=self._fill, args=(served, key, loading), name="tokenizer-load",
                                 daemon=True).start()
            raise api_errors.model_unavailable(served.key, "its tokenizer is loading on this gateway")
        if mine:
            return self._fill(served, key, loading)
        loading.wait(timeout=120.0)
        with self._lock:
            return self._models.get(key, f"its tokenizer {served.spec!r} is still loading here")

    def _fill(self, served: Served, key: tuple[str, str], loading: threading.Event) -> ServedModel | str:
        try:
            model: ServedModel | str = self._load(served.spec)
        except Exception as exc:  # a spec this host cannot load: that version cannot be served here
            model = f"its tokenizer {served.spec!r} does not load here: {exc}"
        if isinstance(model, ServedModel) and served.tokenizer and model.version != served.tokenizer:
            model = f"tokenizer fingerprint {model.version[:12]} here, {served.tokenizer[:12]} on the workers"
        if isinstance(model, str):
            log.warning("model version %s: %s", served.key, model)
        with self._lock:
            self._models[key] = model
            if len(self._models) > self._size:
                self._models.popitem(last=False)
            self._loading.pop(key, None)
        loading.set()
        return model


def _on_event_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


class AliasShares:
    """Per tenant and alias, the versions of its last `WINDOW` picks: a tenant whose sticky keys aim more than
    CAP_FACTOR times a version's weight share at it (with a 3-sigma allowance for chance) (all its load at a
    10% canary, say) has the excess sent to the alias's other versions, so it cannot fill a canary's capacity
    and have others shed there."""

    WINDOW, MIN_PICKS, CAP_FACTOR, MAX_KEYS = 200, 20, 2.0, 10_000

    def __init__(self) -> None:
        self._picks: OrderedDict[tuple[str, str], deque[str]] = OrderedDict()

    def cap(self, tenant: str, alias: Alias, live: set[str], key: str, sticky: bytes) -> str:
        recent = self._picks.get((tenant, alias.name))
        if recent is None:
            recent = self._picks[(tenant, alias.name)] = deque(maxlen=self.WINDOW)
            if len(self._picks) > self.MAX_KEYS:
                self._picks.popitem(last=False)
        self._picks.move_to_end((tenant, alias.name))
        weights = {k: w for k, w in alias.targets if k in live and w > 0}
        total = sum(weights.values())
        if len(recent) >= self.MIN_PICKS and key in weights and total > 0:
            share, n = weights[key] / total, len(recent) + 1
            # CAP_FACTOR x the share, plus 3 standard deviations of honest random keys (never reached by them)
            if recent.count(key) + 1 > self.CAP_FACTOR * share * n + 3 * math.sqrt(n * share * (1 - share)):
                others = [(k, w) for k, w in weights.items() if k != key]
                if others:
                    key = weighted_pick(others, sticky)
        recent.append(key)
        return key


class FleetPools:
    """Model pools over a Fleet: versions, model names and aliases (Redis records, plus the built-in `default`
    for the gateway's own model) resolved to a live version, sticky by tenant and prefix key."""

    def __init__(self, fleet: Fleet, tokenizers: TokenizerCache, aliases: AliasTable | None = None,
                 make_gate: Callable[[Router, str | None], CapacityGate | None] | None = None,
                 class_pools: dict[Priority, str] | None = None) -> None:
        self.fleet = fleet
        self.tokenizers = tokenizers
        self.aliases = aliases
        self._make_gate = make_gate  # (router, pool label or None for every worker) -> the gate
        self.class_pools = class_pools or {}
        self._gates: dict[tuple[str, str | None], tuple[Router, CapacityGate | None]] = {}
        self.shares = AliasShares()

    def alias(self, name: str) -> Alias | None:
        alias = self.aliases.get(name) if self.aliases is not None else None
        if alias is None and name == DEFAULT_ALIAS:
            versions = self.fleet.versions_of(self.tokenizers.default.model_id)
            alias = Alias(name, tuple((v, 1.0) for v in versions)) if versions else None
        return alias

    def pick(self, name: str, sticky: bytes, tenant: Tenant | None = None) -> str:
        """The version key for `name`; 404 when nothing by that name exists, 503 when none of it is live (or
        its alias record is malformed: the operator's mistake, never charged to the client). With `tenant`, an
        alias picks only among the versions the tenant may use (403 when none), so its stickiness never lands
        a request on a forbidden version."""
        fleet = self.fleet
        live = set(fleet.live_versions())
        alias = self.alias(name)
        if alias is not None:
            if tenant is not None and not self._alias_allowed(tenant, name):
                alias = Alias(alias.name, tuple((k, w) for k, w in alias.targets if self._allowed(tenant, k)))
                if not alias.targets:
                    raise api_errors.model_not_allowed(name)
            key = alias.pick(live, sticky)
            if key is not None and tenant is not None:
                key = self.shares.cap(tenant.name, alias, live, key, sticky)
        elif name in fleet.versions():
            key = name if name in live else None
        elif self.aliases is not None and self.aliases.broken(name) and not fleet.versions_of(name):
            raise api_errors.model_unavailable(name, "its alias record is malformed")
        else:
            versions = fleet.versions_of(name)
            if not versions:
                raise api_errors.model_not_found(name)
            up = [(v, 1.0) for v in versions if v in live]
            key = weighted_pick(up, sticky) if up else None
        if key is None:
            raise api_errors.model_unavailable(name)
        return key

    def _alias_allowed(self, tenant: Tenant, name: str) -> bool:
        """`name` itself is in the tenant's allow-list, and it names an alias only (an alias named like a
        model never stands for that model's permission: its versions are checked one by one instead)."""
        return tenant.allows_model(name) and (tenant.allowed_models is None
                                              or not self.fleet.versions_of(name))

    def resolve(self, name: str, tenant: Tenant, prefix: str, priority: Priority | None = None) -> Target:
        key = self.pick(name, sticky_key(tenant.name, name, prefix), tenant)
        served = self.fleet.served(key)
        router = self.fleet.router(key)
        assert served is not None and router is not None  # picked among the fleet's versions
        if not ((self.alias(name) is not None and self._alias_allowed(tenant, name))
                or self._allowed(tenant, key)
                or (self.alias(name) is None and tenant.allows_model(name))):
            raise api_errors.model_not_allowed(name)
        model = self.tokenizers.get(served)
        if isinstance(model, str):
            raise api_errors.model_unavailable(name, "this gateway cannot tokenize for it")
        return Target(key, model, router, self._gate(key, router, priority), key, key)

    def _gate(self, key: str, router: Router, priority: Priority | None) -> CapacityGate | None:
        """The version's capacity gate; per traffic-class pool when the class's pool label has workers in it
        and others do not carry it (capacity admission counts per pool)."""
        if self._make_gate is None:
            return None
        label: str | None = self.class_pools.get(priority) if priority is not None else None
        if label is not None:
            pool_of = router.membership.pool_of
            labels = {pool_of(w) for w in router.member_ids()}  # prefill-role workers take no requests
            if label not in labels or len(labels) == 1:
                label = None
        found = self._gates.get((key, label))
        if found is None or found[0] is not router:  # new, or the version was forgotten and came back
            found = self._gates[(key, label)] = (router, self._make_gate(router, label))
        return found[1]

    def notify(self) -> None:
        """New worker stats: every version's capacity waiters look again."""
        for _, gate in list(self._gates.values()):
            if gate is not None:
                gate.notify()

    def listing(self, tenant: Tenant) -> list[str]:
        """Versions, model names and aliases with a live version, that the tenant may use."""
        fleet = self.fleet
        live = fleet.live_versions()
        names: set[str] = set(live)
        names.update(s.name for s in (fleet.served(k) for k in live) if s is not None)
        alias_names = set(self.aliases.names() if self.aliases is not None else ()) | {DEFAULT_ALIAS}
        for a in alias_names:
            alias = self.alias(a)
            if alias is not None and alias.pick(live, b"") is not None:
                names.add(a)
        return sorted(n for n in names if self._allowed(tenant, n))

    def _allowed(self, tenant: Tenant, name: str) -> bool:
        served = self.fleet.served(name)
        return tenant.allows_model(name) or (served is not None and tenant.allows_model(served.name))

    def ready(self) -> bool:
        return bool(self.fleet.live_versions())

    async def close(self) -> None:
        if self.aliases is not None:
            await self.aliases.close()
        await self.fleet.close()
