"""One 3-primary Redis Cluster per test session, on free loopback ports, stopped for sure at the end."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from config.local_stack.redis_cluster import RedisClusterProcs


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[RedisClusterProcs]:
    procs = RedisClusterProcs(primaries=3)
    procs.start()
    try:
        yield procs
    finally:
        procs.stop()


@pytest.fixture()
def cluster_url(redis_cluster: RedisClusterProcs) -> str:
    """The cluster's `redis+cluster://` URL, every primary flushed (data and scripts) before the test."""
    redis_cluster.wait_ok()
    redis_cluster.flush()
    return redis_cluster.url
