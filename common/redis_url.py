"""The Redis URL forms every process accepts: `redis://` (one server) or `redis+cluster://h:p[,h:p…]`
(Cluster).

Light: redis-py is imported inside the factories only. Private to `worker.protocol`, which re-exports it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote

CLUSTER_SCHEMES = {"redis+cluster": False, "rediss+cluster": True}  # scheme -> TLS


@dataclass(slots=True, frozen=True)
class ClusterURL:
    """A parsed `redis+cluster://[user:password@]host:port[,host:port…]` URL (seed nodes; no database)."""

    nodes: tuple[tuple[str, int], ...]
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    ssl: bool = False


def is_cluster_url(url: str) -> bool:
    return url.partition("://")[0].lower() in CLUSTER_SCHEMES


def parse_cluster_url(url: str) -> ClusterURL:
    """Parse a cluster URL; raises ValueError naming what is wrong."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme.lower() not in CLUSTER_SCHEMES:
        raise ValueError(f"not a Redis Cluster URL (redis+cluster://host:port[,host:port]): {url!r}")
    netloc, _, path = rest.partition("/")
    path = path.partition("?")[0]
    if path not in ("", "0"):
        raise ValueError("Redis Cluster has database 0 only; drop the /<db> part of the URL")
    userinfo, at, hosts = netloc.rpartition("@")
    username = password = None
    if at:
        user, colon, secret = userinfo.partition(":")
        username, password = (unquote(user) or None), (unquote(secret) if colon else None)
    nodes = tuple(_host_port(item) for item in hosts.split(",") if item.strip())
    if not nodes:
        raise ValueError(f"a Redis Cluster URL names at least one host:port: {url!r}")
    return ClusterURL(nodes, username, password, CLUSTER_SCHEMES[scheme.lower()])


def _host_port(item: str) -> tuple[str, int]:
    host, colon, port = item.strip().rpartition(":")
    if not colon or not host:
        host, port = item.strip(), "6379"
    try:
        return host.strip("[]"), int(port)
    except ValueError:
        raise ValueError(f"bad host:port {item!r} in a Redis Cluster URL") from None


def _cluster_kwargs(url: str, kwargs: dict[str, Any]) -> tuple[dict[str, Any], tuple[tuple[str, int], ...]]:
    parsed = parse_cluster_url(url)
    extra = {"username": parsed.username, "password": parsed.password}
    if parsed.ssl:
        extra["ssl"] = True
    return {**{k: v for k, v in extra.items() if v is not None}, **kwargs}, parsed.nodes


def sync_redis(url: str, **kwargs: Any) -> Any:
    """A blocking client: `redis.cluster.RedisCluster` for a cluster URL, else `redis.Redis.from_url`."""
    import redis
    from redis.cluster import ClusterNode, RedisCluster

    if not is_cluster_url(url):
        return redis.Redis.from_url(url, **kwargs)
    options, nodes = _cluster_kwargs(url, kwargs)
    return RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in nodes], **options)


def async_redis(url: str, cluster_class: type | None = None, **kwargs: Any) -> Any:
    """An asyncio client: `redis.asyncio.RedisCluster` (or `cluster_class`) for a cluster URL, else
    `redis.asyncio.Redis.from_url`. The cluster client finds the topology on its first command."""
    import redis.asyncio as aredis
    from redis.asyncio.cluster import ClusterNode

    if not is_cluster_url(url):
        return aredis.Redis.from_url(url, **kwargs)
    options, nodes = _cluster_kwargs(url, kwargs)
    cls = cluster_class or aredis.RedisCluster
    return cls(startup_nodes=[ClusterNode(h, p) for h, p in nodes], **options)
