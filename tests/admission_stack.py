"""Test helper: a restartable private Redis, a tiny-model worker and N real `switchyard gateway` processes.

Used by the HTTP-level admission tests; Redis keeps a dump file, so tenants survive `restart_redis()`.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from config.local_stack.launcher import GatewayProc, WorkerProc
from tests.conftest import RedisServer


@dataclass(slots=True)
class AdmissionStack:
    log_dir: Path
    redis: RedisServer
    worker: WorkerProc | None = None
    gateways: list[GatewayProc] = field(default_factory=list)

    @classmethod
    def start(cls, *, gateways: int = 1, gateway_settings: dict[str, object] | None = None,
              worker_args: list[str] | None = None, ready_timeout: float = 120.0) -> AdmissionStack:
        log_dir = Path(tempfile.mkdtemp(prefix="sy-adm-test-"))
        stack = cls(log_dir, RedisServer(log_dir))
        try:
            stack.redis.start()
            stack.worker = WorkerProc(log_dir, extra=["--no-prefix-cache", *(worker_args or [])])
            config = log_dir / "gateway.toml"
            config.write_text("[gateway]\n" + "".join(f"{k} = {_toml(v)}\n" for k, v in
                                                      (gateway_settings or {}).items()))
            for _ in range(gateways):
                stack.gateways.append(stack._spawn_gateway(config))
            stack.wait_ready(ready_timeout)
        except BaseException:
            print(stack.logs())
            stack.stop()
            raise
        return stack

    def _spawn_gateway(self, config: Path) -> GatewayProc:
        assert self.worker is not None
        return GatewayProc.spawn(self.log_dir, ["--config", str(config), "--redis-url", self.redis.url,
                                                "--workers", self.worker.endpoint, "--worker-timeout", "10",
                                                "--log-level", "WARNING"])

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        pending = list(self.gateways)
        while pending:
            dead = [g for g in self.gateways if g.proc.poll() is not None]
            if dead or (self.worker is not None and self.worker.proc.poll() is not None):
                raise RuntimeError("a gateway or the worker exited during start-up")
            pending = [g for g in pending if not g.ready()]
            if pending and time.monotonic() > deadline:
                raise TimeoutError(f"{len(pending)} gateway(s) not ready after {timeout}s")
            if pending:
                time.sleep(0.25)

    def warm_up(self, concurrent: int) -> None:
        """`concurrent` simultaneous 1-token requests to each gateway (outcomes ignored, one 200 needed).

        A cold gateway opens one Redis connection per concurrent request under its first burst; on a
        loaded 2-core box its event loop then stalls past the 0.5 s Redis timeout and it fails closed
        (503 quota_service_unavailable). Tests that measure a burst run on warm pools."""
        import asyncio

        import httpx

        key = self.create_tenant("warmup", tpm=0, rpm=0, max_concurrent=0)
        body = {"model": "default", "prompt": [100], "max_tokens": 1}

        async def burst() -> list[int]:
            async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=None)) as http:
                async def one(url: str) -> int:
                    resp = await http.post(url + "/v1/completions", json=body,
                                           headers={"authorization": f"Bearer {key}"})
                    return resp.status_code
                return await asyncio.gather(*(one(g.base_url) for g in self.gateways
                                              for _ in range(concurrent)))

        if 200 not in asyncio.run(burst()):
            raise RuntimeError("no request succeeded during the warm-up")

    def restart_redis(self, down_s: float = 0.0) -> None:
        self.redis.stop()
        time.sleep(down_s)
        self.redis.start()

    def create_tenant(self, name: str, **fields: object) -> str:
        """Create (or update) tenant `name`; returns a fresh API key."""
        from tenancy.tenant_admin import tenant_with_new_key
        return tenant_with_new_key(self.redis.url, name, **fields)

    def logs(self) -> str:
        return log_tails(self.log_dir)

    def stop(self) -> None:
        for gw in self.gateways:
            gw.stop()
        if self.worker is not None:
            self.worker.stop()
        self.redis.stop(save=False)


def log_tails(log_dir: Path) -> str:
    """The last 4,000 characters of each process log in `log_dir`, for failure reports."""
    parts = []
    for path in sorted(log_dir.glob("*.log")):
        parts.append(f"--- {path.name}\n{path.read_text(errors='replace')[-4000:]}")
    return "\n".join(parts)


def _toml(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {_toml(v)}" for k, v in value.items()) + "}"
    return repr(value)


def redis_now_us(r) -> float:
    sec, usec = r.time()
    return sec * 1e6 + usec


def bucket_level(r, tenant: str, tpm: int) -> tuple[float, float]:
    """(token level now, Redis time now in µs), the refill applied exactly as the Lua scripts do."""
    from tenancy.schema import bucket_key

    tok, ts = r.hmget(bucket_key(tenant), "tok", "ts")
    now = redis_now_us(r)
    if tok is None:
        return float(tpm), now
    return min(tpm, float(tok) + (now - float(ts)) * tpm / 60e6), now


def set_bucket(r, tenant: str, tokens: float, requests: float) -> None:
    from tenancy.schema import bucket_key

    r.hset(bucket_key(tenant), mapping={"tok": tokens, "req": requests, "ts": int(redis_now_us(r))})
