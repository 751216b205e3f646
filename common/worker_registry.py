"""The Redis registration record a live worker keeps under a TTL, for gateways to discover it."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

ROLES = ("both", "prefill", "decode")
ENGINES = ("switchyard", "vllm")  # both: serves gateways and prefills itself; prefill: only `pf` work

# Both under the hash tag `{sy:workers}`: one Redis Cluster slot, so one script reads the set and the records.
REGISTRY_TAG = "{sy:workers}"
REGISTRY_KEY_PREFIX = REGISTRY_TAG + ":worker:"
REGISTRY_SET_KEY = REGISTRY_TAG  # sorted set: member = worker id, score = registration expiry (Redis ms)
LEGACY_REGISTRY_KEY_PREFIX = "sy:worker:"  # untagged names before Redis Cluster support (`switchyard redis
LEGACY_REGISTRY_SET_KEY = "sy:workers"     # migrate-keys` renames them)


@dataclass(slots=True)
class Registration:
    """A live worker's Redis record: JSON at `REGISTRY_KEY_PREFIX + worker_id`, kept alive by a TTL."""

    worker_id: str
    endpoint: str
    model: str
    version: int  # the protocol version
    started_at: float
    # what it serves (model pools; all optional, so older records still parse): the model version label,
    # the tokenizer fingerprint, the model spec a gateway loads that tokenizer from, and the traffic-class
    # pool label
    model_version: str = ""
    tokenizer: str = ""
    spec: str = ""
    pool: str = ""
    role: str = "both"  # disaggregation: both, prefill (only prefills for decode workers) or decode
    engine: str = "switchyard"  # the engine behind the worker protocol: switchyard or vllm (vllm-engine.md)


OPTIONAL_TEXT = ("model_version", "tokenizer", "spec", "pool")
MAX_TEXT = 256


def registration_key(worker_id: str) -> str:
    return REGISTRY_KEY_PREFIX + worker_id


def encode_registration(reg: Registration) -> str:
    return json.dumps(asdict(reg))


def parse_registration(raw: bytes | str) -> Registration:
    """Parse a registry value; raises ValueError when it is not a well-formed registration."""
    try:
        obj = json.loads(raw)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"registration is not JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise ValueError("registration is not a JSON object")
    try:
        reg = Registration(worker_id=obj["worker_id"], endpoint=obj["endpoint"], model=obj["model"],
                           version=obj["version"], started_at=obj["started_at"])
    except KeyError as exc:
        raise ValueError(f"registration lacks field {exc}") from None
    if not (isinstance(reg.worker_id, str) and isinstance(reg.endpoint, str) and isinstance(reg.model, str)
            and isinstance(reg.version, int) and isinstance(reg.started_at, int | float)):
        raise ValueError("registration field has the wrong type")
    for name in OPTIONAL_TEXT:
        value = obj.get(name, "")
        if not isinstance(value, str) or len(value) > MAX_TEXT:
            raise ValueError(f"registration field {name} is not a string of at most {MAX_TEXT} characters")
        setattr(reg, name, value)
    role = obj.get("role", "both")
    if role not in ROLES:
        raise ValueError(f"registration role must be one of {ROLES}")
    reg.role = role
    engine = obj.get("engine", "switchyard")
    if engine not in ENGINES:
        raise ValueError(f"registration engine must be one of {ENGINES}")
    reg.engine = engine
    return reg
