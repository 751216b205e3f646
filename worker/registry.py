"""Keeps this worker's registration record (`worker.protocol.Registration`) alive in Redis: written at
start, rewritten every REFRESH_INTERVAL_S under a TTL, deleted on clean exit (a killed worker's expires).
"""

from __future__ import annotations

import logging
import threading

import redis

from worker.protocol import Registration, encode_registration, registration_key

REGISTRATION_TTL_MS = 5000
REFRESH_INTERVAL_S = 1.0

log = logging.getLogger(__name__)


class Registrar:
    """Writes a Registration to Redis now and every REFRESH_INTERVAL_S from a daemon thread."""

    def __init__(self, redis_url: str, registration: Registration) -> None:
        self._redis = redis.Redis.from_url(redis_url, socket_timeout=2.0, socket_connect_timeout=2.0)
        self._key = registration_key(registration.worker_id)
        self._value = encode_registration(registration)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="sy-registrar", daemon=True)

    def start(self) -> None:
        self._write()  # fail loudly at start-up when Redis is unreachable
        self._thread.start()

    def _write(self) -> None:
        self._redis.set(self._key, self._value, px=REGISTRATION_TTL_MS)

    def _loop(self) -> None:
        while not self._stop.wait(REFRESH_INTERVAL_S):
            try:
                self._write()
            except Exception as exc:  # Redis blips must not kill the worker; the TTL covers the gap
                log.warning("registry refresh failed: %s", exc)

    def stop(self) -> None:
        """Stop refreshing and delete the key (clean exit)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=REFRESH_INTERVAL_S + 3.0)
        try:
            self._redis.delete(self._key)
        except Exception as exc:
            log.warning("registry delete failed (key expires in %d ms): %s", REGISTRATION_TTL_MS, exc)
        finally:
            self._redis.close()
