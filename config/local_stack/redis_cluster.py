"""A local Redis Cluster for tests and benchmarks: N primaries (and replicas) of redis-server on loopback
ports.

`redis-server --cluster-enabled yes` per node, then `redis-cli --cluster create`; `stop()` kills every node
it started and removes their files. Slot moves go through the servers' own commands.
"""

from __future__ import annotations

import atexit
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis

from config.local_stack.launcher import free_port, wait_for_port


@dataclass(slots=True)
class Node:
    port: int
    bus_port: int
    proc: subprocess.Popen | None = None

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5)

    def node_id(self) -> str:
        with self.client() as c:
            return c.execute_command("CLUSTER MYID").decode()


@dataclass(slots=True)
class RedisClusterProcs:
    """`primaries` primaries with `replicas` replicas each, all on 127.0.0.1."""

    primaries: int = 3
    replicas: int = 0
    node_timeout_ms: int = 1000
    nodes: list[Node] = field(default_factory=list)
    workdir: Path | None = None

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes[: self.primaries])

    def start(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None or shutil.which("redis-cli") is None:
            raise RuntimeError("redis-server / redis-cli not installed: run `make test`, which installs them")
        self.workdir = Path(tempfile.mkdtemp(prefix="sy-cluster-"))
        atexit.register(self.stop)  # also when the session dies before its fixture's finalizer
        try:
            for _ in range(self.primaries * (1 + self.replicas)):
                node = Node(free_port(), free_port())
                self.nodes.append(node)
                node.proc = subprocess.Popen(
                    [binary, "--port", str(node.port), "--cluster-port", str(node.bus_port),
                     "--bind", "127.0.0.1", "--cluster-enabled", "yes",
                     "--cluster-config-file", f"nodes-{node.port}.conf",
                     "--cluster-node-timeout", str(self.node_timeout_ms), "--dir", str(self.workdir),
                     "--save", "", "--appendonly", "no", "--daemonize", "no", "--loglevel", "warning"],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            for node in self.nodes:
                wait_for_port(node.port)
            subprocess.run(
                ["redis-cli", "--cluster", "create", *(f"127.0.0.1:{n.port}" for n in self.nodes),
                 "--cluster-replicas", str(self.replicas), "--cluster-yes"],
                check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=60)
            self.wait_ok()
        except BaseException:
            self.stop()
            raise

    def wait_ok(self, timeout: float = 30.0) -> None:
        """Until every live node says `cluster_state:ok` and knows every other node."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                if all(self._node_ok(n) for n in self.nodes if n.proc is not None):
                    return
            except redis.RedisError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError("Redis Cluster did not become ok")
            time.sleep(0.1)

    def _node_ok(self, node: Node) -> bool:
        with node.client() as c:
            state = c.cluster("INFO").get("cluster_state")
            known = len(c.cluster("NODES"))
        live = sum(1 for n in self.nodes if n.proc is not None)
        return state == "ok" and known >= live

    def stop(self) -> None:
        for node in self.nodes:
            if node.proc is not None:
                node.proc.kill()
                node.proc.wait(timeout=10)
                node.proc = None
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)
            self.workdir = None

    def flush(self) -> None:
        for node in self.nodes:
            if node.proc is None:
                continue
            with node.client() as c:
                if c.execute_command("ROLE")[0] == b"master":
                    c.flushall()
                    c.script_flush()

    # ------------------------------------------------------------ slots

    def owner(self, key: str) -> Node:
        """The primary that serves `key`'s slot now."""
        slot = self.slot(key)
        with self.nodes[0].client() as c:
            for start, end, primary, *_ in c.execute_command("CLUSTER SLOTS"):
                if start <= slot <= end:
                    port = int(primary[1])
                    return next(n for n in self.nodes if n.port == port)
        raise LookupError(f"slot {slot} is not served")

    def slot(self, key: str) -> int:
        with self.nodes[0].client() as c:
            return int(c.execute_command("CLUSTER KEYSLOT", key))

    def migrate_slot(self, slot: int, source: Node, target: Node, batch: int = 100) -> int:
        """Move `slot` from `source` to `target` the way `redis-cli --cluster reshard` does; returns keys
        moved."""
        src_id, dst_id = source.node_id(), target.node_id()
        moved = 0
        with source.client() as src, target.client() as dst:
            dst.execute_command("CLUSTER SETSLOT", slot, "IMPORTING", src_id)
            src.execute_command("CLUSTER SETSLOT", slot, "MIGRATING", dst_id)
            while keys := src.execute_command("CLUSTER GETKEYSINSLOT", slot, batch):
                src.execute_command("MIGRATE", "127.0.0.1", target.port, "", 0, 5000, "REPLACE", "KEYS",
                                    *keys)
                moved += len(keys)
            order = [target, source, *(n for n in self.nodes if n is not target and n is not source)]
            for node in order:  # the target first, so no node points back at the source
                if node.proc is None:
                    continue
                with node.client() as c:
                    if c.execute_command("ROLE")[0] == b"master":
                        c.execute_command("CLUSTER SETSLOT", slot, "NODE", dst_id)
        return moved
