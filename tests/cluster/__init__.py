"""Tests against a real 3-primary Redis Cluster (`tests.redis_cluster`), under the `redis_cluster` marker."""
