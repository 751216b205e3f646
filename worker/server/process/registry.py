"""Keeps this worker's registration (`worker.protocol.Registration`) alive in Redis: the JSON record under
a TTL plus its entry in the registry sorted set (score = expiry on the Redis clock), rewritten every
REFRESH_INTERVAL_S from a thread, removed on clean exit (a killed worker's expire).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import redis

from common.redis_url import sync_redis
from common.worker_registry import REGISTRY_SET_KEY, Registration, encode_registration, registration_key

REGISTRATION_TTL_MS = 5000
REFRESH_INTERVAL_S = 1.0

log = logging.getLogger(__name__)

# KEYS: record key, registry set. ARGV: record, TTL ms, worker id. One round trip, scored by Redis TIME.
_HEARTBEAT = """
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
redis.call('ZADD', KEYS[2], now_ms + tonumber(ARGV[2]), ARGV[3])
return now_ms
"""


def heartbeat(client: redis.Redis, reg: Registration, ttl_ms: int = REGISTRATION_TTL_MS) -> Any:
    """Write `reg`'s record and its registry-set entry, both expiring `ttl_ms` from now (Redis clock)."""
    script = client.register_script(_HEARTBEAT)  # EVALSHA, loading the script again after a Redis restart
    return script(keys=[registration_key(reg.worker_id), REGISTRY_SET_KEY],
                  args=[encode_registration(reg), int(ttl_ms), reg.worker_id])


def unregister(client: redis.Redis, worker_id: str) -> None:
    pipe = client.pipeline(transaction=True)  # one slot: both keys carry the registry's hash tag
    pipe.delete(registration_key(worker_id))
    pipe.zrem(REGISTRY_SET_KEY, worker_id)
    pipe.execute()


class Registrar:
    """Writes a Registration to Redis now and every REFRESH_INTERVAL_S from a daemon thread."""

    def __init__(self, redis_url: str, registration: Registration) -> None:
        self._redis = sync_redis(redis_url, socket_timeout=2.0, socket_connect_timeout=2.0)  # or a cluster
        self._registration = registration
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="sy-registrar", daemon=True)

    def start(self) -> None:
        self._write()  # fail loudly at start-up when Redis is unreachable
        self._thread.start()

    def _write(self) -> None:
        heartbeat(self._redis, self._registration)

    def _loop(self) -> None:
        failing = False
        while not self._stop.wait(REFRESH_INTERVAL_S):
            try:
                self._write()
            except Exception as exc:  # Redis blips must not kill the worker; gateways keep a live link
                if not failing:
                    log.warning("registry refresh failed (retrying every %.0f s): %s",
                                REFRESH_INTERVAL_S, exc)
                failing = True
                continue
            if failing:
                log.info("registry refresh works again")
            failing = False

    def stop(self) -> None:
        """Stop refreshing and remove the registration (clean exit)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=REFRESH_INTERVAL_S + 3.0)
        try:
            unregister(self._redis, self._registration.worker_id)
        except Exception as exc:
            log.warning("registry delete failed (it expires in %d ms): %s", REGISTRATION_TTL_MS, exc)
        finally:
            self._redis.close()
