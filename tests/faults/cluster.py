"""A fault-test cluster: a restartable private Redis, N `tiny-random` workers and M real gateways.

`FaultCluster.start(workers=3, gateways=1, gateway_settings={...})` reuses the admission tests' process
wrappers (`RedisServer` keeps its data in a dump file across `restart_redis`, `GatewayProc`, `WorkerProc`)
and configures every gateway with one TOML `[gateway]` table listing all worker endpoints, so each test
can set the worker-loss timeout, lease TTL, drain grace period and admission wait it needs. Gateways log
JSON at INFO to their own file; `gateway_log_records` parses it and `unattributed_errors` returns the
ERROR lines without a request id (and any line that is not JSON, such as a stray traceback).
`bucket_level`/`set_bucket` (from `tests.admission_stack`) read and write a tenant's token bucket on the Redis
clock, so refund arithmetic is exact. With `discover=True` the gateways list no workers and find them in the
Redis registry instead; with `cluster_key` every worker link is CURVE-secured with that key (given to the
processes in their TOML files, never on a command line), and `add_gateway` starts a gateway with its own
settings. Everything started is stopped by `stop()`, SIGKILL after a grace period.
"""

from __future__ import annotations

import asyncio
import json
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from config.local_stack.launcher import GatewayProc, WorkerProc
from tests.admission_stack import _toml, log_tails
from tests.conftest import RedisServer

GATEWAY_SEES_WORKER_S = 2.0  # a gateway's client hears a restarted worker within one hello interval (1 s)


@dataclass(slots=True)
class FaultCluster:
    log_dir: Path
    redis: RedisServer
    config_path: Path
    worker_args: list[str] = field(default_factory=list)
    discover: bool = False
    cluster_key: str | None = None
    workers: list[WorkerProc] = field(default_factory=list)
    gateways: list[GatewayProc] = field(default_factory=list)

    @classmethod
    def start(cls, *, workers: int = 1, gateways: int = 1, gateway_settings: dict[str, object] | None = None,
              worker_args: Sequence[str] = ("--no-prefix-cache",), ready_timeout: float = 180.0,
              discover: bool = False, cluster_key: str | None = None) -> FaultCluster:
        log_dir = Path(tempfile.mkdtemp(prefix="sy-faults-"))
        cluster = cls(log_dir, RedisServer(log_dir), log_dir / "gateway.toml", list(worker_args), discover,
                      cluster_key)
        try:
            cluster.redis.start()
            cluster.workers = [cluster.spawn_worker() for _ in range(workers)]
            cluster.write_gateway_config(cluster.config_path, gateway_settings or {})
            cluster.gateways = [cluster.spawn_gateway() for _ in range(gateways)]
            cluster.wait_ready(ready_timeout)
        except BaseException:
            print(cluster.logs())
            cluster.stop()
            raise
        return cluster

    def _key_line(self) -> str:
        return "" if self.cluster_key is None else f"cluster_secret_key = {_toml(self.cluster_key)}\n"

    def spawn_worker(self, port: int | None = None) -> WorkerProc:
        extra = list(self.worker_args)
        if self.cluster_key is not None:
            config = self.log_dir / "worker.toml"
            config.write_text(self._key_line())
            extra += ["--config", str(config)]
        return WorkerProc(self.log_dir, extra=extra, port=port,
                          redis_url=self.redis.url if self.discover else None)

    def write_gateway_config(self, path: Path, gateway_settings: dict[str, object]) -> None:
        settings = {"worker_timeout": 1.0, **gateway_settings}
        if not self.discover:
            settings["workers"] = [w.endpoint for w in self.workers]
        path.write_text(self._key_line() + "[gateway]\n" + "".join(
            f"{k} = {_toml_value(v)}\n" for k, v in settings.items()))

    def add_gateway(self, gateway_settings: dict[str, object]) -> GatewayProc:
        """Start one more gateway with its own settings (it is stopped with the cluster)."""
        path = self.log_dir / f"gateway-{len(self.gateways)}-{time.monotonic_ns()}.toml"
        self.write_gateway_config(path, gateway_settings)
        gw = self.spawn_gateway(path)
        self.gateways.append(gw)
        return gw

    def spawn_gateway(self, config_path: Path | None = None) -> GatewayProc:
        config = str(config_path or self.config_path)
        return GatewayProc.spawn(self.log_dir, ["--config", config, "--redis-url", self.redis.url,
                                                "--log-level", "INFO", "--log-format", "json"])

    def wait_ready(self, timeout: float, gateways: Sequence[GatewayProc] | None = None) -> None:
        deadline = time.monotonic() + timeout
        pending = list(self.gateways if gateways is None else gateways)
        while pending:
            if any(g.proc.poll() is not None for g in pending) or any(w.proc.poll() is not None
                                                                      for w in self.workers):
                raise RuntimeError("a gateway or worker exited during start-up")
            pending = [g for g in pending if not g.ready()]
            if pending and time.monotonic() > deadline:
                raise TimeoutError(f"{len(pending)} gateway(s) not ready after {timeout}s")
            if pending:
                time.sleep(0.25)

    def create_tenant(self, name: str, **fields: object) -> str:
        """Create (or update) tenant `name`; returns a fresh API key."""
        from tenancy.tenant_admin import tenant_with_new_key
        return tenant_with_new_key(self.redis.url, name, **fields)

    def heal(self, timeout: float = 120.0) -> None:
        """Restart every worker that exited (same port, so the gateways' lists still hold) and replace
        every gateway that exited; returns once all are serving again."""
        restarted = []
        for i, w in enumerate(self.workers):
            if w.proc.poll() is not None:
                w.stop()
                w.log_path.rename(w.log_path.with_suffix(f".{time.monotonic_ns()}.log"))
                self.workers[i] = self.spawn_worker(port=w.port)
                restarted.append(self.workers[i])
        for i, g in enumerate(self.gateways):
            if g.proc.poll() is not None:
                self.gateways[i] = self.spawn_gateway()
        self.wait_ready(timeout)
        if restarted:
            asyncio.run(_wait_stats([w.endpoint for w in restarted], timeout, self.cluster_key))
            time.sleep(GATEWAY_SEES_WORKER_S)

    def logs(self) -> str:
        return log_tails(self.log_dir)

    def stop(self) -> None:
        for gw in self.gateways:
            gw.stop()
        for w in self.workers:
            w.stop()
        self.redis.stop(save=False)


async def _wait_stats(endpoints: list[str], timeout: float, cluster_key: str | None = None) -> None:
    """Wait until each worker sends stats to an observer client (it is up and serving)."""
    from router.links.client import WorkerClient

    for endpoint in endpoints:
        client = WorkerClient(endpoint, gateway_id=f"faults-observer-{time.monotonic_ns()}",
                              worker_timeout=5.0, cluster_key=cluster_key)
        await client.start()
        try:
            await client.wait_ready(timeout)
        finally:
            await client.close()


_SHARED: FaultCluster | None = None
_START_FAILED: str | None = None
SHARED_READY_TIMEOUT_S = 240.0  # three workers and a gateway loading at once on a busy 2-core box
# One cluster for the default-suite fault modules: 3 workers of 8,192 KV tokens each (4 MB of tiny-random
# fp32 KV at 512 bytes a token), one gateway. Tests that break something call `heal()` first.
SHARED_KV_BYTES = 4 << 20
SHARED_GATEWAY_SETTINGS: dict[str, object] = {
    "worker_timeout": 1.0, "lease_ttl": 3.0, "admission_wait_ms": 500, "interactive_reserve": 0.25,
    "drain_timeout": 30.0}


def shared_cluster() -> FaultCluster:
    """The session's shared fault cluster (started on first use), healed of earlier tests' faults."""
    global _SHARED, _START_FAILED
    if _START_FAILED is not None:
        raise RuntimeError(f"the shared fault cluster did not start earlier in this session: {_START_FAILED}")
    if _SHARED is None:
        try:
            _SHARED = FaultCluster.start(
                workers=3, gateway_settings=SHARED_GATEWAY_SETTINGS, ready_timeout=SHARED_READY_TIMEOUT_S,
                worker_args=["--no-prefix-cache", "--kv-cache-bytes", str(SHARED_KV_BYTES),
                             "--drain-timeout", "30"])
        except Exception as exc:
            _START_FAILED = repr(exc)  # fail the other modules at once instead of retrying for minutes each
            raise
    else:
        _SHARED.heal()
    return _SHARED


def stop_shared_cluster() -> None:
    global _SHARED
    if _SHARED is not None:
        _SHARED.stop()
        _SHARED = None


def _toml_value(value: object) -> str:
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return _toml(value)


def gateway_log_records(gw: GatewayProc) -> tuple[list[dict], list[str]]:
    """(parsed JSON log records, lines that are not JSON objects) of one gateway's log file."""
    records, other = [], []
    for line in gw.log_path.read_text(errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            rec = None
        if isinstance(rec, dict):
            records.append(rec)
        else:
            other.append(line)
    return records, other


def unattributed_errors(gw: GatewayProc) -> list[str]:
    """ERROR/CRITICAL log lines without a request id, plus any non-JSON line (a stray traceback)."""
    records, other = gateway_log_records(gw)
    bad = [json.dumps(r) for r in records if r.get("level") in ("ERROR", "CRITICAL")
           and not r.get("request_id")]
    return bad + other
