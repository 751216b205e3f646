"""Worker registration in Redis: one key per live worker, kept alive by a heartbeat thread.

Key `sy:worker:<worker_id>` holds a JSON object `{"worker_id", "endpoint", "model",
"version", "started_at"}` with a TTL of REGISTRATION_TTL_MS, rewritten every
REFRESH_INTERVAL_S while the worker lives and deleted on clean exit; a SIGKILLed
worker's key expires within the TTL. The router's membership watcher imports only
the constants and `parse_registration()` from here (no torch, no engine).
"""

from __future__ import annotations

import json
import logging
import threading
from dataclasses import asdict, dataclass

KEY_PREFIX = "sy:worker:"
REGISTRATION_TTL_MS = 5000
REFRESH_INTERVAL_S = 1.0

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Registration:
    worker_id: str
    endpoint: str
    model: str
    version: int
    started_at: float


def registration_key(worker_id: str) -> str:
    return KEY_PREFIX + worker_id


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
    return reg


class Registrar:
    """Writes a Registration to Redis now and every REFRESH_INTERVAL_S from a daemon thread."""

    def __init__(self, redis_url: str, registration: Registration) -> None:
        import redis  # imported here so that the protocol-only users of this module don't need it

        self._redis = redis.Redis.from_url(redis_url, socket_timeout=2.0, socket_connect_timeout=2.0)
        self._key = registration_key(registration.worker_id)
        self._value = json.dumps(asdict(registration))
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
