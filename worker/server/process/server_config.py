"""The worker server's settings (`ServerConfig`) and the endpoint it advertises to gateways."""

from __future__ import annotations

import socket
from dataclasses import dataclass


@dataclass(slots=True)
class ServerConfig:
    bind: str = "tcp://127.0.0.1:5555"
    advertise: str | None = None
    worker_id: str | None = None
    redis_url: str | None = None
    drain_timeout: float = 30.0
    drain_handoff: float | None = 1.0  # seconds into a drain to hand running streams over; None: never
    gateway_timeout: float = 5.0
    stats_interval: float = 0.1
    cluster_key: str | None = None  # z85 CURVE secret key; None: plain TCP, loopback binds only
    # announced in the registration (model pools): version label, spec
    # gateways load the tokenizer from, pool label
    model_version: str = ""
    model_spec: str = ""
    pool: str = ""
    # disaggregated prefill (worker.server.disagg.prefill_side / decode_side): the role announced, and how
    # long a decode worker waits for a prefill worker's next pages (stall) and for a whole transfer (lease)
    # before prefilling itself
    role: str = "both"
    disagg_stall_s: float = 5.0
    disagg_lease_s: float = 60.0
    # vLLM-format KV events (worker.server.process.kv_publisher), None: off; topic None: kv@<worker>@<model>
    kv_events_endpoint: str | None = None
    kv_events_replay: str | None = None
    kv_events_topic: str | None = None
    kv_events_plain: bool = False  # no CurveZMQ on them even with a cluster key


def advertised_endpoint(bound: str) -> str:
    """The endpoint gateways should dial: the bound one, with a wildcard host replaced by this host's name."""
    for wildcard in ("tcp://0.0.0.0:", "tcp://*:"):
        if bound.startswith(wildcard):
            return "tcp://" + socket.gethostname() + ":" + bound[len(wildcard):]
    return bound
